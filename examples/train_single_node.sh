#!/usr/bin/env bash
# Pre-train a masked-diffusion LM on the GPUs of one node.
#
#   bash examples/train_single_node.sh                      # all GPUs of this node
#   GPUS=4 TP=2 DATA=/data/corpus_text_document bash examples/train_single_node.sh
#
# Every variable below can be set from the environment. Extra arguments are passed on to the trainer
# (e.g. `bash examples/train_single_node.sh --train-iters 100`).
set -euo pipefail
cd "$(dirname "$0")/.."

GPUS=${GPUS:-$(nvidia-smi --list-gpus 2>/dev/null | wc -l)}
[ "$GPUS" -ge 1 ] || { echo "no GPU found: set GPUS, or train on CPU with 'megadlms train --device cpu'" >&2; exit 1; }
MODEL=${MODEL:-qwen3-1.7b}              # a preset, or a Hugging Face config.json / folder
TP=${TP:-1}                             # tensor-parallel size (divides the heads and KV groups)
STRATEGY=${STRATEGY:-optim_grads_params} # no_shard (DDP) | optim | optim_grads | optim_grads_params (FSDP2)
MICRO_BATCH=${MICRO_BATCH:-4}
GLOBAL_BATCH=${GLOBAL_BATCH:-$((MICRO_BATCH * GPUS / TP))}
SEQ=${SEQ:-4096}
ITERS=${ITERS:-10000}
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

exec torchrun --standalone --nproc_per_node="$GPUS" pretrain_difflm.py \
    --model-path "$MODEL" --seq-length "$SEQ" \
    --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" --train-iters "$ITERS" \
    --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 500 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 \
    --bf16 "${FP8_ARGS[@]}" \
    --tensor-model-parallel-size "$TP" "${SP_ARGS[@]}" \
    --data-parallel-sharding-strategy "$STRATEGY" "${OVERLAP_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    --log-interval 10 --eval-interval 1000 --eval-iters 10 \
    --save "$SAVE" --save-interval 1000 --async-save "${LOAD_ARGS[@]}" \
    --tensorboard-dir "$SAVE/tensorboard" \
    "$@"
