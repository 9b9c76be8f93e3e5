/* The subset of the NVTX v3 tool-injection ABI that moescope implements, declared from NVIDIA's
 * published documentation of nvToolsExt.h / the NVTX callback interface (not copied from it).
 *
 * How NVTX reaches a tool: the instrumented library reads NVTX_INJECTION64_PATH, dlopen()s the tool
 * and calls its exported `InitializeInjectionNvtx2(get_export_table)`. The tool asks that function
 * for export table 1 (callbacks), asks it for each callback module's function table (an array of
 * pointers to the library's function-pointer slots) and writes its own functions into the slots.
 * Every value below is part of that stable, documented ABI; only names are ours. */
#ifndef MOESCOPE_NVTX_ABI_H
#define MOESCOPE_NVTX_ABI_H

#include <stddef.h>
#include <stdint.h>
#include <wchar.h>

/* Export table ids passed to the get-export-table function. */
enum msnvtx_export_table_id {
    MSNVTX_ETID_CALLBACKS = 1,
    MSNVTX_ETID_VERSIONINFO = 3,
};

/* Callback modules (the groups of API functions a tool can replace). */
enum msnvtx_callback_module {
    MSNVTX_CB_MODULE_CORE = 1,  /* nvtxMark*, nvtxRange*, nvtxNameCategory*, nvtxNameOsThread* */
    MSNVTX_CB_MODULE_CORE2 = 5, /* the nvtxDomain* functions */
};

/* Slot indexes in the CORE module's function table. */
enum msnvtx_cbid_core {
    MSNVTX_CORE_MarkEx = 1,
    MSNVTX_CORE_MarkA = 2,
    MSNVTX_CORE_MarkW = 3,
    MSNVTX_CORE_RangeStartEx = 4,
    MSNVTX_CORE_RangeStartA = 5,
    MSNVTX_CORE_RangeStartW = 6,
    MSNVTX_CORE_RangeEnd = 7,
    MSNVTX_CORE_RangePushEx = 8,
    MSNVTX_CORE_RangePushA = 9,
    MSNVTX_CORE_RangePushW = 10,
    MSNVTX_CORE_RangePop = 11,
    MSNVTX_CORE_NameCategoryA = 12,
    MSNVTX_CORE_NameCategoryW = 13,
    MSNVTX_CORE_NameOsThreadA = 14,
    MSNVTX_CORE_NameOsThreadW = 15,
};

/* Slot indexes in the CORE2 (domain) module's function table. */
enum msnvtx_cbid_core2 {
    MSNVTX_CORE2_DomainMarkEx = 1,
    MSNVTX_CORE2_DomainRangeStartEx = 2,
    MSNVTX_CORE2_DomainRangeEnd = 3,
    MSNVTX_CORE2_DomainRangePushEx = 4,
    MSNVTX_CORE2_DomainRangePop = 5,
    MSNVTX_CORE2_DomainResourceCreate = 6,
    MSNVTX_CORE2_DomainResourceDestroy = 7,
    MSNVTX_CORE2_DomainNameCategoryA = 8,
    MSNVTX_CORE2_DomainNameCategoryW = 9,
    MSNVTX_CORE2_DomainRegisterStringA = 10,
    MSNVTX_CORE2_DomainRegisterStringW = 11,
    MSNVTX_CORE2_DomainCreateA = 12,
    MSNVTX_CORE2_DomainCreateW = 13,
    MSNVTX_CORE2_DomainDestroy = 14,
    MSNVTX_CORE2_Initialize = 15,
};

/* nvtxEventAttributes_t::payloadType values. */
enum msnvtx_payload_type {
    MSNVTX_PAYLOAD_NONE = 0,
    MSNVTX_PAYLOAD_U64 = 1,
    MSNVTX_PAYLOAD_I64 = 2,
    MSNVTX_PAYLOAD_DOUBLE = 3,
    MSNVTX_PAYLOAD_U32 = 4,
    MSNVTX_PAYLOAD_I32 = 5,
    MSNVTX_PAYLOAD_FLOAT = 6,
};
/* The payload extension's marker: payload.ullValue points at extension data with a schema. */
#define MSNVTX_PAYLOAD_EXT ((int32_t)0xDFBD0009)

/* nvtxEventAttributes_t::messageType values. */
enum msnvtx_message_type {
    MSNVTX_MESSAGE_NONE = 0,
    MSNVTX_MESSAGE_ASCII = 1,
    MSNVTX_MESSAGE_UNICODE = 2,
    MSNVTX_MESSAGE_REGISTERED = 3,
};

/* nvtxEventAttributes_t, version 2 (48 bytes on LP64). `size` says how much of it the caller filled:
 * fields past `size` must not be read. */
typedef struct msnvtx_event_attributes {
    uint16_t version;
    uint16_t size;
    uint32_t category;
    int32_t color_type;
    uint32_t color;
    int32_t payload_type;
    int32_t reserved0;
    union {
        uint64_t u64;
        int64_t i64;
        double f64;
        uint32_t u32;
        int32_t i32;
        float f32;
    } payload;
    int32_t message_type;
    union {
        const char *ascii;
        const wchar_t *unicode;
        const void *registered;
    } message;
} msnvtx_event_attributes;

/* Opaque handles as the application sees them; a tool chooses their values. */
typedef void *msnvtx_domain_handle;
typedef void *msnvtx_string_handle;
typedef uint64_t msnvtx_range_id;

