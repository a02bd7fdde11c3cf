"""Stand-in driver libraries and tools that are real ELF files, for what must load them.

Part of the simulated backend, beside the fake driver tree (fakedriver.py), whose files are a
line of text by default. Where something must actually load the driver (a container started
through a CDI spec in tests/test_deployed.py; the CUDA load of ``gpu-dra gpu-check --simulate``),
:func:`build_libraries` compiles each library of ``fakedriver.LIBRARIES`` with the machine's C
compiler as a shared object with the soname the real one has, exporting the functions a CUDA
program or NVML user calls first (:data:`EXPORTS`: ``cuInit``, ``cuDeviceGetCount``,
``cuDeviceGet``, ``cuDeviceGetName``, and what an MPS client's memory steps call
(:data:`MPS_CLIENT_C`); ``nvmlInit_v2``, ``nvmlDeviceGetCount_v2``, ...), answering
for the simulated GPUs it is given. :func:`build_nvidia_smi` is a stand-in ``nvidia-smi`` that
runs in a root without Python (a minimal container): ``-L`` lists the GPUs its
``libnvidia-ml.so.1`` reports, as the real one does. Needs ``cc``.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path

from dra_driver.sim.fakedriver import LIBRARIES
from dra_driver.sim.profiles import DRIVER_VERSION

_GPU_TABLE = """
static const char *gpu_names[] = {%(names)s};
static const char *gpu_uuids[] = {%(uuids)s};
static const unsigned long long gpu_memory[] = {%(memory)s};
static const int gpu_count = %(count)d;
"""
MPS_CLIENT_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
/* What an MPS client of device 0 sees of its memory, and nothing more: a context, the memory
 * (the GPU's, or the CUDA_MPS_PINNED_DEVICE_MEM_LIMIT the environment names for its UUID,
 * applied only while CUDA_MPS_PIPE_DIRECTORY holds a daemon's control socket, as real MPS does;
 * the daemon's own default limit is not asked), and allocations counted against it. No
 * kernel runs: cuModuleLoadData answers CUDA_ERROR_NOT_SUPPORTED (801), cuDeviceGetAttribute
 * too (the stand-in knows no SM count). */
static unsigned long long in_use;
#define MAX_BLOCKS 65536
static unsigned long long block_sizes[MAX_BLOCKS];
static int blocks;
static unsigned long long limit_bytes(void) {
    unsigned long long total = gpu_count ? gpu_memory[0] : 0;
    const char *pipe = getenv("CUDA_MPS_PIPE_DIRECTORY");
    const char *limits = getenv("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT");
    char control[4096];
    struct stat st;
    if (!pipe || !limits || !gpu_count) return total;
    snprintf(control, sizeof control, "%%s/control", pipe);
    if (stat(control, &st) != 0 || !S_ISSOCK(st.st_mode)) return total; /* no MPS: no limit */
    char copy[4096];
    snprintf(copy, sizeof copy, "%%s", limits);
    for (char *entry = strtok(copy, ","); entry; entry = strtok(NULL, ",")) {
        char *value = entry, *equals = strchr(entry, '=');
        if (equals) { /* <device>=<limit>: this device by UUID or index, or another's */
            *equals = 0;
            if (strcmp(entry, gpu_uuids[0]) != 0 && strcmp(entry, "0") != 0) continue;
            value = equals + 1;
        }
        char *unit;
        unsigned long long n = strtoull(value, &unit, 10);
        unsigned long long bytes = n << (*unit == 'G' ? 30 : 20);
        return bytes < total ? bytes : total;
    }
    return total;
}
int cuDevicePrimaryCtxRetain(void **context, int device) {
    if (device < 0 || device >= gpu_count) return 101;
    *context = (void *)1;
    return 0;
}
int cuDevicePrimaryCtxRelease_v2(int device) { return device < 0 || device >= gpu_count ? 101 : 0; }
int cuCtxSetCurrent(void *context) { return context ? 0 : 201; /* CUDA_ERROR_INVALID_CONTEXT */ }
int cuCtxSynchronize(void) { return 0; }
int cuDeviceGetAttribute(int *value, int attribute, int device) {
    (void)value; (void)attribute; (void)device;
    return 801;
}
int cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes) {
    unsigned long long limit = limit_bytes();
    *free_bytes = (size_t)(limit - in_use);
    *total_bytes = (size_t)(gpu_count ? gpu_memory[0] : 0);
    return 0;
}
int cuMemAlloc_v2(unsigned long long *pointer, size_t size) {
    if (size == 0) return 1; /* CUDA_ERROR_INVALID_VALUE */
    if (blocks == MAX_BLOCKS || in_use + size > limit_bytes()) return 2; /* OUT_OF_MEMORY */
    block_sizes[blocks] = size;
    in_use += size;
    *pointer = ((unsigned long long)++blocks) << 32;
    return 0;
}
int cuMemFree_v2(unsigned long long pointer) {
    unsigned long long index = pointer >> 32;
    if (index == 0 || index > (unsigned long long)blocks || !block_sizes[index - 1]) return 1;
    in_use -= block_sizes[index - 1];
    block_sizes[index - 1] = 0;
    return 0;
}
int cuModuleLoadData(void **module, const void *image) {
    (void)module; (void)image;
    return 801;
}
int cuModuleGetFunction(void **f, void *module, const char *name) {
    (void)f; (void)module; (void)name;
    return 801;
}
int cuModuleUnload(void *module) { (void)module; return 0; }
int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                   unsigned bz, unsigned shared, void *stream, void **params, void **extra) {
    (void)f; (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)shared;
    (void)stream; (void)params; (void)extra;
    return 801;
}
"""
"""The stand-in libcuda's side for ``gpu-check --mps``'s probe (gpucheck/probe.c, ``mps``); a ``%``
template like the rest of libcuda's source."""

