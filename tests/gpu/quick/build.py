"""quick.sh step ``build``: setup.py's extensions (the csrc kernels through csrc/build_gpu.py, and the data helpers)
built out of tree into build/quick/ext, in the background while ``train`` runs; ``install`` copies them into the
package afterwards, so every run of ``train`` sees one kernel set from start to end.

On CPU torch setup.py builds no GPU extension: the twin is skipped with the CPU checks that cover it.
"""

from __future__ import annotations

import glob
import os
import shutil
import sys

from tests.gpu.quick.common import REPO, StepArgs, env_with, run_logged, step_args
from tests.gpu.quick.summary import first_error_line

LIB = os.path.join(REPO, "build", "quick", "ext", "lib")
TMP = os.path.join(REPO, "build", "quick", "ext", "tmp")
CSRC = {"attention": "megatron/kernels/_flash_attn_hip", "norm": "megatron/kernels/_fused_norm_hip"}
CPU_SKIP = ("CPU torch: setup.py builds no GPU extension here. `bash csrc/check_hip_compile.sh` (run by "
            "tests/run.sh) compiles the same .hip files with hipcc for gfx90a and nvcc for sm_80/sm_90 through "
            "csrc/common/wave64.h; the kernels twin runs them on the CPU emulator")


def built(lib: str = LIB) -> dict[str, str]:
    """op -> the extension file built for it under ``lib`` (ops whose build failed are absent)."""
    out = {}
    for op, stem in CSRC.items():
        hits = glob.glob(os.path.join(lib, stem + "*.so"))
        if hits:
            out[op] = hits[0]
    return out


def install(lib: str = LIB, csrc: bool = True) -> list[str]:
    """Copy the extensions built under ``lib`` to their places in the package (what an in-place build does), the
    csrc kernels only with ``csrc``; the package paths copied."""
    done = []
    for src in glob.glob(os.path.join(lib, "megatron", "**", "*.so"), recursive=True):
        rel = os.path.relpath(src, lib)
        if not csrc and any(rel.startswith(stem) for stem in CSRC.values()):
            continue
        dst = os.path.join(REPO, rel)
        shutil.copy2(src, dst)
        done.append(os.path.relpath(dst, REPO))
    return sorted(done)


def uninstall() -> list[str]:
    """Remove the csrc extensions from the package (after a failed build); the package paths removed."""
    gone = []
    for stem in CSRC.values():
        for path in glob.glob(os.path.join(REPO, stem + "*.so")):
            os.remove(path)
            gone.append(os.path.relpath(path, REPO))
    return sorted(gone)


def main(a: StepArgs) -> None:
    if not a.gpu:
        a.result("skipped", CPU_SKIP)
        return
    # torch only here: the orchestrator imports this module for install() and must stay free of torch.
    import torch
    from torch.utils import cpp_extension

    toolkit = cpp_extension.ROCM_HOME if torch.version.hip else cpp_extension.CUDA_HOME
    env = env_with(MAX_JOBS=os.environ.get("MAX_JOBS", "8"))  # half the cores: train runs alongside
    cmd = [sys.executable, "setup.py", "build_ext", "--build-lib", LIB, "--build-temp", TMP]
    rc, text = run_logged(cmd, a.log("setup"), a.left(), env)
    have = built()
    facts = dict(toolkit=toolkit, ninja=shutil.which("ninja") is not None, built=sorted(have))
    if rc != 0:
        a.result("failed", f"setup.py build_ext exit {rc}: {first_error_line(text)}", **facts)
    elif len(have) == len(CSRC):
        a.result("passed", f"csrc {' + '.join(sorted(have))} built with {toolkit} "
                 f"({'ninja' if facts['ninja'] else 'no ninja: one file at a time'})", **facts)
    elif toolkit is None:
        a.result("skipped", "no CUDA/ROCm toolkit (nvcc/hipcc) on this machine: the csrc kernels cannot be built; "
                 "their tests skip, Triton and torch kernels remain", **facts)
    else:
        warned = [ln for ln in text.splitlines() if "WARNING" in ln and "build_gpu" in ln]
        a.result("failed", (warned[0] if warned else first_error_line(text)).strip(), **facts)


if __name__ == "__main__":
    main(step_args())
