#!/usr/bin/env bash
# Builds the Stockade microVM guest: Debian's kernel (linux-image-amd64) and a busybox
# initramfs holding the guest's /init and the kernel modules it needs. Idempotent: a second
# run with the same inputs (kernel package version, busybox binary, this recipe) changes
# nothing. Needs root only for nothing; needs apt (Debian's registry) for the kernel package.
#
#   vm-images/build.sh [OUT_DIR]        (default /var/cache/stockade/vm)
#
# OUT_DIR gets vmlinux (the kernel, uncompressed: QEMU boots it through its PVH entry, which
# saves the guest from decompressing itself, seconds under TCG), initramfs.cpio.gz and
# manifest.json (what the launcher checks).
# STOCKADE_VM_KERNEL_PACKAGE overrides the kernel package (default: what linux-image-amd64
# depends on, e.g. linux-image-6.1.0-57-amd64).
#
# OUT_DIR is a symlink to a complete build (.<name>.<stamp> next to it), replaced by one
# rename(2): a sandbox starting during a build sees the old image or the new one, never a
# half-written one. Builds of one OUT_DIR take turns (flock on .<name>.lock next to it); the
# previous build stays (a sandbox may be starting on it), older ones are removed.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-/var/cache/stockade/vm}
out=${out%/}
busybox=${STOCKADE_VM_BUSYBOX:-/bin/busybox}
parent=$(dirname "$out")
name=$(basename "$out")

log() { echo "vm-images: $*" >&2; }

mkdir -p "$parent"
exec 9> "$parent/.$name.lock"
flock 9

find_kernel() {
    pkg=${STOCKADE_VM_KERNEL_PACKAGE:-}
    if [ -z "$pkg" ]; then
        pkg=$(apt-cache depends linux-image-amd64 2>/dev/null \
              | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
    fi
    version=
    [ -n "$pkg" ] && version=$(apt-cache policy "$pkg" 2>/dev/null | awk '/Candidate:/ {print $2}')
    [ -n "$version" ] && [ "$version" != "(none)" ]
}
refreshed=
refresh() {
    # only when the package lists do not know the kernel (a fresh machine) or its download
    # failed (lists older than the mirror): never on every build
    [ -z "$refreshed" ] || return 1
    refreshed=1
    log "refreshing the apt package lists"
    apt-get update -qq || { log "apt-get update failed"; return 1; }
}
if ! find_kernel; then
    refresh || true
    find_kernel || { log "cannot find the kernel package (apt-cache depends linux-image-amd64)"; exit 1; }
fi
case $(ldd "$busybox" 2>&1 || true) in *"not a dynamic executable"*) ;; *) false ;; esac || \
    { log "$busybox is not a static binary (install busybox-static)"; exit 1; }

# everything that decides the output: a change in any of them rebuilds
# (contents only: the same recipe in another clone or path is the same build)
stamp=$( { echo "$pkg $version"
           for f in "$busybox" "$here/init" "$here/modules.txt" "$0"; do sha256sum < "$f"; done
         } | sha256sum | cut -d' ' -f1)
if [ -f "$out/manifest.json" ] && grep -q "\"stamp\": \"$stamp\"" "$out/manifest.json" \
        && [ -f "$out/vmlinux" ] && [ -f "$out/initramfs.cpio.gz" ]; then
    log "up to date in $out ($pkg $version)"
    exit 0
fi

log "building $pkg $version into $out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
download() { ( cd "$work" && apt-get download -q "$pkg=$version" >/dev/null 2>&1 ); }
if ! download; then
    # stale lists name a version the mirror no longer has: refresh once, look again
    refresh && find_kernel && download || \
        ( cd "$work" && apt-get download "$pkg=$version" )  # again, to show apt's error
