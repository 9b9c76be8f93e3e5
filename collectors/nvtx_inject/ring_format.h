/* The moescope NVTX shared-memory file: one per instrumented process, written by the injection
 * library (producer, many threads), read by the agent (one consumer). collectors/nvtx.py mirrors
 * these layouts; tests/nvtx/test_layout.py checks the mirror against moescope_nvtx_layout().
 * docs/nvtx-transport.md explains the protocol. All integers are little-endian host order. */
#ifndef MOESCOPE_NVTX_RING_FORMAT_H
#define MOESCOPE_NVTX_RING_FORMAT_H

#include <stdint.h>

/* "MSNVTX02" read as little-endian bytes. Version 2 added the schema entries, the blob region and
 * counters 10-20; an agent of version 1 refuses the file (its magic differs). */
#define MSRING_MAGIC 0x32305854564e534dULL
#define MSRING_VERSION 2u
#define MSRING_HEADER_BYTES 4096u
#define MSRING_FILE_PREFIX "moescope-nvtx."
#define MSRING_DEFAULT_RECORDS 65536u     /* 4 MiB of 64-byte records */
#define MSRING_DEFAULT_STRING_BYTES (1u << 20)
#define MSRING_MAX_STRING_BYTES 4096u      /* longer texts are truncated (flagged, counted) */
#define MSRING_DEFAULT_BLOB_BYTES (8u << 20) /* payload-extension bytes in flight (MOESCOPE_NVTX_BLOB_BYTES) */
#define MSRING_DEFAULT_PAYLOAD_MAX_BYTES (256u << 10) /* per payload (MOESCOPE_NVTX_PAYLOAD_MAX_BYTES): a
                                                        * DeepSeek-V3 step routing vector is 116 KiB */
#define MSRING_MAX_SCHEMAS 4096u        /* schemas recorded per process; later ones are dropped */
#define MSRING_MAX_SCHEMA_FIELDS 32u    /* fields per recorded schema; larger schemas are dropped */
#define MSRING_MAX_SCHEMA_NAME_BYTES 47u /* schema and field names are cut to this many bytes */

/* Producer-side counters, header.counters[...]. */
enum msring_counter {
    MSRING_DROPPED_FULL = 0,        /* ring full: event dropped, never blocked */
    MSRING_DROPPED_STRING_FULL = 1, /* string region or intern table full: text not recorded */
    MSRING_STRINGS_TRUNCATED = 2,   /* text longer than MSRING_MAX_STRING_BYTES */
    MSRING_EXT_PAYLOADS = 3,        /* payload extension (schema) payloads: recorded as type EXT */
    MSRING_UNKNOWN_PAYLOADS = 4,    /* payload type not in the ABI */
    MSRING_UNKNOWN_MESSAGES = 5,    /* message type not in the ABI */
    MSRING_UNSUPPORTED_CALLS = 6,   /* resource naming and other calls moescope ignores */
    MSRING_INIT_CALLS = 7,          /* InitializeInjectionNvtx2 calls (one per instrumented object) */
    MSRING_BAD_UNICODE = 8,         /* wide strings with invalid code points (replaced by U+FFFD) */
    MSRING_DEPTH_SHARED = 9,        /* events of a thread using more than 16 domains (nesting shared) */
    /* payload extension: every EXT event that got a slot is counted in MSRING_EXT_PAYLOADS and in
     * exactly one of RECORDED or the four *_DROPPED reasons */
    MSRING_EXT_OVERSIZE_DROPPED = 10,      /* payload larger than MOESCOPE_NVTX_PAYLOAD_MAX_BYTES */
    MSRING_EXT_BLOB_FULL_DROPPED = 11,     /* blob region full (the agent is behind): never waited */
    MSRING_EXT_UNKNOWN_SCHEMA_DROPPED = 12, /* schema id never recorded (unregistered, or dropped) */
    MSRING_EXT_MALFORMED_DROPPED = 13,     /* NULL data or bytes, size 0, count <= 0, schema id 0 */
    MSRING_EXT_ENTRIES_DROPPED = 14,       /* payload-data entries beyond the first (reserved0 > 1) */
    MSRING_SCHEMAS_REGISTERED = 15,        /* schemas recorded in the string region */
    MSRING_SCHEMAS_DROPPED = 16,           /* over MSRING_MAX_SCHEMAS / _FIELDS, or region full */
    MSRING_SCHEMAS_MALFORMED_DROPPED = 17, /* NULL attr/entries, missing mandatory fields, absurd sizes */
    MSRING_EXT_RECORDED = 18,              /* payloads copied into the blob region */
    MSRING_EXT_INIT_CALLS = 19,            /* InitializeInjectionNvtxExtension calls */
    MSRING_EXT_UNKNOWN_MODULES = 20,       /* extension modules other than the payload one (left empty) */
    MSRING_COUNTERS = 32,
};

/* Record kinds. */
enum msring_kind {
    MSRING_KIND_PUSH = 1,
    MSRING_KIND_POP = 2,
    MSRING_KIND_START = 3,
    MSRING_KIND_END = 4,
    MSRING_KIND_MARK = 5,
};

/* Record payload_type: the ABI's values 0..6 (32-bit values widened to 64 bits, float to double),
 * plus these two. */
enum msring_payload {
    MSRING_PAYLOAD_EXT = 7,
    MSRING_PAYLOAD_UNKNOWN = 8,
    MSRING_PAYLOAD_EXT_LOST = 9, /* an EXT payload whose bytes were not recorded; payload = its
                                    schema id (0 when the data could not be read); the reason is
                                    a counter */
};
/* For MSRING_PAYLOAD_EXT records, payload is the blob position (bytes ever reserved before it) of
 * a struct msring_blob_entry followed by its bytes; positions wrap modulo blob_bytes. */

