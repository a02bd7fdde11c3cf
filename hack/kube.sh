#!/usr/bin/env bash
# make kube: builds the real Kubernetes programs the real-cluster tier runs (etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler, kubelet, kubemark) from their Go modules, plus this
# project's test tooling in hack/kube (the hollow node with the kubelet's real DRA manager, and
# the allocator oracle), into a cache folder outside the clone keyed by the Kubernetes version:
#   ${GPU_DRA_KUBE_CACHE:-$HOME/.cache/gpu-dra/kube}/<version>/bin
# A folder that holds every binary and a stamp matching hack/kube's sources is reused as it is.
# Prints the folder on stdout (the tests find it the same way; KUBEBUILDER_ASSETS overrides).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
src=$here/kube
version=$(awk '$1=="k8s.io/kubernetes" {print $2; exit}' "$src/go.mod")
cache=${GPU_DRA_KUBE_CACHE:-$HOME/.cache/gpu-dra/kube}
out=$cache/$version/bin
programs=(etcd kube-apiserver kube-controller-manager kube-scheduler kubelet kubemark hollownode draoracle)
# The stamp: every file of hack/kube (the oracle and the hollow node are ours and change).
stamp=$( (cd "$src" && find . -type f \( -name '*.go' -o -name 'go.mod' -o -name 'go.sum' \) -print0 \
  | sort -z | xargs -0 sha256sum; sha256sum < "$here/kube.sh") | sha256sum | cut -c1-16)
have_all() {
  [ -f "$out/.stamp" ] && [ "$(cat "$out/.stamp")" = "$stamp" ] || return 1
  for p in "${programs[@]}"; do [ -x "$out/$p" ] || return 1; done
}
if have_all; then
  echo "$out"
  exit 0
fi
[ -x /usr/local/go/bin/go ] && PATH="$PATH:/usr/local/go/bin"
command -v go >/dev/null 2>&1 || { echo "make kube: no go on PATH (Go 1.26 or newer)" >&2; exit 1; }
mkdir -p "$out"
start=$(date +%s)
cd "$src"
# -trimpath: the binaries do not name this clone; CGO off: static, as Kubernetes releases them
# (the kubelet's cadvisor parts need no cgo on Linux).
export CGO_ENABLED=0 GOFLAGS=-mod=mod
echo "make kube: building Kubernetes $version into $out (first build: tens of minutes)" >&2
# The version the release's own build stamps in (hack/lib/version.sh): what /version, helm's
# kubeVersion check and the components' logs report. -s -w: no symbol tables (a third of the size).
minor=${version#v1.}
minor=${minor%%.*}
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $pkg.gitVersion=$version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done
go build -trimpath -ldflags "$ldflags" -o "$out/" \
  k8s.io/kubernetes/cmd/kube-apiserver \
  k8s.io/kubernetes/cmd/kube-controller-manager \
  k8s.io/kubernetes/cmd/kube-scheduler \
  k8s.io/kubernetes/cmd/kubelet \
  k8s.io/kubernetes/cmd/kubemark >&2
go build -trimpath -ldflags "-s -w" -o "$out/etcd" ./etcd >&2
for tool in hollownode draoracle; do
  if [ -d "$tool" ]; then go build -trimpath -ldflags "$ldflags" -o "$out/$tool" "./$tool" >&2; fi
done
printf '%s\n' "$stamp" > "$out/.stamp"
end=$(date +%s)
echo "make kube: built in $((end - start)) s; $(du -sh "$out" | cut -f1) in $out" >&2
echo "$out"
