/* Plays NVTX's side of the payload extension in C, the way NVTX's generated code does it: loads the
 * injection library, hands InitializeInjectionNvtx2 the core tables and
 * InitializeInjectionNvtxExtension a payload module of 63 slots, then registers schemas through the
 * slot the library filled and sends EXT payloads, well-formed and hostile, from 1 and 8 threads.
 * Built and run by tests/nvtx/test_nvtx_payload_ext.py (abi_harness.build_c_harness).
 *
 *   ext_harness LIBRARY LOG_JSON THREAD_EVENTS
 * Prints "ready" once the ring exists, waits for a line on stdin, runs, writes LOG_JSON (what it
 * sent, per case), prints "done" and exits. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../collectors/nvtx_inject/nvtx_client.h"

typedef void (*mark_fn)(msnvtx_domain_handle, const msnvtx_event_attributes *);
typedef int (*push_fn)(msnvtx_domain_handle, const msnvtx_event_attributes *);
typedef int (*pop_fn)(msnvtx_domain_handle);
typedef msnvtx_domain_handle (*domain_create_fn)(const char *);
typedef uint64_t (*schema_register_fn)(msnvtx_domain_handle, const msnvtx_schema_attr *);
typedef uint8_t (*is_enabled_fn)(msnvtx_domain_handle);

static intptr_t payload_slots[63];

static mark_fn mark;
static push_fn push;
static pop_fn pop;
static schema_register_fn schema_register;
static msnvtx_domain_handle domain;
static long thread_events;

/* An int32 array schema as the nvtx package registers it: a static scalar, then (size, data). */
static uint64_t register_int32_array(void) {
    msnvtx_schema_entry scalar = {.type = 15 /* INT32 */, .name = "int32"};
    msnvtx_schema_attr a = {.field_mask = MSNVTX_SCHEMA_FIELD_TYPE | MSNVTX_SCHEMA_FIELD_ENTRIES |
                                          MSNVTX_SCHEMA_FIELD_NUM_ENTRIES | MSNVTX_SCHEMA_FIELD_STATIC_SIZE,
                            .type = 1, .entries = &scalar, .entry_count = 1, .static_size = 4};
    uint64_t scalar_id = schema_register(NULL, &a);
    msnvtx_schema_entry fields[2] = {{.type = 18 /* UINT64 */, .name = "size"},
                                     {.flags = 3 << 4 /* length index */, .type = scalar_id, .name = "data"}};
    msnvtx_schema_attr arr = {.field_mask = MSNVTX_SCHEMA_FIELD_TYPE | MSNVTX_SCHEMA_FIELD_ENTRIES |
                                            MSNVTX_SCHEMA_FIELD_NUM_ENTRIES,
                              .type = 2, .entries = fields, .entry_count = 2};
    return schema_register(NULL, &arr);
}

static void ext_mark(int32_t reserved0, const void *data) {
    msnvtx_event_attributes a = {.version = 3, .size = sizeof a, .payload_type = MSNVTX_PAYLOAD_EXT,
                                 .reserved0 = reserved0};
    a.payload.u64 = (uint64_t)(uintptr_t)data;
    mark(domain, &a);
}

/* bytes = uint64 length + int32 values (first, first+1, ...): the nvtx package's array layout */
static size_t fill_array(unsigned char *buf, uint64_t length, int32_t first) {
    memcpy(buf, &length, 8);
    for (uint64_t i = 0; i < length; i++) {
        int32_t v = first + (int32_t)i;
        memcpy(buf + 8 + 4 * i, &v, 4);
    }
    return 8 + 4 * length;
}

static uint64_t g_array_schema;

