"""csrc/build_gpu.py: no extension on CPU torch, and every source it lists exists."""

from __future__ import annotations

import importlib.util
import os

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _build_gpu():
    spec = importlib.util.spec_from_file_location("build_gpu", os.path.join(REPO, "csrc", "build_gpu.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cpu_torch_builds_nothing():
    if torch.version.hip or torch.version.cuda:
        return
    assert _build_gpu().gpu_extensions() == []


def test_listed_sources_exist_and_device_code_has_no_torch_headers():
    for name, sources in _build_gpu()._EXTENSIONS.items():
        assert name.startswith("megatron.kernels._")
        for src in sources:
            path = os.path.join(REPO, src)
            assert os.path.isfile(path), src
            if src.endswith(".hip"):
                with open(path) as f:
                    text = f.read()
                assert "torch/" not in text and "ATen/" not in text, f"{src} must stay free of torch headers"
