/* C-side NVTX load for benchmarks/nvtx_overhead.py. Plays the instrumented application's NVTX
 * copy the way NVTX's generated code does it: one global function pointer per API function, NULL
 * when no tool is attached (the call is then a load and a branch), or filled by the tool's
 * InitializeInjectionNvtx2 when NVTX_INJECTION64_PATH names one.
 *
 *   nvtx_cdriver pushpop ITERATIONS   -> {"ns_per_pushpop": ...}
 *   nvtx_cdriver rate EVENTS_PER_S SECONDS -> {"emitted": ..., "seconds": ...}
 *   nvtx_cdriver extmark ITERATIONS -> marks with a 256 x int32 payload-extension payload (the
 *       nvtx package's array layout; schema registered through the payload module), per event
 *       in the same keys as pushpop
 *
 * Prints "ready" after init (the ring exists), waits for a line on stdin, runs, prints JSON. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../collectors/nvtx_inject/nvtx_client.h"

typedef int (*push_fn)(msnvtx_domain_handle, const msnvtx_event_attributes *);
typedef int (*pop_fn)(msnvtx_domain_handle);
typedef void (*mark_fn)(msnvtx_domain_handle, const msnvtx_event_attributes *);
typedef msnvtx_domain_handle (*domain_create_fn)(const char *);
typedef msnvtx_string_handle (*register_fn)(msnvtx_domain_handle, const char *);


static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint64_t cpu_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

typedef uint64_t (*schema_register_fn)(msnvtx_domain_handle, const msnvtx_schema_attr *);
static intptr_t payload_slots[63]; /* the payload extension module's one segment */

static inline void mark(msnvtx_domain_handle d, const msnvtx_event_attributes *a) {
    mark_fn f = (mark_fn)__atomic_load_n(&core2_slots[MSNVTX_CORE2_DomainMarkEx], __ATOMIC_RELAXED);
    if (f) f(d, a);
}

static inline int push(msnvtx_domain_handle d, const msnvtx_event_attributes *a) {
    push_fn f = (push_fn)__atomic_load_n(&core2_slots[MSNVTX_CORE2_DomainRangePushEx], __ATOMIC_RELAXED);
    return f ? f(d, a) : -1;
}

