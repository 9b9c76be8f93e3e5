/* docs/nvtx-convention.md's C examples for adopters, statement for statement, with this project's
 * ABI names (nvtx_abi.h) where the doc uses NVIDIA's (NVIDIA's headers are not in this tree): the
 * three vector schemas exactly as the doc registers them (a dynamic schema: a UINT64 "length", then
 * the INT32 / INT64 / FLOAT32 "values" indexed by it; no nested scalar schema, unlike the PyPI nvtx
 * package), then STEPS steps of the per-layer v2 form and STEPS of the v2.2 compact form. Built and
 * run by tests/nvtx/test_convention_doc_examples.py, which computes the same numbers in numpy.
 *
 *   doc_c_producer LIBRARY LAYERS EXPERTS STEPS
 * Prints "ready" once the ring exists, waits for a line on stdin, emits, exits 0. Values, for step s
 * (the compact steps continue the count), layer l, expert e, request r:
 *   tokens[l][e] = (7s + 3l + 5e) % 11, over[l][e] = min(tokens, (s + l + e) % 3),
 *   entropy = 0.5 + 0.25 l + 0.125 s (exact in float32), step tokens = 16 + s,
 *   requests (per-layer steps): R = 2 + s % 2, key 5000 + 10 s + r, input tokens 4 r, output 1. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../collectors/nvtx_inject/nvtx_client.h"

/* NVTX_PAYLOAD_ENTRY_TYPE_* and NVTX_PAYLOAD_ENTRY_FLAG_ARRAY_LENGTH_INDEX, NVTX_PAYLOAD_SCHEMA_TYPE_DYNAMIC */
#define ENTRY_TYPE_INT32 15
#define ENTRY_TYPE_INT64 17
#define ENTRY_TYPE_UINT64 18
#define ENTRY_TYPE_FLOAT32 43
#define ENTRY_FLAG_ARRAY_LENGTH_INDEX (3u << 4)
#define SCHEMA_TYPE_DYNAMIC 2

typedef void (*mark_fn)(msnvtx_domain_handle, const msnvtx_event_attributes *);
typedef int (*push_fn)(msnvtx_domain_handle, const msnvtx_event_attributes *);
typedef int (*pop_fn)(msnvtx_domain_handle);
typedef msnvtx_domain_handle (*domain_create_fn)(const char *);
typedef msnvtx_string_handle (*register_fn)(msnvtx_domain_handle, const char *);
typedef uint64_t (*schema_register_fn)(msnvtx_domain_handle, const msnvtx_schema_attr *);

static intptr_t payload_slots[63];
static mark_fn mark;
static push_fn push;
static pop_fn pop;
static msnvtx_domain_handle moe;

/* the doc's `schema` with its entries: dynamic, fieldMask TYPE | ENTRIES | NUM_ENTRIES */
static uint64_t vector_schema(schema_register_fn schema_register, uint64_t value_type) {
    msnvtx_schema_entry entries[2] = {
        {0, ENTRY_TYPE_UINT64, "length", NULL, 0, 0, NULL, NULL},
        {ENTRY_FLAG_ARRAY_LENGTH_INDEX, value_type, "values", NULL, /* index of the length entry */ 0, 0, NULL, NULL},
    };
    msnvtx_schema_attr schema = {0};
    schema.field_mask = MSNVTX_SCHEMA_FIELD_TYPE | MSNVTX_SCHEMA_FIELD_ENTRIES | MSNVTX_SCHEMA_FIELD_NUM_ENTRIES;
    schema.type = SCHEMA_TYPE_DYNAMIC;
    schema.entries = entries;
    schema.entry_count = 2;
    return schema_register(moe, &schema);
}

static msnvtx_event_attributes attrs(msnvtx_string_handle name, uint32_t category) {
    msnvtx_event_attributes a;
    memset(&a, 0, sizeof a);
    a.version = 3; /* NVTX_VERSION */
    a.size = sizeof a; /* NVTX_EVENT_ATTRIB_STRUCT_SIZE */
    a.message_type = MSNVTX_MESSAGE_REGISTERED;
    a.message.registered = name;
    a.category = category;
    return a;
}

static void ext_mark(msnvtx_string_handle name, uint32_t category, const msnvtx_payload_data *data) {
    msnvtx_event_attributes a = attrs(name, category);
    a.payload_type = MSNVTX_PAYLOAD_EXT;
    a.payload.u64 = (uint64_t)(uintptr_t)data;
    a.reserved0 = 1; /* one payload-data entry */
    mark(moe, &a);
}

static void push_i64(msnvtx_string_handle name, uint32_t category, int64_t value) {
    msnvtx_event_attributes a = attrs(name, category);
    a.payload_type = MSNVTX_PAYLOAD_I64;
    a.payload.i64 = value;
    push(moe, &a);
}

static int32_t tokens_of(int s, int l, int e) { return (7 * s + 3 * l + 5 * e) % 11; }

static int32_t over_of(int s, int l, int e) {
    int32_t cap = (s + l + e) % 3, t = tokens_of(s, l, e);
    return cap < t ? cap : t;
}

static double entropy_of(int s, int l) { return 0.5 + 0.25 * l + 0.125 * s; }

