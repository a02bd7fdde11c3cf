#!/usr/bin/env bash
# make containerd: builds containerd 2.x (containerd, its runc shim, ctr) and the CNI plugins
# (bridge, host-local, loopback) the real-kubelet tier runs, from their Go modules (pinned by
# hack/containerd/go.mod), into a cache folder outside the clone keyed by containerd's version:
#   ${GPU_DRA_CONTAINERD_CACHE:-$HOME/.cache/gpu-dra/containerd}/<version>/bin
# A folder that holds every binary and a stamp matching hack/containerd's sources is reused as it
# is. runc is Debian's (apt-get install runc). Prints the folder on stdout.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
src=$here/containerd
version=$(awk '$1=="github.com/containerd/containerd/v2" {print $2; exit}' "$src/go.mod")
cache=${GPU_DRA_CONTAINERD_CACHE:-$HOME/.cache/gpu-dra/containerd}
out=$cache/$version/bin
programs=(containerd containerd-shim-runc-v2 ctr bridge host-local loopback)
stamp=$( (cd "$src" && find . -type f \( -name '*.go' -o -name 'go.mod' -o -name 'go.sum' \) -print0 \
  | sort -z | xargs -0 sha256sum; sha256sum < "$here/containerd.sh") | sha256sum | cut -c1-16)
have_all() {
  [ -f "$out/.stamp" ] && [ "$(cat "$out/.stamp")" = "$stamp" ] || return 1
  for p in "${programs[@]}"; do [ -x "$out/$p" ] || return 1; done
}
if have_all; then
  echo "$out"
  exit 0
fi
[ -x /usr/local/go/bin/go ] && PATH="$PATH:/usr/local/go/bin"
command -v go >/dev/null 2>&1 || { echo "make containerd: no go on PATH (Go 1.26 or newer)" >&2; exit 1; }
mkdir -p "$out"
start=$(date +%s)
cd "$src"
# Static and cgo-free, as containerd's own release builds the shim: without cgo the btrfs
# snapshotter is left out (overlayfs and native remain). GOFLAGS=-p=1 on a shared 2-core machine
# is the caller's choice (GOFLAGS in the environment is kept).
export CGO_ENABLED=0 GOFLAGS="${GOFLAGS:-} -mod=mod"
echo "make containerd: building containerd $version into $out" >&2
cver=github.com/containerd/containerd/v2/version
ldflags="-s -w -X $cver.Version=$version -X $cver.Package=github.com/containerd/containerd/v2"
go build -trimpath -tags no_btrfs -ldflags "$ldflags" -o "$out/" \
  github.com/containerd/containerd/v2/cmd/containerd \
  github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2 \
  github.com/containerd/containerd/v2/cmd/ctr >&2
go build -trimpath -ldflags "-s -w" -o "$out/" \
  github.com/containernetworking/plugins/plugins/main/bridge \
  github.com/containernetworking/plugins/plugins/ipam/host-local \
  github.com/containernetworking/plugins/plugins/main/loopback >&2
printf '%s\n' "$stamp" > "$out/.stamp"
end=$(date +%s)
echo "make containerd: built in $((end - start)) s; $(du -sh "$out" | cut -f1) in $out" >&2
echo "$out"
