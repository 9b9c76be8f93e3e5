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

#endif /* MOESCOPE_NVTX_ABI_H */