int main(int argc, char **argv) {
    if (argc != 5) return 2;
    int L = atoi(argv[2]), E = atoi(argv[3]), steps = atoi(argv[4]);
    if (L < 1 || L > 64 || E < 1 || E > 1024 || steps < 1 || steps > 64) return 2;
    void *lib;
    int loaded = msclient_load(argv[1], &lib);
    if (loaded) return loaded + 2;
    int (*init_ext)(msnvtx_ext_module_info *) =
        (int (*)(msnvtx_ext_module_info *))dlsym(lib, "InitializeInjectionNvtxExtension");
    msnvtx_ext_segment seg = {0, 63, payload_slots};
    msnvtx_ext_module_info info = {3, sizeof info, MSNVTX_EXT_MODULE_PAYLOAD, 0x0104, 1, &seg, NULL, NULL};
    if (!init_ext || !init_ext(&info)) return 5;
    mark = (mark_fn)core2_slots[MSNVTX_CORE2_DomainMarkEx];
    push = (push_fn)core2_slots[MSNVTX_CORE2_DomainRangePushEx];
    pop = (pop_fn)core2_slots[MSNVTX_CORE2_DomainRangePop];
    register_fn reg = (register_fn)core2_slots[MSNVTX_CORE2_DomainRegisterStringA];
    schema_register_fn schema_register = (schema_register_fn)payload_slots[MSNVTX_PAYLOAD_SLOT_SchemaRegister];
    if (!mark || !push || !pop || !reg || !schema_register) return 6;

    /* once: the domain, the strings, the schemas */
    moe = ((domain_create_fn)core2_slots[MSNVTX_CORE2_DomainCreateA])("moe");
    msnvtx_string_handle s_step = reg(moe, "moe.step"), s_step_requests = reg(moe, "moe.step.requests"),
                         s_layer = reg(moe, "moe.layer"), s_router = reg(moe, "moe.router"),
                         s_routing = reg(moe, "moe.routing"), s_experts = reg(moe, "moe.experts"),
                         s_step_routing = reg(moe, "moe.step.routing"), s_step_entropy = reg(moe, "moe.step.entropy");
    uint64_t int32_vector = vector_schema(schema_register, ENTRY_TYPE_INT32);
    uint64_t int64_vector = vector_schema(schema_register, ENTRY_TYPE_INT64);
    uint64_t float_vector = vector_schema(schema_register, ENTRY_TYPE_FLOAT32);
    if (!int32_vector || !int64_vector || !float_vector) return 7;
    printf("ready\n");
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof line, stdin)) return 8;

    /* {length as uint64, values}: the largest vector is the compact step's L·2E int32 */
    unsigned char *buf = calloc(1, 8 + 8 * (size_t)(2 * L * E + 3 * 4));
    if (!buf) return 9;
    for (int s = 0; s < steps; s++) { /* the per-layer v2 form */
        push_i64(s_step, 0, 16 + s);
        int R = 2 + s % 2;
        uint64_t n = 3u * (uint64_t)R;
        memcpy(buf, &n, 8);
        for (int r = 0; r < R; r++) {
            int64_t key = 5000 + 10 * s + r, input = 4 * r, output = 1;
            memcpy(buf + 8 + 8 * r, &key, 8);
            memcpy(buf + 8 + 8 * (R + r), &input, 8);
            memcpy(buf + 8 + 8 * (2 * R + r), &output, 8);
        }
        msnvtx_payload_data step_requests = {int64_vector, 8 + 3 * (size_t)R * 8, buf};
        ext_mark(s_step_requests, 0, &step_requests);
        for (int l = 0; l < L; l++) {
            push_i64(s_layer, (uint32_t)l + 1, E);
            msnvtx_event_attributes ra = attrs(s_router, (uint32_t)l + 1);
            ra.payload_type = MSNVTX_PAYLOAD_DOUBLE;
            ra.payload.f64 = entropy_of(s, l);
            push(moe, &ra);
            n = 2u * (uint64_t)E;
            memcpy(buf, &n, 8);
            int64_t assigned = 0;
            for (int e = 0; e < E; e++) {
                int32_t t = tokens_of(s, l, e), o = over_of(s, l, e);
                memcpy(buf + 8 + 4 * e, &t, 4);
                memcpy(buf + 8 + 4 * (E + e), &o, 4);
                assigned += t;
            }
            msnvtx_payload_data data = {int32_vector, 8 + 2 * (size_t)E * 4, buf};
            ext_mark(s_routing, (uint32_t)l + 1, &data);
            pop(moe); /* moe.router */
            push_i64(s_experts, (uint32_t)l + 1, assigned);
            pop(moe); /* moe.experts */
            pop(moe); /* moe.layer */
        }
        pop(moe); /* moe.step */
    }
    for (int s = steps; s < 2 * steps; s++) { /* the v2.2 compact form */
        push_i64(s_step, 0, 16 + s);
        for (int l = 0; l < L; l++) {
            push_i64(s_layer, (uint32_t)l + 1, E);
            pop(moe);
        }
        uint64_t n = 2u * (uint64_t)L * (uint64_t)E;
        memcpy(buf, &n, 8);
        for (int l = 0; l < L; l++)
            for (int e = 0; e < E; e++) {
                int32_t t = tokens_of(s, l, e), o = over_of(s, l, e);
                memcpy(buf + 8 + 4 * ((size_t)l * 2 * E + e), &t, 4);
                memcpy(buf + 8 + 4 * ((size_t)l * 2 * E + E + e), &o, 4);
            }
        msnvtx_payload_data routing = {int32_vector, 8 + 2 * (size_t)L * E * 4, buf};
        ext_mark(s_step_routing, 0, &routing);
        unsigned char fbuf[8 + 4 * 64];
        n = (uint64_t)L;
        memcpy(fbuf, &n, 8);
        for (int l = 0; l < L; l++) {
            float h = (float)entropy_of(s, l);
            memcpy(fbuf + 8 + 4 * l, &h, 4);
        }
        msnvtx_payload_data entropy = {float_vector, 8 + 4 * (size_t)L, fbuf};
        ext_mark(s_step_entropy, 0, &entropy);
        pop(moe); /* moe.step */
    }
    free(buf);
    return 0;
}
