"""setuptools extensions for the HIP kernels in csrc/: built on ROCm torch only, skipped cleanly elsewhere.

setup.py calls ``gpu_extensions()``. The device code (*.hip) is written for AMD gfx90a (wavefront 64) and
has no CUDA port: on CUDA torch the Triton kernels in megatron/kernels/ are the fused path instead.
"""

from __future__ import annotations

import os

# Paths are relative to the repository root, as setuptools requires.
_EXTENSIONS = {
    "megatron.kernels._flash_attn_hip": [
        "csrc/flash_attention/flash_attn.cpp",
        "csrc/flash_attention/flash_attn_fwd.hip",
        "csrc/flash_attention/flash_attn_bwd.hip",
    ],
    "megatron.kernels._fused_norm_hip": [
        "csrc/fused_layernorm/fused_norm.cpp",
        "csrc/fused_layernorm/fused_norm.hip",
    ],
}


def _hipcc_flags() -> list[str]:
    flags = ["-O3", "-std=c++17"]
    # PYTORCH_ROCM_ARCH (e.g. "gfx90a;gfx942") wins; otherwise build for Frontier's MI250X only.
    if not os.environ.get("PYTORCH_ROCM_ARCH"):
        flags.append("--offload-arch=gfx90a")
    return flags


def gpu_extensions() -> list:
    """CUDAExtension objects (hipcc under ROCm torch) for the fused kernels, or [] when not a ROCm build."""
    try:
        import torch
    except ImportError:
        return []
    if not getattr(torch.version, "hip", None):
        if getattr(torch.version, "cuda", None):
            print("csrc/build_gpu.py: CUDA torch: the HIP kernels target gfx90a only; skipping (Triton is used)")
        return []
    from torch.utils.cpp_extension import CUDAExtension

    return [
        CUDAExtension(
            name,
            sources,
            include_dirs=[os.path.abspath(os.path.dirname(sources[0]))],
            extra_compile_args={"cxx": ["-O3"], "nvcc": _hipcc_flags()},
        )
        for name, sources in _EXTENSIONS.items()
    ]
