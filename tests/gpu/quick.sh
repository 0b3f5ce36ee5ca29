#!/usr/bin/env bash
# The first minutes on a lent GPU (issue 35): one script that shows the most, most valuable first.
#
#   bash tests/gpu/quick.sh [STEP...]        steps: build train kernels speed variants speed2 kbench suite
#
# Each step runs under its own coreutils `timeout`, lowered to what is left of the run's budget (QUICK_BUDGET_S,
# default 330 s on a GPU, counted from this script's start, install included: the whole first run fits 6 minutes
# on one H100). Every log, each step's JSON and summary.txt go to $OUT (default build/quick/out). summary.txt
# holds the date, device, versions, then one line per step: passed | failed with its first error line |
# skipped with why, with tokens/s, MFU and memory where the step measures them. Named steps run alone (in the
# order above); with none, all run, the extra ones (variants speed2 kbench suite) only while the budget lasts.
# On a GPU, naming a step that uses the csrc kernels rebuilds them too (a no-op when nothing changed).
# Details of each step: tests/gpu/quick/plan.py and the step modules beside it.
#
# Offline install (tests/gpu/gpu_python.sh, shared with tests/gpu/run.sh): on a machine whose python3 has a CUDA
# or ROCm torch but no deepspeed, the wheels in .whl/ (built where the network is, by
# `bash ../shared/gpu/offline_wheels.sh .whl`) go into build/gpu-site with no index; without .whl/ this stops at
# once with one line. The csrc kernels and data helpers are built out of tree by step `build`, alongside `train`.
#
# Without a GPU (CPU torch, or none visible) every step runs its CPU twin at tiny sizes (Triton under
# TRITON_INTERPRET=1, the csrc kernels on the CPU emulator, a tiny model for train/resume and speed) or says
# in the summary why it skips; nothing it prints is a GPU result. Exit status: 0 when no step failed, 1 when
# one did, 2 on a bad step name or a missing .whl/.
#
# With the device tool (the lead, when a task is lent a GPU; .whl/ built beforehand and listed in
# .git/info/exclude):
#   run  command "bash tests/gpu/quick.sh"  carry [".whl"]  timeout_s 420     -> $OUT/summary.txt and logs
#   run  command "bash tests/gpu/quick.sh kernels speed"  carry [".whl"]      -> only the steps that failed,
#        after a fix (same warm machine: the wheels and builds are reused; raise QUICK_BUDGET_S for extra steps,
#        e.g. "QUICK_BUDGET_S=540 bash tests/gpu/quick.sh variants speed2" with timeout_s 600)
set -euo pipefail
cd "$(dirname "$0")/../.."
export QUICK_T0="${QUICK_T0:-$(date +%s)}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
OUT="${OUT:-$PWD/build/quick/out}"
mkdir -p "$OUT"
export OUT
# shellcheck source=tests/gpu/gpu_python.sh
source tests/gpu/gpu_python.sh

gpu_select_python
if [ "$GPU_TORCH" = 1 ]; then
  if ! gpu_offline_wheels 2>"$OUT/install.log"; then
    cat "$OUT/install.log" >&2
    cp "$OUT/install.log" "$OUT/summary.txt"  # the one line, where the lead looks first
    exit 2
  fi
  cat "$OUT/install.log" >&2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m tests.gpu.quick "$@"