EXPORTS = {
    "libcuda": _GPU_TABLE
    + r"""
#include <string.h>
int cuInit(unsigned int flags) { return (int)flags; }
int cuDeviceGetCount(int *count) { *count = gpu_count; return 0; }
int cuDeviceGet(int *device, int ordinal) {
    if (ordinal < 0 || ordinal >= gpu_count) return 101; /* CUDA_ERROR_INVALID_DEVICE */
    *device = ordinal;
    return 0;
}
int cuDeviceGetName(char *name, int length, int device) {
    if (device < 0 || device >= gpu_count || length < 1) return 101;
    strncpy(name, gpu_names[device], (size_t)length - 1);
    name[length - 1] = 0;
    return 0;
}
"""
    + MPS_CLIENT_C,
    "libnvidia-ml": _GPU_TABLE
    + r"""
#include <stdint.h>
#include <string.h>
int nvmlInit_v2(void) { return 0; }
int nvmlShutdown(void) { return 0; }
int nvmlDeviceGetCount_v2(unsigned *count) { *count = (unsigned)gpu_count; return 0; }
int nvmlDeviceGetHandleByIndex_v2(unsigned index, void **device) {
    if (index >= (unsigned)gpu_count) return 2; /* NVML_ERROR_INVALID_ARGUMENT */
    *device = (void *)(uintptr_t)(index + 1);
    return 0;
}
static int copy(const char *text, char *out, unsigned length) {
    if (strlen(text) + 1 > length) return 7; /* NVML_ERROR_INSUFFICIENT_SIZE */
    strcpy(out, text);
    return 0;
}
int nvmlDeviceGetName(void *device, char *name, unsigned length) {
    return copy(gpu_names[(uintptr_t)device - 1], name, length);
}
int nvmlDeviceGetUUID(void *device, char *uuid, unsigned length) {
    return copy(gpu_uuids[(uintptr_t)device - 1], uuid, length);
}
""",
    "libnvcuvid": "int cuvidGetDecoderCaps(void *caps) { return caps == 0 ? 0 : 1; }",
}
"""C source of the libraries that answer calls (``%`` fields: the GPU table); every other
library exports one stub function."""

