# shellcheck shell=bash
# Frontier environment for Megatron-Frontier jobs. Source it from an sbatch script, after `set -euo pipefail`:
#     source "$MEGATRON_DIR/examples/frontier/env.sh"
# It loads the modules, sets the MIOpen / RCCL / libfabric variables of OLCF's current PyTorch recipe (shared
# FRONTIER.md), exports MASTER_ADDR / MASTER_PORT and NNODES, and can copy the Python environment to node-local NVMe.
# One node and many differ in one place: NCCL_NET is OFI across nodes (a missing network plugin then fails at once
# instead of falling back to TCP sockets at a fraction of the speed) and Socket on one node (the plugin never
# initialises there).
#
# Settings, all optional (export before `sbatch`, or edit here); every variable below can also be overridden:
#   FRONTIER_MODULES        modules to load            (default: PrgEnv-gnu rocm craype-accel-amd-gfx90a)
#   FRONTIER_NET_MODULE     RCCL's network plugin (aws-ofi-nccl) and its variables, loaded after rocm
#                                                                                 (default: rccl-net-plugin)
#   FRONTIER_EXTRA_MODULES  more modules, e.g. "cray-python" or a pinned "rocm/7.1.1"       (default: none)
#   FRONTIER_VENV           Python virtualenv to activate           (default: $MEGATRON_DIR/.venv if it exists)
#   FRONTIER_ENV_TARBALL    a .tar.gz whose top level is a Python environment (bin/, lib/): `conda-pack -o env.tar.gz`
#                           or `tar -czf env.tar.gz -C /path/to/env .`;
#                           when set it is sbcast to /mnt/bb/$USER on every node and PYTHON points at the copy.
#                           Needs `#SBATCH -C nvme`. Worth it from ~100 nodes: thousands of ranks importing torch
#                           from Lustre at once is slow.                                        (default: none)
#   PYTHON                  interpreter                                                       (default: python3)
#   MASTER_PORT             rank 0's rendezvous port                                          (default: 29500)
#   MIOPEN_CACHE_ROOT       node-local folder for MIOpen's databases              (default: /tmp/$USER-miopen-cache)

MEGATRON_DIR=${MEGATRON_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}
export MEGATRON_DIR

# --- modules ------------------------------------------------------------------------------------------------------
# `module` is a shell function from Lmod on Frontier; outside Frontier (CI, laptops) there is none.
if command -v module >/dev/null 2>&1; then
    # shellcheck disable=SC2086  # word splitting is wanted: one module name per word
    module load ${FRONTIER_MODULES:-PrgEnv-gnu rocm craype-accel-amd-gfx90a} ${FRONTIER_EXTRA_MODULES:-}
    if [[ -n ${FRONTIER_NET_MODULE-rccl-net-plugin} ]]; then
        module load "${FRONTIER_NET_MODULE-rccl-net-plugin}"  # after rocm: it builds on that RCCL
    fi
else
    echo "env.sh: no 'module' command here; skipping module loads" >&2
fi

NNODES=${NNODES:-${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}}
export NNODES

# --- MIOpen: its default database lives in $HOME; thousands of ranks writing there fail, so keep it node-local ---
export MIOPEN_USER_DB_PATH="${MIOPEN_CACHE_ROOT:-/tmp/${USER:-user}-miopen-cache}"
export MIOPEN_CUSTOM_CACHE_DIR="$MIOPEN_USER_DB_PATH"
mkdir -p "$MIOPEN_USER_DB_PATH"

# --- RCCL and libfabric (OLCF's PyTorch-on-Frontier recipe; each can be overridden from the environment) ----------
if (( NNODES > 1 )); then
    export NCCL_NET=${NCCL_NET:-OFI}        # RCCL must use the plugin across nodes: fail at once if it is missing
else
    export NCCL_NET=${NCCL_NET:-Socket}     # one node: the plugin never initialises; traffic stays on the node