static inline int pop(msnvtx_domain_handle d) {
    pop_fn f = (pop_fn)__atomic_load_n(&core2_slots[MSNVTX_CORE2_DomainRangePop], __ATOMIC_RELAXED);
    return f ? f(d) : -1;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s pushpop N | rate EVENTS_PER_S SECONDS\n", argv[0]);
        return 2;
    }
    const char *tool = getenv("NVTX_INJECTION64_PATH");
    if (tool && *tool) {
        void *lib;
        int loaded = msclient_load(tool, &lib);
        if (loaded == 1) {
            fprintf(stderr, "dlopen: %s\n", dlerror());
            return 1;
        }
        if (loaded) {
            fprintf(stderr, "injection init failed\n");
            return 1;
        }
        int (*init_ext)(msnvtx_ext_module_info *) =
            (int (*)(msnvtx_ext_module_info *))dlsym(lib, "InitializeInjectionNvtxExtension");
        msnvtx_ext_segment seg = {0, 63, payload_slots};
        msnvtx_ext_module_info info = {3, sizeof info, MSNVTX_EXT_MODULE_PAYLOAD, 0x0104, 1, &seg, NULL, NULL};
        if (init_ext) init_ext(&info);
    }
    msnvtx_domain_handle domain = NULL;
    msnvtx_event_attributes attr;
    memset(&attr, 0, sizeof attr);
    attr.version = 3;
    attr.size = sizeof attr;
    attr.payload_type = MSNVTX_PAYLOAD_I64;
    attr.payload.i64 = 42;
    if (core2_slots[MSNVTX_CORE2_DomainCreateA]) {
        domain = ((domain_create_fn)core2_slots[MSNVTX_CORE2_DomainCreateA])("bench");
        attr.message_type = MSNVTX_MESSAGE_REGISTERED;
        attr.message.registered =
            ((register_fn)core2_slots[MSNVTX_CORE2_DomainRegisterStringA])(domain, "bench.range");
    }
    printf("ready\n");
    fflush(stdout);
    char line[64];
    if (!fgets(line, sizeof line, stdin)) return 1;

    if (strcmp(argv[1], "extmark") == 0) {
        long n = atol(argv[2]);
        /* the nvtx package's array schema: a static int32 scalar, then (uint64 size, data[size]) */
        schema_register_fn reg = (schema_register_fn)payload_slots[MSNVTX_PAYLOAD_SLOT_SchemaRegister];
        const uint64_t must = MSNVTX_SCHEMA_FIELD_TYPE | MSNVTX_SCHEMA_FIELD_ENTRIES | MSNVTX_SCHEMA_FIELD_NUM_ENTRIES;
        msnvtx_schema_entry scalar = {.type = 15};
        msnvtx_schema_attr sa = {.field_mask = must, .type = 1, .entries = &scalar, .entry_count = 1};
        uint64_t scalar_id = reg ? reg(domain, &sa) : 0;
        msnvtx_schema_entry fields[2] = {{.type = 18}, {.flags = 3 << 4, .type = scalar_id}};
        msnvtx_schema_attr aa = {.field_mask = must, .type = 2, .entries = fields, .entry_count = 2};
        static unsigned char bytes[8 + 256 * 4];
        uint64_t length = 256;
        memcpy(bytes, &length, 8);
        msnvtx_payload_data data = {reg ? reg(domain, &aa) : 0, sizeof bytes, bytes};
        msnvtx_event_attributes ext = attr;
        ext.payload_type = MSNVTX_PAYLOAD_EXT;
        ext.reserved0 = 1;
        ext.payload.u64 = (uint64_t)(uintptr_t)&data;
        uint64_t c0 = cpu_ns(), t0 = now_ns();
        for (long i = 0; i < n; i++) mark(domain, &ext);
        uint64_t t1 = now_ns(), c1 = cpu_ns();
        printf("{\"ns_per_pushpop\": %.3f, \"cpu_ns_per_pushpop\": %.3f, \"iterations\": %ld}\n",
               (double)(t1 - t0) / (double)n, (double)(c1 - c0) / (double)n, n);
    } else if (strcmp(argv[1], "pushpop") == 0) {
        long n = atol(argv[2]);
        uint64_t c0 = cpu_ns(), t0 = now_ns();
        for (long i = 0; i < n; i++) {
            push(domain, &attr);
            pop(domain);
        }
        uint64_t t1 = now_ns(), c1 = cpu_ns();
        printf("{\"ns_per_pushpop\": %.3f, \"cpu_ns_per_pushpop\": %.3f, \"iterations\": %ld}\n",
               (double)(t1 - t0) / (double)n, (double)(c1 - c0) / (double)n, n);
    } else if (strcmp(argv[1], "rate") == 0 && argc >= 4) {
        double rate = atof(argv[2]), seconds = atof(argv[3]);
        uint64_t total = (uint64_t)(rate * seconds), emitted = 0;
        uint64_t t0 = now_ns();
        const uint64_t chunk = 200; /* events per pacing check */
        while (emitted < total) {
            for (uint64_t i = 0; i < chunk && emitted < total; i += 2, emitted += 2) {
                push(domain, &attr);
                pop(domain);
            }
            /* pace: wait until the schedule says the next chunk is due */
            uint64_t due = t0 + (uint64_t)((double)emitted * 1e9 / rate);
            while (now_ns() < due) {
            }
        }
        uint64_t t1 = now_ns();
        printf("{\"emitted\": %llu, \"seconds\": %.6f}\n", (unsigned long long)emitted, (double)(t1 - t0) / 1e9);
    } else {
        fprintf(stderr, "unknown mode %s\n", argv[1]);
        return 2;
    }
    fflush(stdout);
    return 0;
}
