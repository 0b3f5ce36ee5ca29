"""What quick.sh runs on, as one JSON line: whether a GPU is visible, its name, and the versions for the summary.

Run as its own process by the orchestrator, which itself never imports torch.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import sys

from tests.gpu.quick.common import BENCH


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def probe() -> dict:
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    kind = f"hip {torch.version.hip}" if torch.version.hip else f"cuda {torch.version.cuda}"
    versions = {"python": platform.python_version(), "torch": f"{torch.__version__} ({kind})"}
    for dist in ("triton", "transformers", "deepspeed", "numpy"):
        versions[dist] = _version(dist)
    if n:
        sys.path.insert(0, BENCH)  # bench/ is no package
        import gpu_env  # noqa: E402 - after the path

        versions["driver"] = gpu_env.driver_version()
        names = [torch.cuda.get_device_name(i) for i in range(n)]
        device = names[0] + (f" (x{n}; quick.sh uses the first)" if n > 1 else "")
    else:
        device = f"none visible ({platform.processor() or platform.machine()}, {os.cpu_count()} CPUs)"
    return {"gpu": n > 0, "device": device, "device_short": names[0] if n else "cpu", "versions": versions}


if __name__ == "__main__":
    print(json.dumps(probe()))
