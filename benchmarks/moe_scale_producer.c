/* One expert-parallel rank's NVTX load in C for benchmarks/moe_scale.py: the moe/v1 convention
 * (docs/nvtx-convention.md) and the scalar parts of moe/v2, emitted the way NVTX's generated code
 * calls a tool (benchmarks/nvtx_cdriver.c does the same): one global function-pointer slot per API
 * function, NULL with no tool (a load and a branch), filled by the tool's InitializeInjectionNvtx2
 * when NVTX_INJECTION64_PATH names one.
 *
 *   moe_scale_producer LAYERS EXPERTS TOPK v1|v2|v2-compact STEPS_PER_S DURATION_S TOKENS REQUESTS SEED
 *
 * v2 sends the routing vector (moe.routing, int32[2E]) and moe.experts.time (float32[E]) as NVTX
 * extended payloads, registering the same schemas the PyPI nvtx package registers for a 1-D numpy
 * array (a static scalar schema, then a dynamic one: uint64 length, then the length-indexed data);
 * v2-compact (moe/v2.2) sends per layer only its moe.layer range and per step moe.step.routing
 * (int32[L·2E]) and moe.step.entropy (float32[L]) the same way. Both need the tool's payload
 * extension (InitializeInjectionNvtxExtension, declared in nvtx_abi.h): without it they exit 3
 * with one line and the harness records why. Routing: k x tokens assignments per layer drawn from a Zipf-like law (weight 1/rank, ranks
 * shuffled per layer), capacity ceil(1.25 k tokens / E), a pool of steps drawn before stepping.
 * Protocol as benchmarks/moe_scale_producer.py: a "ready" JSON line, wait for a line on stdin, step
 * with absolute deadlines, a result JSON line, wait for a line (or EOF) before exiting. Emission cost
 * is CLOCK_THREAD_CPUTIME_ID around each step's emission block (NVTX calls and attribute sets only). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <math.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../collectors/nvtx_inject/nvtx_client.h"

#define POOL_STEPS 16
#define CAPACITY_FACTOR 1.25
#define WAIT_FOR_EXIT_MS 300000

#ifdef MSNVTX_SCHEMA_ID_STATIC_START /* nvtx_abi.h declares the payload extension */
#define HAVE_PAYLOAD_EXT 1
#define ENTRY_TYPE_INT32 15
#define ENTRY_TYPE_UINT64 18
#define ENTRY_TYPE_FLOAT32 43
#define ENTRY_FLAG_ARRAY_LENGTH_INDEX (3u << 4)
#define SCHEMA_TYPE_STATIC 1
#define SCHEMA_TYPE_DYNAMIC 2
typedef uint64_t (*schema_register_fn)(msnvtx_domain_handle, const msnvtx_schema_attr *);
static intptr_t ext_slots[16];
#else
#define HAVE_PAYLOAD_EXT 0
#endif

typedef int (*push_fn)(msnvtx_domain_handle, const msnvtx_event_attributes *);
typedef int (*pop_fn)(msnvtx_domain_handle);
typedef void (*mark_fn)(msnvtx_domain_handle, const msnvtx_event_attributes *);
typedef msnvtx_domain_handle (*domain_create_fn)(const char *);
typedef msnvtx_string_handle (*register_fn)(msnvtx_domain_handle, const char *);