NVIDIA_SMI_C = r"""
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
int main(int argc, char **argv) {
    if (argc != 2 || strcmp(argv[1], "-L") != 0) {
        fprintf(stderr, "this stand-in nvidia-smi knows only -L\n");
        return 2;
    }
    void *nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (!nvml) { fprintf(stderr, "NVIDIA-SMI has failed: %s\n", dlerror()); return 9; }
    int (*init)(void) = (int (*)(void))dlsym(nvml, "nvmlInit_v2");
    int (*count)(unsigned *) = (int (*)(unsigned *))dlsym(nvml, "nvmlDeviceGetCount_v2");
    int (*get)(unsigned, void **) = (int (*)(unsigned, void **))dlsym(nvml,
        "nvmlDeviceGetHandleByIndex_v2");
    int (*name)(void *, char *, unsigned) = (int (*)(void *, char *, unsigned))dlsym(nvml,
        "nvmlDeviceGetName");
    int (*uuid)(void *, char *, unsigned) = (int (*)(void *, char *, unsigned))dlsym(nvml,
        "nvmlDeviceGetUUID");
    unsigned n = 0;
    if (!init || !count || !get || !name || !uuid || init() != 0 || count(&n) != 0) return 9;
    for (unsigned i = 0; i < n; i++) {
        void *device;
        char text[96], id[96];
        if (get(i, &device) || name(device, text, sizeof text) || uuid(device, id, sizeof id))
            return 15;
        printf("GPU %u: %s (UUID: %s)\n", i, text, id);
    }
    return 0;
}
"""


def soname(lib: str) -> str:
    """The soname the real library has (``libcuda.so.1``), or ``<lib>.so.<driver version>``."""
    versioned = [n for n in LIBRARIES[lib] if re.fullmatch(rf"{re.escape(lib)}\.so\.\d+", n)]
    return versioned[0] if versioned else f"{lib}.so.{DRIVER_VERSION}"


def _strings(values: Sequence[str]) -> str:
    return ", ".join(json.dumps(v) for v in values) or "0"


def build_libraries(
    out: Path, *, gpus: Sequence[tuple[str, str]] = (), memory_mib: Sequence[int] = ()
) -> dict[str, bytes]:
    """Every library of ``fakedriver.LIBRARIES`` as ELF bytes, built in ``out``; ``gpus``:
    (product name, UUID) of each GPU libcuda and libnvidia-ml report, in index order;
    ``memory_mib``: their memory (libcuda's cuMemGetInfo; 0 where not given)."""
    memory = [*memory_mib, *([0] * (len(gpus) - len(memory_mib)))][: len(gpus)]
    table = {
        "names": _strings([name for name, _ in gpus]),
        "uuids": _strings([uuid for _, uuid in gpus]),
        "memory": ", ".join(f"{mib << 20}ULL" for mib in memory) or "0",
        "count": len(gpus),
    }
    libraries = {}
    for lib in LIBRARIES:
        source = out / f"{lib}.c"
        symbol = re.sub(r"\W", "_", lib)
        text = EXPORTS.get(lib, f"int gpu_dra_stub_{symbol}(void) {{ return 7; }}")
        source.write_text(text % table if "%(" in text else text)
        target = out / f"{lib}.so"
        subprocess.run(
            ["cc", "-shared", "-fPIC", f"-Wl,-soname,{soname(lib)}", "-o", target, source],
            check=True,
        )
        libraries[lib] = target.read_bytes()
    return libraries


def build_nvidia_smi(out: Path) -> bytes:
    """The stand-in ``nvidia-smi -L`` as ELF bytes (built in ``out``)."""
    (out / "nvidia-smi.c").write_text(NVIDIA_SMI_C)
    target = out / "nvidia-smi"
    subprocess.run(["cc", "-O1", "-o", target, out / "nvidia-smi.c"], check=True)
    return target.read_bytes()


__all__ = ["EXPORTS", "MPS_CLIENT_C", "build_libraries", "build_nvidia_smi", "soname"]
