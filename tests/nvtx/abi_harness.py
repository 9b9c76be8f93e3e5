"""Plays NVTX's side of the injection ABI with ctypes, in its own process: loads the library, calls
InitializeInjectionNvtx2 with an export table of our own (twice: two "instrumented objects"), then
calls the CORE (default-domain, ASCII and wide) and CORE2 functions the library installed,
including malformed input. This is exactly what NVTX's generated code does: a call through the
function pointer the tool wrote into its slot.

stdio protocol: "ready" -> (line) -> runs the calls -> writes --log -> "done" -> (line) -> exit.

`build_c_harness` compiles the C harnesses of this folder (ext_harness.c: the payload extension
from C, hostile input, 8 threads), which play NVTX's generated code with no Python in between.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import shutil
import subprocess
import sys
import threading
from ctypes import CFUNCTYPE, POINTER, Structure, c_char_p, c_int, c_size_t, c_uint, c_uint32, c_uint64, c_void_p
from pathlib import Path
from typing import Any

from moescope.collectors.nvtx import injection_library_path

HERE = Path(__file__).resolve().parent


def build_c_harness(name: str, out_dir: Path) -> Path:
    """Compiles tests/nvtx/<name>.c (against the library's own ABI header) into out_dir."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc) to build the C NVTX harness")
    exe = out_dir / name
    subprocess.run([cc, "-std=c11", "-O1", "-Wall", "-Wextra", "-Werror", "-pthread", "-o", str(exe),
                    str(HERE / f"{name}.c"), "-ldl"], check=True)
    return exe


GET_MODULE = CFUNCTYPE(c_int, c_int, POINTER(c_void_p), POINTER(c_uint))
GET_EXPORT_TABLE = CFUNCTYPE(c_void_p, c_uint32)
SET_VERSION = CFUNCTYPE(None, c_uint32)


class Callbacks(Structure):
    _fields_ = [("struct_size", c_size_t), ("get_module_function_table", GET_MODULE)]


class VersionInfo(Structure):
    _fields_ = [("struct_size", c_size_t), ("version", c_uint32), ("reserved0", c_uint32),
                ("set_injection_nvtx_version", SET_VERSION)]


class Payload(ctypes.Union):
    _fields_ = [("u64", c_uint64), ("f64", ctypes.c_double), ("i32", ctypes.c_int32), ("f32", ctypes.c_float)]


class Message(ctypes.Union):
    _fields_ = [("ascii", c_char_p), ("ptr", c_void_p)]


class EventAttributes(Structure):
    _fields_ = [("version", ctypes.c_uint16), ("size", ctypes.c_uint16), ("category", c_uint32),
                ("color_type", ctypes.c_int32), ("color", c_uint32), ("payload_type", ctypes.c_int32),
                ("reserved0", ctypes.c_int32), ("payload", Payload), ("message_type", ctypes.c_int32),
                ("message", Message)]


class FakeNvtx:
    """One instrumented object's function-pointer slots and export tables."""

    def __init__(self) -> None:
        self.slots = {1: (c_void_p * 16)(), 5: (c_void_p * 16)()}
        base = ctypes.sizeof(c_void_p)
        self.tables = {m: (c_void_p * 16)(*[ctypes.addressof(s) + base * i for i in range(16)])
                       for m, s in self.slots.items()}
        self.versions_set: list[int] = []
        self._get_module = GET_MODULE(self._module)
        self._set_version = SET_VERSION(self.versions_set.append)
        self.callbacks = Callbacks(ctypes.sizeof(Callbacks), self._get_module)
        self.version_info = VersionInfo(ctypes.sizeof(VersionInfo), 3, 0, self._set_version)
        self._get_export_table = GET_EXPORT_TABLE(self._export_table)

    def _module(self, module: int, out_table: Any, out_size: Any) -> int:
        if module not in self.tables:
            return 0
        out_table[0] = ctypes.addressof(self.tables[module])
        out_size[0] = 16
        return 1

    def _export_table(self, table_id: int) -> int | None:
        if table_id == 1:
            return ctypes.addressof(self.callbacks)
        if table_id == 3:
            return ctypes.addressof(self.version_info)
        return None

    def init(self, lib: ctypes.CDLL) -> int:
        fn = lib.InitializeInjectionNvtx2
        fn.argtypes = [GET_EXPORT_TABLE]
        fn.restype = c_int
        return int(fn(self._get_export_table))

    def fn(self, module: int, slot: int, restype: Any, *argtypes: Any) -> Any:
        address = self.slots[module][slot]
        assert address, f"module {module} slot {slot} was not filled"
        return CFUNCTYPE(restype, *argtypes)(address)


def wide(code_points: list[int]) -> Any:
    """A NUL-terminated wchar_t (UTF-32 here) string, code points as given (even invalid ones)."""
    return (c_uint32 * (len(code_points) + 1))(*code_points, 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--log", required=True)
    args = parser.parse_args(argv)
    lib = ctypes.CDLL(str(injection_library_path()))
    first, second = FakeNvtx(), FakeNvtx()
    results: dict[str, Any] = {"init": [first.init(lib), second.init(lib)]}
    results["versions_set"] = first.versions_set
    domain_create = first.fn(5, 12, c_void_p, c_char_p)
    domain = domain_create(b"abi")
    results["same_domain_twice"] = domain == second.fn(5, 12, c_void_p, c_char_p)(b"abi")
    print("ready", flush=True)
    sys.stdin.readline()

    core, core2 = first, second  # calls go through both objects' slots: one process, one ring
    mark_a = core.fn(1, 2, None, c_char_p)
    mark_w = core.fn(1, 3, None, c_void_p)
    start_a = core.fn(1, 5, c_uint64, c_char_p)
    end = core.fn(1, 7, None, c_uint64)
    push_a = core.fn(1, 9, c_int, c_char_p)
    push_w = core.fn(1, 10, c_int, c_void_p)
    pop = core.fn(1, 11, c_int)
    name_category_a = core.fn(1, 12, None, c_uint32, c_char_p)
    name_thread_a = core.fn(1, 14, None, c_uint32, c_char_p)
    mark_ex = core2.fn(5, 1, None, c_void_p, POINTER(EventAttributes))
    push_ex = core2.fn(5, 4, c_int, c_void_p, POINTER(EventAttributes))
    dpop = core2.fn(5, 5, c_int, c_void_p)
    resource_create = core2.fn(5, 6, c_void_p, c_void_p, c_void_p)
    register_w = core2.fn(5, 11, c_void_p, c_void_p, c_void_p)
    dname_category_a = core2.fn(5, 8, None, c_void_p, c_uint32, c_char_p)

    results["tid"] = threading.get_native_id()
    name_thread_a(results["tid"], b"abi-main")
    name_category_a(3, b"default-cat")
    dname_category_a(domain, 4, b"abi-cat")
    levels = [push_a(b"core.push")]
    mark_a(b"core.mark")
    mark_a(b"core.mark")  # same text: same string id
    mark_w(ctypes.cast(wide([ord(c) for c in "wide \u00e9\u4e2d\U0001f600"]), c_void_p))
    mark_w(ctypes.cast(wide([0x41, 0xD800, 0x110000, 0x42]), c_void_p))  # surrogate, > U+10FFFF
    levels.append(push_w(ctypes.cast(wide([ord(c) for c in "wide.push"]), c_void_p)))
    levels.append(pop())
    levels.append(pop())
    levels.append(pop())  # nothing open: -1
    rid = start_a(b"core.start")
    end(rid)
    results["range_id"] = rid

    handle = register_w(domain, ctypes.cast(wide([ord(c) for c in "registered.w"]), c_void_p))
    a = EventAttributes(version=3, size=ctypes.sizeof(EventAttributes), category=4, payload_type=5,
                        message_type=3)
    a.payload.i32 = -7
    a.message.ptr = handle
    push_ex(domain, ctypes.byref(a))
    b = EventAttributes(version=3, size=ctypes.sizeof(EventAttributes), payload_type=6, message_type=1)
    b.payload.f32 = 0.25
    b.message.ascii = b"float.mark"
    mark_ex(domain, ctypes.byref(b))
    c = EventAttributes(version=3, size=ctypes.sizeof(EventAttributes), payload_type=0x1234, message_type=99)
    mark_ex(domain, ctypes.byref(c))  # unknown payload and message types
    d = EventAttributes(version=3, size=ctypes.sizeof(EventAttributes), payload_type=-0x2042FFF7, message_type=1)
    d.payload.u64 = 0xDEAD  # an EXT payload with reserved0 = 0 (no entries): never followed
    d.message.ascii = b"ext.mark"
    mark_ex(domain, ctypes.byref(d))
    e = EventAttributes(version=3, size=8, category=9, payload_type=2, message_type=1)
    e.message.ascii = b"beyond.size"  # size says only version/size/category are valid
    mark_ex(domain, ctypes.byref(e))
    mark_ex(domain, None)
    levels.append(dpop(domain))
    levels.append(dpop(domain))  # unbalanced
    results["levels"] = levels
    results["resource"] = resource_create(domain, None)

    with open(args.log, "w") as f:
        json.dump(results, f)
    print("done", flush=True)
    sys.stdin.readline()
    return 0


if __name__ == "__main__":
    sys.exit(main())
