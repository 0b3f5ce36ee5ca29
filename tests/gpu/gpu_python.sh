# Sourced by tests/gpu/run.sh and tests/gpu/quick.sh (from the repository root): which python runs the GPU work,
# and its offline install. Defines functions only; sets nothing until they are called.
#
#   gpu_select_python     PY = .venv/bin/python when its torch is a CUDA or ROCm build, else the machine's python3
#                         when its torch is (an offline image with CUDA torch preinstalled); GPU_TORCH=1 then.
#                         Otherwise GPU_TORCH=0 and PY = .venv/bin/python or python3 (CPU torch).
#   gpu_offline_wheels    for the machine's own python3 without deepspeed: installs .whl/*.whl (collected by
#                         ../shared/gpu/offline_wheels.sh on a machine with network) into build/gpu-site with no
#                         index and puts it on PYTHONPATH; a previous run's build/gpu-site is reused. Without .whl/
#                         it prints one line and returns 2.
#   gpu_install_package   for the machine's own python3: pip install -e . (no index) when megatron.data._helpers is
#                         missing; builds the data helpers and, on CUDA/ROCm torch with nvcc/hipcc, the csrc kernels.
# shellcheck shell=bash
# shellcheck disable=SC2034  # PY and GPU_TORCH are for the scripts that source this file

gpu_torch() {  # $1 is a python whose torch is a CUDA or ROCm build
  "$1" -c 'import sys, torch; sys.exit(0 if (torch.version.cuda or torch.version.hip) else 1)' >/dev/null 2>&1
}

gpu_select_python() {
  GPU_TORCH=1
  if [ -x .venv/bin/python ] && gpu_torch .venv/bin/python; then
    PY=.venv/bin/python
  elif command -v python3 >/dev/null 2>&1 && gpu_torch python3; then
    PY=python3
  else
    GPU_TORCH=0
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
  fi
}

gpu_offline_wheels() {
  [ "$PY" = python3 ] || return 0  # .venv/ has its own packages
  local site="$PWD/build/gpu-site"
  if [ -d "$site" ]; then export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"; fi  # a previous run's wheels
  "$PY" -c 'import deepspeed' >/dev/null 2>&1 && return 0
  if ! compgen -G ".whl/*.whl" >/dev/null; then
    echo "error: $PY has a GPU torch but no deepspeed, and .whl/ holds no wheels: build them where the network is" \
         "(bash ../shared/gpu/offline_wheels.sh .whl) and carry .whl with the working tree" >&2
    return 2
  fi
  echo "> installing .whl/*.whl into $site (offline)"
  "$PY" -m pip install -q --upgrade --no-index --no-deps --target "$site" .whl/*.whl || return 2
  case ":${PYTHONPATH:-}:" in *":$site:"*) ;; *) export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" ;; esac
}

gpu_install_package() {
  [ "$PY" = python3 ] || return 0  # .venv/ was installed by tools/setup_venv.sh
  "$PY" -c 'import megatron.data._helpers' >/dev/null 2>&1 && return 0
  echo "> installing this package in place (builds megatron.data._helpers)"
  "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . \
    || "$PY" -m pip install -q --no-deps --no-build-isolation --no-index --break-system-packages -e .
}
