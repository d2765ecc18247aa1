/* A stand-in libnvidia-ml.so.1 with the C ABI pynvml calls, for hosts without a GPU.
 *
 * It lets the tests drive nbos's real NVML code path (pynvml, ctypes, dlopen) through
 * the outcomes a driver can give. Behaviour comes from the environment:
 *   FAKE_NVML_INIT_RC  return code of nvmlInitWithFlags (default 0, success)
 *   FAKE_NVML_COUNT    number of devices (default 3)
 *   FAKE_NVML_LOG      file that records "init" and "shutdown" calls
 * Device 1 cannot report utilization (NOT_SUPPORTED); device 2 is lost (GPU_IS_LOST).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned int gpu, memory; } nvmlUtilization_t;
typedef void *nvmlDevice_t;

static unsigned long devices[8];

static void record(const char *what) {
    const char *path = getenv("FAKE_NVML_LOG");
    if (!path) return;
    FILE *f = fopen(path, "a");
    if (f) { fprintf(f, "%s\n", what); fclose(f); }
}

static int env_int(const char *name, int fallback) {
    const char *v = getenv(name);
    return v ? atoi(v) : fallback;
}

static int index_of(nvmlDevice_t d) { return (int)((unsigned long *)d - devices); }

int nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    record("init");
    return env_int("FAKE_NVML_INIT_RC", 0);
}

int nvmlShutdown(void) { record("shutdown"); return 0; }

int nvmlSystemGetDriverVersion(char *buf, unsigned int len) {
    snprintf(buf, len, "999.99.01");
    return 0;
}

int nvmlDeviceGetCount_v2(unsigned int *count) {
    *count = (unsigned int)env_int("FAKE_NVML_COUNT", 3);
    return 0;
}

int nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (index == 2) return 15; /* NVML_ERROR_GPU_IS_LOST */
    if (index >= 8) return 2;  /* NVML_ERROR_INVALID_ARGUMENT */
    *device = &devices[index];
    return 0;
}

int nvmlDeviceGetName(nvmlDevice_t d, char *buf, unsigned int len) {
    snprintf(buf, len, "Fake H100 #%d", index_of(d));
    return 0;
}

int nvmlDeviceGetUUID(nvmlDevice_t d, char *buf, unsigned int len) {
    snprintf(buf, len, "GPU-fake-%04d", index_of(d));
    return 0;
}

int nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m) {
    m->total = 81559ULL * 1024 * 1024;
    m->used = (unsigned long long)(index_of(d) + 1) * 512 * 1024 * 1024;
    m->free = m->total - m->used;
    return 0;
}

int nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *u) {
    if (index_of(d) == 1) return 3; /* NVML_ERROR_NOT_SUPPORTED */
    u->gpu = 42;
    u->memory = 7;
    return 0;
}
