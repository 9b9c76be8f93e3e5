/* moescope's NVTX injection library: NVTX calls of an instrumented process -> a shared-memory ring
 * the moescope agent drains (docs/nvtx-transport.md).
 *
 * Loaded by NVTX itself when the process runs with NVTX_INJECTION64_PATH=<this .so>. Costs:
 * with no agent attached every event callback is one relaxed load and a return; attached, it is a
 * clock read, a lock-free slot reservation and a 64-byte write. It never blocks on the agent: a full
 * ring drops the event and counts it. Registered strings, domain and category names go once into
 * an append-only string region of the same file, so an agent attaching late still learns them.
 * Payload-extension (schema) payloads: schemas go into the string region when registered; each
 * event's bytes are copied (bounded) into a lock-free byte ring, the blob region, of the file. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include <wchar.h>

#include "nvtx_abi.h"
#include "ring_format.h"

#define EXPORT __attribute__((visibility("default")))
#define LIKELY(x) __builtin_expect(!!(x), 1)
#define UNLIKELY(x) __builtin_expect(!!(x), 0)

_Static_assert(sizeof(struct msring_record) == 64, "record must be one cache line");
_Static_assert(sizeof(struct msring_header) <= MSRING_HEADER_BYTES, "header must fit its page");
_Static_assert(sizeof(struct msring_string_entry) == 24, "string entry header is 24 bytes");
_Static_assert(sizeof(msnvtx_event_attributes) == 48, "nvtxEventAttributes_v2 is 48 bytes");
_Static_assert(sizeof(msnvtx_ext_module_info) == 40, "nvtxExtModuleInfo_t is 40 bytes");
_Static_assert(sizeof(msnvtx_schema_entry) == 64, "nvtxPayloadSchemaEntry_t is 64 bytes");
_Static_assert(sizeof(msnvtx_schema_attr) == 80, "nvtxPayloadSchemaAttr_t is 80 bytes");
_Static_assert(sizeof(msnvtx_payload_data) == 24, "nvtxPayloadData_t is 24 bytes");
_Static_assert(sizeof(struct msring_blob_entry) == 16, "blob entry header is 16 bytes");
_Static_assert(sizeof(struct msring_schema) == 40, "schema header is 40 bytes");
_Static_assert(sizeof(struct msring_schema_field) == 40, "schema field is 40 bytes");

/* ---- process state ------------------------------------------------------------------------- */

static struct msring_header *g_hdr;  /* NULL: no ring (creation failed): events are ignored */
static struct msring_record *g_ring;
static char *g_strings;
static char *g_blob;
static uint64_t g_blob_mask;
static uint64_t g_payload_max;
static size_t g_map_bytes;
static uint64_t g_mask;
static char g_path[PATH_MAX];
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER; /* intern table + string region */
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static int g_init_ok;
static _Atomic uint64_t g_next_range_id = 1;

static inline _Atomic uint64_t *counter(int which) {
    return (_Atomic uint64_t *)&g_hdr->counters[which];
}

static inline void count(int which) {
    if (g_hdr) atomic_fetch_add_explicit(counter(which), 1, memory_order_relaxed);
}

static inline void count_n(int which, uint64_t n) {
    if (g_hdr) atomic_fetch_add_explicit(counter(which), n, memory_order_relaxed);
}

static inline uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* vDSO: no syscall */
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint64_t env_u64(const char *name, uint64_t fallback, uint64_t lo, uint64_t hi) {
    const char *text = getenv(name);
    if (!text || !*text) return fallback;
    char *end = NULL;
    errno = 0;
    unsigned long long value = strtoull(text, &end, 10);
    if (errno || !end || *end || value < lo || value > hi) return fallback;
    return value;
}

/* ---- ring file ----------------------------------------------------------------------------- */

/* Creates <dir>/moescope-nvtx.<pid> (0600), fully allocated so that a full tmpfs can never turn a
 * later write into SIGBUS in the host, and renamed into place only once its header is complete. */
static int ring_create(pid_t pid) {
    const char *dir = getenv("MOESCOPE_NVTX_DIR");
    if (!dir || !*dir) dir = "/dev/shm";
    uint64_t records = env_u64("MOESCOPE_NVTX_RING_RECORDS", MSRING_DEFAULT_RECORDS, 64, 1u << 24);
    if (records & (records - 1)) records = MSRING_DEFAULT_RECORDS; /* must be a power of two */
    uint64_t string_bytes = env_u64("MOESCOPE_NVTX_STRING_BYTES", MSRING_DEFAULT_STRING_BYTES,
                                    1u << 16, 1u << 28);
    string_bytes = (string_bytes + 7) & ~7ull;
    uint64_t blob_bytes = env_u64("MOESCOPE_NVTX_BLOB_BYTES", MSRING_DEFAULT_BLOB_BYTES, 1u << 16, 1u << 30);
    if (blob_bytes & (blob_bytes - 1)) blob_bytes = MSRING_DEFAULT_BLOB_BYTES; /* a power of two */
    /* one payload may take at most a quarter of the region, so a few always fit */
    uint64_t payload_max = env_u64("MOESCOPE_NVTX_PAYLOAD_MAX_BYTES", MSRING_DEFAULT_PAYLOAD_MAX_BYTES,
                                   16, 1u << 28);
    if (payload_max > blob_bytes / 4) payload_max = blob_bytes / 4;

    char path[PATH_MAX], tmp[PATH_MAX];
    if (snprintf(path, sizeof path, "%s/%s%d", dir, MSRING_FILE_PREFIX, (int)pid) >= (int)sizeof path)
        return -ENAMETOOLONG;
    if (snprintf(tmp, sizeof tmp, "%s.tmp", path) >= (int)sizeof tmp) return -ENAMETOOLONG;

    uint64_t strings_offset = MSRING_HEADER_BYTES + records * sizeof(struct msring_record);
    uint64_t blob_offset = (strings_offset + string_bytes + 63) & ~63ull;
    size_t bytes = blob_offset + blob_bytes;
    int fd = open(tmp, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0) return -errno;
    int err = 0;
    if (fchmod(fd, 0600) != 0) err = -errno;
    if (!err) err = -posix_fallocate(fd, 0, (off_t)bytes);
    void *map = MAP_FAILED;
    if (!err) {
        /* populate now: a page fault on first touch would otherwise land on some event's path */
        map = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
        if (map == MAP_FAILED) err = -errno;
    }
    close(fd);
    if (err) {
        unlink(tmp);
        return err;
    }
    struct msring_header *h = map;
    h->version = MSRING_VERSION;
    h->header_bytes = MSRING_HEADER_BYTES;
    h->record_bytes = sizeof(struct msring_record);
    h->capacity = (uint32_t)records;
    h->ring_offset = MSRING_HEADER_BYTES;
    h->strings_offset = strings_offset;
    h->strings_bytes = string_bytes;
    h->blob_offset = blob_offset;
    h->blob_bytes = blob_bytes;
    h->payload_max_bytes = payload_max;
    h->pid = (uint32_t)pid;
    h->created_ns = now_ns();
    atomic_store_explicit((_Atomic uint64_t *)&h->magic, MSRING_MAGIC, memory_order_release);
    if (rename(tmp, path) != 0) {
        err = -errno;
        munmap(map, bytes);
        unlink(tmp);
        return err;
    }
    g_hdr = h;
    g_ring = (struct msring_record *)((char *)map + h->ring_offset);
    g_strings = (char *)map + h->strings_offset;
    g_blob = (char *)map + blob_offset;
    g_blob_mask = blob_bytes - 1;
    g_payload_max = payload_max;
    g_map_bytes = bytes;
    g_mask = records - 1;
    memcpy(g_path, path, sizeof g_path);
    return 0;
}

