#!/usr/bin/env bash
# diffu-GRPO on the reverse-digits task, on the CPU: the SFT example's model (examples/sft), then GRPO with the
# exact-match reward on the training prompts; prints the reward curve.
#   bash examples/rl/run.sh [WORK_DIR]      (the SFT part as in examples/sft/run.sh, then about as long for GRPO)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
WORK="${1:-/tmp/megadlms_rl_example}"
PY="${PYTHON:-python}"
MEGADLMS="$PY -m megadlms"
ITERS="${GRPO_ITERS:-60}"
MODEL=(--model-path tiny --num-layers 3 --hidden-size 96 --num-attention-heads 4 --num-query-groups 2
       --ffn-hidden-size 256 --seq-length 48 --device cpu --no-compile --num-workers 0 --no-progress
       --no-generate-sample)

# 1. the SFT example's data and model, SFT run to 600 iterations (skipped when WORK already holds them)
if [[ ! -f "$WORK/sft/latest_checkpointed_iteration.txt" ]]; then
  CONTINUE_ITERS=600 bash "$HERE/../sft/run.sh" "$WORK"
fi

# 2. GRPO prompts: the training prompts with their answers, rendered as the SFT data was
$PY - "$WORK" <<'PY'
import json, sys
work = sys.argv[1]
with open(f"{work}/data/train.jsonl") as f, open(f"{work}/data/grpo_prompts.jsonl", "w") as out:
    for line in f:
        r = json.loads(line)
        out.write(json.dumps({"prompt": f"Q: {r['prompt']}\nA: ", "answer": r["response"]}) + "\n")
PY

# 3. diffu-GRPO from the SFT weights: 8 prompts x 8 completions a step; the exact-match reward plus partial credit
#    for digits in place (exact matches are rare after this short SFT), KL to the SFT model
rm -rf "$WORK/grpo"
$MEGADLMS train "${MODEL[@]}" --load "$WORK/sft" --finetune --rl grpo --rl-data "$WORK/data/grpo_prompts.jsonl" \
    --rl-reward exact_match,position_match --grpo-group-size 8 --micro-batch-size 8 --train-iters "$ITERS" --lr 5e-5 \
    --lr-warmup-iters 0 --lr-decay-style constant --rl-gen-length 16 --rl-block-length 16 --rl-temperature 1.0 \
    --rl-kl-beta 0.02 --log-interval 1 --eval-iters 0 --save "$WORK/grpo"

# 4. the curve: the rewards of each step's rollouts, in windows of 10 steps
$PY - "$WORK/grpo/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
r = [(m["iteration"], m["rl/reward/exact_match"], m["rl/reward/position_match"]) for m in rows
     if "rl/reward/exact_match" in m]
for i in range(0, len(r), 10):
    w = r[i:i + 10]
    print(f"steps {w[0][0]:>3}-{w[-1][0]:>3}: exact match {sum(e for _, e, _ in w) / len(w):.3f}, "
          f"digits in place {sum(p for _, _, p in w) / len(w):.3f}")
PY
