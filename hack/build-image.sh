#!/usr/bin/env bash
# `make image`: build the agent's image with podman, buildah or docker (the first one installed;
# ENGINE=... chooses), tagged IMAGE (default gpu-dra:<version of pyproject.toml>).
#
# The base is the build argument BASE_IMAGE. Unset, it is the Dockerfile's default (the official
# python image, pinned by digest); when that base is neither present nor pullable (no registry
# reachable, as on air-gapped machines), this says so and builds on the local Debian base of
# hack/build-local-base.sh instead (LOCAL_BASE, built first when missing). A BASE_IMAGE given
# explicitly is used as it is, or the build fails. The local base is rebuilt when it is older
# than BASE_MAX_AGE_DAYS (default 7: Debian's security updates reach it weekly at least) or when
# REFRESH_BASE=1 asks.
#
# No untagged images are left behind: the build stage is tagged (BUILD_IMAGE, default
# localhost/gpu-dra-build:<version>) so that its layers stay cached for the next build, and the
# untagged images of earlier builds (the final stage's, by its title label, and the build
# stage's, by its gpu-dra.stage label) are removed after each build; nobody else's images.
set -euo pipefail
cd "$(dirname "$0")/.."

version="$(grep -m1 '^version' pyproject.toml | cut -d'"' -f2)"
image="${IMAGE:-gpu-dra:$version}"
build_image="${BUILD_IMAGE:-localhost/gpu-dra-build:$version}"
local_base="${LOCAL_BASE:-localhost/gpu-dra-base:bookworm}"
engine="${ENGINE:-}"
if [ -z "$engine" ]; then
  for candidate in podman buildah docker; do
    if command -v "$candidate" >/dev/null 2>&1; then engine="$candidate"; break; fi
  done
fi
if [ -z "$engine" ]; then
  echo "make image: no podman, buildah or docker installed" >&2
  exit 1
fi

present() {  # is image $1 in the engine's local store?
  case "$engine" in
    buildah) buildah inspect --type image "$1" >/dev/null 2>&1 ;;
    *) "$engine" image inspect "$1" >/dev/null 2>&1 ;;
  esac
}

base="${BASE_IMAGE:-}"
if [ -z "$base" ]; then
  base="$(sed -n 's/^ARG BASE_IMAGE=//p' Dockerfile)"
  if ! present "$base" && ! "$engine" pull -q "$base" >/dev/null 2>&1; then
    echo "make image: cannot pull $base (no registry reachable?);" \
      "building on the local Debian base $local_base (hack/build-local-base.sh)" >&2
    ENGINE="$engine" MAX_AGE_DAYS="${BASE_MAX_AGE_DAYS:-7}" FORCE="${REFRESH_BASE:-0}" \
      bash hack/build-local-base.sh "$local_base" >&2
    base="$local_base"
  fi
fi

case "$engine" in
  buildah) build=(buildah build --layers) ;;
  docker) build=(env DOCKER_BUILDKIT=1 docker build) ;;  # RUN --mount needs BuildKit
  *) build=("$engine" build --layers) ;;
esac
# pip in the build stage trusts what this machine trusts (a proxy's CA, say): CA_BUNDLE, by
# default the system bundle, goes in as a build secret, which no layer keeps.
ca_bundle="${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"
extra=()
if [ -s "$ca_bundle" ]; then extra=(--secret "id=ca-bundle,src=$ca_bundle"); fi
# PIP_INDEX_URL: a PyPI mirror for the build stage's pip.
if [ -n "${PIP_INDEX_URL:-}" ]; then extra+=(--build-arg "PIP_INDEX_URL=$PIP_INDEX_URL"); fi
args=("${extra[@]}" --build-arg "BASE_IMAGE=$base" --build-arg "VERSION=$version" -f Dockerfile)
"${build[@]}" "${args[@]}" --target build -t "$build_image" .
"${build[@]}" "${args[@]}" -t "$image" .

# Untagged images of ours (dangling: no tag, no child image), a few passes since removing one
# can leave its parent layer dangling; an image a running build still uses is refused and kept.
removed=0
for _ in 1 2 3 4 5 6 7 8; do
  ids="$(for label in org.opencontainers.image.title=gpu-dra gpu-dra.stage=build; do
    "$engine" images -q --filter dangling=true --filter "label=$label" 2>/dev/null || true
  done | sort -u)"
  [ -n "$ids" ] || break
  gone=0
  for id in $ids; do
    if "$engine" rmi "$id" >/dev/null 2>&1; then gone=$((gone + 1)); fi
  done
  removed=$((removed + gone))
  [ "$gone" -gt 0 ] || break
done
echo "make image: built $image on $base with $engine (removed $removed untagged images of earlier builds)"
