#!/usr/bin/env bash
# `make image`: build the agent's image with podman, buildah or docker (the first one installed;
# ENGINE=... chooses), tagged IMAGE (default gpu-dra:<version of pyproject.toml>).
#
# The base is the build argument BASE_IMAGE. Unset, it is the Dockerfile's default (the official
# python image, pinned by digest); when that base is neither present nor pullable (no registry
# reachable, as on air-gapped machines), this says so and builds on the local Debian base of
# hack/build-local-base.sh instead (LOCAL_BASE, built first when missing). A BASE_IMAGE given
# explicitly is used as it is, or the build fails.
set -euo pipefail
cd "$(dirname "$0")/.."

version="$(grep -m1 '^version' pyproject.toml | cut -d'"' -f2)"
image="${IMAGE:-gpu-dra:$version}"
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
    ENGINE="$engine" bash hack/build-local-base.sh "$local_base" >&2
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
"${build[@]}" "${extra[@]}" --build-arg "BASE_IMAGE=$base" -t "$image" -f Dockerfile .
echo "make image: built $image on $base with $engine"
