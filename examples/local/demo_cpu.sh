#!/usr/bin/env bash
# CPU demo: train a tiny GPT end to end on 2 processes with real tensor parallelism (TP=2, gloo),
# on the embedded default corpus (Python standard-library docstrings), through the full Megatron data
# pipeline: jsonl -> locally trained byte-level BPE -> preprocess_data.py (.bin/.idx) -> pretrain_gpt.py.
#
# Environment (all optional): OUT (default build/demo),
# TRAIN_ITERS (400), NPROC (2), EXTRA_ARGS (appended to pretrain_gpt.py's flags).
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=../../tools/setup_venv.sh
source tools/setup_venv.sh  # creates or reuses .venv/, sets PYTHON and TORCH_EXTENSIONS_DIR
OUT=${OUT:-build/demo}
TRAIN_ITERS=${TRAIN_ITERS:-400}
NPROC=${NPROC:-2}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
mkdir -p "$OUT"

if [ ! -f "$OUT/corpus.jsonl" ]; then
  "$PYTHON" tools/make_demo_corpus.py --output "$OUT/corpus.jsonl"
fi
if [ ! -f "$OUT/tokenizer/vocab.json" ]; then
  "$PYTHON" tools/train_tokenizer.py --input "$OUT/corpus.jsonl" --vocab-size 2048 --output-dir "$OUT/tokenizer"
fi
TOK=(--tokenizer-type GPT2BPETokenizer --vocab-file "$OUT/tokenizer/vocab.json" --merge-file "$OUT/tokenizer/merges.txt")
if [ ! -f "$OUT/demo_text_document.idx" ]; then
  "$PYTHON" tools/preprocess_data.py --input "$OUT/corpus.jsonl" --json-keys text --append-eod --workers 2 \
    --output-prefix "$OUT/demo" "${TOK[@]}"
fi

rm -rf "$OUT/tensorboard"
# shellcheck disable=SC2086  # EXTRA_ARGS is a list of flags
"$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC" --master-port "${MASTER_PORT:-29511}" pretrain_gpt.py \
  --tensor-model-parallel-size 2 --sequence-parallel \
  --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 \
  --micro-batch-size 8 --global-batch-size 16 --train-iters "$TRAIN_ITERS" \
  --lr 2.5e-3 --min-lr 2.5e-4 --lr-decay-style cosine --lr-warmup-iters 20 --weight-decay 0.1 --clip-grad 1.0 \
  --hidden-dropout 0 --attention-dropout 0 \
  --data-path "$OUT/demo_text_document" --split 98,2,0 --data-cache-path "$OUT/index-cache" "${TOK[@]}" \
  --log-interval 5 --eval-interval 100 --eval-iters 5 --zero-stage 1 \
  --tensorboard-dir "$OUT/tensorboard" ${EXTRA_ARGS:-} 2>&1 | tee "$OUT/train.log" | grep -v "WARNING\|shm_comm_op"

"$PYTHON" tools/plot_loss.py --log "$OUT/train.log" --output "$OUT/loss.png" --check-drop 0.30
echo "demo: training log in $OUT/train.log, TensorBoard events in $OUT/tensorboard, loss curve in $OUT/loss.png"
