# Image of the gpu-dra node agent (`make image`). Two stages: the first builds wheels of the package
# and of its dependencies at the exact versions of constraints.txt, the second installs only those
# wheels (no compiler, no network, no build files) into the same slim Python base.
#
# Base (BASE_IMAGE): by default the official python image, pinned by version and by digest so that
# a rebuild gets the same bytes; bump both together (`docker buildx imagetools inspect
# python:<version>-slim-bookworm`). Where no registry is reachable, `make image` builds on
# localhost/gpu-dra-base:bookworm instead (hack/build-local-base.sh: Debian 12 with Debian's own
# Python 3.11 and pip). Every step below runs unchanged on both: both are bookworm with apt, and
# the steps call `python3 -m ...`, never a path (the official image has its Python in /usr/local,
# Debian's is /usr/bin/python3). The name is fully qualified: podman resolves no short names
# unless registries.conf says where to look.
# No `# syntax=` line: BuildKit's own Dockerfile frontend (Docker >= 23) and buildah both know
# RUN --mount; the line would make docker fetch a frontend image from Docker Hub first.
ARG BASE_IMAGE=docker.io/library/python:3.11.13-slim-bookworm@sha256:86adf8dbadc3d6e82ee5dd2c74bec2e1c2467cdad47886280501df722372d2e1

FROM ${BASE_IMAGE} AS build
# Every layer of this stage carries the label: hack/build-image.sh removes the untagged ones a
# rebuild leaves behind (and the final stage's, by its title label), nothing else.
LABEL gpu-dra.stage="build"
# A PyPI mirror, where PyPI is out of reach (hack/build-image.sh passes PIP_INDEX_URL on); this
# stage only, so it stays out of the image.
ARG PIP_INDEX_URL
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
# The CDI hook runs on the node, outside this image: a static binary works on any host. It is
# compiled here, not copied from the build context, so that it never depends on what the builder's
# machine has (its libc, a stale `make hook`); Debian's gcc + libc6-dev exist for both bases.
# First, before any source is copied, so that this layer stays cached across source changes.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# The dependencies' wheels (and the build backend's) before the package's own: a layer that changes
# only with pyproject.toml and constraints.txt. (`pip wheel` installs nothing, so Debian's PEP 668 guard does not apply.)
# Behind a TLS-intercepting proxy, pip needs the builder's CA bundle: hack/build-image.sh passes
# the machine's as the build secret `ca-bundle` (a secret: it reaches no layer); without it, pip
# uses its own certificates.
COPY pyproject.toml constraints.txt ./
RUN --mount=type=secret,id=ca-bundle \
    if [ -s /run/secrets/ca-bundle ]; then export PIP_CERT=/run/secrets/ca-bundle; fi \
    && python3 -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb")); print(*p["project"]["dependencies"], *p["build-system"]["requires"], sep="\n")' > requirements.txt \
    && python3 -m pip wheel --wheel-dir /wheels -c constraints.txt -r requirements.txt
COPY README.md ./
COPY dra_driver ./dra_driver
# The package's own wheel offline: its build backend (setuptools) is among the wheels above.
RUN gcc -static -O2 -Wall -o dra_driver/cdi/hook/gpu-dra-cdi-hook dra_driver/cdi/hook/hook.c \
    && python3 -m pip wheel --wheel-dir /wheels --no-index --find-links /wheels --no-deps \
       -c constraints.txt . \
    && cd /wheels && sha256sum *.whl > /wheels.sha256
# The SBOM tool (cyclonedx-bom, pinned in constraints.txt) in a virtualenv of its own: the final
# stage runs it from a bind mount over the agent's installed environment, so the SBOM lists what
# the image has, and the tool itself stays out of the image.
RUN --mount=type=secret,id=ca-bundle \
    if [ -s /run/secrets/ca-bundle ]; then export PIP_CERT=/run/secrets/ca-bundle; fi \
    && python3 -m venv /sbom-tool \
    && /sbom-tool/bin/python3 -m pip install -c constraints.txt cyclonedx-bom

FROM ${BASE_IMAGE}
ARG VERSION=""
LABEL org.opencontainers.image.title="gpu-dra" \
      org.opencontainers.image.description="Kubernetes DRA driver for NVIDIA GPUs (node agent)" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# The agent lives in a virtual environment, /opt/gpu-dra, whose bin/ is first on PATH: the same
# on both bases, and on Debian's the only way that respects its PEP 668 guard (its system Python
# belongs to apt; `pip install --break-system-packages` would mix our packages with apt's). The
# venv has no pip of its own: the base's pip installs into it (`--python`), so the image carries
# one pip, the base's. The wheels are bind-mounted, not copied, so they leave no layer behind.
# Their checksums are copied, and kept as a record of what was installed: podman/buildah (1.28)
# key the cache of a RUN by its text alone, not by what it mounts, so without this change of
# input a new wheel of the package would not be installed (stale image, seen here).
COPY --from=build /wheels.sha256 /opt/gpu-dra/wheels.sha256
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    --mount=type=bind,source=constraints.txt,target=/tmp/constraints.txt \
    python3 -m venv --without-pip /opt/gpu-dra \
    && python3 -m pip --python /opt/gpu-dra/bin/python3 install --no-index --find-links /wheels \
       -c /tmp/constraints.txt gpu-dra \
    && python3 -OO -m compileall -q -j 0 /opt/gpu-dra/lib \
       "$(python3 -c 'import sysconfig; print(sysconfig.get_path("stdlib"))')"
# The software bill of materials of the installed environment (CycloneDX JSON, reproducible: no
# timestamp or serial number), every Python package with its version, licence and PyPI package
# URL: /opt/gpu-dra/sbom.cdx.json (docs/install.md "The image").
RUN --mount=type=bind,from=build,source=/sbom-tool,target=/sbom-tool \
    /sbom-tool/bin/python3 -m cyclonedx_py environment --output-reproducible --of JSON \
       -o /opt/gpu-dra/sbom.cdx.json /opt/gpu-dra/bin/python3
LABEL org.opencontainers.image.version="${VERSION}" \
      gpu-dra.sbom="/opt/gpu-dra/sbom.cdx.json"
# After the install: `python3` above is the base's, from now on it is the venv's.
ENV PATH=/opt/gpu-dra/bin:$PATH
# The chart runs the agent with PYTHONOPTIMIZE=2 (no docstrings: less memory); the line above
# compiles those .pyc files for the agent, its dependencies and the standard library (pip compiles
# only the plain ones), so that nothing is compiled at every start (PYTHONDONTWRITEBYTECODE keeps
# the image read-only at run time).
# Non-root by default, which is enough for `gpu-dra explain` and simulated GPUs. The node agent on
# real nodes runs as root (the chart sets runAsUser: 0 and privileged): the kubelet's socket
# directories and the CDI directory are root-owned host paths, and NVML/MIG management needs the
# GPU device nodes (see charts/gpu-dra/values.yaml, kubeletPlugin.securityContext).
USER 65532:65532
ENTRYPOINT ["gpu-dra-kubelet-plugin"]
