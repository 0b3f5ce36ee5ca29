"""Run the Triton kernels under TRITON_INTERPRET=1 on CPU, for this directory only.

Triton reads TRITON_INTERPRET when a function is decorated with @triton.jit: its own standard library at
`import triton`, our kernels at `import megatron.kernels.triton_*`. So this conftest imports triton with the
variable set and then restores the environment at once; the package-scoped fixture sets it again only
while these tests run, (re)imports our kernel modules inside it and drops them afterwards, so no other
test directory sees the variable or interpreted kernels of ours.
"""

from __future__ import annotations

import os
import sys

import pytest

_TRITON_MODULES = ("megatron.kernels.triton_attention", "megatron.kernels.triton_norms")


def _set_interpret(value: str | None) -> None:
    if value is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = value


_OLD = os.environ.get("TRITON_INTERPRET")
if "triton" in sys.modules and _OLD != "1":
    SKIP_REASON: str | None = "triton was imported before TRITON_INTERPRET=1 was set: run tests/unit/kernels alone"
else:
    SKIP_REASON = None
    _set_interpret("1")
    try:
        import triton  # noqa: F401
    except ImportError:
        SKIP_REASON = "triton is not installed (pip install triton==3.9.0)"
    finally:
        _set_interpret(_OLD)


def _forget_triton_modules() -> None:
    for name in _TRITON_MODULES:
        sys.modules.pop(name, None)


@pytest.fixture(scope="package", autouse=True)
def triton_interpreter():
    if SKIP_REASON is not None:
        pytest.skip(SKIP_REASON)
    _set_interpret("1")
    _forget_triton_modules()
    yield
    _set_interpret(_OLD)
    _forget_triton_modules()