/* Record flags: bits 0-1 say where the message came from; bit 2: its text was not recorded;
 * bit 3: push/pop/mark events of this thread in this domain were dropped just before this one. */
enum msring_flags {
    MSRING_MSG_NONE = 0,
    MSRING_MSG_REGISTERED = 1,
    MSRING_MSG_ASCII = 2,
    MSRING_MSG_UNICODE = 3,
    MSRING_MSG_LOST = 4,
    MSRING_GAP = 8,
};
#define MSRING_MAX_STACK 32 /* push ids are kept this deep per thread and domain */

/* String-region entry kinds. */
enum msring_string_kind {
    MSRING_STR_STRING = 1,   /* id = string id (registered string or interned message) */
    MSRING_STR_DOMAIN = 2,   /* id = domain id (0 is the default domain, never written) */
    MSRING_STR_CATEGORY = 3, /* id = category value within domain_id */
    MSRING_STR_THREAD = 4,   /* id = kernel thread id named by nvtxNameOsThread */
    MSRING_STR_SCHEMA = 5,   /* id = schema slot (1..); text = struct msring_schema and its fields */
};
enum msring_string_flags {
    MSRING_STRF_TRUNCATED = 1,
    MSRING_STRF_BAD_UNICODE = 2,
};

struct msring_header {
    /* line 0: identity, immutable once the file is visible (it is renamed into place) */
    uint64_t magic;
    uint32_t version;
    uint32_t header_bytes;
    uint32_t record_bytes;
    uint32_t capacity; /* records, a power of two */
    uint64_t ring_offset;
    uint64_t strings_offset;
    uint64_t strings_bytes;
    uint32_t pid;
    uint32_t reserved0;
    uint64_t created_ns; /* CLOCK_MONOTONIC */
    /* line 1: written by the consumer; producers load consumer_attached (relaxed) per event */
    _Alignas(64) uint32_t consumer_attached;
    uint32_t consumer_pid;
    uint64_t consumer_heartbeat_ns;
    uint64_t attach_count;
    uint32_t producer_exited; /* set by the producer's exit handler */
    uint32_t reserved1;
    /* line 2: producers' reservation counter (records ever reserved) */
    _Alignas(64) uint64_t head;
    /* line 3: consumer's position (records consumed or skipped) */
    _Alignas(64) uint64_t tail;
    /* line 4: string region fill, published after each entry is complete */
    _Alignas(64) uint64_t strings_used;
    uint64_t strings_count;
    /* lines 5-8: counters */
    _Alignas(64) uint64_t counters[MSRING_COUNTERS];
    /* line 9: the blob region (payload-extension bytes), immutable once the file is visible */
    _Alignas(64) uint64_t blob_offset;
    uint64_t blob_bytes;        /* a power of two */
    uint64_t payload_max_bytes; /* per payload, without its entry header */
    /* line 10: producers' blob reservation counter (bytes ever reserved, CAS) */
    _Alignas(64) uint64_t blob_head;
    /* line 11: the consumer's blob position: bytes below it may be reused */
    _Alignas(64) uint64_t blob_tail;
};

/* One event: exactly one cache line. seq = position + 1, stored last (release) to commit. */
struct msring_record {
    uint64_t seq;
    uint64_t ts_ns; /* CLOCK_MONOTONIC */
    uint64_t payload;
    uint64_t range_id; /* start/end: the range id; push: this push's id (unique in the process, 0
                          deeper than MSRING_MAX_STACK); pop: the id of the push it closes (0: unknown) */
    uint32_t tid;      /* kernel thread id (gettid) */
    uint32_t domain_id;
    uint32_t string_id; /* 0: no message */
    uint32_t category;
    uint32_t color;
    uint16_t kind;
    uint16_t payload_type;
    uint32_t flags;
    /* nesting on this thread in this domain, counted by the library since the agent attached:
     * push: level of the range it opens (0 = outermost); pop: level of the range it closes, or -1
     * when nothing pushed since the attach is open; mark: ranges open; start/end: 0 */
    int32_t level;
};

/* One string-region entry, 8-byte aligned; text_bytes of UTF-8-ish text then a NUL, padded. */
struct msring_string_entry {
    uint32_t entry_bytes; /* whole entry incl. padding */
    uint16_t kind;
    uint16_t flags;
    uint32_t id;
    uint32_t domain_id;
    uint32_t text_bytes;
    uint32_t reserved;
};

/* Blob entry header (8-byte aligned; entries are reserved in multiples of 8 bytes). The size bytes
 * follow; an entry may wrap around the end of the region. */
struct msring_blob_entry {
    uint64_t schema_id;
    uint32_t size;
    uint32_t reserved;
};

/* The text of a MSRING_STR_SCHEMA string-region entry: this, field_count fields, then the schema
 * name (name_bytes) and each field's name (its name_bytes), back to back, not NUL-terminated. */
struct msring_schema {
    uint64_t schema_id;
    uint64_t flags;
    uint64_t static_size; /* 0 when not given */
    uint32_t type;        /* 1 static, 2 dynamic, 3/4 unions */
    uint32_t field_count;
    uint32_t name_bytes;
    uint32_t reserved;
};
struct msring_schema_field {
    uint64_t flags;
    uint64_t type; /* predefined entry type, or the id of another schema */
    uint64_t array_detail;
    uint64_t offset;
    uint32_t name_bytes;
    uint32_t reserved;
};

#endif /* MOESCOPE_NVTX_RING_FORMAT_H */
