#!/usr/bin/env bash
# SFT of a tiny masked-diffusion LM on the CPU, scored on held-out prompts before and after.
#   bash examples/sft/run.sh [WORK_DIR]                      (a few minutes on 2 idle CPU cores)
#   CONTINUE_ITERS=600 bash examples/sft/run.sh [WORK_DIR]   (then resumes the SFT run to 600 iterations)
# Optional: DATA_ARGS (extra make_data.py flags, e.g. "--min-digits 2 --max-digits 3"), SFT_ITERS (250),
# GEN_LENGTH (16: tokens generated per held-out answer).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
WORK="${1:-/tmp/megadlms_sft_example}"
source "$HERE/../find_python.sh"  # PY: $PYTHON, else the repository's .venv, else python3
MEGADLMS="$PY -m megadlms"
rm -rf "$WORK" && mkdir -p "$WORK"
MODEL=(--model-path tiny --num-layers 3 --hidden-size 96 --num-attention-heads 4 --num-query-groups 2
       --ffn-hidden-size 256 --seq-length 48 --device cpu --no-compile --num-workers 0 --no-progress
       --no-generate-sample)
SFT_ITERS="${SFT_ITERS:-250}"
GEN_LENGTH="${GEN_LENGTH:-16}"
GEN=(--prompt-file "$WORK/data/heldout_prompts.jsonl" --gen-length "$GEN_LENGTH" --block-length "$GEN_LENGTH"
     --steps "$GEN_LENGTH" --device cpu --micro-batch-size 50 --no-progress)

# 1. data: a generated instruction set, rendered with a plain prompt template (the bundled tokenizer has none)
# shellcheck disable=SC2086  # DATA_ARGS is a list of flags
$PY "$HERE/make_data.py" --out "$WORK/data" ${DATA_ARGS:-}
$MEGADLMS preprocess --chat --input "$WORK/data/train.jsonl" --output-prefix "$WORK/data/reverse" \
    --prompt-template $'Q: {prompt}\nA: ' --no-progress

# 2. the model before SFT: a short masked-diffusion pre-training on the bundled corpus
$MEGADLMS train "${MODEL[@]}" --micro-batch-size 16 --train-iters 40 --lr 3e-3 --lr-warmup-iters 10 \
    --log-interval 20 --eval-iters 0 --save "$WORK/base"
$MEGADLMS generate --load "$WORK/base" "${GEN[@]}" --output-file "$WORK/before.jsonl"

# 3. SFT on packed conversations (prompts never masked, EOS padding trained on)
$MEGADLMS train "${MODEL[@]}" --load "$WORK/base" --finetune --sft --data-path "$WORK/data/reverse_chat_document" \
    --split 98,2,0 --micro-batch-size 16 --train-iters "$SFT_ITERS" --lr 3e-3 --lr-warmup-iters 20 --weight-decay 0.01 \
    --log-interval 25 --eval-interval $((SFT_ITERS / 2)) --eval-iters 2 --save "$WORK/sft"
$MEGADLMS generate --load "$WORK/sft" "${GEN[@]}" --output-file "$WORK/after.jsonl"

# 4. optional (CONTINUE_ITERS=600): resume the SFT run up to that many iterations (optimizer and data position
#    kept; the cosine schedule is re-planned over the new total) and score it again
OUTPUTS=("$WORK/before.jsonl" "$WORK/after.jsonl")
if [[ -n "${CONTINUE_ITERS:-}" ]]; then
  $MEGADLMS train "${MODEL[@]}" --load "$WORK/sft" --sft --data-path "$WORK/data/reverse_chat_document" \
      --split 98,2,0 --micro-batch-size 16 --train-iters "$CONTINUE_ITERS" --lr 3e-3 --lr-warmup-iters 20 \
      --weight-decay 0.01 --log-interval 50 --eval-interval 175 --eval-iters 2 --save "$WORK/sft"
  $MEGADLMS generate --load "$WORK/sft" "${GEN[@]}" --output-file "$WORK/after_$CONTINUE_ITERS.jsonl"
  OUTPUTS+=("$WORK/after_$CONTINUE_ITERS.jsonl")
fi

# 5. held-out scores, before and after SFT
$PY "$HERE/score.py" "${OUTPUTS[@]}"
