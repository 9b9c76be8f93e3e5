"""Reference MoE serving runtime: model, batching HTTP server, expert residency and hot-migration,
FP16 fallback, NVTX instrumentation (moe/v1) and a control socket. See README.md in this folder."""
