#!/usr/bin/env bash
# CPU long-context demo: DeepSpeed-Ulysses sequence parallelism (--ds-sequence-parallel-size) on 4 gloo processes.
# Each process holds 1/SP of every 8192-token sequence; the two all-to-alls around attention give each process
# the whole sequence for 1/SP of the heads. First the dry run shows the planner's memory per rank at SP=1 and at
# SP (activations / SP), then SP ranks train on the embedded default corpus (byte tokens, RoPE positions).
# Measured on this CPU (bench/RESULTS.md, "Long sequences"): saved activations per rank fall to 0.53 / 0.26 of
# SP=1 at SP=2 / 4.
#
# Environment (all optional): OUT (default build/long_context), SEQ (8192), SP (4), TRAIN_ITERS (20),
# EXTRA_ARGS (appended to pretrain_gpt.py's flags).
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=../../tools/setup_venv.sh
source tools/setup_venv.sh  # creates or reuses .venv/, sets PYTHON and TORCH_EXTENSIONS_DIR
OUT=${OUT:-build/long_context}
SEQ=${SEQ:-8192}
SP=${SP:-4}
TRAIN_ITERS=${TRAIN_ITERS:-20}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
mkdir -p "$OUT"

MODEL=(--num-layers 4 --hidden-size 128 --num-attention-heads 8 --num-key-value-heads 4 --seq-length "$SEQ"
       --max-position-embeddings "$SEQ" --position-embedding-type rope --normalization rmsnorm --swiglu)
for sp in 1 "$SP"; do
  # --use-flash-attn-v2: torch's CPU attention keeps no s x s scores either (flash-style log-sum-exp only).
  echo "== dry run, SP=$sp: memory per rank as megatron/perf/memory.py models it (fp32, incl. 3 GiB overhead) =="
  "$PYTHON" tools/show_layout.py --world-size "$SP" --ds-sequence-parallel-size "$sp" "${MODEL[@]}" \
    --vocab-size 256 --use-flash-attn-v2 --summary-only | grep -E "activations|logits|total"
done

# shellcheck disable=SC2086  # EXTRA_ARGS is a list of flags
"$PYTHON" -m torch.distributed.run --nproc-per-node "$SP" --master-port "${MASTER_PORT:-29512}" pretrain_gpt.py \
  --ds-sequence-parallel-size "$SP" "${MODEL[@]}" --demo-corpus \
  --micro-batch-size 1 --global-batch-size 1 --train-iters "$TRAIN_ITERS" \
  --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.1 --clip-grad 1.0 \
  --hidden-dropout 0 --attention-dropout 0 --log-interval 2 --eval-iters 0 --zero-stage 1 \
  ${EXTRA_ARGS:-} 2>&1 | tee "$OUT/train.log" | grep -v "WARNING\|shm_comm_op"
echo "long-context demo: training log in $OUT/train.log"