/* The process is exiting: say so to the agent and remove the file (an attached agent keeps its
 * mapping and drains what is left; nobody can attach to a dead process). */
__attribute__((destructor)) static void ring_at_exit(void) {
    struct msring_header *h = g_hdr;
    if (!h || h->pid != (uint32_t)getpid()) return;
    atomic_store_explicit((_Atomic uint32_t *)&h->producer_exited, 1, memory_order_release);
    unlink(g_path);
}

/* ---- strings ------------------------------------------------------------------------------- */

/* Interned texts: registered strings, domain names, category and thread names, and the inline
 * (ASCII/wide) messages of the C API. Keyed by content so each text reaches the agent once. */
struct intern_slot {
    uint64_t hash;
    uint32_t id;
    uint32_t domain_id;
    uint32_t key_id;
    uint32_t full_bytes;
    uint32_t text_offset; /* in the string region */
    uint16_t kind;
    uint16_t used;
};
#define INTERN_SLOTS (1u << 17)
#define INTERN_MAX_ENTRIES (1u << 16)
static struct intern_slot *g_intern; /* calloc'ed: untouched pages cost no memory */
static uint32_t g_intern_entries;
static uint32_t g_next_id = 1; /* strings and domains share one id space; 0 means none */

static uint64_t hash_text(const char *text, size_t n, uint32_t kind, uint32_t domain, uint32_t key) {
    uint64_t h = 1469598103934665603ull ^ ((uint64_t)kind << 48) ^ ((uint64_t)domain << 16) ^ key;
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)text[i]) * 1099511628211ull;
    return h ^ (h >> 29);
}

/* Appends one entry to the string region; caller holds g_lock. Returns the text's offset or -1. */
static int64_t region_append(uint16_t kind, uint16_t flags, uint32_t id, uint32_t domain_id,
                             const char *text, uint32_t text_bytes) {
    struct msring_header *h = g_hdr;
    if (!h) return -1;
    uint64_t used = atomic_load_explicit((_Atomic uint64_t *)&h->strings_used, memory_order_relaxed);
    uint64_t entry_bytes = (sizeof(struct msring_string_entry) + text_bytes + 1 + 7) & ~7ull;
    if (used + entry_bytes > h->strings_bytes) {
        count(MSRING_DROPPED_STRING_FULL);
        return -1;
    }
    struct msring_string_entry *e = (struct msring_string_entry *)(g_strings + used);
    e->entry_bytes = (uint32_t)entry_bytes;
    e->kind = kind;
    e->flags = flags;
    e->id = id;
    e->domain_id = domain_id;
    e->text_bytes = text_bytes;
    e->reserved = 0;
    char *dst = (char *)(e + 1);
    memcpy(dst, text, text_bytes);
    memset(dst + text_bytes, 0, entry_bytes - sizeof *e - text_bytes);
    atomic_fetch_add_explicit((_Atomic uint64_t *)&h->strings_count, 1, memory_order_relaxed);
    /* publish: the consumer reads entries only below strings_used */
    atomic_store_explicit((_Atomic uint64_t *)&h->strings_used, used + entry_bytes,
                          memory_order_release);
    return (int64_t)((const char *)dst - g_strings);
}

/* Returns the id of (kind, domain, key, text), recording it on first sight. For kinds that carry
 * their own id (category, thread) the result is key_id. 0 when the table or region is full. */
static uint32_t intern(uint16_t kind, uint32_t domain_id, uint32_t key_id, const char *text,
                       size_t full_bytes, uint16_t flags) {
    uint32_t stored = full_bytes > MSRING_MAX_STRING_BYTES ? MSRING_MAX_STRING_BYTES : (uint32_t)full_bytes;
    if (stored < full_bytes) {
        /* cut on a UTF-8 character boundary */
        while (stored > 0 && ((unsigned char)text[stored] & 0xC0) == 0x80) stored--;
        flags |= MSRING_STRF_TRUNCATED;
    }
    uint64_t h = hash_text(text, full_bytes, kind, domain_id, key_id);
    uint32_t result = 0;
    pthread_mutex_lock(&g_lock);
    if (!g_hdr) goto out; /* no ring: texts have nowhere to go */
    if (!g_intern) g_intern = calloc(INTERN_SLOTS, sizeof *g_intern);
    if (!g_intern) goto out;
    for (uint32_t i = (uint32_t)h & (INTERN_SLOTS - 1);; i = (i + 1) & (INTERN_SLOTS - 1)) {
        struct intern_slot *s = &g_intern[i];
        if (!s->used) {
            if (g_intern_entries >= INTERN_MAX_ENTRIES) {
                count(MSRING_DROPPED_STRING_FULL);
                goto out;
            }
            int own_id = kind == MSRING_STR_CATEGORY || kind == MSRING_STR_THREAD;
            uint32_t id = own_id ? key_id : g_next_id;
            int64_t offset = region_append(kind, flags, id, domain_id, text, stored);
            if (offset < 0) goto out;
            if (flags & MSRING_STRF_TRUNCATED) count(MSRING_STRINGS_TRUNCATED);
            if (!own_id) g_next_id++;
            s->hash = h;
            s->id = id;
            s->domain_id = domain_id;
            s->key_id = key_id;
            s->full_bytes = (uint32_t)(full_bytes > UINT32_MAX ? UINT32_MAX : full_bytes);
            s->text_offset = (uint32_t)offset;
            s->kind = kind;
            s->used = 1;
            g_intern_entries++;
            result = id;
            goto out;
        }
        if (s->hash == h && s->kind == kind && s->domain_id == domain_id && s->key_id == key_id &&
            s->full_bytes == (uint32_t)full_bytes &&
            memcmp(g_strings + s->text_offset, text, stored) == 0) {
            result = s->id;
            goto out;
        }
    }
out:
    pthread_mutex_unlock(&g_lock);
    return result;
}

/* Wide (wchar_t = UTF-32 here) text -> UTF-8, at most MSRING_MAX_STRING_BYTES + 4 bytes kept. */
static size_t utf8_from_wide(const wchar_t *w, char *out, size_t cap, size_t *full_bytes, int *bad) {
    size_t n = 0, full = 0;
    *bad = 0;
    for (; *w; w++) {
        uint32_t c = (uint32_t)*w;
        if (c > 0x10FFFF || (c >= 0xD800 && c <= 0xDFFF)) {
            c = 0xFFFD;
            *bad = 1;
        }
        unsigned char buf[4];
        size_t k;
        if (c < 0x80) {
            buf[0] = (unsigned char)c;
            k = 1;
        } else if (c < 0x800) {
            buf[0] = 0xC0 | (c >> 6);
            buf[1] = 0x80 | (c & 0x3F);
            k = 2;
        } else if (c < 0x10000) {
            buf[0] = 0xE0 | (c >> 12);
            buf[1] = 0x80 | ((c >> 6) & 0x3F);
            buf[2] = 0x80 | (c & 0x3F);
            k = 3;
        } else {
            buf[0] = 0xF0 | (c >> 18);
            buf[1] = 0x80 | ((c >> 12) & 0x3F);
            buf[2] = 0x80 | ((c >> 6) & 0x3F);
            buf[3] = 0x80 | (c & 0x3F);
            k = 4;
        }
        if (n + k <= cap) {
            memcpy(out + n, buf, k);
            n += k;
        }
        full += k;
    }
    *full_bytes = full;
    return n;
}

#define WIDE_BUF_BYTES (MSRING_MAX_STRING_BYTES + 8)

static uint32_t intern_ascii(uint16_t kind, uint32_t domain_id, uint32_t key_id, const char *text) {
    if (!text) return 0;
    return intern(kind, domain_id, key_id, text, strlen(text), 0);
}

