"""Front door to the compiled index builders (megatron.data._helpers): picks the int32/int64 variant, and
turns a missing build into a one-line DataError that says how to build it."""

from __future__ import annotations

import importlib

import numpy as np

from megatron.errors import DataError

_INT32_MAX = np.iinfo(np.int32).max
HELPERS_VERSION = 2  # csrc/data/helpers.cpp's VERSION
BUILD_HINT = (
    "the C++ data helpers (megatron.data._helpers) are not built: run `pip install -e .` or "
    "`python setup.py build_ext --inplace` in the repository root"
)


def load_helpers():
    """The compiled module, or DataError with the build command."""
    try:
        # import_module, not `from megatron.data import _helpers`: the latter is satisfied by the package
        # attribute once any earlier import succeeded, so a test that hides the module would see nothing.
        module = importlib.import_module("megatron.data._helpers")
    except ImportError as e:
        raise DataError(f"{BUILD_HINT} ({e})") from None
    if getattr(module, "VERSION", 1) != HELPERS_VERSION:
        raise DataError(f"megatron.data._helpers is stale (version {getattr(module, 'VERSION', 1)}, the sources are "
                        f"at {HELPERS_VERSION}): rebuild it with `python setup.py build_ext --inplace`")
    return module


def sample_idx_needs_int64(sizes: np.ndarray, doc_idx: np.ndarray) -> bool:
    """int32 storage is enough while every doc_idx position and every token count fits in int32."""
    total_tokens = int(sizes[doc_idx].astype(np.int64).sum()) if len(doc_idx) else 0
    return total_tokens > _INT32_MAX or len(doc_idx) > _INT32_MAX


def build_sample_idx(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_samples: int) -> np.ndarray:
    """``(num_samples+1, 2)`` start positions of every sample; see csrc/data/helpers.cpp."""
    helpers = load_helpers()
    sizes = np.ascontiguousarray(sizes, dtype=np.int32)
    doc_idx = np.ascontiguousarray(doc_idx, dtype=np.int64)
    if sample_idx_needs_int64(sizes, doc_idx):
        return helpers.build_sample_idx_int64(sizes, doc_idx, seq_length, num_samples)
    return helpers.build_sample_idx_int32(sizes, doc_idx, seq_length, num_samples)


def build_blending_indices(weights: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16[size], dataset_sample_index int64[size]) for normalized ``weights``."""
    return load_helpers().build_blending_indices(np.ascontiguousarray(weights, dtype=np.float64), size)
