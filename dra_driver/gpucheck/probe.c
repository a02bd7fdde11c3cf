/*
 * gpu-check-probe: what a CUDA program sees of the driver inside a container made from a CDI
 * spec. It loads libcuda.so.1 and libnvidia-ml.so.1 the way the CUDA runtime and NVML users do
 * (dlopen by soname, so the loader cache the spec's hook rebuilt decides where they come from)
 * and calls cuInit(0), cuDeviceGetCount, cuDeviceGetName, nvmlInit_v2, nvmlDeviceGetCount_v2
 * and nvmlShutdown. Read-only: no call changes a GPU. One line per step on standard output:
 *
 *   load LIB ok PATH            the library and the file it was loaded from
 *   load LIB fail DLERROR       e.g. a library it needs that the spec did not mount
 *   call FUNC RESULT [VALUE]    the function's return code (0: success) and what it reported
 *   missing FUNC DLERROR        the library does not export it
 *
 * Exit status: 0 when every step succeeded, 1 otherwise. Built by the check with the machine's
 * C compiler, or carried prebuilt (hack/gpu-check-wheels.sh).
 *
 * `gpu-check-probe mps STEP_MIB ITERATIONS` is what `gpu-check --mps` runs as an MPS client of
 * its own control daemon (the environment says which daemon and which limits). It uses device 0
 * through its primary context and prints, beside the lines above:
 *
 *   value multiprocessors N      cuDeviceGetAttribute(MULTIPROCESSOR_COUNT)
 *   value context_sms N          cuCtxGetExecAffinity(SM_COUNT): the SMs this client may use
 *   value memory_free B          cuMemGetInfo: what the client sees (B bytes)
 *   value memory_total B
 *   value allocated B            cuMemAlloc in steps of STEP_MIB until one fails (all freed)
 *   value alloc_steps N          and the failing call's line: call cuMemAlloc RESULT
 *   value kernel_ms T            the fastest of three launches of a kernel loaded from the PTX
 *                                below (cuModuleLoadData, cuLaunchKernel): every thread runs
 *                                ITERATIONS dependent FMAs, 8 blocks of 256 threads per SM
 *
 * It allocates device memory and runs a kernel; it changes no GPU setting.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int failures;

static void *load(const char *lib) {
    void *handle = dlopen(lib, RTLD_NOW | RTLD_GLOBAL);
    if (!handle) {
        printf("load %s fail %s\n", lib, dlerror());
        failures++;
        return NULL;
    }
    Dl_info info;
    void *any = dlsym(handle, lib[3] == 'c' ? "cuInit" : "nvmlInit_v2");
    printf("load %s ok %s\n", lib, any && dladdr(any, &info) ? info.dli_fname : "?");
    return handle;
}

static void *symbol(void *handle, const char *name) {
    void *f = dlsym(handle, name);
    if (!f) {
        printf("missing %s %s\n", name, dlerror());
        failures++;
    }
    return f;
}

static void result(const char *name, int rc, const char *value) {
    printf("call %s %d%s%s\n", name, rc, value ? " " : "", value ? value : "");
    if (rc != 0) failures++;
}

/* One FMA chain per thread; thread 0 stores its result so the chain is not dead code. */
static const char SPIN_PTX[] =
    ".version 6.0\n"
    ".target sm_60\n"
    ".address_size 64\n"
    ".visible .entry gpu_check_spin(.param .u64 out, .param .u32 iterations)\n"
    "{\n"
    "  .reg .pred %p<3>;\n"
    "  .reg .f32 %f<3>;\n"
    "  .reg .b32 %r<4>;\n"
    "  .reg .b64 %rd<3>;\n"
    "  ld.param.u64 %rd1, [out];\n"
    "  ld.param.u32 %r1, [iterations];\n"
    "  mov.u32 %r2, %tid.x;\n"
    "  cvt.rn.f32.u32 %f1, %r2;\n"
    "  mov.f32 %f2, 0f3F7FFFFE;\n"
    "  mov.u32 %r3, 0;\n"
    "$L_loop:\n"
    "  fma.rn.f32 %f1, %f1, %f2, 0f3F800000;\n"
    "  add.s32 %r3, %r3, 1;\n"
    "  setp.lt.u32 %p1, %r3, %r1;\n"
    "  @%p1 bra $L_loop;\n"
    "  setp.ne.s32 %p2, %r2, 0;\n"
    "  @%p2 bra $L_done;\n"
    "  cvta.to.global.u64 %rd2, %rd1;\n"
    "  st.global.f32 [%rd2], %f1;\n"
    "$L_done:\n"
    "  ret;\n"
    "}\n";