static uint32_t intern_wide(uint16_t kind, uint32_t domain_id, uint32_t key_id, const wchar_t *text) {
    if (!text) return 0;
    char buf[WIDE_BUF_BYTES];
    size_t full = 0;
    int bad = 0;
    size_t n = utf8_from_wide(text, buf, sizeof buf, &full, &bad);
    if (bad) count(MSRING_BAD_UNICODE);
    /* a text longer than the buffer is truncated by intern(); hash the kept part plus length */
    return intern(kind, domain_id, key_id, buf, n < full ? n : full, bad ? MSRING_STRF_BAD_UNICODE : 0);
}

/* ---- events -------------------------------------------------------------------------------- */

struct event {
    uint64_t payload;
    uint32_t string_id;
    uint32_t category;
    uint32_t color;
    uint16_t payload_type;
    uint32_t flags;
    const msnvtx_payload_data *ext; /* payload_type EXT: the caller's payload-data entries */
    int32_t ext_count;              /* ... and how many (the attributes' reserved0) */
};

#define ATTR_HAS(a, field) \
    ((size_t)(a)->size >= offsetof(msnvtx_event_attributes, field) + sizeof((a)->field))

static void parse_attributes(const msnvtx_event_attributes *a, uint32_t domain_id, struct event *e) {
    *e = (struct event){0};
    if (!a) return;
    if (ATTR_HAS(a, category)) e->category = a->category;
    if (ATTR_HAS(a, color) && a->color_type != 0) e->color = a->color;
    if (ATTR_HAS(a, payload)) {
        switch (a->payload_type) {
        case MSNVTX_PAYLOAD_NONE: break;
        case MSNVTX_PAYLOAD_U64:
        case MSNVTX_PAYLOAD_I64:
        case MSNVTX_PAYLOAD_DOUBLE: e->payload = a->payload.u64; break;
        case MSNVTX_PAYLOAD_U32: e->payload = a->payload.u32; break;
        case MSNVTX_PAYLOAD_I32: e->payload = (uint64_t)(int64_t)a->payload.i32; break;
        case MSNVTX_PAYLOAD_FLOAT: {
            double d = (double)a->payload.f32;
            memcpy(&e->payload, &d, sizeof d);
            break;
        }
        case MSNVTX_PAYLOAD_EXT:
            /* schema payloads: copied once the record has its slot (ext_record) */
            e->payload_type = MSRING_PAYLOAD_EXT;
            e->ext = (const msnvtx_payload_data *)(uintptr_t)a->payload.u64;
            e->ext_count = a->reserved0;
            break;
        default:
            e->payload_type = MSRING_PAYLOAD_UNKNOWN;
            count(MSRING_UNKNOWN_PAYLOADS);
            break;
        }
        if (a->payload_type >= MSNVTX_PAYLOAD_NONE && a->payload_type <= MSNVTX_PAYLOAD_FLOAT)
            e->payload_type = (uint16_t)a->payload_type;
    }
    if (!ATTR_HAS(a, message)) return;
    switch (a->message_type) {
    case MSNVTX_MESSAGE_NONE: break;
    case MSNVTX_MESSAGE_REGISTERED: {
        uintptr_t handle = (uintptr_t)a->message.registered;
        if (handle > 0 && handle <= UINT32_MAX) {
            e->string_id = (uint32_t)handle;
            e->flags = MSRING_MSG_REGISTERED;
        } else {
            e->flags = MSRING_MSG_REGISTERED | MSRING_MSG_LOST;
        }
        break;
    }
    case MSNVTX_MESSAGE_ASCII:
        e->string_id = intern_ascii(MSRING_STR_STRING, domain_id, 0, a->message.ascii);
        e->flags = MSRING_MSG_ASCII | (e->string_id ? 0 : MSRING_MSG_LOST);
        break;
    case MSNVTX_MESSAGE_UNICODE:
        e->string_id = intern_wide(MSRING_STR_STRING, domain_id, 0, a->message.unicode);
        e->flags = MSRING_MSG_UNICODE | (e->string_id ? 0 : MSRING_MSG_LOST);
        break;
    default:
        e->flags = MSRING_MSG_LOST;
        count(MSRING_UNKNOWN_MESSAGES);
        break;
    }
}

/* ---- payload extension: schemas and blob bytes ------------------------------------------- */

/* Ids of the recorded schemas, for the event path's lock-free "is it known" test: open
 * addressing, written under g_lock (an id is stored, release, only after its schema entry is
 * published in the string region), read without a lock. 0 marks an empty slot. Schemas are keyed
 * by id alone: the nvtx package registers with a NULL domain and uses the ids in other domains. */
#define SCHEMA_TABLE_SLOTS (2u * MSRING_MAX_SCHEMAS)
static _Atomic uint64_t g_schema_ids[SCHEMA_TABLE_SLOTS];
static uint32_t g_schemas;                                    /* recorded (under g_lock) */
static uint64_t g_next_schema_id = MSNVTX_SCHEMA_ID_DYNAMIC_START; /* under g_lock */

static inline uint32_t schema_hash(uint64_t id) {
    id ^= id >> 33;
    id *= 0xff51afd7ed558ccdull;
    id ^= id >> 33;
    return (uint32_t)id & (SCHEMA_TABLE_SLOTS - 1);
}

static int schema_known(uint64_t id) {
    if (id < MSNVTX_SCHEMA_ID_STATIC_START) return 1; /* a predefined entry type: no registration */
    for (uint32_t i = schema_hash(id), n = 0; n < SCHEMA_TABLE_SLOTS; i = (i + 1) & (SCHEMA_TABLE_SLOTS - 1), n++) {
        uint64_t v = atomic_load_explicit(&g_schema_ids[i], memory_order_acquire);
        if (v == id) return 1;
        if (v == 0) return 0;
    }
    return 0;
}

/* Caller holds g_lock. The table holds at most MSRING_MAX_SCHEMAS ids: never full. */
static void schema_remember(uint64_t id) {
    for (uint32_t i = schema_hash(id);; i = (i + 1) & (SCHEMA_TABLE_SLOTS - 1)) {
        uint64_t v = atomic_load_explicit(&g_schema_ids[i], memory_order_relaxed);
        if (v == id) return;
        if (v == 0) {
            atomic_store_explicit(&g_schema_ids[i], id, memory_order_release);
            return;
        }
    }
}

/* glibc before 2.39 copies from ~2 KiB up with `rep movsb` on AMD Zen 3/4, which runs 15-20x
 * slower when the destination lies a few bytes (8-24 measured) past the source modulo 4 KiB
 * (glibc BZ 30994): a 116 KiB step vector took ~42 us instead of ~2.5 us here. Blob positions
 * advance by the payload sizes, so a steady producer lands there every few hundred events. In
 * that window (taken wide: 64 bytes) payload bytes go through a plain vector loop instead. */
#define COPY_LOOP_MIN_BYTES 2048
#define COPY_ALIAS_WINDOW 64

/* memcpy for payload bytes. The loop: 64 bytes per iteration in unaligned 16-byte vector moves
 * (SSE2, the x86-64 baseline); the empty asm keeps GCC from turning it back into memcpy. */
static void copy_bytes(char *dst, const char *src, size_t n) {
    if (n < COPY_LOOP_MIN_BYTES || (((uintptr_t)dst - (uintptr_t)src) & 4095) >= COPY_ALIAS_WINDOW) {
        memcpy(dst, src, n);
        return;
    }
    typedef unsigned char chunk16 __attribute__((vector_size(16), aligned(1), may_alias));
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        chunk16 a = *(const chunk16 *)(src + i), b = *(const chunk16 *)(src + i + 16);
        chunk16 c = *(const chunk16 *)(src + i + 32), d = *(const chunk16 *)(src + i + 48);
        __asm__ volatile("" ::: "memory");
        *(chunk16 *)(dst + i) = a;
        *(chunk16 *)(dst + i + 16) = b;
        *(chunk16 *)(dst + i + 32) = c;
        *(chunk16 *)(dst + i + 48) = d;
    }
    memcpy(dst + i, src + i, n - i); /* the < 64-byte tail: far below rep movsb's sizes */
}

