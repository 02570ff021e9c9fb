#!/usr/bin/env bash
# Installs everything Stockade needs on a fresh Debian 12 machine, as root. Idempotent:
# a second run checks and installs nothing new. Used by scripts/demo.sh and scripts/test.sh.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"

APT_PACKAGES=(
    nftables iproute2 conntrack procps psmisc util-linux kmod
    qemu-system-x86 busybox-static cpio
    curl git dnsutils ca-certificates
    python3-venv python3-pip   # the demo agent runs Debian's python3 + pip inside the sandbox
    squid tinyproxy   # side-by-side comparisons in bench/
    prometheus strace # promtool checks deploy/prometheus; strace checks the units' syscall filters
    jq                # tests/deploy runs docs/runbooks.md's event queries
    python3-seccomp   # libseccomp's binding for the system Python: compiles the sandbox's seccomp filter
    gcc libc6-dev     # the seccomp tests check a C compiler still works inside the sandbox
    podman runc mmdebstrap   # tests/deploy builds the OCI image (deploy/image) and runs it
)

missing=()
for p in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "bootstrap: installing Debian packages: ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    # the bench starts squid/tinyproxy itself; the packaged services must not hold ports
    for svc in squid tinyproxy prometheus prometheus-node-exporter; do
        systemctl disable --now "$svc" >/dev/null 2>&1 || service "$svc" stop >/dev/null 2>&1 || true
    done
fi

# bookworm-backports for two packages: the gVisor tier's runsc (20240729 has the systrap
# platform; bookworm's own 20221219 runs with ptrace only) and QEMU 10 (bookworm's 7.2 keys
# its TCG translations by virtual address, so under emulation every exec of a dynamically
# linked program, laid out anew by ASLR, is translated again: 2x slower; 8.0+ translates
# position-independently). The source is added when missing (opt out: STOCKADE_BACKPORTS=0);
# apt pins backports low, so only packages asked for with -t come from it. A failure there
# keeps bookworm's package (the launcher speaks both QEMUs); no runsc at all is a warning
# (gvisor profiles are then refused with the reason).
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
qemu_old() {
    dpkg --compare-versions "$(dpkg-query -W -f='${Version}' qemu-system-x86 2>/dev/null)" lt 1:8.1
}
backports_added=
backports() {
    [ -n "$backports_added" ] && return 0
    backports_added=1
    export DEBIAN_FRONTEND=noninteractive
    bpo=/etc/apt/sources.list.d/bookworm-backports.list
    if [ "${STOCKADE_BACKPORTS:-1}" = 1 ] && . /etc/os-release && [ "${VERSION_CODENAME:-}" = bookworm ] \
        && ! grep -rqs "bookworm-backports" /etc/apt/sources.list /etc/apt/sources.list.d/; then
        echo "bootstrap: adding $bpo (runsc with systrap, QEMU 10)" >&2
        echo "deb http://deb.debian.org/debian bookworm-backports main" > "$bpo"
    fi
    # a plain update: `-o Dir::Etc::sourcelist=<one file>` would drop every other list
    apt-get update -qq || true
}
if ! installed runsc; then
    backports
    echo "bootstrap: installing runsc" >&2
    apt-get install -y -qq --no-install-recommends -t bookworm-backports runsc >/dev/null 2>&1 \
        || apt-get install -y -qq --no-install-recommends runsc >/dev/null \
        || echo "bootstrap: WARNING: runsc could not be installed; profiles with" \
                "isolation: gvisor are refused (or list gvisor in launcher.downgrade_isolation)" >&2
fi
if [ "${STOCKADE_BACKPORTS:-1}" = 1 ] && qemu_old; then
    # the whole answer first: `| grep -q` would stop reading at the first match, and
    # apt-cache's SIGPIPE then fails the pipeline under pipefail (QEMU 10 silently skipped)
    offered() { [[ "$(apt-cache policy qemu-system-x86 2>/dev/null)" == *bookworm-backports* ]]; }
    offered || backports
    if offered; then
        echo "bootstrap: installing QEMU from bookworm-backports" >&2
        qlog=$(mktemp)
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            -t bookworm-backports qemu-system-x86 >"$qlog" 2>&1 \
            || { echo "bootstrap: QEMU from bookworm-backports failed:" >&2; tail -5 "$qlog" >&2; }
        rm -f "$qlog"
    fi
    if qemu_old; then
        echo "bootstrap: note: keeping $(qemu-system-x86_64 -version | head -1) (no newer QEMU" \
             "in bookworm-backports: microVM execs are slower under TCG)" >&2
    fi
fi

# the microVM backend's guest (Debian's kernel + a busybox initramfs); idempotent, into the
# launcher's default launcher.microvm.image_dir
# (no mirror, no kernel package: a warning, not a failed bootstrap; microvm profiles are then
# refused with the reason until the image is built)
if ! bash vm-images/build.sh "${STOCKADE_VM_IMAGE_DIR:-/var/cache/stockade/vm}"; then
    echo "bootstrap: WARNING: the microVM guest image could not be built (see above);" \
         "profiles with isolation: microvm are refused until vm-images/build.sh succeeds" \
         "(or list microvm in launcher.downgrade_isolation)" >&2
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "bootstrap: creating .venv" >&2
    "$PY" -m venv .venv
fi
# reinstall only when the declared dependencies change
stamp=.venv/.stockade-deps
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || ! .venv/bin/python -c "import stockade" 2>/dev/null; then
    echo "bootstrap: installing Python packages into .venv" >&2
    .venv/bin/pip install -q --upgrade pip >/dev/null
    .venv/bin/pip install -q -e ".[dev]"
    echo "$want" > "$stamp"
fi