fi
dpkg-deb -x "$work"/*.deb "$work/deb"
kver=${pkg#linux-image-}
moddir="$work/deb/lib/modules/$kver"
[ -f "$work/deb/boot/vmlinuz-$kver" ] || { log "no /boot/vmlinuz-$kver in $pkg"; exit 1; }

# modules in dependency order (dependencies first), each once; =y built-ins are skipped
declare -A seen=()
order=()
resolve() {
    local name=$1 f deps d
    [ -n "${seen[$name]:-}" ] && return 0
    seen[$name]=1
    f=$(find "$moddir/kernel" -name "$name.ko" -o -name "${name//_/-}.ko" | head -1)
    if [ -z "$f" ]; then
        grep -q "/$name.ko$" "$moddir/modules.builtin" && return 0
        log "module $name is neither a module nor built in"; exit 1
    fi
    deps=$(modinfo -F depends "$f")
    for d in ${deps//,/ }; do resolve "$d"; done
    order+=("$f")
}
while read -r m; do
    case $m in ''|'#'*) continue ;; esac
    resolve "$m"
done < "$here/modules.txt"

root="$work/initramfs"
mkdir -p "$root"/{sbx/modules,sbx/cfg,dev,proc,sys,scratch,tmp,etc}
install -m 0755 "$busybox" "$root/sbx/busybox"
install -m 0755 "$here/init" "$root/init"
: > "$root/sbx/modules.list"
for f in "${order[@]}"; do
    install -m 0644 "$f" "$root/sbx/modules/"
    basename "$f" .ko >> "$root/sbx/modules.list"
done
# reproducible archive: fixed order, owners and times
find "$root" -exec touch -h -d @0 {} +
( cd "$root" && find . -print0 | LC_ALL=C sort -z \
    | cpio --null -o -H newc -R 0:0 --reproducible --quiet ) | gzip -9n > "$work/initramfs.cpio.gz"

# the ELF vmlinux inside the bzImage: the first compressed stream that unpacks to an ELF
python3 - "$work/deb/boot/vmlinuz-$kver" "$work/vmlinux" <<'PY'
import gzip, lzma, sys, zlib
data = open(sys.argv[1], "rb").read()
def unpack(i, magic):
    if magic.startswith(b"\xfd7zXZ"):
        return lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(data[i:])
    return zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(data[i:])
for magic in (b"\xfd7zXZ\x00", b"\x1f\x8b\x08"):
    i = data.find(magic)
    while i >= 0:
        try:
            out = unpack(i, magic)
        except (lzma.LZMAError, zlib.error):
            out = b""
        if out[:4] == b"\x7fELF":
            open(sys.argv[2], "wb").write(out)
            sys.exit(0)
        i = data.find(magic, i + 1)
sys.exit("no xz or gzip compressed ELF kernel found in " + sys.argv[1])
PY
grep -q '^CONFIG_PVH=y' "$work/deb/boot/config-$kver" || \
    { log "the kernel has no PVH entry (CONFIG_PVH): QEMU cannot boot it directly"; exit 1; }

# the new build in a directory of its own next to OUT_DIR, then one rename of a symlink
build="$parent/.$name.${stamp:0:16}"
rm -rf "$build"
mkdir -p "$build.tmp"
install -m 0644 "$work/vmlinux" "$work/initramfs.cpio.gz" "$build.tmp/"
cat > "$build.tmp/manifest.json" <<JSON
{"stamp": "$stamp", "kernel_package": "$pkg", "kernel_version": "$version",
 "modules": [$(printf '"%s",' $(cat "$root/sbx/modules.list") | sed 's/,$//')]}
JSON
sync -f "$build.tmp/vmlinux" 2>/dev/null || sync
chmod 0755 "$build.tmp"
mv -T "$build.tmp" "$build"
previous=
if [ -L "$out" ]; then
    previous=$(readlink "$out")
elif [ -e "$out" ]; then
    # an older recipe's plain directory: moved aside (a sandbox starting in this instant
    # finds no image and is refused), removed below
    previous=".$name.old.$$"
    mv -T "$out" "$parent/$previous"
fi
ln -sfn ".$name.${stamp:0:16}" "$parent/.$name.link.$$"
mv -T "$parent/.$name.link.$$" "$out"
# keep the new build and the previous one (a sandbox may be starting on it); an older
# recipe's plain directory is nobody's any more (OUT_DIR's paths lead to the new build)
for d in "$parent/.$name."*; do
    base=${d##*/}
    rest=${base#".$name."}
    # only this OUT_DIR's own leftovers (another OUT_DIR named "$name.x" shares the prefix)
    [[ $rest =~ ^([0-9a-f]{16}(\.tmp)?|old\.[0-9]+|link\.[0-9]+)$ ]] || continue
    case $base in
        ".$name.${stamp:0:16}") ;;
        ".$name.old."*) rm -rf "$d" ;;
        "$previous") ;;
        *) rm -rf "$d" ;;
    esac
done
log "built $out ($(du -sh "$out/initramfs.cpio.gz" | cut -f1) initramfs)"