/* Copies n bytes to blob position pos (modulo the region size). */
static void blob_write(uint64_t pos, const void *src, size_t n) {
    uint64_t at = pos & g_blob_mask;
    size_t first = (size_t)(g_blob_mask + 1 - at);
    if (first > n) first = n;
    copy_bytes(g_blob + at, src, first);
    if (n > first) copy_bytes(g_blob, (const char *)src + first, n - first);
}

/* An EXT event with a slot: copies the first payload-data entry's bytes into the blob region and
 * sets the record's payload to their position, or marks the payload lost (payload = its schema id)
 * and counts why. Lock-free; never waits: a full blob region loses the payload, not the event.
 * Detectable bad input (NULL data or bytes, size 0, a count <= 0, schema id 0) is counted; a wild
 * non-NULL pointer from the process itself cannot be detected and is its own bug. */
__attribute__((noinline)) static void ext_record(const struct event *e, uint64_t *payload,
                                                 uint16_t *payload_type) {
    count(MSRING_EXT_PAYLOADS);
    *payload = 0;
    *payload_type = MSRING_PAYLOAD_EXT_LOST;
    const msnvtx_payload_data *d = e->ext;
    if (e->ext_count <= 0 || !d) {
        count(MSRING_EXT_MALFORMED_DROPPED);
        return;
    }
    if (e->ext_count > 1) count_n(MSRING_EXT_ENTRIES_DROPPED, (uint64_t)(e->ext_count - 1));
    uint64_t schema_id = d->schema_id;
    size_t size = d->size;
    const void *src = d->payload;
    *payload = schema_id;
    if (schema_id == 0 || size == 0 || !src) {
        count(MSRING_EXT_MALFORMED_DROPPED);
        return;
    }
    if (!schema_known(schema_id)) {
        count(MSRING_EXT_UNKNOWN_SCHEMA_DROPPED);
        return;
    }
    if (size > g_payload_max) {
        count(MSRING_EXT_OVERSIZE_DROPPED);
        return;
    }
    struct msring_header *h = g_hdr;
    _Atomic uint64_t *head_p = (_Atomic uint64_t *)&h->blob_head;
    _Atomic uint64_t *tail_p = (_Atomic uint64_t *)&h->blob_tail;
    uint64_t need = (sizeof(struct msring_blob_entry) + size + 7) & ~7ull;
    uint64_t head = atomic_load_explicit(head_p, memory_order_relaxed);
    for (;;) {
        /* acquire: the agent's copy of the bytes we are about to reuse happened before */
        uint64_t tail = atomic_load_explicit(tail_p, memory_order_acquire);
        if (head + need - tail > g_blob_mask + 1) {
            count(MSRING_EXT_BLOB_FULL_DROPPED);
            return;
        }
        /* release: an agent that sees this reservation also sees our earlier slot reservation */
        if (atomic_compare_exchange_weak_explicit(head_p, &head, head + need, memory_order_acq_rel,
                                                  memory_order_relaxed))
            break;
    }
    struct msring_blob_entry entry = {schema_id, (uint32_t)size, 0};
    blob_write(head, &entry, sizeof entry);
    blob_write(head + sizeof entry, src, size);
    count(MSRING_EXT_RECORDED);
    *payload = head;
    *payload_type = MSRING_PAYLOAD_EXT;
}

/* On the (rare) drop path: an agent that stopped heartbeating long ago (killed) is detached here,
 * so the producer goes back to the one-load idle path instead of dropping forever. */
#define STALE_CHECK_EVERY 1024u /* drops between two staleness checks (a power of two) */
static uint64_t g_stale_ns = 5000ull * 1000000ull; /* MOESCOPE_NVTX_STALE_MS, default 5 s */
static void consumer_maybe_gone(struct msring_header *h, uint64_t ts) {
    uint64_t beat = atomic_load_explicit((_Atomic uint64_t *)&h->consumer_heartbeat_ns,
                                         memory_order_relaxed);
    if (ts > beat && ts - beat > g_stale_ns)
        atomic_store_explicit((_Atomic uint32_t *)&h->consumer_attached, 0, memory_order_relaxed);
}

/* Reserves one slot (lock-free CAS on head; drops when full) and commits the record. */
static void publish(uint16_t kind, uint32_t domain_id, const struct event *e, uint64_t range_id,
                    int32_t level, uint8_t *gap, uint32_t tid) {
    struct msring_header *h = g_hdr;
    _Atomic uint64_t *head_p = (_Atomic uint64_t *)&h->head;
    _Atomic uint64_t *tail_p = (_Atomic uint64_t *)&h->tail;
    uint64_t capacity = g_mask + 1;
    uint64_t head = atomic_load_explicit(head_p, memory_order_relaxed);
    for (;;) {
        /* acquire: the consumer's reads of the slot we are about to reuse happened before */
        uint64_t tail = atomic_load_explicit(tail_p, memory_order_acquire);
        if (head - tail >= capacity) {
            uint64_t drops = atomic_fetch_add_explicit(counter(MSRING_DROPPED_FULL), 1, memory_order_relaxed);
            if (gap) *gap = 1; /* the next event of this thread and domain says so */
            if ((drops & (STALE_CHECK_EVERY - 1)) == 0) consumer_maybe_gone(h, now_ns());
            return;
        }
        if (atomic_compare_exchange_weak_explicit(head_p, &head, head + 1, memory_order_relaxed,
                                                  memory_order_relaxed))
            break;
    }
    struct msring_record *r = &g_ring[head & g_mask];
    /* take ownership of a slot a few events ahead now: its line was last read by the agent */
    __builtin_prefetch(&g_ring[(head + 8) & g_mask], 1, 3);
    /* stamped after the reservation: a dropped event costs no clock read */
    r->ts_ns = now_ns();
    uint64_t payload = e ? e->payload : 0;
    uint16_t payload_type = e ? e->payload_type : 0;
    /* the blob is reserved after the slot: the agent's blob release relies on that order */
    if (UNLIKELY(payload_type == MSRING_PAYLOAD_EXT)) ext_record(e, &payload, &payload_type);
    r->payload = payload;
    r->range_id = range_id;
    r->tid = tid;
    r->domain_id = domain_id;
    r->string_id = e ? e->string_id : 0;
    r->category = e ? e->category : 0;
    r->color = e ? e->color : 0;
    r->kind = kind;
    r->payload_type = payload_type;
    uint32_t flags = e ? e->flags : 0;
    if (gap && *gap) {
        flags |= MSRING_GAP;
        *gap = 0;
    }
    r->flags = flags;
    r->level = level;
    atomic_store_explicit((_Atomic uint64_t *)&r->seq, head + 1, memory_order_release);
}

static inline int attached(void) {
    struct msring_header *h = g_hdr;
    return h && atomic_load_explicit((_Atomic uint32_t *)&h->consumer_attached, memory_order_relaxed);
}

static inline uint32_t domain_of(msnvtx_domain_handle d) {
    return (uint32_t)(uintptr_t)d;
}

/* Per-thread nesting per domain, kept only while an agent is attached (the idle path stays one
 * load) and restarted at each attach (attach_count is the generation). Every push gets an id
 * (from a per-thread block of the process-wide counter) kept on a per-domain stack, so a pop
 * names the push it closes and the agent pairs them exactly even when the ring dropped events;
 * levels and the gap flag let it tell which relations survived a drop. */
