/* The NVTX client's side of loading a tool, for this project's own C programs that drive the
 * injection library without NVIDIA's headers (the harnesses in tests/nvtx, the C producers in
 * benchmarks/): the core and core2 slot tables a tool fills through the callbacks export table,
 * and the load that hands them over. Written from the documented ABI (nvtx_abi.h). Everything is
 * static: one copy per program, which includes this once. */
#ifndef MOESCOPE_NVTX_CLIENT_H
#define MOESCOPE_NVTX_CLIENT_H

#include <dlfcn.h>
#include <stdint.h>

#include "nvtx_abi.h"

#define MSCLIENT_MODULE_SLOTS 16

/* NVTX's globals: the tool writes its functions here; read on every call, so a tool attached
 * later is seen */
static msnvtx_function_pointer core_slots[MSCLIENT_MODULE_SLOTS], core2_slots[MSCLIENT_MODULE_SLOTS];
static msnvtx_function_pointer *core_table[MSCLIENT_MODULE_SLOTS], *core2_table[MSCLIENT_MODULE_SLOTS];

static int msclient_get_module(int module, msnvtx_function_table *out, unsigned int *size) {
    if (module == MSNVTX_CB_MODULE_CORE) *out = core_table;
    else if (module == MSNVTX_CB_MODULE_CORE2) *out = core2_table;
    else return 0;
    *size = MSCLIENT_MODULE_SLOTS;
    return 1;
}

static const msnvtx_export_table_callbacks msclient_callbacks = {sizeof msclient_callbacks, msclient_get_module};

static const void *msclient_export_table(uint32_t id) {
    return id == MSNVTX_ETID_CALLBACKS ? (const void *)&msclient_callbacks : NULL;
}

/* dlopen the tool at `path` and hand it the tables (its InitializeInjectionNvtx2). Returns 0, 1
 * (dlopen failed: dlerror() says why) or 2 (no initializer, or it refused); *lib is the handle
 * (for the extension's initializer) when dlopen succeeded. */
static int msclient_load(const char *path, void **lib) {
    for (int i = 0; i < MSCLIENT_MODULE_SLOTS; i++) {
        core_table[i] = &core_slots[i];
        core2_table[i] = &core2_slots[i];
    }
    *lib = dlopen(path, RTLD_NOW);
    if (!*lib) return 1;
    int (*init)(msnvtx_get_export_table_fn) =
        (int (*)(msnvtx_get_export_table_fn))dlsym(*lib, "InitializeInjectionNvtx2");
    if (!init || !init(msclient_export_table)) return 2;
    return 0;
}

#endif
