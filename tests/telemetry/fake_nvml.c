/* A fake libnvidia-ml.so.1 for tests: the NVML C ABI subset moescope calls, with NVML's return
 * codes and struct layouts declared here from the NVML API reference (no NVIDIA header is used).
 * Tests drive it through the fakeNvml* control functions below.
 *
 * Build: gcc -shared -fPIC -Wl,-soname,libnvidia-ml.so.1 -o libnvidia-ml.so.1 fake_nvml.c
 * With -DFAKE_OLD_DRIVER it leaves out what old drivers lack: nvmlDeviceGetMemoryInfo_v2,
 * nvmlDeviceGetFieldValues and the _v3 process lists.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))

typedef int nvmlReturn_t; /* a C enum: int-sized */
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
};
enum { VT_UINT = 1, VT_ULL = 3 };
enum { FI_LINK_COUNT = 91, FI_NVLINK_TX = 138, FI_NVLINK_RX = 139, FI_PCIE_TX = 197, FI_PCIE_RX = 198 };

#define MAX_GPUS 8
#define MAX_LINKS 18
#define MAX_PROCS 16

typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;
typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;
#define NVML_MEMORY_V2_VERSION ((unsigned int)(sizeof(nvmlMemory_v2_t) | (2u << 24)))
typedef struct {
    unsigned int gpu, memory;
} nvmlUtilization_t;
typedef union {
    double dVal;
    unsigned int uiVal;
    unsigned long ulVal;
    unsigned long long ullVal;
    long long sllVal;
    int siVal;
    unsigned short usVal;
} nvmlValue_t;
typedef struct {
    unsigned int fieldId;
    unsigned int scopeId;
    long long timestamp; /* µs since 1970 */
    long long latencyUsec;
    int valueType;
    nvmlReturn_t nvmlReturn;
    nvmlValue_t value;
} nvmlFieldValue_t;
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t; /* v2 and v3 share this layout */

struct proc {
    unsigned int pid;
    unsigned long long used;
};

struct fake_gpu {
    int index;
    int lost;
    char name[96], uuid[96];
    nvmlMemory_v2_t mem;
    nvmlUtilization_t util;
    int util_supported;
    unsigned int links;
    int link_supported[MAX_LINKS];
    unsigned long long tx_kib[MAX_LINKS], rx_kib[MAX_LINKS];
    int counter_type; /* VT_ULL or VT_UINT */
    int pcie_counters; /* PCIe byte counters as field values */
    unsigned long long pcie_tx_bytes, pcie_rx_bytes;
    unsigned int pcie_tx_kbps, pcie_rx_kbps;
    struct proc compute[MAX_PROCS], graphics[MAX_PROCS];
    unsigned int n_compute, n_graphics;
    int procs_unsupported; /* e.g. MIG parent devices, vGPU guests */
};

static struct fake_gpu gpus[MAX_GPUS];
static unsigned int gpu_count;
static int initialised;
static nvmlReturn_t init_result;
static long long clock_us;
static unsigned int init_calls, field_calls, pcie_calls;
static int reset_called;

typedef struct fake_gpu *nvmlDevice_t;

/* ------------------------------------------------------------------ control (tests only) */