#define DEPTH_SLOTS 16
#define ID_BLOCK 1024
struct nesting {
    uint32_t domain;
    int32_t depth;
    uint8_t gap;
    uint64_t stack[MSRING_MAX_STACK];
};
/* Everything per thread in one object, so a callback pays for one TLS lookup. The default
 * (dynamic) TLS model: a dlopen()ed library may not claim static TLS (initial-exec) beyond glibc's
 * small surplus, and this is 4 KiB. */
struct thread_state {
    uint32_t tid; /* kernel thread id, 0 until first needed */
    uint32_t used;
    uint64_t generation;
    uint64_t id_next, id_end;
    struct nesting slot[DEPTH_SLOTS];
};
static __thread struct thread_state t_state;

/* Not inlined on purpose: callers then compute the TLS address once and keep the pointer. */
__attribute__((noinline)) static struct thread_state *thread_state(void) {
    struct thread_state *t = &t_state;
    if (UNLIKELY(t->tid == 0)) t->tid = (uint32_t)syscall(SYS_gettid);
    return t;
}

static inline struct nesting *nesting_of(struct thread_state *t, uint32_t domain_id) {
    uint64_t generation = atomic_load_explicit((_Atomic uint64_t *)&g_hdr->attach_count, memory_order_relaxed);
    if (UNLIKELY(t->generation != generation)) {
        t->generation = generation;
        t->used = 0;
    }
    for (uint32_t i = 0; i < t->used; i++)
        if (t->slot[i].domain == domain_id) return &t->slot[i];
    if (t->used < DEPTH_SLOTS) {
        struct nesting *n = &t->slot[t->used++];
        n->domain = domain_id;
        n->depth = 0;
        n->gap = 0;
        return n;
    }
    count(MSRING_DEPTH_SHARED);
    return &t->slot[DEPTH_SLOTS - 1];
}

static inline uint64_t new_range_id(void) {
    return atomic_fetch_add_explicit(&g_next_range_id, 1, memory_order_relaxed);
}

static inline uint64_t new_push_id(struct thread_state *t) {
    if (UNLIKELY(t->id_next == t->id_end)) {
        t->id_next = atomic_fetch_add_explicit(&g_next_range_id, ID_BLOCK, memory_order_relaxed);
        t->id_end = t->id_next + ID_BLOCK;
    }
    return t->id_next++;
}

__attribute__((noinline)) static void emit_attr(uint16_t kind, uint32_t domain_id,
                                                const msnvtx_event_attributes *a, uint64_t range_id,
                                                int32_t level, uint8_t *gap, uint32_t tid) {
    struct event e;
    parse_attributes(a, domain_id, &e);
    publish(kind, domain_id, &e, range_id, level, gap, tid);
}

__attribute__((noinline)) static void emit_ascii(uint16_t kind, const char *msg, uint64_t range_id,
                                                 int32_t level, uint8_t *gap, uint32_t tid) {
    struct event e = {0};
    e.string_id = intern_ascii(MSRING_STR_STRING, 0, 0, msg);
    e.flags = msg ? (MSRING_MSG_ASCII | (e.string_id ? 0 : MSRING_MSG_LOST)) : 0;
    publish(kind, 0, &e, range_id, level, gap, tid);
}

__attribute__((noinline)) static void emit_wide(uint16_t kind, const wchar_t *msg, uint64_t range_id,
                                                int32_t level, uint8_t *gap, uint32_t tid) {
    struct event e = {0};
    e.string_id = intern_wide(MSRING_STR_STRING, 0, 0, msg);
    e.flags = msg ? (MSRING_MSG_UNICODE | (e.string_id ? 0 : MSRING_MSG_LOST)) : 0;
    publish(kind, 0, &e, range_id, level, gap, tid);
}

__attribute__((noinline)) static void emit_bare(uint16_t kind, uint32_t domain_id, uint64_t range_id,
                                                int32_t level, uint8_t *gap, uint32_t tid) {
    publish(kind, domain_id, NULL, range_id, level, gap, tid);
}

/* A push's place: its level, its id (0 deeper than the id stack) and its domain's gap flag. */
struct push_place {
    int32_t level;
    uint64_t id;
    uint8_t *gap;
};

static inline struct push_place push_in(struct thread_state *t, uint32_t domain_id) {
    struct nesting *n = nesting_of(t, domain_id);
    struct push_place p = {n->depth++, 0, &n->gap};
    if (p.level < MSRING_MAX_STACK) p.id = n->stack[p.level] = new_push_id(t);
    return p;
}

static int pop_in(uint32_t domain_id) {
    struct thread_state *t = thread_state();
    struct nesting *n = nesting_of(t, domain_id);
    int32_t level = -1;
    uint64_t id = 0;
    if (n->depth > 0) {
        level = --n->depth;
        if (level < MSRING_MAX_STACK) id = n->stack[level];
    }
    emit_bare(MSRING_KIND_POP, domain_id, id, level, &n->gap, t->tid);
    return level;
}

/* ---- CORE callbacks (default domain) ------------------------------------------------------- */

static void cb_mark_ex(const msnvtx_event_attributes *a) {
    if (!attached()) return;
    struct thread_state *t = thread_state();
    struct nesting *n = nesting_of(t, 0);
    emit_attr(MSRING_KIND_MARK, 0, a, 0, n->depth, &n->gap, t->tid);
}
static void cb_mark_a(const char *m) {
    if (!attached()) return;
    struct thread_state *t = thread_state();
    struct nesting *n = nesting_of(t, 0);
    emit_ascii(MSRING_KIND_MARK, m, 0, n->depth, &n->gap, t->tid);
}
static void cb_mark_w(const wchar_t *m) {
    if (!attached()) return;
    struct thread_state *t = thread_state();
    struct nesting *n = nesting_of(t, 0);
    emit_wide(MSRING_KIND_MARK, m, 0, n->depth, &n->gap, t->tid);
}
static msnvtx_range_id cb_range_start_ex(const msnvtx_event_attributes *a) {
    uint64_t id = new_range_id();
    if (attached()) emit_attr(MSRING_KIND_START, 0, a, id, 0, NULL, thread_state()->tid);
    return id;
}
static msnvtx_range_id cb_range_start_a(const char *m) {
    uint64_t id = new_range_id();
    if (attached()) emit_ascii(MSRING_KIND_START, m, id, 0, NULL, thread_state()->tid);
    return id;
}
static msnvtx_range_id cb_range_start_w(const wchar_t *m) {
    uint64_t id = new_range_id();
    if (attached()) emit_wide(MSRING_KIND_START, m, id, 0, NULL, thread_state()->tid);
    return id;
}
static void cb_range_end(msnvtx_range_id id) {
    if (attached()) emit_bare(MSRING_KIND_END, 0, id, 0, NULL, thread_state()->tid);
}
/* Push/pop return the nesting level as the NVTX API says, counted since the agent attached (the
 * library keeps no nesting while idle); idle, they return 0. A pop with nothing open returns -1. */