typedef unsigned long long devptr;
#define MAX_STEPS 65536
#define CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT 16

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static int mps_client(unsigned long long step_mib, unsigned iterations) {
    void *cuda = load("libcuda.so.1");
    if (!cuda) return 1;
    int (*cu_init)(unsigned) = (int (*)(unsigned))symbol(cuda, "cuInit");
    int (*retain)(void **, int) = (int (*)(void **, int))symbol(cuda, "cuDevicePrimaryCtxRetain");
    int (*set_current)(void *) = (int (*)(void *))symbol(cuda, "cuCtxSetCurrent");
    int (*release)(int) = (int (*)(int))symbol(cuda, "cuDevicePrimaryCtxRelease_v2");
    int (*attribute)(int *, int, int) = (int (*)(int *, int, int))symbol(cuda,
        "cuDeviceGetAttribute");
    int (*mem_info)(size_t *, size_t *) = (int (*)(size_t *, size_t *))symbol(cuda,
        "cuMemGetInfo_v2");
    int (*mem_alloc)(devptr *, size_t) = (int (*)(devptr *, size_t))symbol(cuda, "cuMemAlloc_v2");
    int (*mem_free)(devptr) = (int (*)(devptr))symbol(cuda, "cuMemFree_v2");
    /* CUDA 11.4 and newer: the SMs an MPS client's context may use */
    int (*affinity)(unsigned *, int) = (int (*)(unsigned *, int))dlsym(cuda,
        "cuCtxGetExecAffinity");
    if (!cu_init || !retain || !set_current || !release || !mem_info || !mem_alloc || !mem_free)
        return 1;
    char text[64];
    int rc = cu_init(0);
    result("cuInit", rc, NULL);
    void *context = NULL;
    if (rc == 0) {
        rc = retain(&context, 0);
        result("cuDevicePrimaryCtxRetain", rc, NULL);
    }
    if (rc == 0) {
        rc = set_current(context);
        result("cuCtxSetCurrent", rc, NULL);
    }
    if (rc != 0) return 1;
    int sms = 0;
    if (attribute && attribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 0) == 0)
        printf("value multiprocessors %d\n", sms);
    unsigned exec[2] = {0, 0}; /* CUexecAffinityParam: type, then the SM count */
    if (affinity && affinity(exec, 0) == 0) printf("value context_sms %u\n", exec[1]);
    size_t free_bytes = 0, total_bytes = 0;
    rc = mem_info(&free_bytes, &total_bytes);
    result("cuMemGetInfo", rc, NULL);
    if (rc == 0) printf("value memory_free %zu\nvalue memory_total %zu\n", free_bytes, total_bytes);
    devptr *blocks = calloc(MAX_STEPS, sizeof *blocks);
    if (!blocks) return 1;
    size_t step = (size_t)step_mib << 20;
    unsigned long long allocated = 0;
    int steps = 0;
    while (steps < MAX_STEPS) {
        rc = mem_alloc(&blocks[steps], step);
        if (rc != 0) break;
        allocated += step;
        steps++;
    }
    printf("value allocated %llu\nvalue alloc_steps %d\n", allocated, steps);
    /* the failing call ends the steps: out of memory (2) is the expected end, not a failure */
    printf("call cuMemAlloc %d\n", rc);
    for (int i = 0; i < steps; i++) mem_free(blocks[i]);
    free(blocks);
    int (*load_data)(void **, const void *) = (int (*)(void **, const void *))dlsym(cuda,
        "cuModuleLoadData");
    int (*get_function)(void **, void *, const char *) =
        (int (*)(void **, void *, const char *))dlsym(cuda, "cuModuleGetFunction");
    int (*launch)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                  void *, void **, void **) =
        (int (*)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                 void *, void **, void **))dlsym(cuda, "cuLaunchKernel");
    int (*synchronize)(void) = (int (*)(void))dlsym(cuda, "cuCtxSynchronize");
    int (*unload)(void *) = (int (*)(void *))dlsym(cuda, "cuModuleUnload");
    if (!load_data || !get_function || !launch || !synchronize || !unload) {
        printf("missing cuModuleLoadData/cuModuleGetFunction/cuLaunchKernel/cuCtxSynchronize\n");
        failures++;
    } else {
        void *module = NULL, *function = NULL;
        rc = load_data(&module, SPIN_PTX);
        result("cuModuleLoadData", rc, NULL);
        if (rc == 0) {
            rc = get_function(&function, module, "gpu_check_spin");
            result("cuModuleGetFunction", rc, NULL);
        }
        devptr out = 0;
        if (rc == 0) rc = mem_alloc(&out, 4);
        double best = -1;
        unsigned grid = (unsigned)(sms > 0 ? sms : 132) * 8;
        for (int run = 0; rc == 0 && run < 4; run++) { /* the first warms up */
            void *params[] = {&out, &iterations};
            double start = now_ms();
            rc = launch(function, grid, 1, 1, 256, 1, 1, 0, NULL, params, NULL);
            if (rc == 0) rc = synchronize();
            double took = now_ms() - start;
            if (run > 0 && (best < 0 || took < best)) best = took;
        }
        if (out) mem_free(out);
        if (module) unload(module);
        if (function) {
            snprintf(text, sizeof text, "%u blocks", grid);
            result("cuLaunchKernel", rc, text);
        }
        if (rc == 0) printf("value kernel_ms %.3f\n", best);
    }
    release(0);
    return failures ? 1 : 0;
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "mps") == 0) {
        unsigned long long step = argc > 2 ? strtoull(argv[2], NULL, 10) : 256;
        unsigned iterations = argc > 3 ? (unsigned)strtoul(argv[3], NULL, 10) : 1u << 20;
        return mps_client(step ? step : 256, iterations);
    }
    char text[256];
    void *cuda = load("libcuda.so.1");
    if (cuda) {
        int (*cu_init)(unsigned) = (int (*)(unsigned))symbol(cuda, "cuInit");
        int (*cu_count)(int *) = (int (*)(int *))symbol(cuda, "cuDeviceGetCount");
        int (*cu_get)(int *, int) = (int (*)(int *, int))symbol(cuda, "cuDeviceGet");
        int (*cu_name)(char *, int, int) = (int (*)(char *, int, int))symbol(cuda, "cuDeviceGetName");
        if (cu_init) result("cuInit", cu_init(0), NULL);
        int count = 0;
        if (cu_count) {
            int rc = cu_count(&count);
            snprintf(text, sizeof text, "%d", count);
            result("cuDeviceGetCount", rc, text);
        }
        for (int i = 0; cu_get && cu_name && i < count; i++) {
            int device = 0;
            int rc = cu_get(&device, i);
            text[0] = '\0';
            if (rc == 0) rc = cu_name(text, (int)sizeof text, device);
            result("cuDeviceGetName", rc, text);
        }
    }
    void *nvml = load("libnvidia-ml.so.1");
    if (nvml) {
        int (*init)(void) = (int (*)(void))symbol(nvml, "nvmlInit_v2");
        int (*count)(unsigned *) = (int (*)(unsigned *))symbol(nvml, "nvmlDeviceGetCount_v2");
        int (*shutdown)(void) = (int (*)(void))symbol(nvml, "nvmlShutdown");
        if (init) {
            int rc = init();
            result("nvmlInit_v2", rc, NULL);
            unsigned n = 0;
            if (rc == 0 && count) {
                int c = count(&n);
                snprintf(text, sizeof text, "%u", n);
                result("nvmlDeviceGetCount_v2", c, text);
            }
            if (rc == 0 && shutdown) result("nvmlShutdown", shutdown(), NULL);
        }
    }
    return failures ? 1 : 0;
}
