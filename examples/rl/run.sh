#!/usr/bin/env bash
# diffu-GRPO on the reverse-digits task, on the CPU: the SFT example (examples/sft) on lists of 2-3 digits, then
# GRPO with the exact-match (plus digits-in-place) reward on the training prompts; prints the rollouts' reward curve and the held-out
# exact match of the SFT model and of every GRPO checkpoint.
#   bash examples/rl/run.sh [WORK_DIR]     (about 12 minutes on 2 idle CPU cores; README.md has the curve)
# Optional: SFT_ITERS (300), SFT_END (550), GRPO_ITERS (300), GRPO_LR (3e-4), GRPO_SAVE (50: held-out scores every
# that many steps)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
WORK="${1:-/tmp/megadlms_rl_example}"
source "$HERE/../find_python.sh"  # PY: $PYTHON, else the repository's .venv, else python3
MEGADLMS="$PY -m megadlms"
ITERS="${GRPO_ITERS:-300}"
SAVE="${GRPO_SAVE:-50}"
MODEL=(--model-path tiny --num-layers 3 --hidden-size 96 --num-attention-heads 4 --num-query-groups 2
       --ffn-hidden-size 256 --seq-length 48 --device cpu --no-compile --num-workers 0 --no-progress
       --no-generate-sample)
GEN=(--prompt-file "$WORK/data/heldout_prompts.jsonl" --gen-length 8 --block-length 8 --steps 8 --device cpu
     --micro-batch-size 50 --no-progress)

# 1. the SFT example on lists of 2-3 digits (4000 training and 200 held-out prompts, no held-out list among the
#    training ones): 300 SFT iterations, resumed to 550; the model then answers part of the held-out prompts
#    exactly (skipped when WORK already holds it)
SFT_END="${SFT_END:-550}"
if [[ ! -f "$WORK/sft/latest_checkpointed_iteration.txt" ]]; then
  DATA_ARGS="--min-digits 2 --max-digits 3" SFT_ITERS="${SFT_ITERS:-300}" CONTINUE_ITERS="$SFT_END" GEN_LENGTH=8 \
      bash "$HERE/../sft/run.sh" "$WORK"
fi

# 2. GRPO prompts: the training prompts with their answers, rendered as the SFT data was (the held-out prompts
#    are only scored)
$PY - "$WORK" <<'PY'
import json, sys
work = sys.argv[1]
with open(f"{work}/data/train.jsonl") as f, open(f"{work}/data/grpo_prompts.jsonl", "w") as out:
    for line in f:
        r = json.loads(line)
        out.write(json.dumps({"prompt": f"Q: {r['prompt']}\nA: ", "answer": r["response"]}) + "\n")
PY

# 3. diffu-GRPO from the SFT weights: 8 prompts x 8 completions of up to 8 tokens a step (temperature 1), reward
#    exact match plus partial credit for digits in place; the whole prompt visible in the one-step estimate (each
#    of its digits decides the answer), no KL term (README.md says why)
rm -rf "$WORK/grpo"
$MEGADLMS train "${MODEL[@]}" --load "$WORK/sft" --finetune --rl grpo --rl-data "$WORK/data/grpo_prompts.jsonl" \
    --rl-reward exact_match,position_match --grpo-group-size 8 --micro-batch-size 8 --train-iters "$ITERS" \
    --lr "${GRPO_LR:-3e-4}" --lr-warmup-iters 10 --lr-decay-style constant --weight-decay 0 \
    --rl-gen-length 8 --rl-block-length 8 --rl-temperature 1.0 --grpo-prompt-mask 0 --rl-kl-beta 0 \
    --log-interval 1 --eval-iters 0 --save "$WORK/grpo" --save-interval "$SAVE"

# 4. held-out exact match of every GRPO checkpoint (greedy decoding, as the SFT example scores)
OUTPUTS=("$WORK/after_$SFT_END.jsonl")
for ((it = SAVE; it <= ITERS; it += SAVE)); do
  $MEGADLMS generate --load "$WORK/grpo" --ckpt-step "$it" "${GEN[@]}" --output-file "$WORK/grpo_$it.jsonl"
  OUTPUTS+=("$WORK/grpo_$it.jsonl")
done

# 5. the curves: the rollouts' rewards (training prompts, sampled at temperature 1) per window of 30 steps,
#    then the held-out scores (after_550.jsonl: the SFT model, before GRPO)
$PY - "$WORK/grpo/metrics.jsonl" <<'PY'
import json, sys
rows = [m for m in map(json.loads, open(sys.argv[1])) if "rl/reward/exact_match" in m]
for i in range(0, len(rows), 30):
    w = rows[i:i + 30]
    mean = lambda key: sum(m[key] for m in w) / len(w)  # noqa: E731
    print(f"GRPO steps {w[0]['iteration']:>3}-{w[-1]['iteration']:>3}: rollout exact match "
          f"{mean('rl/reward/exact_match'):.3f}, digits in place {mean('rl/reward/position_match'):.3f}")
PY
$PY "$HERE/../sft/score.py" "${OUTPUTS[@]}"