static int cb_range_push_ex(const msnvtx_event_attributes *a) {
    if (!attached()) return 0;
    struct thread_state *t = thread_state();
    struct push_place p = push_in(t, 0);
    emit_attr(MSRING_KIND_PUSH, 0, a, p.id, p.level, p.gap, t->tid);
    return p.level;
}
static int cb_range_push_a(const char *m) {
    if (!attached()) return 0;
    struct thread_state *t = thread_state();
    struct push_place p = push_in(t, 0);
    emit_ascii(MSRING_KIND_PUSH, m, p.id, p.level, p.gap, t->tid);
    return p.level;
}
static int cb_range_push_w(const wchar_t *m) {
    if (!attached()) return 0;
    struct thread_state *t = thread_state();
    struct push_place p = push_in(t, 0);
    emit_wide(MSRING_KIND_PUSH, m, p.id, p.level, p.gap, t->tid);
    return p.level;
}
static int cb_range_pop(void) {
    if (!attached()) return 0;
    return pop_in(0);
}
static void cb_name_category_a(uint32_t category, const char *name) {
    intern_ascii(MSRING_STR_CATEGORY, 0, category, name);
}
static void cb_name_category_w(uint32_t category, const wchar_t *name) {
    intern_wide(MSRING_STR_CATEGORY, 0, category, name);
}
static void cb_name_os_thread_a(uint32_t tid, const char *name) {
    intern_ascii(MSRING_STR_THREAD, 0, tid, name);
}
static void cb_name_os_thread_w(uint32_t tid, const wchar_t *name) {
    intern_wide(MSRING_STR_THREAD, 0, tid, name);
}

/* ---- CORE2 callbacks (domains) ------------------------------------------------------------- */

static void cb_domain_mark_ex(msnvtx_domain_handle d, const msnvtx_event_attributes *a) {
    if (!attached()) return;
    struct thread_state *t = thread_state();
    struct nesting *n = nesting_of(t, domain_of(d));
    emit_attr(MSRING_KIND_MARK, domain_of(d), a, 0, n->depth, &n->gap, t->tid);
}
static msnvtx_range_id cb_domain_range_start_ex(msnvtx_domain_handle d, const msnvtx_event_attributes *a) {
    uint64_t id = new_range_id();
    if (attached()) emit_attr(MSRING_KIND_START, domain_of(d), a, id, 0, NULL, thread_state()->tid);
    return id;
}
static void cb_domain_range_end(msnvtx_domain_handle d, msnvtx_range_id id) {
    if (attached()) emit_bare(MSRING_KIND_END, domain_of(d), id, 0, NULL, thread_state()->tid);
}
static int cb_domain_range_push_ex(msnvtx_domain_handle d, const msnvtx_event_attributes *a) {
    if (!attached()) return 0;
    struct thread_state *t = thread_state();
    struct push_place p = push_in(t, domain_of(d));
    emit_attr(MSRING_KIND_PUSH, domain_of(d), a, p.id, p.level, p.gap, t->tid);
    return p.level;
}
static int cb_domain_range_pop(msnvtx_domain_handle d) {
    if (!attached()) return 0;
    return pop_in(domain_of(d));
}
static void *cb_domain_resource_create(msnvtx_domain_handle d, void *attributes) {
    (void)d;
    (void)attributes;
    count(MSRING_UNSUPPORTED_CALLS);
    return NULL;
}
static void cb_domain_resource_destroy(void *resource) {
    (void)resource;
    count(MSRING_UNSUPPORTED_CALLS);
}
static void cb_domain_name_category_a(msnvtx_domain_handle d, uint32_t category, const char *name) {
    intern_ascii(MSRING_STR_CATEGORY, domain_of(d), category, name);
}
static void cb_domain_name_category_w(msnvtx_domain_handle d, uint32_t category, const wchar_t *name) {
    intern_wide(MSRING_STR_CATEGORY, domain_of(d), category, name);
}
static msnvtx_string_handle cb_domain_register_string_a(msnvtx_domain_handle d, const char *s) {
    return (msnvtx_string_handle)(uintptr_t)intern_ascii(MSRING_STR_STRING, domain_of(d), 0, s);
}
static msnvtx_string_handle cb_domain_register_string_w(msnvtx_domain_handle d, const wchar_t *s) {
    return (msnvtx_string_handle)(uintptr_t)intern_wide(MSRING_STR_STRING, domain_of(d), 0, s);
}
/* A domain handle is its id (>= 1); the default domain is NULL, id 0. Same name, same handle. */
static msnvtx_domain_handle cb_domain_create_a(const char *name) {
    return (msnvtx_domain_handle)(uintptr_t)intern_ascii(MSRING_STR_DOMAIN, 0, 0, name);
}
static msnvtx_domain_handle cb_domain_create_w(const wchar_t *name) {
    return (msnvtx_domain_handle)(uintptr_t)intern_wide(MSRING_STR_DOMAIN, 0, 0, name);
}
static void cb_domain_destroy(msnvtx_domain_handle d) {
    (void)d; /* ids are never reused, so the agent can still name late events of this domain */
}
static void cb_initialize(const void *reserved) {
    (void)reserved;
}

/* ---- payload-extension callbacks ----------------------------------------------------------- */

static size_t name_bytes(const char *name) {
    return name ? strnlen(name, MSRING_MAX_SCHEMA_NAME_BYTES) : 0;
}

#define SCHEMA_MAX_DECLARED_FIELDS (1u << 16) /* more than this is not a schema: malformed */
#define SCHEMA_MAX_STATIC_BYTES (1ull << 30)

/* nvtxPayloadSchemaRegister. Records the schema (what the agent needs to decode payloads) in the
 * string region once, under g_lock, before its id is returned, so no event can use it unseen.
 * Always returns an id; one whose schema was malformed or dropped is unknown to events using it. */
static uint64_t cb_payload_schema_register(msnvtx_domain_handle d, const msnvtx_schema_attr *a) {
    const uint64_t mandatory = MSNVTX_SCHEMA_FIELD_TYPE | MSNVTX_SCHEMA_FIELD_ENTRIES |
                               MSNVTX_SCHEMA_FIELD_NUM_ENTRIES;
    int malformed = !a || (a->field_mask & mandatory) != mandatory || !a->entries ||
                    a->entry_count == 0 || a->entry_count > SCHEMA_MAX_DECLARED_FIELDS ||
                    a->type < 1 || a->type > 4 ||
                    ((a->field_mask & MSNVTX_SCHEMA_FIELD_STATIC_SIZE) && a->static_size > SCHEMA_MAX_STATIC_BYTES);
    int given_id = !malformed && (a->field_mask & MSNVTX_SCHEMA_FIELD_SCHEMA_ID);
    if (given_id && (a->schema_id < MSNVTX_SCHEMA_ID_STATIC_START ||
                     a->schema_id >= MSNVTX_SCHEMA_ID_DYNAMIC_START))
        malformed = 1; /* an application-chosen id must lie in the static range */
    pthread_mutex_lock(&g_lock);
    uint64_t id = given_id && !malformed ? a->schema_id : g_next_schema_id++;
    if (malformed) {
        count(MSRING_SCHEMAS_MALFORMED_DROPPED);
        goto out;
    }
    if (!g_hdr || g_schemas >= MSRING_MAX_SCHEMAS || a->entry_count > MSRING_MAX_SCHEMA_FIELDS) {
        count(MSRING_SCHEMAS_DROPPED);
        goto out;
    }
    /* header + fields + names: at most 40 + 32 * 40 + 33 * 47 bytes, under MSRING_MAX_STRING_BYTES */
    char buf[sizeof(struct msring_schema) +
             MSRING_MAX_SCHEMA_FIELDS * (sizeof(struct msring_schema_field) + MSRING_MAX_SCHEMA_NAME_BYTES) +
             MSRING_MAX_SCHEMA_NAME_BYTES];
    _Static_assert(sizeof buf <= MSRING_MAX_STRING_BYTES, "a schema entry fits a string entry");
    uint32_t n = (uint32_t)a->entry_count;
    const char *name = (a->field_mask & MSNVTX_SCHEMA_FIELD_NAME) ? a->name : NULL;
    struct msring_schema hdr = {
        .schema_id = id,
        .flags = (a->field_mask & MSNVTX_SCHEMA_FIELD_FLAGS) ? a->flags : 0,
        .static_size = (a->field_mask & MSNVTX_SCHEMA_FIELD_STATIC_SIZE) ? a->static_size : 0,
        .type = (uint32_t)a->type,
        .field_count = n,
        .name_bytes = (uint32_t)name_bytes(name),
    };
    size_t at = sizeof hdr + n * sizeof(struct msring_schema_field);
    if (hdr.name_bytes) memcpy(buf + at, name, hdr.name_bytes);
    at += hdr.name_bytes;
    for (uint32_t i = 0; i < n; i++) {
        const msnvtx_schema_entry *src = &a->entries[i];
        struct msring_schema_field f = {src->flags, src->type, src->array_or_union_detail, src->offset,
                                        (uint32_t)name_bytes(src->name), 0};
        memcpy(buf + sizeof hdr + i * sizeof f, &f, sizeof f);
        if (f.name_bytes) memcpy(buf + at, src->name, f.name_bytes);
        at += f.name_bytes;
    }
    memcpy(buf, &hdr, sizeof hdr);
    if (region_append(MSRING_STR_SCHEMA, 0, g_schemas + 1, domain_of(d), buf, (uint32_t)at) < 0) {
        count(MSRING_SCHEMAS_DROPPED); /* region full (also counted as dropped_string_full) */
        goto out;
    }
    g_schemas++;
    schema_remember(id); /* after the entry is published: events may use it from now on */
    count(MSRING_SCHEMAS_REGISTERED);
out:
    pthread_mutex_unlock(&g_lock);
    return id;
}

