#!/usr/bin/env bash
# Builds the flotilla image (every binary in one image; the manifests in deploy/ pick one with
# `command`) without pulling a base image: the image is FROM scratch, and everything in it comes
# from this machine.
#
#   deploy/image/build.sh [IMAGE]            # default IMAGE: localhost/flotilla:dev
#
# What goes in: a release build of the four binaries (`cargo build --release --locked`), the
# shared libraries they load (as `ldd` resolves them here, with the dynamic loader), busybox
# (`sh`, `cp`, `mkdir` for the hub's seed-ca init container and for `kubectl exec` into a pod),
# the CA certificates of this machine (a spoke apiserver reached through a kubeconfig may present
# a public CA), and a passwd entry for user 65532, which the image runs as.
#
# Needs: cargo, ldd, busybox (Debian: busybox-static) and one image builder: podman, buildah or
# docker (Debian's podman, buildah and docker.io packages all work; no container runs during
# the build, so the builder needs no container runtime). Set FLOTILLA_IMAGE_BINARIES=DIR to take
# the binaries from DIR instead of building them (a CI that built them already).
set -euo pipefail

image=${1:-localhost/flotilla:dev}
root=$(cd "$(dirname "$0")/../.." && pwd)
binaries=(flotilla-hub flotilla-gateway flotilla-agent flotilla)

say() { echo "image: $*" >&2; }
die() { echo "image: $*" >&2; exit 1; }

builder=
for candidate in podman buildah docker; do
  if command -v "$candidate" >/dev/null; then builder=$candidate; break; fi
done
[ -n "$builder" ] || die "no image builder found: install podman, buildah or docker (Debian: apt-get install podman)"
busybox=$(command -v busybox || true)
[ -n "$busybox" ] || die "busybox not found: install it (Debian: apt-get install busybox-static)"
# A dynamically linked busybox would need its libraries too; the static one needs nothing.
if ldd "$busybox" >/dev/null 2>&1; then
  die "$busybox is dynamically linked: install Debian's busybox-static"
fi
certs=/etc/ssl/certs/ca-certificates.crt
[ -f "$certs" ] || die "$certs not found: install ca-certificates"

if [ -n "${FLOTILLA_IMAGE_BINARIES:-}" ]; then
  bin_dir=$FLOTILLA_IMAGE_BINARIES
else
  say "building ${binaries[*]} (release)"
  (cd "$root" && cargo build --release --locked --bins \
    -p flotilla-hub -p flotilla-gateway -p flotilla-agent -p flotilla-cli)
  bin_dir=${CARGO_TARGET_DIR:-$root/target}/release
fi

context=$(mktemp -d)
trap 'rm -rf "$context"' EXIT
rootfs=$context/rootfs
mkdir -p "$rootfs"/{usr/local/bin,bin,etc/ssl/certs,tmp}
chmod 1777 "$rootfs/tmp"

for binary in "${binaries[@]}"; do
  [ -x "$bin_dir/$binary" ] || die "$bin_dir/$binary is missing: build it first"
  cp "$bin_dir/$binary" "$rootfs/usr/local/bin/"
  strip "$rootfs/usr/local/bin/$binary" 2>/dev/null || true
  # Every library the binary loads, at the path the loader looks for it, and the loader.
  ldd "$bin_dir/$binary" | awk '/=> \// {print $3} /^\t\/[^ ]+ \(/ {print $1}' |
    while read -r lib; do
      mkdir -p "$rootfs$(dirname "$lib")"
      cp -L "$lib" "$rootfs$lib"
    done
done

cp "$busybox" "$rootfs/bin/busybox"
for applet in $("$busybox" --list); do
  [ -e "$rootfs/bin/$applet" ] || ln -s busybox "$rootfs/bin/$applet"
done
cp "$certs" "$rootfs/etc/ssl/certs/ca-certificates.crt"
printf 'root:x:0:0:root:/root:/bin/sh\nflotilla:x:65532:65532:flotilla:/var/lib/flotilla:/bin/sh\n' \
  > "$rootfs/etc/passwd"
printf 'root:x:0:\nflotilla:x:65532:\n' > "$rootfs/etc/group"
printf 'hosts: files dns\n' > "$rootfs/etc/nsswitch.conf"

cp "$root/deploy/image/Containerfile" "$context/Containerfile"
say "assembling $image with $builder"
case $builder in
  podman | docker) "$builder" build --file "$context/Containerfile" --tag "$image" "$context" >&2 ;;
  buildah) buildah bud --file "$context/Containerfile" --tag "$image" "$context" >&2 ;;
esac
say "built $image"
echo "$image"