EXPORT void fakeNvmlReset(unsigned int count) {
    reset_called = 1;
    memset(gpus, 0, sizeof gpus);
    gpu_count = count > MAX_GPUS ? MAX_GPUS : count;
    initialised = 0;
    init_result = NVML_SUCCESS;
    clock_us = 1700000000000000LL;
    init_calls = field_calls = pcie_calls = 0;
    for (unsigned int i = 0; i < MAX_GPUS; i++) {
        struct fake_gpu *g = &gpus[i];
        g->index = (int)i;
        snprintf(g->name, sizeof g->name, "Fake H100 80GB HBM3");
        snprintf(g->uuid, sizeof g->uuid, "GPU-fa4e0000-0000-0000-0000-00000000000%u", i);
        g->mem.total = 85899345920ULL;
        g->mem.reserved = 536870912ULL;
        g->mem.used = 0;
        g->mem.free = g->mem.total - g->mem.reserved;
        g->util_supported = 1;
        g->counter_type = VT_ULL;
        g->pcie_counters = 1;
    }
}
EXPORT void fakeNvmlSetInitResult(int result) { init_result = result; }
EXPORT void fakeNvmlSetClockUs(long long us) { clock_us = us; }
EXPORT void fakeNvmlSetLost(unsigned int i, int lost) { gpus[i].lost = lost; }
EXPORT void fakeNvmlSetMemory(unsigned int i, unsigned long long total, unsigned long long reserved,
                              unsigned long long used) {
    gpus[i].mem.total = total;
    gpus[i].mem.reserved = reserved;
    gpus[i].mem.used = used;
    gpus[i].mem.free = total - reserved - used;
}
EXPORT void fakeNvmlSetUtilization(unsigned int i, int supported, unsigned int gpu, unsigned int mem) {
    gpus[i].util_supported = supported;
    gpus[i].util.gpu = gpu;
    gpus[i].util.memory = mem;
}
EXPORT void fakeNvmlSetLinks(unsigned int i, unsigned int links, int counter_type) {
    gpus[i].links = links > MAX_LINKS ? MAX_LINKS : links;
    gpus[i].counter_type = counter_type;
    for (unsigned int l = 0; l < gpus[i].links; l++) gpus[i].link_supported[l] = 1;
}
EXPORT void fakeNvmlSetLink(unsigned int i, unsigned int link, int supported, unsigned long long tx_kib,
                            unsigned long long rx_kib) {
    gpus[i].link_supported[link] = supported;
    gpus[i].tx_kib[link] = tx_kib;
    gpus[i].rx_kib[link] = rx_kib;
}
EXPORT void fakeNvmlSetPcie(unsigned int i, int counters, unsigned long long tx_bytes, unsigned long long rx_bytes,
                            unsigned int tx_kbps, unsigned int rx_kbps) {
    gpus[i].pcie_counters = counters;
    gpus[i].pcie_tx_bytes = tx_bytes;
    gpus[i].pcie_rx_bytes = rx_bytes;
    gpus[i].pcie_tx_kbps = tx_kbps;
    gpus[i].pcie_rx_kbps = rx_kbps;
}
/* graphics: 0 compute list, 1 graphics list. used == ~0ULL is NVML_VALUE_NOT_AVAILABLE. */
EXPORT void fakeNvmlAddProcess(unsigned int i, int graphics, unsigned int pid, unsigned long long used) {
    struct fake_gpu *g = &gpus[i];
    if (graphics && g->n_graphics < MAX_PROCS) g->graphics[g->n_graphics++] = (struct proc){pid, used};
    if (!graphics && g->n_compute < MAX_PROCS) g->compute[g->n_compute++] = (struct proc){pid, used};
}
EXPORT void fakeNvmlClearProcesses(unsigned int i) { gpus[i].n_compute = gpus[i].n_graphics = 0; }
EXPORT void fakeNvmlSetProcessListsSupported(unsigned int i, int supported) { gpus[i].procs_unsupported = !supported; }
EXPORT unsigned int fakeNvmlInitCalls(void) { return init_calls; }
EXPORT unsigned int fakeNvmlFieldValueCalls(void) { return field_calls; }
EXPORT unsigned int fakeNvmlPcieThroughputCalls(void) { return pcie_calls; }

/* ------------------------------------------------------------------ NVML */

#define CHECK_DEVICE(d)                                                                    \
    do {                                                                                   \
        if (!initialised) return NVML_ERROR_UNINITIALIZED;                                 \
        if ((d) == NULL || (d) < gpus || (d) >= gpus + gpu_count) return NVML_ERROR_INVALID_ARGUMENT; \
        if ((d)->lost) return NVML_ERROR_GPU_IS_LOST;                                      \
    } while (0)

EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    static int env_read;
    (void)flags;
    if (!env_read && !reset_called) {
        /* For dry runs of tests/gpu/check_gpu.py: FAKE_NVML_GPUS=N gives N default fake GPUs
         * (ignored once a test has configured the fake through fakeNvmlReset). */
        const char *n = getenv("FAKE_NVML_GPUS");
        env_read = 1;
        if (n != NULL) fakeNvmlReset((unsigned int)atoi(n));
    }
    init_calls++;
    if (init_result != NVML_SUCCESS) return init_result;
    initialised++;
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
EXPORT nvmlReturn_t nvmlShutdown(void) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    initialised--;
    return NVML_SUCCESS;
}
EXPORT const char *nvmlErrorString(nvmlReturn_t r) {
    switch (r) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    default: return "Unknown Error";
    }
}
EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    snprintf(version, length, "0.0.fake");
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    *count = gpu_count;
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (index >= gpu_count) return NVML_ERROR_INVALID_ARGUMENT;
    *device = &gpus[index];
    return gpus[index].lost ? NVML_ERROR_GPU_IS_LOST : NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *name, unsigned int length) {
    CHECK_DEVICE(d);
    if (length < strlen(d->name) + 1) return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(name, d->name);
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *uuid, unsigned int length) {
    CHECK_DEVICE(d);
    if (length < strlen(d->uuid) + 1) return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(uuid, d->uuid);
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m) {
    CHECK_DEVICE(d);
    m->total = d->mem.total;
    m->free = d->mem.free;
    m->used = d->mem.total - d->mem.free; /* v1 "used" includes driver-reserved memory */
    return NVML_SUCCESS;
}
#ifndef FAKE_OLD_DRIVER
EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *m) {
    CHECK_DEVICE(d);
    if (m->version != NVML_MEMORY_V2_VERSION) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    unsigned int version = m->version;
    *m = d->mem;
    m->version = version;
    return NVML_SUCCESS;
}
#endif
EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *u) {
    CHECK_DEVICE(d);
    if (!d->util_supported) return NVML_ERROR_NOT_SUPPORTED;
    *u = d->util;
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t d, unsigned int link, int *is_active) {
    CHECK_DEVICE(d);
    if (d->links == 0) return NVML_ERROR_NOT_SUPPORTED;
    if (link >= d->links) return NVML_ERROR_INVALID_ARGUMENT;
    *is_active = 1;
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetPcieThroughput(nvmlDevice_t d, int counter, unsigned int *value) {
    CHECK_DEVICE(d);
    pcie_calls++;
    if (counter == 0) *value = d->pcie_tx_kbps;
    else if (counter == 1) *value = d->pcie_rx_kbps;
    else return NVML_ERROR_INVALID_ARGUMENT;
    return NVML_SUCCESS;
}

#ifndef FAKE_OLD_DRIVER
static void set_counter(nvmlFieldValue_t *v, int type, unsigned long long value) {
    v->valueType = type;
    if (type == VT_UINT) v->value.uiVal = (unsigned int)value; /* a 32-bit counter wraps at 2^32 */
    else v->value.ullVal = value;
}

EXPORT nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t d, int count, nvmlFieldValue_t *values) {
    CHECK_DEVICE(d);
    if (count < 0 || values == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    field_calls++;
    for (int i = 0; i < count; i++) {
        nvmlFieldValue_t *v = &values[i];
        unsigned int link = v->scopeId;
        v->timestamp = clock_us;
        v->latencyUsec = 3;
        v->nvmlReturn = NVML_SUCCESS;
        switch (v->fieldId) {
        case FI_LINK_COUNT:
            if (d->links == 0) v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
            else set_counter(v, VT_UINT, d->links);
            break;
        case FI_NVLINK_TX:
        case FI_NVLINK_RX:
            if (link >= d->links) v->nvmlReturn = NVML_ERROR_INVALID_ARGUMENT;
            else if (!d->link_supported[link]) v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
            else set_counter(v, d->counter_type, v->fieldId == FI_NVLINK_TX ? d->tx_kib[link] : d->rx_kib[link]);
            break;
        case FI_PCIE_TX:
        case FI_PCIE_RX:
            if (!d->pcie_counters) v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
            else set_counter(v, VT_ULL, v->fieldId == FI_PCIE_TX ? d->pcie_tx_bytes : d->pcie_rx_bytes);
            break;
        default:
            v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        }
    }
    return NVML_SUCCESS;
}
#endif

/* NVML's list protocol: too small a buffer (or NULL) -> INSUFFICIENT_SIZE with the needed count;
 * an empty list -> SUCCESS with count 0. */
static nvmlReturn_t list_processes(nvmlDevice_t d, const struct proc *procs, unsigned int n, unsigned int *count,
                                   nvmlProcessInfo_t *infos) {
    CHECK_DEVICE(d);
    if (d->procs_unsupported) return NVML_ERROR_NOT_SUPPORTED;
    if (count == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (n == 0) {
        *count = 0;
        return NVML_SUCCESS;
    }
    if (infos == NULL || *count < n) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned int i = 0; i < n; i++) {
        infos[i].pid = procs[i].pid;
        infos[i].usedGpuMemory = procs[i].used;
        infos[i].gpuInstanceId = 0xFFFFFFFFu;
        infos[i].computeInstanceId = 0xFFFFFFFFu;
    }
    *count = n;
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t d, unsigned int *c, nvmlProcessInfo_t *p) {
    return list_processes(d, d ? d->compute : NULL, d ? d->n_compute : 0, c, p);
}
EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t d, unsigned int *c, nvmlProcessInfo_t *p) {
    return list_processes(d, d ? d->graphics : NULL, d ? d->n_graphics : 0, c, p);
}
#ifndef FAKE_OLD_DRIVER
EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *c, nvmlProcessInfo_t *p) {
    return list_processes(d, d ? d->compute : NULL, d ? d->n_compute : 0, c, p);
}
EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t d, unsigned int *c, nvmlProcessInfo_t *p) {
    return list_processes(d, d ? d->graphics : NULL, d ? d->n_graphics : 0, c, p);
}
#endif
