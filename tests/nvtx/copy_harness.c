/* Sends EXT payloads whose bytes the injection library copies with its own loop as well as with
 * memcpy: sizes on both sides of the loop's 2 KiB threshold, sources placed so that the blob
 * destination lies 0-63 bytes past them modulo 4 KiB (the window where the library leaves glibc's
 * memcpy, see copy_bytes in inject.c) or far from it, and enough bytes to wrap the blob region so
 * payloads are split at its end. One thread, one event at a time, so the harness knows each
 * event's blob position: the ring is fresh and every payload is recorded (the test drains).
 * Built and run by tests/nvtx/test_inject_payload_copy.py (abi_harness.build_c_harness).
 *
 *   copy_harness LIBRARY EVENTS
 * Prints "ready" once the ring exists, waits for a line on stdin, sends EVENTS marks (a pause of
 * 2 ms after each, so the agent keeps the blob drained), prints "done" and exits. Event i carries
 * an int32 array of lengths[i % N] values i * 2^20 + j (j = 0, 1, ...). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../../collectors/nvtx_inject/nvtx_client.h"

typedef void (*mark_fn)(msnvtx_domain_handle, const msnvtx_event_attributes *);
typedef msnvtx_domain_handle (*domain_create_fn)(const char *);
typedef uint64_t (*schema_register_fn)(msnvtx_domain_handle, const msnvtx_schema_attr *);

static intptr_t payload_slots[63];

/* int32 element counts: below, at and above 2 KiB of bytes, odd tails, up to 200 KiB */
static const uint32_t lengths[] = {16, 509, 510, 511, 512, 1021, 1024, 4093, 16384, 29696, 51201};
#define N_LENGTHS (sizeof lengths / sizeof lengths[0])
/* (destination - source) modulo 4 KiB: inside the library's window (< 64) and outside it */
static const uint32_t gaps[] = {0, 8, 16, 24, 40, 63, 64, 200, 2048};
#define N_GAPS (sizeof gaps / sizeof gaps[0])
#define BLOB_ENTRY_HEADER 16 /* struct msring_blob_entry: schema id, size, 0 */

int main(int argc, char **argv) {
    if (argc != 3) return 2;
    long events = atol(argv[2]);
    void *lib;
    int loaded = msclient_load(argv[1], &lib);
    if (loaded) return loaded + 2; /* 3: dlopen, 4: the initializer */
    int (*init_ext)(msnvtx_ext_module_info *) = (int (*)(msnvtx_ext_module_info *))dlsym(lib, "InitializeInjectionNvtxExtension");
    if (!init_ext) return 4;
    mark_fn mark = (mark_fn)core2_slots[MSNVTX_CORE2_DomainMarkEx];
    if (!mark) return 5;
    msnvtx_domain_handle domain = ((domain_create_fn)core2_slots[MSNVTX_CORE2_DomainCreateA])("copy");
    msnvtx_ext_segment seg = {0, 63, payload_slots};
    msnvtx_ext_module_info info = {3, sizeof info, MSNVTX_EXT_MODULE_PAYLOAD, 0x0104, 1, &seg, NULL, NULL};
    if (!init_ext(&info)) return 6;
    schema_register_fn schema_register = (schema_register_fn)payload_slots[MSNVTX_PAYLOAD_SLOT_SchemaRegister];
    if (!schema_register) return 7;
    /* an int32 array schema as the nvtx package registers it: a static scalar, then (size, data) */
    msnvtx_schema_entry scalar = {.type = 15 /* INT32 */, .name = "int32"};
    msnvtx_schema_attr sa = {.field_mask = MSNVTX_SCHEMA_FIELD_TYPE | MSNVTX_SCHEMA_FIELD_ENTRIES |
                                           MSNVTX_SCHEMA_FIELD_NUM_ENTRIES | MSNVTX_SCHEMA_FIELD_STATIC_SIZE,
                             .type = 1, .entries = &scalar, .entry_count = 1, .static_size = 4};
    uint64_t scalar_id = schema_register(NULL, &sa);
    msnvtx_schema_entry fields[2] = {{.type = 18 /* UINT64 */, .name = "size"},
                                     {.flags = 3 << 4 /* length index */, .type = scalar_id, .name = "data"}};
    msnvtx_schema_attr aa = {.field_mask = MSNVTX_SCHEMA_FIELD_TYPE | MSNVTX_SCHEMA_FIELD_ENTRIES |
                                           MSNVTX_SCHEMA_FIELD_NUM_ENTRIES,
                             .type = 2, .entries = fields, .entry_count = 2};
    uint64_t array_id = schema_register(NULL, &aa);

    size_t arena_bytes = 8 + 4 * 51201 + 8192;
    unsigned char *arena = aligned_alloc(4096, (arena_bytes + 4095) & ~(size_t)4095);
    if (!arena) return 8;
    printf("ready\n"); /* the ring exists; the agent attaches now */
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof line, stdin)) return 9;

    /* the blob region starts page-aligned at position 0, and each recorded payload advances it by
     * its 16-byte header plus its bytes rounded up to 8 */
    uint64_t head = 0;
    for (long i = 0; i < events; i++) {
        uint32_t n = lengths[i % N_LENGTHS];
        uint32_t gap = gaps[(i / N_LENGTHS) % N_GAPS];
        size_t bytes = 8 + 4 * (size_t)n;
        uint64_t dst_page_offset = (head + BLOB_ENTRY_HEADER) & 4095;
        unsigned char *src = arena + ((dst_page_offset - gap) & 4095);
        uint64_t length = n;
        memcpy(src, &length, 8);
        for (uint32_t j = 0; j < n; j++) {
            int32_t v = (int32_t)((i << 20) + j);
            memcpy(src + 8 + 4 * (size_t)j, &v, 4);
        }
        msnvtx_payload_data d = {array_id, bytes, src};
        msnvtx_event_attributes a = {.version = 3, .size = sizeof a, .payload_type = MSNVTX_PAYLOAD_EXT,
                                     .reserved0 = 1};
        a.payload.u64 = (uint64_t)(uintptr_t)&d;
        mark(domain, &a);
        head += (BLOB_ENTRY_HEADER + bytes + 7) & ~(uint64_t)7;
        nanosleep(&(struct timespec){0, 2000000}, NULL);
    }
    free(arena);
    printf("done\n");
    fflush(stdout);
    return 0;
}
