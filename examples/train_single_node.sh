#!/usr/bin/env bash
# Pre-train a masked-diffusion LM on the GPUs of one node.
#
#   bash examples/train_single_node.sh                      # all GPUs of this node
#   GPUS=4 TP=2 DATA=/data/corpus_text_document bash examples/train_single_node.sh
#   ITERS=100 bash examples/train_single_node.sh --log-interval 1
#
# Every variable below can be set from the environment (PYTHON: the python with megadlms, default the
# repository's .venv). Extra arguments are passed on to the trainer. DRY_RUN=1 prints the command instead of
# running it. GPUs only: on a CPU, `megadlms train` trains the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/find_python.sh          # PY: $PYTHON, else .venv/bin/python, else python3

VISIBLE=$("$PY" -c "import torch; print(torch.cuda.device_count())")  # the CUDA GPUs torch can use here
GPUS=${GPUS:-$VISIBLE}
if [ "${DRY_RUN:-0}" != 1 ] && { [ "$GPUS" -lt 1 ] || [ "$GPUS" -gt "$VISIBLE" ]; }; then
  echo "train_single_node.sh: GPUS=$GPUS, but torch sees $VISIBLE CUDA GPU(s) here; this script trains on GPUs" \
       "(on a CPU, 'megadlms train' trains the demo)" >&2
  exit 1
fi
MODEL=${MODEL:-qwen3-1.7b}              # a preset, or a Hugging Face config.json / folder
TP=${TP:-1}                             # tensor-parallel size (divides the heads and KV groups)
STRATEGY=${STRATEGY:-optim_grads_params} # no_shard (DDP) | optim | optim_grads | optim_grads_params (FSDP2)
MICRO_BATCH=${MICRO_BATCH:-4}
GLOBAL_BATCH=${GLOBAL_BATCH:-$((MICRO_BATCH * GPUS / TP))}
SEQ=${SEQ:-4096}
ITERS=${ITERS:-10000}
WARMUP=${WARMUP:-$((ITERS / 10 < 500 ? ITERS / 10 : 500))}  # a tenth of the run, at most 500 iterations
SAVE=${SAVE:-runs/${MODEL}-dlm}
DATA_ARGS=()
if [ -n "${DATA:-}" ]; then             # a preprocessed corpus (megadlms preprocess); none: the bundled demo corpus
  DATA_ARGS=(--data-path "$DATA" --tokenizer-model "${TOKENIZER:?set TOKENIZER to the tokenizer of DATA}")
fi
FP8_ARGS=()
if [ "${FP8:-1}" = 1 ]; then            # FP8 needs compute capability >= 8.9 (Ada, Hopper, Blackwell)
  FP8_ARGS=(--fp8-format hybrid)
fi
SP_ARGS=()
if [ "$TP" -gt 1 ]; then SP_ARGS=(--sequence-parallel); fi
OVERLAP_ARGS=(--overlap-grad-reduce)
if [ "$STRATEGY" != no_shard ]; then OVERLAP_ARGS+=(--overlap-param-gather); fi  # sharded weights only
LOAD_ARGS=()                            # resume when the save folder holds a checkpoint
if [ -f "$SAVE/latest_checkpointed_iteration.txt" ]; then LOAD_ARGS=(--load "$SAVE"); fi

RUN=()
if [ "${DRY_RUN:-0}" = 1 ]; then RUN=(echo); fi
exec "${RUN[@]}" "$PY" -m torch.distributed.run --standalone --nproc_per_node="$GPUS" pretrain_difflm.py \
    --model-path "$MODEL" --seq-length "$SEQ" \
    --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" --train-iters "$ITERS" \
    --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters "$WARMUP" --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 \
    --bf16 "${FP8_ARGS[@]}" \
    --tensor-model-parallel-size "$TP" "${SP_ARGS[@]}" \
    --data-parallel-sharding-strategy "$STRATEGY" "${OVERLAP_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    --log-interval 10 --eval-interval 1000 --eval-iters 10 \
    --save "$SAVE" --save-interval 1000 --async-save "${LOAD_ARGS[@]}" \
    --tensorboard-dir "$SAVE/tensorboard" \
    "$@"
