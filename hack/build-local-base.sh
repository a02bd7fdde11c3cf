#!/usr/bin/env bash
# A local base image for the agent's image, from Debian's packages alone: Debian 12 (bookworm)
# with its Python 3.11, venv and pip, built with mmdebstrap and imported into podman (or docker).
# For machines without a container registry (air-gapped sites, CI here): `make image` uses it
# when the official python base cannot be pulled. Needs root, mmdebstrap and a Debian mirror
# (MIRROR, default deb.debian.org; an internal mirror or apt-cacher works the same).
#
#   hack/build-local-base.sh [TAG]     TAG defaults to localhost/gpu-dra-base:bookworm
#
# Does nothing when TAG exists and is younger than MAX_AGE_DAYS (default 7; 0 never rebuilds for
# age); FORCE=1 rebuilds it whatever its age. The Dockerfile's steps after FROM run unchanged on
# this base: both are bookworm with apt, `python3` on PATH and pip for it.
set -euo pipefail

tag="${1:-localhost/gpu-dra-base:bookworm}"
mirror="${MIRROR:-http://deb.debian.org/debian}"
engine="${ENGINE:-$(command -v podman || command -v buildah || command -v docker || true)}"
engine="$(basename "${engine:-none}")"

if [ "$engine" = none ]; then
  echo "build-local-base: no podman, buildah or docker installed" >&2
  exit 1
fi
if [ "$engine" = buildah ]; then
  inspect=(buildah inspect --type image)
else
  inspect=("$engine" image inspect)
fi
max_age_days="${MAX_AGE_DAYS:-7}"
created() {  # the image's creation time in seconds since the epoch, or nothing
  local out
  # podman's and buildah's Created is a time value; docker's an RFC 3339 string.
  if out="$("${inspect[@]}" --format '{{.Created.Unix}}' "$tag" 2>/dev/null)" \
      && [[ "$out" =~ ^[0-9]+$ ]]; then
    echo "$out"
  elif out="$("${inspect[@]}" --format '{{.Created}}' "$tag" 2>/dev/null)"; then
    date -d "$out" +%s 2>/dev/null || true
  fi
}
if [ "${FORCE:-0}" != 1 ] && "${inspect[@]}" "$tag" >/dev/null 2>&1; then
  born="$(created)"
  age_days=$(( ( $(date +%s) - ${born:-0} ) / 86400 ))
  if [ "$max_age_days" = 0 ] || { [ -n "$born" ] && [ "$age_days" -lt "$max_age_days" ]; }; then
    echo "build-local-base: $tag exists, ${age_days} days old (FORCE=1 rebuilds it)"
    exit 0
  fi
  echo "build-local-base: $tag is ${age_days} days old (MAX_AGE_DAYS=$max_age_days): rebuilding" \
    "it with the mirror's current packages"
fi
if ! command -v mmdebstrap >/dev/null 2>&1; then
  echo "build-local-base: mmdebstrap is not installed (apt-get install mmdebstrap)" >&2
  exit 1
fi

# minbase: essential packages + apt, no recommends; python3-venv and python3-pip are what the
# Dockerfile uses (`python3 -m venv`, `python3 -m pip`); ca-certificates lets pip reach PyPI.
# Without manual pages, translations and documentation but the copyright files (about 50 MB).
rootfs() {
  mmdebstrap --variant=minbase --quiet \
    --aptopt='APT::Install-Recommends "false"' \
    --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --dpkgopt='path-include=/usr/share/locale/locale.alias' \
    --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --include=python3,python3-venv,python3-pip,ca-certificates \
    bookworm - "$mirror" \
    "deb ${SECURITY_MIRROR:-http://deb.debian.org/debian-security} bookworm-security main"
}
path='PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin'
message="bookworm minbase + python3 (hack/build-local-base.sh)"
if [ "$engine" = buildah ]; then
  # buildah has no import: a container from scratch gets the tarball, then is committed.
  work="$(mktemp -d)"
  trap 'rm -rf "$work"; [ -z "${ctr:-}" ] || buildah rm "$ctr" >/dev/null' EXIT
  rootfs > "$work/rootfs.tar"
  ctr="$(buildah from scratch)"
  buildah add "$ctr" "$work/rootfs.tar" / >/dev/null
  buildah config --env "$path" --env LANG=C.UTF-8 --cmd '["python3"]' "$ctr"
  buildah commit -q "$ctr" "$tag" >/dev/null
else
  # The tarball goes straight into the engine: no file left behind.
  rootfs | "$engine" import --change "ENV=$path" --change 'ENV=LANG=C.UTF-8' \
    --change 'CMD=["python3"]' --message "$message" - "$tag" >/dev/null
fi
echo "build-local-base: built $tag"