/* nvtxPayloadEnumRegister: not recorded (fields of an enum type stay undecoded); counted. The id
 * returned is never a known schema. */
static uint64_t cb_payload_enum_register(msnvtx_domain_handle d, const void *attr) {
    (void)d;
    (void)attr;
    count(MSRING_UNSUPPORTED_CALLS);
    pthread_mutex_lock(&g_lock);
    uint64_t id = g_next_schema_id++;
    pthread_mutex_unlock(&g_lock);
    return id;
}

static uint64_t cb_scope_register(msnvtx_domain_handle d, const void *attr) {
    (void)d;
    (void)attr;
    count(MSRING_UNSUPPORTED_CALLS);
    return 0; /* NVTX_SCOPE_NONE */
}

/* Every domain is enabled: the nvtx package turns a disabled domain into no-op Python stubs. */
static uint8_t cb_domain_is_enabled(msnvtx_domain_handle d) {
    (void)d;
    return 1;
}

/* Tool-provided timestamps: the clock of the records (CLOCK_MONOTONIC). */
static int64_t cb_timestamp_get(void) {
    return (int64_t)now_ns();
}

/* ---- initialisation ------------------------------------------------------------------------ */

static void atfork_prepare(void) {
    pthread_mutex_lock(&g_lock);
}
static void atfork_parent(void) {
    pthread_mutex_unlock(&g_lock);
}
/* A forked child gets its own ring (its pid names it) carrying the parent's strings, whose
 * handles stay valid in the child; the parent's ring is left to the parent. */
static void atfork_child(void) {
    t_state.tid = 0;
    pthread_mutex_unlock(&g_lock);
    struct msring_header *old = g_hdr;
    if (!old) return;
    char *old_strings = g_strings;
    size_t old_bytes = g_map_bytes;
    uint64_t used = old->strings_used, strings = old->strings_count;
    g_hdr = NULL;
    if (ring_create(getpid()) == 0 && used <= g_hdr->strings_bytes) {
        memcpy(g_strings, old_strings, used); /* same offsets: the intern table stays valid */
        g_hdr->strings_count = strings;
        atomic_store_explicit((_Atomic uint64_t *)&g_hdr->strings_used, used, memory_order_release);
    } else {
        /* no ring for the child (or one too small for the parent's strings): the child's events
         * are ignored and the intern table, which points into the old region, is forgotten */
        if (g_hdr) {
            unlink(g_path);
            munmap(g_hdr, g_map_bytes);
        }
        g_hdr = NULL;
        g_ring = NULL;
        g_strings = NULL;
        g_blob = NULL;
        free(g_intern);
        g_intern = NULL;
        g_intern_entries = 0;
    }
    munmap(old, old_bytes);
}

/* `agent start -- CMD` names the process it launched in MOESCOPE_NVTX_ARMED (its trampoline
 * writes its own pid there just before exec). That process records from its first event, before
 * the agent has found its ring, and the agent's first attach keeps what is there
 * (collectors/nvtx.py NvtxRing.attach): without this, whatever it emitted between its first NVTX
 * call and the agent's attach was never recorded. Another process that inherited the variable (a
 * forked worker) is not armed: nobody is waiting for its ring. An agent that never comes is
 * detached by the drop path's stale-heartbeat check, as a killed one is. */
static void arm_if_launched(struct msring_header *h) {
    const char *armed = getenv("MOESCOPE_NVTX_ARMED");
    if (!armed || !*armed) return;
    char *end = NULL;
    errno = 0;
    unsigned long long pid = strtoull(armed, &end, 10);
    if (errno || !end || *end || pid != (unsigned long long)getpid()) return;
    atomic_store_explicit((_Atomic uint64_t *)&h->consumer_heartbeat_ns, now_ns(), memory_order_relaxed);
    uint32_t idle = 0; /* an agent that attached since the file became visible keeps its own state */
    atomic_compare_exchange_strong_explicit((_Atomic uint32_t *)&h->consumer_attached, &idle, 1,
                                            memory_order_release, memory_order_relaxed);
}

static void init_once(void) {
    g_stale_ns = env_u64("MOESCOPE_NVTX_STALE_MS", 5000, 10, 3600000) * 1000000ull;
    int err = ring_create(getpid());
    if (err) {
        fprintf(stderr, "moescope-nvtx: cannot create the NVTX ring (%s); NVTX capture disabled\n",
                strerror(-err));
        return;
    }
    arm_if_launched(g_hdr);
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
    g_init_ok = 1;
}

static int fill_module(const msnvtx_export_table_callbacks *cb, int module,
                       const msnvtx_function_pointer *fns, unsigned int n) {
    msnvtx_function_table table = NULL;
    unsigned int size = 0;
    if (!cb->get_module_function_table(module, &table, &size) || !table) return 0;
    for (unsigned int i = 1; i < n && i < size; i++)
        if (fns[i] && table[i]) *table[i] = fns[i];
    return 1;
}

#define FN(f) ((msnvtx_function_pointer)(f))

