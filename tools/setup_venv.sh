#!/usr/bin/env bash
# Create or reuse the project's virtual environment at .venv/ and install the package into it.
# Sourced by examples/local/demo_cpu.sh and tests/run.sh, so each of those is one command on a fresh machine.
# Re-installs only when setup.py / pyproject.toml / the C++ data helpers change (a stamp file records their hash).
#
# torch: if the venv has none, `torch==2.13.0` is installed (the CPU wheel on the project's machines).
# On Frontier, install ROCm torch into the environment first (README.md, docs/frontier.md); it is then left alone.
set -euo pipefail
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_venv="$_root/.venv"
if [ ! -x "$_venv/bin/python" ]; then
  echo "setup: creating $_venv"
  "${PYTHON_FOR_VENV:-python3}" -m venv "$_venv"
fi
_want="$(cat "$_root/setup.py" "$_root/pyproject.toml" "$_root/csrc/data/helpers.cpp" | sha256sum | cut -d' ' -f1)"
_stamp="$_venv/.megatron-frontier-stamp"
if [ "$(cat "$_stamp" 2>/dev/null || true)" != "$_want" ] || ! "$_venv/bin/python" -c "import megatron.data._helpers" 2>/dev/null; then
  echo "setup: installing megatron-frontier into $_venv (first run takes a few minutes)"
  "$_venv/bin/python" -m pip install -q --upgrade pip setuptools wheel pybind11
  if ! "$_venv/bin/python" -c "import torch" 2>/dev/null; then
    "$_venv/bin/python" -m pip install -q "torch==2.13.0"
  fi
  # No build isolation: the HIP extension must see the environment's (ROCm) torch to decide to build. The test
  # extras bring wandb too (setup.py), so the W&B tests run rather than skip.
  (cd "$_root" && "$_venv/bin/python" -m pip install -q --no-build-isolation -e ".[test]")
  # Test-only extras for the CPU machines: Triton for the interpreted kernel tests (triton==3.9.0 is the
  # version they were checked with; on Frontier ROCm torch brings its own Triton, so setup.py does not pin it),
  # and MPICH + mpi4py so MPI rank discovery runs for real.
  "$_venv/bin/python" -c "import triton" 2>/dev/null || "$_venv/bin/python" -m pip install -q "triton==3.9.0"
  "$_venv/bin/python" -c "import mpi4py" 2>/dev/null || "$_venv/bin/python" -m pip install -q mpich mpi4py
  echo "$_want" > "$_stamp"
fi
export PATH="$_venv/bin:$PATH"
export PYTHON="$_venv/bin/python"
# DeepSpeed JIT-builds a CPU comm op on first start (~45 s): cache it inside the repo's ignored build/.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$_root/build/torch_extensions}"
mkdir -p "$TORCH_EXTENSIONS_DIR"
