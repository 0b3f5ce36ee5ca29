"""Shared pytest settings: single-threaded test processes, and Triton's CPU interpreter set up before any test
module can import triton, so the kernel tests (tests/unit/kernels) run whatever else is collected with them."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _collects_gpu_suite(config) -> bool:
    """Is tests/gpu among what this session collects (a path argument above, at or below it)?"""
    gpu = (config.rootpath / "tests" / "gpu").resolve()
    for arg in config.args:
        path = (Path(config.invocation_params.dir) / arg.split("::")[0]).resolve()
        if path == gpu or gpu in path.parents or path in gpu.parents:
            return True
    return False


def _gpu_visible() -> bool:
    import torch  # only asked when tests/gpu is collected: a CPU-only session of unit tests need not pay for it

    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def _import_triton_interpreted() -> None:
    """Triton reads TRITON_INTERPRET when a function is decorated with @triton.jit, its own standard library's at
    `import triton`: imported here with the variable set, its library runs under the interpreter for the whole
    process. The variable itself is restored at once, so that no other test (nor a subprocess) sees it: kernel
    selection outside tests/unit/kernels stays what a user gets. tests/unit/kernels/conftest.py sets it again only
    while its tests run. Without triton, the kernel tests say so."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton  # noqa: F401
    except ImportError:
        pass
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


def pytest_configure(config):
    config.addinivalue_line("markers", "timeout(seconds): upper bound for a multi-process test")
    # Before collection imports any test module. The GPU suite on a device compiles Triton for it instead; the
    # kernel package then skips, naming why (tests/unit/kernels/conftest.py).
    if not (_collects_gpu_suite(config) and _gpu_visible()):
        _import_triton_interpreted()
