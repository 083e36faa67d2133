#!/bin/bash
# A local base image for the Dockerfile where no image registry can be reached: Debian 12 (bookworm,
# whose python3 is 3.11) made by debootstrap from a Debian package mirror, imported with buildah.
#
#   sudo docker/build-local-base.sh                 # -> localhost/habitus-base:bookworm
#   WORK=/tmp/habitus-image MIRROR=http://deb.debian.org/debian TAG=... docker/build-local-base.sh
#
# Needs root, debootstrap and buildah (apt-get install debootstrap buildah podman). The rootfs and the
# tarball stay under $WORK (never in the repository). Then docker/build-local-image.sh builds the
# project's Dockerfile FROM it. docs/journal/operations.md has what this gave on the build machine.
set -euo pipefail
WORK=${WORK:-/tmp/habitus-image}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
TAG=${TAG:-localhost/habitus-base:bookworm}
ROOTFS=$WORK/rootfs

mkdir -p "$WORK"
if [ ! -x "$ROOTFS/usr/bin/python3" ]; then
  rm -rf "$ROOTFS"
  # minbase: dpkg, apt and essential packages only; python3 (3.11.2) with venv/ensurepip, and CA
  # certificates for pip
  nice -n 10 debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$ROOTFS" "$MIRROR"
fi
# what debootstrap may leave mounted, and what an image does not carry
for m in proc sys dev/pts dev; do umount "$ROOTFS/$m" 2>/dev/null || true; done
chroot "$ROOTFS" apt-get clean
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin "$ROOTFS"/var/log/*.log \
       "$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/info/*
# the image's apt reads the same mirror the rootfs came from
printf 'deb %s bookworm main\ndeb %s bookworm-updates main\n' "$MIRROR" "$MIRROR" > "$ROOTFS/etc/apt/sources.list"
"$ROOTFS/usr/bin/python3" --version 2>/dev/null || chroot "$ROOTFS" python3 --version

tar --numeric-owner --xattrs -C "$ROOTFS" -cf "$WORK/rootfs.tar" .
ctr=$(buildah from scratch)
buildah add "$ctr" "$WORK/rootfs.tar" /
buildah config --env LANG=C.UTF-8 --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --cmd python3 --label org.opencontainers.image.description="Debian bookworm minbase + python3.11, debootstrap" \
  "$ctr"
buildah commit --rm "$ctr" "$TAG"
buildah images "$TAG"
