#!/usr/bin/env bash
# Builds bench/caller/kubelet_caller.cc, the bench's native gRPC caller (the kubelet's side),
# into $1. Needs g++ and libgrpc++-dev: installed with apt-get when missing and running as root
# on Debian; elsewhere it says what to install and exits 2 (the bench then uses its Python
# caller and says so, and tests/test_bench_caller.py skips). Any other failure (the compiler
# refusing the source) exits with the compiler's status, which fails that test.
set -euo pipefail
out="${1:?usage: build-bench-caller.sh <output binary>}"
src="$(cd "$(dirname "$0")/.." && pwd)/bench/caller/kubelet_caller.cc"
if [ -x "$out" ] && [ "$out" -nt "$src" ]; then
  exit 0
fi
have_toolchain() {
  command -v g++ >/dev/null 2>&1 && pkg-config --exists grpc++ 2>/dev/null
}
if ! have_toolchain; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing g++ and libgrpc++-dev for the bench's native gRPC caller" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq g++ pkg-config libgrpc++-dev >/dev/null
  fi
fi
if ! have_toolchain; then
  echo "cannot build the native gRPC caller: install g++, pkg-config and libgrpc++-dev" >&2
  exit 2
fi
mkdir -p "$(dirname "$out")"
# shellcheck disable=SC2046
g++ -O2 -std=c++17 -Wall -Wextra -o "$out.tmp" "$src" $(pkg-config --cflags --libs grpc++)
mv "$out.tmp" "$out"
