"""The GPU suite (`bash tests/gpu/run.sh`): every test here needs an accelerator.

On a machine without one, every test in this folder is skipped at collection, so `pytest tests/gpu`
reports only skips and exits 0, and the CPU suite (`bash tests/run.sh`) spends no time here.
"""

from __future__ import annotations

import os

import pytest


def accelerator_count() -> int:
    """Number of usable accelerator devices (CUDA or ROCm torch); 0 on CPU torch."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(os.path.abspath(__file__))  # this folder, whatever pytest took as its rootdir
    n = accelerator_count()
    skip_all = pytest.mark.skip(reason="needs a GPU (CUDA or ROCm torch with a visible device)")
    for item in items:
        if not str(item.fspath).startswith(here):
            continue
        if n == 0:
            item.add_marker(skip_all)
            continue
        need = item.get_closest_marker("gpus")
        if need is not None and n < need.args[0]:
            item.add_marker(pytest.mark.skip(reason=f"needs {need.args[0]} GPUs, {n} visible"))
