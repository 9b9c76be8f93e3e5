"""The compact host step's reductions in one native call (step_fill.c, a plain C shared object built
by setup.py and loaded with ctypes).

`StepFill` belongs to one `_CompactFast` (moescope/hf/emit.py): it holds the addresses of its held
vectors and a reused address array, and `fill()` reads each layer's router scores and top-k indices
where torch keeps them (no copy) and writes counts and entropies into the held vectors. It returns
None, having written nothing, for tensors it does not take (a dtype other than float32, float64 or
bfloat16 scores and int64 or int32 indices, non-contiguous memory, layers of other sizes); the
caller then takes the torch path. `available()` is False when the library was not built (a source
checkout without `pip install -e .`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

LIBRARY = Path(__file__).resolve().parent / "libmoescope_hf.so"
KIND_CODES = {"softmax": 0, "probabilities": 1}  # what step_fill.c computes; sigmoid stays on torch
_SCORE_TYPES = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2}
_INDEX_BYTES = {torch.int64: 8, torch.int32: 4}


def _load() -> Any:
    try:
        lib = ctypes.CDLL(str(LIBRARY))
    except OSError:
        return None
    fn = lib.moescope_hf_step_fill
    i64, i32, p = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
    fn.argtypes = [p, i64, i64, i64, i64, i32, i32, i32, p, i64, p]
    fn.restype = i64
    return fn


_FILL = _load()


def available() -> bool:
    return _FILL is not None


def _address(a: np.ndarray) -> int:
    address: int = a.__array_interface__["data"][0]
    return address


class StepFill:
    """One compact step's native fill: `routing` [L, 2E] int32 (tokens halves written) and
    `entropy` [L] float64 (bits), both held vectors that outlive this object's user. Called from
    the model thread only (the hooks run there; its address array is not shared between threads)."""

    __slots__ = ("layers", "experts", "_ptrs", "_ptrs_address", "_routing", "_routing_address", "_row_stride",
                 "_entropy", "_entropy_address")

    def __init__(self, routing: np.ndarray, entropy: np.ndarray) -> None:
        layers, width = routing.shape
        if routing.dtype != np.int32 or entropy.dtype != np.float64 or entropy.shape != (layers,):
            raise ValueError("StepFill: int32 [L, 2E] routing and float64 [L] entropy")
        if not (routing.flags.c_contiguous and entropy.flags.c_contiguous):
            raise ValueError("StepFill: contiguous held vectors")
        self.layers, self.experts = layers, width // 2
        self._ptrs = np.zeros(2 * layers, dtype=np.uint64)  # scores, then indices, per layer
        self._ptrs_address = _address(self._ptrs)
        self._routing, self._entropy = routing, entropy  # kept alive with the addresses below
        self._routing_address, self._row_stride = _address(routing), width
        self._entropy_address = _address(entropy)

    def fill(self, scores: Sequence[torch.Tensor], indices: Sequence[torch.Tensor], kind: int) -> int | None:
        """Per layer (in order) its scores [..., E] and indices [..., k], all layers of one shape ->
        the held vectors; returns the indices outside 0..E-1 (left out of the counts), or None when
        the tensors are not ones the native pass takes (nothing written)."""
        fn = _FILL
        layers = self.layers
        if fn is None or len(scores) != layers or len(indices) != layers:
            return None
        first, first_indices = scores[0], indices[0]
        score_type = _SCORE_TYPES.get(first.dtype)
        index_bytes = _INDEX_BYTES.get(first_indices.dtype)
        if score_type is None or index_bytes is None or first.dim() < 1 or first.shape[-1] != self.experts:
            return None
        score_shape, index_shape = first.shape, first_indices.shape
        score_dtype, index_dtype = first.dtype, first_indices.dtype
        ptrs = self._ptrs
        # host memory of the tensors' own values: CPU, dense, not a lazily negated view
        for i, s in enumerate(scores):
            if (s.dtype != score_dtype or s.shape != score_shape or not s.is_cpu or not s.is_contiguous()
                    or s.is_neg()):
                return None
            ptrs[i] = s.data_ptr()
        for i, x in enumerate(indices, layers):
            if x.dtype != index_dtype or x.shape != index_shape or not x.is_cpu or not x.is_contiguous():
                return None
            ptrs[i] = x.data_ptr()
        score_elements, index_elements = first.numel(), first_indices.numel()
        outside: int = fn(self._ptrs_address, layers, score_elements // self.experts, self.experts, index_elements,
                          kind, score_type, index_bytes, self._routing_address, self._row_stride,
                          self._entropy_address)
        return None if outside < 0 else outside