fi
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-hsn0}             # bootstrap over the Slingshot interface
export NCCL_CROSS_NIC=${NCCL_CROSS_NIC:-1}                        # rings may use any of the 4 NICs
export HSA_FORCE_FINE_GRAIN_PCIE=${HSA_FORCE_FINE_GRAIN_PCIE:-1}
export FI_MR_CACHE_MONITOR=${FI_MR_CACHE_MONITOR:-kdreg2}         # the current default; never "memhooks": it deadlocks
export FI_CXI_DEFAULT_CQ_SIZE=${FI_CXI_DEFAULT_CQ_SIZE:-131072}
export FI_CXI_DEFAULT_TX_SIZE=${FI_CXI_DEFAULT_TX_SIZE:-2048}
export FI_CXI_RX_MATCH_MODE=${FI_CXI_RX_MATCH_MODE:-hybrid}
export FI_CXI_DISABLE_HOST_REGISTER=${FI_CXI_DISABLE_HOST_REGISTER:-1}
# alt_read goes with `#SBATCH --network=disable_rdzv_get` (read from the batch script, $0), and only with it.
if [[ -z ${FI_CXI_RDZV_PROTO:-} ]] && grep -Eq '^#SBATCH[[:space:]]+--network=([^ ]*,)?disable_rdzv_get' "$0" 2>/dev/null
then
    export FI_CXI_RDZV_PROTO=alt_read
fi
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}  # keeps TP comm/compute overlap ordered
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-7}                      # the 7 cores srun -c7 gives each rank

# --- rendezvous: rank 0 runs on the first host of the allocation (srun's block distribution) ----------------------
if [[ -z ${MASTER_ADDR:-} ]]; then
    hosts=$(scontrol show hostnames "${SLURM_JOB_NODELIST:?env.sh needs a Slurm allocation (sbatch or salloc)}")
    MASTER_ADDR=${hosts%%$'\n'*}
    unset hosts
fi
export MASTER_ADDR
export MASTER_PORT=${MASTER_PORT:-29500}

# --- Python --------------------------------------------------------------------------------------------------------
FRONTIER_VENV=${FRONTIER_VENV:-$MEGATRON_DIR/.venv}
if [[ -f $FRONTIER_VENV/bin/activate ]]; then
    # shellcheck source=/dev/null
    source "$FRONTIER_VENV/bin/activate"
fi
PYTHON=${PYTHON:-python3}
if [[ -n ${FRONTIER_ENV_TARBALL:-} ]]; then
    nvme_env="/mnt/bb/${USER:-user}/python-env"
    sbcast --force --preserve "$FRONTIER_ENV_TARBALL" "/mnt/bb/${USER:-user}/python-env.tar.gz"
    # shellcheck disable=SC2016  # $1 / $2 expand in the inner bash on each node
    srun -N "$NNODES" --ntasks-per-node=1 bash -c \
        'mkdir -p "$1" && tar -xzf "$2" -C "$1"' _ "$nvme_env" \
        "/mnt/bb/${USER:-user}/python-env.tar.gz"
    PYTHON="$nvme_env/bin/python"
    unset nvme_env
fi
export PYTHON

echo "env.sh: ${NNODES} node(s), MASTER_ADDR=${MASTER_ADDR}:${MASTER_PORT}, PYTHON=${PYTHON}" >&2

# --- helpers shared by the sbatch scripts ----------------------------------------------------------------------------
# DATA_ARGS: real data when DATA_PATH (a .bin/.idx prefix, or Megatron's "w1 p1 w2 p2" blend) is set, else --mock-data.
# shellcheck disable=SC2034  # DATA_ARGS is read by the sbatch scripts that source this file
frontier_data_args() {
    if [[ -n ${DATA_PATH:-} ]]; then
        local data_dir=${DATA_DIR:-$MEGATRON_DIR/data} words
        read -r -a words <<< "$DATA_PATH"  # a blend "w1 p1 w2 p2" is several words
        DATA_ARGS=(--data-path "${words[@]}" --split "${SPLIT:-949,50,1}"
                   --tokenizer-type "${TOKENIZER_TYPE:-GPT2BPETokenizer}"
                   --vocab-file "${VOCAB_FILE:-$data_dir/gpt2-vocab.json}"
                   --merge-file "${MERGE_FILE:-$data_dir/gpt2-merges.txt}")
    else
        DATA_ARGS=(--mock-data)
    fi
}

# What would waste this job (walltime bin, signal lead, rendezvous variables, --save on home, ...): warnings only.
frontier_check_job() {
    "$PYTHON" "$MEGATRON_DIR/tools/check_job.py" "$0" "$@" || true
}

# Print where every rank lands and the memory per GCD before spending node-hours; a layout that cannot work
# (TP across nodes, sizes that do not divide) stops the job here. SHOW_LAYOUT=0 skips it.
frontier_show_layout() {
    if [[ ${SHOW_LAYOUT:-1} != 0 ]]; then
        "$PYTHON" "$MEGATRON_DIR/tools/show_layout.py" --nodes "$NNODES" --summary-only "$@"
    fi
}
