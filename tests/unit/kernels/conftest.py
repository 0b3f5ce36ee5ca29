"""Run the Triton kernels under TRITON_INTERPRET=1 on CPU, for this directory only.

tests/conftest.py imports triton with the variable set, before any test module is collected, so triton's own
standard library is interpreted in every session whatever else it collects. Our kernels read the variable when
`megatron.kernels.triton_*` is imported: the package-scoped fixture sets it only while these tests run,
(re)imports those modules inside it and drops them afterwards, so no other test sees the variable or
interpreted kernels of ours.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

_TRITON_MODULES = ("megatron.kernels.triton_attention", "megatron.kernels.triton_norms")


def _set_interpret(value: str | None) -> None:
    if value is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = value


def _interpreter_unavailable() -> str | None:
    """Why triton's interpreter cannot run here, or None. Asked when the tests run, not at import (so triton is
    imported here only after tests/conftest.py had its turn)."""
    try:
        import triton.language.standard as std
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return "triton is not installed (pip install triton==3.9.0)"
    if not isinstance(std.cdiv, InterpretedFunction):
        if torch.cuda.is_available():  # tests/conftest.py leaves triton compiled for the device: tests/gpu runs
            return "a GPU is visible and this session runs tests/gpu: run pytest tests/unit/kernels on its own"
        return "triton was imported before tests/conftest.py set TRITON_INTERPRET=1: find that import"
    return None


def _forget_triton_modules() -> None:
    for name in _TRITON_MODULES:
        sys.modules.pop(name, None)


@pytest.fixture(scope="package", autouse=True)
def triton_interpreter():
    why = _interpreter_unavailable()
    if why is not None:
        pytest.skip(why)
    old = os.environ.get("TRITON_INTERPRET")
    _set_interpret("1")
    _forget_triton_modules()
    yield
    _set_interpret(old)
    _forget_triton_modules()
