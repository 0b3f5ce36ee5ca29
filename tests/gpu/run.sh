#!/usr/bin/env bash
# The GPU suite (docs/verification.md): bash tests/gpu/run.sh [pytest args]
#
# Python: .venv/ when its torch is a CUDA or ROCm build, else the machine's own python3 when its torch is
# (e.g. an offline image with CUDA torch preinstalled). For such an image, wheels collected by
# ../shared/gpu/offline_wheels.sh into .whl/ (deepspeed, pydantic, ...) are installed into build/gpu-site
# (on PYTHONPATH) without the network, and this package is installed in place (it builds the data helpers).
# Without a CUDA/ROCm torch or without a visible device it says so; pytest then reports only skips, exit 0.
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"

gpu_torch() {  # $1 is a python whose torch is a CUDA or ROCm build
  "$1" -c 'import sys, torch; sys.exit(0 if (torch.version.cuda or torch.version.hip) else 1)' >/dev/null 2>&1
}

PY=""
if [ -x .venv/bin/python ] && gpu_torch .venv/bin/python; then
  PY=.venv/bin/python
elif command -v python3 >/dev/null 2>&1 && gpu_torch python3; then
  PY=python3
  site="$PWD/build/gpu-site"
  if [ -d "$site" ]; then export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"; fi  # a previous run's wheels
  if ! "$PY" -c 'import deepspeed' >/dev/null 2>&1; then
    if compgen -G ".whl/*.whl" >/dev/null; then
      echo "> installing .whl/*.whl into $site (offline)"
      "$PY" -m pip install -q --upgrade --no-index --no-deps --target "$site" .whl/*.whl
      export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    else
      echo "error: $PY has a GPU torch but no deepspeed; put its wheels in .whl/ (../shared/gpu/offline_wheels.sh)" >&2
      exit 2
    fi
  fi
  if ! "$PY" -c 'import megatron.data._helpers' >/dev/null 2>&1; then
    echo "> installing this package in place (builds megatron.data._helpers)"
    "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . \
      || "$PY" -m pip install -q --no-deps --no-build-isolation --no-index --break-system-packages -e .
  fi
fi

if [ -z "$PY" ]; then
  echo "> no CUDA/ROCm torch here (.venv or python3): the GPU suite cannot run; every test will be skipped"
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
else
  "$PY" -c 'import torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
kind = "ROCm " + torch.version.hip if torch.version.hip else "CUDA " + str(torch.version.cuda)
names = ", ".join(torch.cuda.get_device_name(i) for i in range(n)) or "none visible: every test will be skipped"
print(f"> torch {torch.__version__} ({kind}); {n} GPU(s): {names}")'
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