typedef void (*msnvtx_function_pointer)(void);
/* A module's table: an array of pointers to the library's function-pointer slots. */
typedef msnvtx_function_pointer **msnvtx_function_table;

typedef const void *(*msnvtx_get_export_table_fn)(uint32_t export_table_id);

/* Export table MSNVTX_ETID_CALLBACKS. */
typedef struct msnvtx_export_table_callbacks {
    size_t struct_size;
    int (*get_module_function_table)(int module, msnvtx_function_table *out_table,
                                     unsigned int *out_size);
} msnvtx_export_table_callbacks;

/* Export table MSNVTX_ETID_VERSIONINFO. */
typedef struct msnvtx_export_table_version_info {
    size_t struct_size;
    uint32_t version;
    uint32_t reserved0;
    void (*set_injection_nvtx_version)(uint32_t version);
} msnvtx_export_table_version_info;

/* ---- The payload extension (NVTX "extension modules"), declared from NVIDIA's documentation of
 * nvToolsExtPayload.h and the extension-module mechanism. An instrumented object that uses an
 * extension calls the tool's exported `InitializeInjectionNvtxExtension(module_info)` once per
 * module; the module info lists segments of function slots (plain function addresses, not
 * pointers to slots as in the core ABI) for the tool to fill. Slots left empty become no-ops. */

/* Extension module ids. */
enum msnvtx_ext_module {
    MSNVTX_EXT_MODULE_PAYLOAD = 2,
};

/* Slot indexes in the payload module's (only) segment. */
enum msnvtx_payload_slot {
    MSNVTX_PAYLOAD_SLOT_SchemaRegister = 0,
    MSNVTX_PAYLOAD_SLOT_EnumRegister = 1,
    MSNVTX_PAYLOAD_SLOT_DomainIsEnabled = 7,
    MSNVTX_PAYLOAD_SLOT_TimestampGet = 8,
    MSNVTX_PAYLOAD_SLOT_ScopeRegister = 12,
};

typedef struct msnvtx_ext_segment {
    size_t segment_id;
    size_t slot_count;
    intptr_t *slots; /* slot_count function addresses */
} msnvtx_ext_segment;

/* What NVTX hands InitializeInjectionNvtxExtension (40 bytes on LP64; struct_size says so). */
typedef struct msnvtx_ext_module_info {
    uint16_t nvtx_version;
    uint16_t struct_size;
    uint16_t module_id;
    uint16_t compat_id; /* the module's version (0x0104 for the pinned nvtx 0.2.17) */
    size_t segment_count;
    msnvtx_ext_segment *segments;
    void *get_export_function;
    const void *ext_info; /* payload module: size/alignment of the predefined entry types */
} msnvtx_ext_module_info;

/* nvtxPayloadSchemaAttr_t::fieldMask bits: a field whose bit is clear must not be read. */
enum msnvtx_schema_field {
    MSNVTX_SCHEMA_FIELD_NAME = 1 << 1,
    MSNVTX_SCHEMA_FIELD_TYPE = 1 << 2,
    MSNVTX_SCHEMA_FIELD_FLAGS = 1 << 3,
    MSNVTX_SCHEMA_FIELD_ENTRIES = 1 << 4,
    MSNVTX_SCHEMA_FIELD_NUM_ENTRIES = 1 << 5,
    MSNVTX_SCHEMA_FIELD_STATIC_SIZE = 1 << 6,
    MSNVTX_SCHEMA_FIELD_SCHEMA_ID = 1 << 8,
};

/* Schema ids: below STATIC_START an id is a predefined entry type (decoded as that type, no
 * registration); [STATIC_START, DYNAMIC_START) are chosen by the application; from DYNAMIC_START
 * on they are assigned by the tool. */
#define MSNVTX_SCHEMA_ID_STATIC_START (1ull << 24)
#define MSNVTX_SCHEMA_ID_DYNAMIC_START (1ull << 32)

/* One field of a schema (nvtxPayloadSchemaEntry_t, 64 bytes). `type` is a predefined entry type
 * (NVTX_PAYLOAD_ENTRY_TYPE_*: INT8 11 .. UINT64 18, FLOAT 19, DOUBLE 20, FLOAT32 43, FLOAT64 44,
 * ...) or the id of another registered schema. */
typedef struct msnvtx_schema_entry {
    uint64_t flags; /* bits 4-6 array kind: 1 fixed size, 2 zero-terminated, 3 length-index, ... */
    uint64_t type;
    const char *name;
    const char *description;
    uint64_t array_or_union_detail;
    uint64_t offset;
    const void *semantics;
    const void *reserved;
} msnvtx_schema_entry;

/* nvtxPayloadSchemaAttr_t (80 bytes). */
typedef struct msnvtx_schema_attr {
    uint64_t field_mask;
    const char *name;
    uint64_t type; /* 1 static, 2 dynamic, 3 union, 4 union with internal selector */
    uint64_t flags;
    const msnvtx_schema_entry *entries;
    size_t entry_count;
    size_t static_size;
    size_t pack_align;
    uint64_t schema_id;
    void *extension;
} msnvtx_schema_attr;

/* nvtxPayloadData_t: with payload_type EXT, payload.u64 points at `reserved0` of these. */
typedef struct msnvtx_payload_data {
    uint64_t schema_id;
    size_t size;
    const void *payload;
} msnvtx_payload_data;

#endif /* MOESCOPE_NVTX_ABI_H */
