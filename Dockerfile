# syntax=docker/dockerfile:1
# Image of the gpu-dra node agent (`make image`). Two stages: the first builds wheels of the package
# and of its dependencies at the exact versions of constraints.txt, the second installs only those
# wheels (no compiler, no network, no build files) into the same slim Python base.
#
# Base: the official python image, pinned by version and by digest so that a rebuild gets the same
# bytes; bump both together (`docker buildx imagetools inspect python:<version>-slim-bookworm`).

FROM python:3.11.13-slim-bookworm@sha256:86adf8dbadc3d6e82ee5dd2c74bec2e1c2467cdad47886280501df722372d2e1 AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml constraints.txt README.md ./
COPY dra_driver ./dra_driver
# The CDI hook runs on the node, outside this image: a static binary works on any host.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && gcc -static -O2 -Wall -o dra_driver/cdi/hook/gpu-dra-cdi-hook dra_driver/cdi/hook/hook.c
RUN python -m pip wheel --wheel-dir /wheels -c constraints.txt .

FROM python:3.11.13-slim-bookworm@sha256:86adf8dbadc3d6e82ee5dd2c74bec2e1c2467cdad47886280501df722372d2e1
LABEL org.opencontainers.image.title="gpu-dra" \
      org.opencontainers.image.description="Kubernetes DRA driver for NVIDIA GPUs (node agent)" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# The wheels are bind-mounted, not copied, so they leave no layer behind.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    --mount=type=bind,source=constraints.txt,target=/tmp/constraints.txt \
    python -m pip install --no-index --find-links /wheels -c /tmp/constraints.txt gpu-dra \
    && python -OO -m compileall -q -j 0 /usr/local/lib/python3.11
# The chart runs the agent with PYTHONOPTIMIZE=2 (no docstrings: less memory); the line above
# compiles those .pyc files (pip compiles only the plain ones), so that nothing is compiled at
# every start (PYTHONDONTWRITEBYTECODE keeps the image read-only at run time).
# Non-root by default, which is enough for `gpu-dra explain` and simulated GPUs. The node agent on
# real nodes runs as root (the chart sets runAsUser: 0 and privileged): the kubelet's socket
# directories and the CDI directory are root-owned host paths, and NVML/MIG management needs the
# GPU device nodes (see charts/gpu-dra/values.yaml, kubeletPlugin.securityContext).
USER 65532:65532
ENTRYPOINT ["gpu-dra-kubelet-plugin"]
