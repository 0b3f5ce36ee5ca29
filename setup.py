"""Install Megatron-Frontier: `pip install -e .[test]`.

Builds the pybind11 data-index helpers always, and the csrc GPU kernels only when torch is a ROCm or CUDA
build (optional: a failed kernel build is a warning; on CPU torch they are skipped cleanly; see
docs/verification.md).
"""

import os

from setuptools import find_packages, setup

try:
    from pybind11.setup_helpers import Pybind11Extension, build_ext
except ImportError as e:  # pragma: no cover - pybind11 is a build requirement in pyproject.toml
    raise SystemExit("pybind11 is needed to build megatron.data._helpers: pip install pybind11") from e


def _ext_modules():
    """(extensions, build_ext command): torch's BuildExtension when GPU kernels are built (it knows nvcc/hipcc)."""
    exts = [
        Pybind11Extension(
            "megatron.data._helpers",
            ["csrc/data/helpers.cpp"],
            cxx_std=17,
            extra_compile_args=["-O3"],
        )
    ]
    build_cmd = build_ext
    if os.path.exists("csrc/build_gpu.py"):
        import importlib.util

        spec = importlib.util.spec_from_file_location("build_gpu", "csrc/build_gpu.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        gpu = mod.gpu_extensions()
        if gpu:
            exts += gpu
            build_cmd = mod.build_ext_class()
    return [e for e in exts if os.path.exists(e.sources[0])], build_cmd


_EXT_MODULES, _BUILD_EXT = _ext_modules()


setup(
    name="megatron-frontier",
    version="0.1.0",
    description="Megatron-DeepSpeed-style GPT pretraining tuned for Frontier (AMD MI250X)",
    packages=find_packages(include=["megatron", "megatron.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.1",
        "deepspeed>=0.14",
        "numpy",
        "transformers",
        "tokenizers",
        "sentencepiece",  # --tokenizer-type GPTSentencePieceTokenizer | Llama2Tokenizer | SentencePieceTokenizer
        "safetensors",
        "tensorboard",
        "pybind11",
        "xxhash>=3.0",
    ],
    # wandb: --wandb-project / --wandb-exp-name (>= 0.31: `wandb leet inspect`, the reader the tests use).
    extras_require={"wandb": ["wandb>=0.31"],
                    "test": ["pytest", "pytest-xdist", "matplotlib", "import-linter", "wandb>=0.31"]},
    ext_modules=_EXT_MODULES,
    cmdclass={"build_ext": _BUILD_EXT},
)
