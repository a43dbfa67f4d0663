#!/usr/bin/env bash
# Packed SFT on one GPU along each attention / precision path, losses per iteration side by side:
# the default (compiled layers replayed from CUDA graphs, FlexAttention document masks), without the graphs,
# --no-compile, --no-reset-attention-mask, FP8, and pre-training at the same shape for tokens/s. Logs to $OUT (or
# ./sft_paths_logs); a table prints last, and the script exits 1 when a run logged a non-finite loss or skipped steps.
#     bash benchmarks/sft_paths.sh [ITERS] [VARIANTS]      (VARIANTS: comma-separated names below)
#     SFT_MODEL=llada-8b SFT_MBS=1 SFT_EXTRA="--recompute-granularity full" bash benchmarks/sft_paths.sh 6 bf16,fp8
#                                                          (another model / micro-batch / flags; default qwen3-0.6b x 4)
set -u
OUT=${OUT:-sft_paths_logs}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PY:-python3}
ITERS=${1:-6}
VARIANTS=${2:-bf16,bf16_no_compile,bf16_no_doc_mask,fp8}
W=${SFT_WORK:-/tmp/megadlms_sft_paths}
if [ ! -f "$W/data/reverse_chat_document.idx" ]; then
    mkdir -p "$W/data"
    $PY examples/sft/make_data.py --out "$W/data" --train 60000 > "$OUT/sft_data.log" 2>&1
    $PY -m megadlms preprocess --chat --input "$W/data/train.jsonl" --output-prefix "$W/data/reverse" \
        --prompt-template $'Q: {prompt}\nA: ' --no-progress >> "$OUT/sft_data.log" 2>&1
fi
read -r -a EXTRA <<< "${SFT_EXTRA:-}"
M=(--model-path "${SFT_MODEL:-qwen3-0.6b}" --seq-length "${SFT_SEQ:-4096}" --micro-batch-size "${SFT_MBS:-4}"
   --train-iters "$ITERS" --log-interval 1 --no-progress --num-workers 2 --no-generate-sample "${EXTRA[@]}")
S=(--sft --data-path "$W/data/reverse_chat_document" --split 98,2,0 --eval-interval "$ITERS" --eval-iters 2)
run() {  # run NAME ARGS...
    local name=$1; shift
    case ",$VARIANTS," in *",$name,"*) ;; *) return ;; esac
    local t0=$SECONDS
    timeout 240 $PY -m megadlms train "$@" > "$OUT/sft_$name.log" 2>&1
    echo "$name: exit $? in $((SECONDS - t0)) s" >> "$OUT/sft_status.txt"
}
run bf16 "${M[@]}" "${S[@]}"
run bf16_no_graphs "${M[@]}" "${S[@]}" --cuda-graphs off
run bf16_no_compile "${M[@]}" "${S[@]}" --no-compile
run bf16_no_doc_mask "${M[@]}" "${S[@]}" --no-reset-attention-mask
run fp8 "${M[@]}" "${S[@]}" --fp8-format hybrid
run fp8_no_graphs "${M[@]}" "${S[@]}" --fp8-format hybrid --cuda-graphs off
run fp8_no_compile "${M[@]}" "${S[@]}" --fp8-format hybrid --no-compile
run pretrain_bf16 "${M[@]}" --eval-iters 0 --difflm-varilen-prob 0
run pretrain_fp8 "${M[@]}" --eval-iters 0 --difflm-varilen-prob 0 --fp8-format hybrid
cat "$OUT/sft_status.txt"
$PY - "$OUT" <<'EOF'
import math, re, sys, pathlib
out = pathlib.Path(sys.argv[1])
runs, bad = {}, []
for log in sorted(out.glob("sft_*.log")):
    if log.stem == "sft_data":
        continue
    rows = {}
    for line in log.read_text().splitlines():
        m = re.match(r"iter\s+(\d+)/\d+ \| loss (\S+) .*?\| ([\d,]+) tok/s", line)
        if m:
            rows[int(m[1])] = (m[2], m[3])
            if "skipped" in line or not math.isfinite(float(m[2])):
                bad.append(f"{log.name}: {line.strip()}")
        m = re.match(r"validation at iter (\d+) \| loss ([\d.]+)", line)
        if m:
            rows[f"val{m[1]}"] = (m[2], "")
    runs[log.stem[4:]] = rows
keys = sorted({k for r in runs.values() for k in r}, key=lambda k: (isinstance(k, str), str(k).zfill(8)))
print(f"{'iter':<8}" + "".join(f"{n:>18}" for n in runs))
for k in keys:
    print(f"{str(k):<8}" + "".join(f"{r.get(k, ('-', ''))[0]:>18}" for r in runs.values()))
print(f"{'tok/s':<8}" + "".join(f"{(list(r.values())[-1][1] if r else '-'):>18}" for r in runs.values()))
if bad:
    sys.exit("non-finite loss or skipped steps (the tok/s above are not of training steps):\n" + "\n".join(bad))
EOF
