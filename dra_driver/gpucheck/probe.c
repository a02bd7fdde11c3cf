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
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>

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

int main(void) {
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
