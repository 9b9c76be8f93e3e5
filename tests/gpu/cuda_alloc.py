"""A CUDA process for the GPU check: allocates device memory through the CUDA driver API (ctypes on
libcuda.so.1, no toolkit or torch needed), prints `allocated N bytes on device D`, and holds it until
its stdin closes or it is killed. On failure it prints one `error: ...` line and exits 1.

    python tests/gpu/cuda_alloc.py --bytes 1073741824 [--device 0]
"""

from __future__ import annotations

import argparse
import ctypes
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--device", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        print(f"error: libcuda.so.1 not loadable ({exc})", flush=True)
        return 1

    def check(result: int, what: str) -> None:
        # CUresult: 0 is CUDA_SUCCESS.
        if result != 0:
            raise RuntimeError(f"{what} returned CUresult {result}")

    device = ctypes.c_int()
    context = ctypes.c_void_p()
    pointer = ctypes.c_uint64()  # CUdeviceptr is 64-bit on 64-bit hosts
    try:
        check(cuda.cuInit(0), "cuInit")
        check(cuda.cuDeviceGet(ctypes.byref(device), args.device), "cuDeviceGet")
        check(cuda.cuCtxCreate_v2(ctypes.byref(context), 0, device), "cuCtxCreate_v2")
        check(cuda.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(args.bytes)), "cuMemAlloc_v2")
        # Touch it so the allocation is backed, not only reserved.
        check(cuda.cuMemsetD8_v2(pointer, ctypes.c_ubyte(1), ctypes.c_size_t(args.bytes)), "cuMemsetD8_v2")
        check(cuda.cuCtxSynchronize(), "cuCtxSynchronize")
    except (RuntimeError, AttributeError) as exc:
        print(f"error: {exc}", flush=True)
        return 1
    print(f"allocated {args.bytes} bytes on device {args.device}", flush=True)
    sys.stdin.read()  # hold until stdin closes or a signal ends us
    cuda.cuMemFree_v2(pointer)
    cuda.cuCtxDestroy_v2(context)
    return 0


if __name__ == "__main__":
    sys.exit(main())