static uint64_t clock_ns(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static msnvtx_domain_handle domain;

static inline void push(const msnvtx_event_attributes *a) {
    push_fn f = (push_fn)__atomic_load_n(&core2_slots[MSNVTX_CORE2_DomainRangePushEx], __ATOMIC_RELAXED);
    if (f) f(domain, a);
}

static inline void pop(void) {
    pop_fn f = (pop_fn)__atomic_load_n(&core2_slots[MSNVTX_CORE2_DomainRangePop], __ATOMIC_RELAXED);
    if (f) f(domain);
}

static inline void mark(const msnvtx_event_attributes *a) {
    mark_fn f = (mark_fn)__atomic_load_n(&core2_slots[MSNVTX_CORE2_DomainMarkEx], __ATOMIC_RELAXED);
    if (f) f(domain, a);
}

static uint64_t rng_state;

static uint64_t next_random(void) { /* splitmix64 */
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double uniform(void) { return (double)(next_random() >> 11) / 9007199254740992.0; }

static void init_attr(msnvtx_event_attributes *a, const char *message) {
    memset(a, 0, sizeof *a);
    a->version = 3;
    a->size = sizeof *a;
    a->payload_type = MSNVTX_PAYLOAD_I64;
    if (core2_slots[MSNVTX_CORE2_DomainRegisterStringA]) {
        a->message_type = MSNVTX_MESSAGE_REGISTERED;
        a->message.registered = ((register_fn)core2_slots[MSNVTX_CORE2_DomainRegisterStringA])(domain, message);
    }
}

static void wait_line(int timeout_ms) {
    struct pollfd p = {0, POLLIN, 0};
    char line[64];
    if (poll(&p, 1, timeout_ms) > 0 && (p.revents & POLLIN)) {
        if (!fgets(line, sizeof line, stdin)) return;
    }
}

#if HAVE_PAYLOAD_EXT
/* The schema ids the nvtx package would use for a 1-D array of `entry_type` (see the header comment). */
static uint64_t register_array_schema(schema_register_fn reg, uint64_t entry_type, const char *name) {
    msnvtx_schema_entry scalar = {0, entry_type, name, NULL, 0, 0, NULL, NULL};
    msnvtx_schema_attr attr;
    memset(&attr, 0, sizeof attr);
    attr.field_mask = MSNVTX_SCHEMA_FIELD_TYPE | MSNVTX_SCHEMA_FIELD_ENTRIES | MSNVTX_SCHEMA_FIELD_NUM_ENTRIES;
    attr.type = SCHEMA_TYPE_STATIC;
    attr.entries = &scalar;
    attr.entry_count = 1;
    uint64_t scalar_id = reg(domain, &attr);
    msnvtx_schema_entry array[2] = {
        {0, ENTRY_TYPE_UINT64, "size", NULL, 0, 0, NULL, NULL},
        {ENTRY_FLAG_ARRAY_LENGTH_INDEX, scalar_id, "data", NULL, 0, 0, NULL, NULL},
    };
    attr.type = SCHEMA_TYPE_DYNAMIC;
    attr.entries = array;
    attr.entry_count = 2;
    return reg(domain, &attr);
}
#endif

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    if (argc < 10) {
        fprintf(stderr, "usage: %s LAYERS EXPERTS TOPK v1|v2|v2-compact STEPS_PER_S DURATION_S TOKENS REQUESTS SEED\n",
                argv[0]);
        return 2;
    }
    int layers = atoi(argv[1]), experts = atoi(argv[2]), top_k = atoi(argv[3]);
    const char *convention = argv[4];
    double steps_per_s = atof(argv[5]), duration_s = atof(argv[6]);
    int tokens = atoi(argv[7]), requests = atoi(argv[8]);
    rng_state = (uint64_t)atoll(argv[9]) * 7919u + 1u;
    if (layers < 1 || experts < 1 || top_k < 1 || top_k > experts || tokens < 1 || requests < 0 ||
        !(steps_per_s > 0) || !(duration_s > 0) ||
        (strcmp(convention, "v1") && strcmp(convention, "v2") && strcmp(convention, "v2-compact"))) {
        fprintf(stderr, "moe_scale_producer: bad arguments\n");
        return 2;
    }
    int v2 = strcmp(convention, "v2") == 0, compact = strcmp(convention, "v2-compact") == 0;
    const char *tool = getenv("NVTX_INJECTION64_PATH");
    int have_tool = 0;
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
        have_tool = 1;
        if (v2 || compact) {
#if HAVE_PAYLOAD_EXT
            int (*ext_init)(msnvtx_ext_module_info *) =
                (int (*)(msnvtx_ext_module_info *))dlsym(lib, "InitializeInjectionNvtxExtension");
            msnvtx_ext_segment segment = {0, 16, ext_slots};
            msnvtx_ext_module_info info = {3, sizeof info, MSNVTX_EXT_MODULE_PAYLOAD, 0x0104, 1, &segment, NULL, NULL};
            if (!ext_init || !ext_init(&info) || !ext_slots[MSNVTX_PAYLOAD_SLOT_SchemaRegister]) {
                fprintf(stderr, "moe_scale_producer: v2 needs the NVTX payload extension for moe.routing, which "
                                "the injection library does not offer\n");
                return 3;
            }
#else
            fprintf(stderr, "moe_scale_producer: v2 needs the NVTX payload extension for moe.routing, which "
                            "nvtx_abi.h does not declare in this build\n");
            return 3;
#endif
        }
    }
    if (core2_slots[MSNVTX_CORE2_DomainCreateA])
        domain = ((domain_create_fn)core2_slots[MSNVTX_CORE2_DomainCreateA])("moe");
    msnvtx_event_attributes a_step, a_req, a_layer, a_router, a_tok, a_drop, a_ffn;
    init_attr(&a_step, "moe.step");
    init_attr(&a_req, "moe.request");
    init_attr(&a_layer, "moe.layer");
    init_attr(&a_router, "moe.router");
    init_attr(&a_tok, "moe.expert.tokens");
    init_attr(&a_drop, "moe.expert.dropped");
    init_attr(&a_ffn, "moe.expert.ffn");
    a_router.payload_type = MSNVTX_PAYLOAD_DOUBLE;
    msnvtx_event_attributes a_routing, a_experts, a_time, a_step_routing, a_step_entropy;
    init_attr(&a_routing, "moe.routing");
    init_attr(&a_experts, "moe.experts");
    init_attr(&a_time, "moe.experts.time");
    init_attr(&a_step_routing, "moe.step.routing");
    init_attr(&a_step_entropy, "moe.step.entropy");
#if HAVE_PAYLOAD_EXT
    uint64_t routing_schema = 0, time_schema = 0;
    if ((v2 || compact) && have_tool) {
        schema_register_fn reg = (schema_register_fn)ext_slots[MSNVTX_PAYLOAD_SLOT_SchemaRegister];
        routing_schema = register_array_schema(reg, ENTRY_TYPE_INT32, "int32");
        time_schema = register_array_schema(reg, ENTRY_TYPE_FLOAT32, "float32");
    }
    /* payload blocks: [uint64 length][values], rebuilt per layer inside the emission block */
    size_t routing_bytes = sizeof(uint64_t) + 2 * (size_t)experts * sizeof(int32_t);
    size_t time_bytes = sizeof(uint64_t) + (size_t)experts * sizeof(float);
    unsigned char *routing_block = malloc(routing_bytes), *time_block = malloc(time_bytes);
    if (!routing_block || !time_block) return 1;
    msnvtx_payload_data routing_data = {routing_schema, routing_bytes, routing_block};
    msnvtx_payload_data time_data = {time_schema, time_bytes, time_block};
    a_routing.payload_type = MSNVTX_PAYLOAD_EXT;
    a_routing.reserved0 = 1; /* one payload data entry */
    a_routing.payload.u64 = (uint64_t)(uintptr_t)&routing_data;
    a_time.payload_type = MSNVTX_PAYLOAD_EXT;
    a_time.reserved0 = 1;
    a_time.payload.u64 = (uint64_t)(uintptr_t)&time_data;
    /* v2-compact, per step: [uint64 L·2E][per layer demand[E] ++ over capacity[E]], [uint64 L][entropy] */
    size_t step_routing_bytes = sizeof(uint64_t) + (size_t)layers * 2 * (size_t)experts * sizeof(int32_t);
    size_t step_entropy_bytes = sizeof(uint64_t) + (size_t)layers * sizeof(float);
    unsigned char *step_routing_block = malloc(step_routing_bytes), *step_entropy_block = malloc(step_entropy_bytes);
    if (!step_routing_block || !step_entropy_block) return 1;
    msnvtx_payload_data step_routing_data = {routing_schema, step_routing_bytes, step_routing_block};
    msnvtx_payload_data step_entropy_data = {time_schema, step_entropy_bytes, step_entropy_block};
    a_step_routing.payload_type = a_step_entropy.payload_type = MSNVTX_PAYLOAD_EXT;
    a_step_routing.reserved0 = a_step_entropy.reserved0 = 1;
    a_step_routing.payload.u64 = (uint64_t)(uintptr_t)&step_routing_data;
    a_step_entropy.payload.u64 = (uint64_t)(uintptr_t)&step_entropy_data;
#endif

    /* Routing pool: per layer a shuffled Zipf law; per pooled step a draw of k x tokens assignments. */
    size_t cells = (size_t)layers * (size_t)experts;
    double *cdf = malloc(cells * sizeof *cdf);
    double *entropy = malloc((size_t)layers * sizeof *entropy);
    int32_t *demand = calloc(POOL_STEPS * cells, sizeof *demand);
    if (!cdf || !entropy || !demand) return 1;
    double *w = malloc((size_t)experts * sizeof *w);
    double total = 0;
    for (int e = 0; e < experts; e++) total += (w[e] = 1.0 / (e + 1));
    for (int l = 0; l < layers; l++) {
        for (int e = experts - 1; e > 0; e--) { /* Fisher-Yates */
            int j = (int)(next_random() % (uint64_t)(e + 1));
            double t = w[e]; w[e] = w[j]; w[j] = t;
        }
        double acc = 0, h = 0;
        for (int e = 0; e < experts; e++) {
            double p = w[e] / total;
            h -= p * log2(p);
            acc += p;
            cdf[(size_t)l * experts + e] = acc;
        }
        entropy[l] = h;
    }
    int assignments = top_k * tokens;
    int capacity = (int)ceil(CAPACITY_FACTOR * assignments / experts);
    for (int s = 0; s < POOL_STEPS; s++)
        for (int l = 0; l < layers; l++) {
            const double *c = cdf + (size_t)l * experts;
            int32_t *d = demand + (size_t)s * cells + (size_t)l * experts;
            for (int t = 0; t < assignments; t++) {
                double u = uniform() * c[experts - 1];
                int lo = 0, hi = experts - 1;
                while (lo < hi) {
                    int mid = (lo + hi) / 2;
                    if (c[mid] < u) lo = mid + 1;
                    else hi = mid;
                }
                d[lo]++;
            }
        }

    printf("{\"ready\": true, \"pid\": %d, \"tool\": %s}\n", (int)getpid(), have_tool ? "true" : "false");
    fflush(stdout);
    wait_line(WAIT_FOR_EXIT_MS);

    uint64_t period_ns = (uint64_t)(1e9 / steps_per_s);
    long total_steps = lround(steps_per_s * duration_s);
    if (total_steps < 1) total_steps = 1;
    uint64_t *cpu = malloc((size_t)total_steps * sizeof *cpu);
    uint64_t *wall = malloc((size_t)total_steps * sizeof *wall);
    if (!cpu || !wall) return 1;
    uint64_t calls = 0, late = 0;
    uint64_t process_cpu0 = clock_ns(CLOCK_PROCESS_CPUTIME_ID);
    uint64_t start = clock_ns(CLOCK_MONOTONIC);
    for (long i = 0; i < total_steps; i++) {
        uint64_t due = start + (uint64_t)i * period_ns, now = clock_ns(CLOCK_MONOTONIC);
        if (now < due) {
            struct timespec ts = {(time_t)(due / 1000000000ull), (long)(due % 1000000000ull)};
            clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL);
        } else if (now - due > period_ns) {
            late++;
        }
        const int32_t *step = demand + (size_t)(i % POOL_STEPS) * cells;
        long first_key = 1000 + (i * requests) % 4096;
        uint64_t c0 = clock_ns(CLOCK_THREAD_CPUTIME_ID), w0 = clock_ns(CLOCK_MONOTONIC);
        a_step.payload.i64 = tokens;
        push(&a_step);
        for (int r = 0; r < requests; r++) {
            a_req.payload.i64 = first_key + r;
            mark(&a_req);
        }
        calls += 2 + (uint64_t)requests;
#if HAVE_PAYLOAD_EXT
        if (compact) {
            /* moe/v2.2: a layer is its moe.layer range; the step's vectors, built as the runtime's
             * once-per-step copy would hold them, go after the last layer */
            uint64_t n = (uint64_t)layers * 2 * (uint64_t)experts;
            int32_t *values = (int32_t *)(step_routing_block + sizeof n);
            float *bits = (float *)(step_entropy_block + sizeof n);
            memcpy(step_routing_block, &n, sizeof n);
            n = (uint64_t)layers;
            memcpy(step_entropy_block, &n, sizeof n);
            for (int l = 0; l < layers; l++) {
                const int32_t *d = step + (size_t)l * experts;
                a_layer.category = (uint32_t)l + 1;
                a_layer.payload.i64 = experts;
                push(&a_layer);
                pop();
                int32_t *row = values + (size_t)l * 2 * experts;
                for (int e = 0; e < experts; e++) {
                    row[e] = d[e];
                    row[experts + e] = d[e] > capacity ? d[e] - capacity : 0;
                }
                bits[l] = (float)entropy[l];
            }
            mark(&a_step_routing);
            mark(&a_step_entropy);
            pop();
            calls += 2 * (uint64_t)layers + 2; /* the layers, the two vectors (step push + pop counted above) */
            cpu[i] = clock_ns(CLOCK_THREAD_CPUTIME_ID) - c0;
            wall[i] = clock_ns(CLOCK_MONOTONIC) - w0;
            continue;
        }
#endif
        for (int l = 0; l < layers; l++) {
            const int32_t *d = step + (size_t)l * experts;
            a_layer.category = (uint32_t)l + 1;
            a_layer.payload.i64 = experts;
            push(&a_layer);
            a_router.category = (uint32_t)l + 1;
            a_router.payload.f64 = entropy[l];
            push(&a_router);
#if HAVE_PAYLOAD_EXT
            if (v2) {
                /* the runtime's vector: demand per expert, then over capacity per expert */
                uint64_t n = 2 * (uint64_t)experts, processed = 0;
                int32_t *values = (int32_t *)(routing_block + sizeof n);
                float *times = (float *)(time_block + sizeof(uint64_t));
                memcpy(routing_block, &n, sizeof n);
                n = (uint64_t)experts;
                memcpy(time_block, &n, sizeof n);
                for (int e = 0; e < experts; e++) {
                    int32_t done = d[e] > capacity ? capacity : d[e];
                    values[e] = d[e];
                    values[experts + e] = d[e] - done;
                    times[e] = 0.8f * (float)done;
                    processed += (uint64_t)done;
                }
                a_routing.category = (uint32_t)l + 1;
                mark(&a_routing);
                pop();
                a_experts.category = (uint32_t)l + 1;
                a_experts.payload.i64 = (int64_t)processed;
                push(&a_experts);
                a_time.category = (uint32_t)l + 1;
                mark(&a_time);
                pop();
                pop();
                calls += 7;
                continue;
            }
#endif
            for (int e = 0; e < experts; e++)
                if (d[e] > 0) {
                    a_tok.category = (uint32_t)e + 1;
                    a_tok.payload.i64 = d[e];
                    mark(&a_tok);
                    calls++;
                }
            for (int e = 0; e < experts; e++)
                if (d[e] > capacity) {
                    a_drop.category = (uint32_t)e + 1;
                    a_drop.payload.i64 = d[e] - capacity;
                    mark(&a_drop);
                    calls++;
                }
            pop();
            for (int e = 0; e < experts; e++)
                if (d[e] > 0) {
                    a_ffn.category = (uint32_t)e + 1;
                    a_ffn.payload.i64 = d[e] > capacity ? capacity : d[e];
                    push(&a_ffn);
                    pop();
                    calls += 2;
                }
            pop();
            calls += 4;
        }
        pop();
        cpu[i] = clock_ns(CLOCK_THREAD_CPUTIME_ID) - c0;
        wall[i] = clock_ns(CLOCK_MONOTONIC) - w0;
    }
    double wall_s = (double)(clock_ns(CLOCK_MONOTONIC) - start) / 1e9;
    double process_cpu_s = (double)(clock_ns(CLOCK_PROCESS_CPUTIME_ID) - process_cpu0) / 1e9;
    double cpu_sum = 0;
    for (long i = 0; i < total_steps; i++) cpu_sum += (double)cpu[i];
    qsort(cpu, (size_t)total_steps, sizeof *cpu, cmp_u64);
    qsort(wall, (size_t)total_steps, sizeof *wall, cmp_u64);
    printf("{\"pid\": %d, \"tool\": %s, \"steps_emitted\": %ld, \"nvtx_calls\": %llu, \"nvtx_calls_per_step\": %.1f, "
           "\"emission_cpu_us_per_step_median\": %.3f, \"emission_cpu_us_per_step_mean\": %.3f, "
           "\"emission_wall_us_per_step_median\": %.3f, \"process_cpu_s\": %.6f, \"wall_s\": %.6f, "
           "\"achieved_steps_per_s\": %.3f, \"late_steps\": %llu}\n",
           (int)getpid(), have_tool ? "true" : "false", total_steps, (unsigned long long)calls,
           (double)calls / (double)total_steps, (double)cpu[total_steps / 2] / 1e3,
           cpu_sum / (double)total_steps / 1e3, (double)wall[total_steps / 2] / 1e3, process_cpu_s, wall_s,
           (double)total_steps / wall_s, (unsigned long long)late);
    fflush(stdout);
    wait_line(WAIT_FOR_EXIT_MS);
    return 0;
}
