/* The fake libnvidia-ml of tests/telemetry, configured when it is loaded, for a whole-agent run.
 *
 * tests/telemetry drive the fake from the test process through its fakeNvml* functions; here the
 * agent (another process) loads it with --nvml-library, so this file sets it up in a constructor
 * and makes the counters move with the wall clock: 2 GPUs with 4 NVLink links each, memory at 93 %
 * (above the default memory_alert threshold of 92 %, below expert_offload's 95 %), NVLink and PCIe
 * byte counters that grow with time and NVML timestamps that advance (a frozen timestamp gives no
 * rate, so no PCIe throughput).
 *
 * Build: gcc -shared -fPIC -Wl,-soname,libnvidia-ml.so.1 -o libnvidia-ml.so.1 fake_nvml_live.c
 */
#include <time.h>

/* The static fake answers field values; the wrapper below advances its clock and counters first. */
#define nvmlDeviceGetFieldValues fakeNvmlStaticFieldValues
#include "../telemetry/fake_nvml.c"
#undef nvmlDeviceGetFieldValues

#define LIVE_GPUS 2
#define LIVE_LINKS 4
#define GIB (1024ULL * 1024ULL * 1024ULL)

static long long live_start_us;

static long long live_now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (long long)ts.tv_sec * 1000000LL + ts.tv_nsec / 1000;
}

__attribute__((constructor)) static void live_setup(void) {
    fakeNvmlReset(LIVE_GPUS);
    live_start_us = live_now_us();
    clock_us = live_start_us;
    for (unsigned int i = 0; i < LIVE_GPUS; i++) {
        /* in use = reserved + used = 93 % of total (memory_signal reads total - free) */
        unsigned long long total = 80 * GIB, reserved = GIB / 2;
        fakeNvmlSetMemory(i, total, reserved, total / 100 * 93 - reserved);
        fakeNvmlSetUtilization(i, 1, 40 + 10 * i, 20);
        fakeNvmlSetLinks(i, LIVE_LINKS, VT_ULL);
    }
}

/* Counters as a function of time since load: link l of GPU i moves (i + l + 1) MiB/s each way,
 * PCIe 8 MiB/s out and 4 MiB/s in; the timestamp NVML reports is now. */
EXPORT nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t d, int count, nvmlFieldValue_t *values) {
    long long now = live_now_us();
    unsigned long long elapsed_ms = (unsigned long long)((now - live_start_us) / 1000);
    clock_us = now;
    for (unsigned int i = 0; i < LIVE_GPUS; i++) {
        struct fake_gpu *g = &gpus[i];
        for (unsigned int l = 0; l < LIVE_LINKS; l++) {
            g->tx_kib[l] = elapsed_ms * (i + l + 1); /* 1 KiB/ms ~ 1 MiB/s */
            g->rx_kib[l] = elapsed_ms * (i + l + 1) / 2;
        }
        g->pcie_tx_bytes = elapsed_ms * 8 * 1024;
        g->pcie_rx_bytes = elapsed_ms * 4 * 1024;
    }
    return fakeNvmlStaticFieldValues(d, count, values);
}
