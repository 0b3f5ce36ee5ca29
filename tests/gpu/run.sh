#!/usr/bin/env bash
# The GPU suite (docs/verification.md): bash tests/gpu/run.sh [pytest args]
#
# Python: .venv/ when its torch is a CUDA or ROCm build, else the machine's own python3 when its torch is
# (e.g. an offline image with CUDA torch preinstalled). For such an image, wheels collected by
# ../shared/gpu/offline_wheels.sh into .whl/ (deepspeed, pydantic, ...) are installed into build/gpu-site
# (on PYTHONPATH) without the network, and this package is installed in place (it builds the data helpers):
# tests/gpu/gpu_python.sh, shared with tests/gpu/quick.sh.
# Without a CUDA/ROCm torch or without a visible device it says so; pytest then reports only skips, exit 0.
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
# shellcheck source=tests/gpu/gpu_python.sh
source tests/gpu/gpu_python.sh

gpu_select_python
if [ "$GPU_TORCH" = 1 ]; then
  gpu_offline_wheels || exit 2
  gpu_install_package
  "$PY" -c 'import torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
kind = "ROCm " + torch.version.hip if torch.version.hip else "CUDA " + str(torch.version.cuda)
names = ", ".join(torch.cuda.get_device_name(i) for i in range(n)) or "none visible: every test will be skipped"
print(f"> torch {torch.__version__} ({kind}); {n} GPU(s): {names}")'
else
  echo "> no CUDA/ROCm torch here (.venv or python3): the GPU suite cannot run; every test will be skipped"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

set +e
"$PY" -m pytest -q -p no:cacheprovider -rs --durations=20 tests/gpu "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests (exit code 5); check the -k/-m filters" >&2
  exit 1
fi
exit "$rc"