static void *worker(void *arg) {
    int32_t index = (int32_t)(intptr_t)arg;
    unsigned char buf[8 + 4 * 16];
    for (long i = 0; i < thread_events; i++) {
        /* value = index * 1e6 + i, so the test can tell every payload's origin */
        msnvtx_payload_data d = {g_array_schema, fill_array(buf, 1 + i % 16, index * 1000000 + (int32_t)i), buf};
        msnvtx_event_attributes a = {.version = 3, .size = sizeof a, .payload_type = MSNVTX_PAYLOAD_EXT,
                                     .reserved0 = 1};
        a.payload.u64 = (uint64_t)(uintptr_t)&d;
        if (i % 2) {
            push(domain, &a);
            pop(domain);
        } else {
            mark(domain, &a);
        }
    }
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 4) return 2;
    thread_events = atol(argv[3]);
    void *lib;
    int loaded = msclient_load(argv[1], &lib);
    if (loaded) return loaded + 2; /* 3: dlopen, 4: the initializer */
    int (*init_ext)(msnvtx_ext_module_info *) = (int (*)(msnvtx_ext_module_info *))dlsym(lib, "InitializeInjectionNvtxExtension");
    if (!init_ext) return 4;
    mark = (mark_fn)core2_slots[MSNVTX_CORE2_DomainMarkEx];
    push = (push_fn)core2_slots[MSNVTX_CORE2_DomainRangePushEx];
    pop = (pop_fn)core2_slots[MSNVTX_CORE2_DomainRangePop];
    if (!mark || !push || !pop) return 5;
    domain = ((domain_create_fn)core2_slots[MSNVTX_CORE2_DomainCreateA])("ext");
    printf("ready\n"); /* the ring exists; the agent attaches now */
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof line, stdin)) return 6;

    /* the extension modules arrive on first use, here after the attach (so counted by the agent) */
    msnvtx_ext_segment seg = {0, 63, payload_slots};
    msnvtx_ext_module_info info = {3, sizeof info, MSNVTX_EXT_MODULE_PAYLOAD, 0x0104, 1, &seg, NULL, NULL};
    msnvtx_ext_segment other_seg = {0, 4, (intptr_t[4]){0}};
    msnvtx_ext_module_info other = {3, sizeof other, 7 /* a module the library does not know */, 1, 1, &other_seg, NULL, NULL};
    int ext_results[3] = {init_ext(&info), init_ext(&info) /* idempotent */, init_ext(&other)};
    schema_register = (schema_register_fn)payload_slots[MSNVTX_PAYLOAD_SLOT_SchemaRegister];
    is_enabled_fn is_enabled = (is_enabled_fn)payload_slots[MSNVTX_PAYLOAD_SLOT_DomainIsEnabled];
    if (!schema_register || !is_enabled) return 8;

    FILE *log = fopen(argv[2], "w");
    if (!log) return 7;
    fprintf(log, "{\"ext_init\": [%d, %d, %d], \"enabled\": %d, \"other_slots_untouched\": %d",
            ext_results[0], ext_results[1], ext_results[2], is_enabled(domain), other_seg.slots[0] == 0);
    g_array_schema = register_int32_array();
    fprintf(log, ", \"array_schema\": %llu", (unsigned long long)g_array_schema);

    /* malformed schema registrations: each counted, each answered with an id never known */
    msnvtx_schema_entry one = {.type = 15};
    const uint64_t must = MSNVTX_SCHEMA_FIELD_TYPE | MSNVTX_SCHEMA_FIELD_ENTRIES | MSNVTX_SCHEMA_FIELD_NUM_ENTRIES;
    msnvtx_schema_attr bad[] = {
        {.field_mask = must, .type = 1, .entries = NULL, .entry_count = 3},         /* NULL entries */
        {.field_mask = must, .type = 1, .entries = &one, .entry_count = 1ull << 40}, /* huge count */
        {.field_mask = must, .type = 1, .entries = &one, .entry_count = 0},          /* no entries */
        {.field_mask = MSNVTX_SCHEMA_FIELD_TYPE, .type = 1, .entries = &one, .entry_count = 1},
        {.field_mask = must, .type = 9, .entries = &one, .entry_count = 1},          /* no such type */
        {.field_mask = must | MSNVTX_SCHEMA_FIELD_STATIC_SIZE, .type = 1, .entries = &one, .entry_count = 1,
         .static_size = 1ull << 40},
        {.field_mask = must | MSNVTX_SCHEMA_FIELD_SCHEMA_ID, .type = 1, .entries = &one, .entry_count = 1,
         .schema_id = 5}, /* an application id outside the static range */
    };
    uint64_t bad_ids[8];
    size_t n_bad = sizeof bad / sizeof bad[0];
    for (size_t i = 0; i < n_bad; i++) bad_ids[i] = schema_register(domain, &bad[i]);
    bad_ids[n_bad] = schema_register(domain, NULL);
    fprintf(log, ", \"malformed_schemas\": %zu", n_bad + 1);
    msnvtx_schema_entry many[33];
    for (int i = 0; i < 33; i++) many[i] = (msnvtx_schema_entry){.type = 15, .offset = 4u * (unsigned)i};
    msnvtx_schema_attr wide = {.field_mask = must, .type = 1, .entries = many, .entry_count = 33};
    uint64_t wide_id = schema_register(domain, &wide); /* more fields than recorded: dropped */
    /* an application-chosen static id, and a name */
    msnvtx_schema_attr named = {.field_mask = must | MSNVTX_SCHEMA_FIELD_SCHEMA_ID | MSNVTX_SCHEMA_FIELD_NAME |
                                              MSNVTX_SCHEMA_FIELD_STATIC_SIZE,
                                .name = "scalar.int32", .type = 1, .entries = &one, .entry_count = 1,
                                .static_size = 4, .schema_id = (1ull << 24) + 7};
    uint64_t static_id = schema_register(domain, &named);
    fprintf(log, ", \"static_id\": %llu", (unsigned long long)static_id);

    unsigned char buf[8 + 4 * 64];
    /* 1. well-formed: [10, 11, 12, 13] */
    msnvtx_payload_data good = {g_array_schema, fill_array(buf, 4, 10), buf};
    ext_mark(1, &good);
    /* 2. truncated: the length says 100, the bytes hold 1 element (recorded; the agent refuses it) */
    unsigned char trunc[12], one_value[12];
    fill_array(one_value, 1, 77);
    memcpy(trunc, one_value, 12);
    uint64_t claim = 100;
    memcpy(trunc, &claim, 8);
    msnvtx_payload_data truncated = {g_array_schema, sizeof trunc, trunc};
    ext_mark(1, &truncated);
    /* 3. a predefined type as the schema id: 4 int32 */
    int32_t four[4] = {-1, -2, -3, -4};
    msnvtx_payload_data predefined = {15, sizeof four, four};
    ext_mark(1, &predefined);
    /* 4. the static id: one int32 */
    int32_t forty_two = 42;
    msnvtx_payload_data by_static = {static_id, 4, &forty_two};
    ext_mark(1, &by_static);
    /* 5. reserved0 = 5: five entries, the first is taken, four counted */
    msnvtx_payload_data five[5];
    for (int i = 0; i < 5; i++) five[i] = good;
    ext_mark(5, five);
    int recorded = 5; /* events 1-5 */
    /* lost, one each: unknown id, malformed-schema id, dropped (wide) schema id */
    msnvtx_payload_data unknown = {(1ull << 24) + 5, 16, buf};
    ext_mark(1, &unknown);
    msnvtx_payload_data bad_schema = {bad_ids[0], 16, buf};
    ext_mark(1, &bad_schema);
    msnvtx_payload_data wide_payload = {wide_id, 16, buf};
    ext_mark(1, &wide_payload);
    int unknown_schema = 3;
    /* oversize: the default cap is 256 KiB */
    size_t big_bytes = (256u << 10) + 8;
    unsigned char *big = calloc(1, big_bytes);
    msnvtx_payload_data oversize = {g_array_schema, big_bytes, big};
    ext_mark(1, &oversize);
    /* malformed events: NULL data, NULL bytes, size 0, schema id 0, reserved0 = 0 and -1 */
    msnvtx_payload_data null_bytes = {g_array_schema, 16, NULL};
    msnvtx_payload_data zero_size = {g_array_schema, 0, buf};
    msnvtx_payload_data zero_schema = {0, 16, buf};
    ext_mark(1, NULL);
    ext_mark(1, &null_bytes);
    ext_mark(1, &zero_size);
    ext_mark(1, &zero_schema);
    ext_mark(0, &good);
    ext_mark(-1, &good);
    int malformed_events = 6;
    int single_events = recorded + unknown_schema + 1 + malformed_events;

    /* 10k schemas: the library records 4096 in all, the rest are answered and dropped */
    uint64_t last_id = 0;
    for (int i = 0; i < 10000; i++) last_id = register_int32_array();
    msnvtx_payload_data late = {last_id, fill_array(buf, 2, 5), buf};
    ext_mark(1, &late); /* its schema was dropped: unknown */
    single_events += 1;
    unknown_schema += 1;
    fprintf(log, ", \"schema_attempts\": %d", 2 /* first array */ + 1 /* wide */ + 1 /* static */ + 20000);

    /* 8 threads at once */
    pthread_t threads[8];
    for (int i = 0; i < 8; i++) pthread_create(&threads[i], NULL, worker, (void *)(intptr_t)i);
    for (int i = 0; i < 8; i++) pthread_join(threads[i], NULL);
    long thread_nvtx_events = 8 * (thread_events + thread_events / 2); /* marks, or push+pop */
    long thread_ext = 8 * thread_events;
    fprintf(log, ", \"single_events\": %d, \"recorded_single\": %d, \"unknown_schema\": %d"
                 ", \"malformed_events\": %d, \"oversize\": 1, \"entries_dropped\": 4"
                 ", \"thread_ext_events\": %ld, \"emitted\": %ld}\n",
            single_events, recorded, unknown_schema, malformed_events, thread_ext,
            (long)single_events + thread_nvtx_events);
    fclose(log);
    free(big);
    printf("done\n");
    fflush(stdout);
    return 0;
}
