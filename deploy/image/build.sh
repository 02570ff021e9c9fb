#!/usr/bin/env bash
# Builds the Stockade OCI image from Debian packages only: mmdebstrap makes the base rootfs
# from the Debian mirror apt already uses (no registry pull), podman (or buildah) adds the
# Python wheels, the microVM guest and the shipped rules with every RUN offline.
#
#   deploy/image/build.sh            prints the image reference on its last line
#
# Caches (under STOCKADE_IMAGE_CACHE, default /var/cache/stockade/image), so a rebuild is fast:
#   base-<key>.tar   the rootfs; <key> hashes packages.txt, the suite and the mirror
#   wheels-<key>/    the dependency wheels; <key> hashes pyproject.toml
# and the images themselves: localhost/stockade-base:<key> and localhost/stockade:<src>, where
# <src> hashes every input (an existing image is reused, not rebuilt: a repeat takes seconds).
#
# Environment: STOCKADE_DEBIAN_MIRROR (default http://deb.debian.org/debian),
# STOCKADE_DEBIAN_SECURITY (default http://deb.debian.org/debian-security),
# STOCKADE_IMAGE_TOOL (podman or buildah; default podman when installed),
# STOCKADE_VM_IMAGE_DIR (the guest to ship; default /var/cache/stockade/vm, built when absent),
# PIP (the pip that collects wheels; default the checkout's .venv/bin/pip).
#
# Rootful podman on hosts with hybrid cgroups: crun refuses them, hence `--runtime runc`, and
# explicit ulimits (the defaults podman derives from the host's are refused there too).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
cache=${STOCKADE_IMAGE_CACHE:-/var/cache/stockade/image}
mirror=${STOCKADE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
security=${STOCKADE_DEBIAN_SECURITY:-http://deb.debian.org/debian-security}
suite=bookworm
pip=${PIP:-$repo/.venv/bin/pip}
vm=${STOCKADE_VM_IMAGE_DIR:-/var/cache/stockade/vm}
tool=${STOCKADE_IMAGE_TOOL:-}
if [ -z "$tool" ]; then
    if command -v podman >/dev/null; then tool=podman; else tool=buildah; fi
fi

log() { echo "image: $*" >&2; }
die() { log "$*"; exit 1; }

command -v mmdebstrap >/dev/null || die "mmdebstrap is missing (apt-get install mmdebstrap)"
command -v "$tool" >/dev/null || die "$tool is missing (apt-get install podman or buildah)"
[ -x "$pip" ] || die "no pip at $pip (run scripts/bootstrap.sh, or set PIP)"
[ "$(id -u)" = 0 ] || die "run as root (rootful podman, mmdebstrap's root mode)"

mkdir -p "$cache"
exec 9> "$cache/.lock"
flock 9   # builds on one host take turns: they share the caches and the base image

hash_of() { sha256sum | cut -c1-16; }
image_exists() { "$tool" image exists "$1" 2>/dev/null || "$tool" inspect --type image "$1" >/dev/null 2>&1; }

# -- 1. the base rootfs ------------------------------------------------------------------------
mapfile -t packages < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' -e '/^$/d' "$here/packages.txt")
[ ${#packages[@]} -gt 0 ] || die "packages.txt lists no package"
base_key=$( (cat "$here/packages.txt"; echo "$suite $mirror $security") | hash_of)
base_tar=$cache/base-$base_key.tar
base_image=localhost/stockade-base:$base_key
if [ ! -s "$base_tar" ]; then
    log "building the base rootfs ($suite, ${#packages[@]} packages) into $base_tar"
    include=$(IFS=,; echo "${packages[*]}")
    mmdebstrap --variant=apt --mode=root --format=tar \
        --aptopt='APT::Install-Recommends "false"' \
        --include="$include" \
        --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
        "$suite" "$base_tar.part" \
        "deb $mirror $suite main" \
        "deb $mirror $suite-updates main" \
        "deb $security $suite-security main" \
        "deb $mirror $suite-backports main"
    mv "$base_tar.part" "$base_tar"
fi
if ! image_exists "$base_image"; then
    log "importing $base_tar as $base_image"
    "$tool" import "$base_tar" "$base_image" >/dev/null
fi

# -- 2. the image's inputs --------------------------------------------------------------------
# <src> hashes everything that goes into the image: the base, the Containerfile, the
# dependency set, the project's source (not its wheel: wheels carry build timestamps), the
# guest, the rules and the example config. An image of the same inputs is reused as it is.
[ -f "$vm/manifest.json" ] || { log "building the microVM guest into $vm"; bash "$repo/vm-images/build.sh" "$vm" >&2; }
wheels_key=$(hash_of < "$repo/pyproject.toml")
sources() {   # the files the project's wheel is built from, NUL-separated
    (cd "$repo" && find pyproject.toml README.md stockade policy gateway broker launcher \
        -type f ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 | sort -z)
}
src=$( (echo "$base_key $wheels_key"; cat "$here/Containerfile";
        cd "$repo" && { sources; find rules deploy/stockade.yaml -type f -print0 | sort -z; } \
            | xargs -0 sha256sum;
        cd "$vm/" && find . -type f -print0 | sort -z | xargs -0 sha256sum) | hash_of)
image=localhost/stockade:$src
if image_exists "$image"; then
    log "reusing $image"
    echo "$image"
    exit 0
fi

# -- 3. the build context ----------------------------------------------------------------------
ctx=$(mktemp -d "$cache/ctx.XXXXXX")
trap 'rm -rf "$ctx"' EXIT
# wheels are built from a copy of exactly the hashed sources (setuptools would also leave
# a build/ directory in the checkout)
mkdir "$ctx/src"
sources | (cd "$repo" && xargs -0 cp --parents -t "$ctx/src")
wheels=$cache/wheels-$wheels_key
if [ ! -d "$wheels" ]; then
    log "collecting the dependency wheels into $wheels"
    "$pip" wheel -q --wheel-dir "$wheels.part" "$ctx/src" >&2
    rm -f "$wheels.part"/stockade-*.whl   # the project's own wheel is built every time
    mv "$wheels.part" "$wheels"
fi
mkdir "$ctx/wheels"
cp -l "$wheels"/*.whl "$ctx/wheels/" 2>/dev/null || cp "$wheels"/*.whl "$ctx/wheels/"
"$pip" wheel -q --no-deps --wheel-dir "$ctx/wheels" "$ctx/src" >&2
rm -rf "$ctx/src"
cp -rL "$vm" "$ctx/vm"
cp -r "$repo/rules" "$ctx/rules"
cp "$repo/deploy/stockade.yaml" "$ctx/stockade.yaml"
version=$("$repo/.venv/bin/python" -c 'from importlib.metadata import version; print(version("stockade"))' 2>/dev/null || echo unknown)
echo "$version" > "$ctx/version"

# -- 4. the image ------------------------------------------------------------------------------
log "building $image with $tool"
"$tool" build --runtime runc --network none \
    --ulimit nofile=1024:1024 --ulimit nproc=1024:1024 \
    --build-arg "BASE=$base_image" --label "org.opencontainers.image.version=$version" \
    -f "$here/Containerfile" -t "$image" "$ctx" >&2
echo "$image"
