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


def test_cuda_torch_builds_the_hip_sources_through_cu_wrappers(monkeypatch, tmp_path):
    """On CUDA torch each .hip file reaches nvcc as a one-line .cu wrapper (BuildExtension sends only .cu there)."""
    from torch.utils import cpp_extension

    mod = _build_gpu()
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", "/usr/local/cuda")
    monkeypatch.chdir(tmp_path)  # the wrappers go to ./build/csrc_cuda, as under setup.py at the repo root
    exts = mod.gpu_extensions()
    assert sorted(e.name for e in exts) == sorted(mod._EXTENSIONS)
    for ext in exts:
        assert ext.optional
        hip = [s for s in mod._EXTENSIONS[ext.name] if s.endswith(".hip")]
        cu = [s for s in ext.sources if s.endswith(".cu")]
        assert len(cu) == len(hip) and not any(s.endswith(".hip") for s in ext.sources)
        for wrapper, src in zip(cu, hip, strict=True):
            with open(wrapper) as f:
                assert f'#include "{os.path.basename(src)}"' in f.read()
            assert os.path.dirname(os.path.join(REPO, src)) in ext.include_dirs  # where the include resolves


def test_cuda_torch_without_toolkit_builds_nothing(monkeypatch):
    from torch.utils import cpp_extension

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    assert _build_gpu().gpu_extensions() == []


def test_failed_gpu_build_is_a_warning(monkeypatch, capsys):
    """A compiler failure in a GPU extension must not fail `pip install`; other extensions still fail loudly."""
    from setuptools import Distribution, Extension
    from torch.utils import cpp_extension

    def boom(self, ext):
        raise RuntimeError("Error compiling objects for extension")

    monkeypatch.setattr(cpp_extension.BuildExtension, "build_extension", boom)
    cmd = _build_gpu().build_ext_class()(Distribution())
    assert cmd.build_extension(Extension("megatron.kernels._flash_attn_hip", ["x.cu"])) is None
    assert "WARNING: building megatron.kernels._flash_attn_hip failed" in capsys.readouterr().out
    try:
        cmd.build_extension(Extension("megatron.data._helpers", ["x.cpp"]))
    except RuntimeError:
        pass
    else:
        raise AssertionError("a non-GPU extension's build failure must propagate")