/* Called by NVTX once per instrumented shared object (each carries its own NVTX copy). */
EXPORT int InitializeInjectionNvtx2(msnvtx_get_export_table_fn get_export_table) {
    pthread_once(&g_once, init_once);
    if (!g_init_ok || !get_export_table) return 0;
    count(MSRING_INIT_CALLS);
    const msnvtx_export_table_callbacks *cb = get_export_table(MSNVTX_ETID_CALLBACKS);
    if (!cb || cb->struct_size < sizeof *cb || !cb->get_module_function_table) return 0;

    msnvtx_function_pointer core[16] = {0};
    core[MSNVTX_CORE_MarkEx] = FN(cb_mark_ex);
    core[MSNVTX_CORE_MarkA] = FN(cb_mark_a);
    core[MSNVTX_CORE_MarkW] = FN(cb_mark_w);
    core[MSNVTX_CORE_RangeStartEx] = FN(cb_range_start_ex);
    core[MSNVTX_CORE_RangeStartA] = FN(cb_range_start_a);
    core[MSNVTX_CORE_RangeStartW] = FN(cb_range_start_w);
    core[MSNVTX_CORE_RangeEnd] = FN(cb_range_end);
    core[MSNVTX_CORE_RangePushEx] = FN(cb_range_push_ex);
    core[MSNVTX_CORE_RangePushA] = FN(cb_range_push_a);
    core[MSNVTX_CORE_RangePushW] = FN(cb_range_push_w);
    core[MSNVTX_CORE_RangePop] = FN(cb_range_pop);
    core[MSNVTX_CORE_NameCategoryA] = FN(cb_name_category_a);
    core[MSNVTX_CORE_NameCategoryW] = FN(cb_name_category_w);
    core[MSNVTX_CORE_NameOsThreadA] = FN(cb_name_os_thread_a);
    core[MSNVTX_CORE_NameOsThreadW] = FN(cb_name_os_thread_w);

    msnvtx_function_pointer core2[16] = {0};
    core2[MSNVTX_CORE2_DomainMarkEx] = FN(cb_domain_mark_ex);
    core2[MSNVTX_CORE2_DomainRangeStartEx] = FN(cb_domain_range_start_ex);
    core2[MSNVTX_CORE2_DomainRangeEnd] = FN(cb_domain_range_end);
    core2[MSNVTX_CORE2_DomainRangePushEx] = FN(cb_domain_range_push_ex);
    core2[MSNVTX_CORE2_DomainRangePop] = FN(cb_domain_range_pop);
    core2[MSNVTX_CORE2_DomainResourceCreate] = FN(cb_domain_resource_create);
    core2[MSNVTX_CORE2_DomainResourceDestroy] = FN(cb_domain_resource_destroy);
    core2[MSNVTX_CORE2_DomainNameCategoryA] = FN(cb_domain_name_category_a);
    core2[MSNVTX_CORE2_DomainNameCategoryW] = FN(cb_domain_name_category_w);
    core2[MSNVTX_CORE2_DomainRegisterStringA] = FN(cb_domain_register_string_a);
    core2[MSNVTX_CORE2_DomainRegisterStringW] = FN(cb_domain_register_string_w);
    core2[MSNVTX_CORE2_DomainCreateA] = FN(cb_domain_create_a);
    core2[MSNVTX_CORE2_DomainCreateW] = FN(cb_domain_create_w);
    core2[MSNVTX_CORE2_DomainDestroy] = FN(cb_domain_destroy);
    core2[MSNVTX_CORE2_Initialize] = FN(cb_initialize);

    if (!fill_module(cb, MSNVTX_CB_MODULE_CORE, core, 16)) return 0;
    if (!fill_module(cb, MSNVTX_CB_MODULE_CORE2, core2, 16)) return 0;

    const msnvtx_export_table_version_info *vi = get_export_table(MSNVTX_ETID_VERSIONINFO);
    if (vi && vi->struct_size >= sizeof *vi && vi->set_injection_nvtx_version)
        vi->set_injection_nvtx_version(vi->version);
    return 1;
}

/* Called by NVTX once per extension module per instrumented object (the payload module for
 * schemas and nvtxDomainIsEnabled). Fills the slots it implements, within slot_count; slots it
 * leaves empty NVTX turns into no-ops. Modules it does not know are counted and left empty. */
EXPORT int InitializeInjectionNvtxExtension(msnvtx_ext_module_info *info) {
    pthread_once(&g_once, init_once);
    if (!g_init_ok || !info) return 0;
    count(MSRING_EXT_INIT_CALLS);
    if (info->struct_size < offsetof(msnvtx_ext_module_info, get_export_function) ||
        info->module_id != MSNVTX_EXT_MODULE_PAYLOAD) {
        count(MSRING_EXT_UNKNOWN_MODULES);
        return 1;
    }
    if (info->segment_count < 1 || !info->segments) return 1;
    msnvtx_ext_segment *seg = &info->segments[0];
    if (!seg->slots) return 1;
    struct {
        size_t slot;
        intptr_t fn;
    } const fill[] = {
        {MSNVTX_PAYLOAD_SLOT_SchemaRegister, (intptr_t)cb_payload_schema_register},
        {MSNVTX_PAYLOAD_SLOT_EnumRegister, (intptr_t)cb_payload_enum_register},
        {MSNVTX_PAYLOAD_SLOT_DomainIsEnabled, (intptr_t)cb_domain_is_enabled},
        {MSNVTX_PAYLOAD_SLOT_TimestampGet, (intptr_t)cb_timestamp_get},
        {MSNVTX_PAYLOAD_SLOT_ScopeRegister, (intptr_t)cb_scope_register},
    };
    for (size_t i = 0; i < sizeof fill / sizeof fill[0]; i++)
        if (fill[i].slot < seg->slot_count) seg->slots[fill[i].slot] = fill[i].fn;
    return 1;
}

/* Layout facts for the Python mirror's test: sizes and offsets, in a fixed order. */
#define OFF(type, field) ((uint64_t)offsetof(struct type, field))
EXPORT uint32_t moescope_nvtx_layout(uint64_t *out, uint32_t n) {
    const uint64_t v[] = {
        MSRING_MAGIC, MSRING_VERSION, MSRING_HEADER_BYTES, sizeof(struct msring_header),
        sizeof(struct msring_record), sizeof(struct msring_string_entry),
        OFF(msring_header, magic), OFF(msring_header, version), OFF(msring_header, header_bytes),
        OFF(msring_header, record_bytes), OFF(msring_header, capacity),
        OFF(msring_header, ring_offset), OFF(msring_header, strings_offset),
        OFF(msring_header, strings_bytes), OFF(msring_header, pid), OFF(msring_header, created_ns),
        OFF(msring_header, consumer_attached), OFF(msring_header, consumer_pid),
        OFF(msring_header, consumer_heartbeat_ns), OFF(msring_header, attach_count),
        OFF(msring_header, producer_exited), OFF(msring_header, head), OFF(msring_header, tail),
        OFF(msring_header, strings_used), OFF(msring_header, strings_count),
        OFF(msring_header, counters), MSRING_COUNTERS,
        OFF(msring_record, seq), OFF(msring_record, ts_ns), OFF(msring_record, payload),
        OFF(msring_record, range_id), OFF(msring_record, tid), OFF(msring_record, domain_id),
        OFF(msring_record, string_id), OFF(msring_record, category), OFF(msring_record, color),
        OFF(msring_record, kind), OFF(msring_record, payload_type), OFF(msring_record, flags),
        OFF(msring_record, level),
        OFF(msring_string_entry, entry_bytes), OFF(msring_string_entry, kind),
        OFF(msring_string_entry, flags), OFF(msring_string_entry, id),
        OFF(msring_string_entry, domain_id), OFF(msring_string_entry, text_bytes),
        MSRING_MAX_STRING_BYTES,
        OFF(msring_header, blob_offset), OFF(msring_header, blob_bytes),
        OFF(msring_header, payload_max_bytes), OFF(msring_header, blob_head),
        OFF(msring_header, blob_tail), sizeof(struct msring_blob_entry),
        sizeof(struct msring_schema), sizeof(struct msring_schema_field),
        OFF(msring_schema, schema_id), OFF(msring_schema, flags), OFF(msring_schema, static_size),
        OFF(msring_schema, type), OFF(msring_schema, field_count), OFF(msring_schema, name_bytes),
        OFF(msring_schema_field, flags), OFF(msring_schema_field, type),
        OFF(msring_schema_field, array_detail), OFF(msring_schema_field, offset),
        OFF(msring_schema_field, name_bytes), MSRING_MAX_SCHEMAS, MSRING_MAX_SCHEMA_FIELDS,
    };
    uint32_t total = (uint32_t)(sizeof v / sizeof v[0]);
    for (uint32_t i = 0; i < n && i < total; i++) out[i] = v[i];
    return total;
}
