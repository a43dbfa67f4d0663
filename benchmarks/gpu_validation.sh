#!/usr/bin/env bash
# One GPU command that checks the parts other than raw speed (benchmarks/fp8_block.py and
# train_throughput.py cover that): FP8 numerics on the real kernels, the CLI trainer on qwen3-1.7b
# (tokens/s, MFU, data-loading share), the trainer's CUDA graphs against eager, FP8 vs BF16 loss
# curves, the samplers' speed, and the torchrun world-size-1 overhead. Logs go to $OUT (or ./gpu_validation_logs); a summary prints last.
#     bash benchmarks/gpu_validation.sh
set -u
OUT=${OUT:-gpu_validation_logs}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/megadlms_inductor}
PY=${PY:-python3}
step() {  # step NAME SECONDS CMD...: run with a time cap, keep the log, note the exit status
    local name=$1 cap=$2; shift 2
    local t0=$SECONDS
    timeout "$cap" "$@" > "$OUT/$name.log" 2>&1
    echo "$name: exit $? in $((SECONDS - t0)) s" >> "$OUT/status.txt"
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
$PY -c "import torch; print('torch', torch.__version__)" >> "$OUT/gpu.txt"
step fp8_check 60 $PY -m megadlms fp8-check
step fp8_numerics 90 $PY benchmarks/fp8_numerics.py
step train_qwen3_1p7b 150 $PY -m megadlms train --model-path qwen3-1.7b --seq-length 4096 --micro-batch-size 4 \
    --train-iters 20 --log-interval 5 --eval-iters 0 --no-progress --difflm-varilen-prob 0 --num-workers 2
step cuda_graph_check 200 $PY benchmarks/cuda_graph_check.py --iters 8
step generate 120 $PY benchmarks/generate.py
step fp8_convergence 200 $PY benchmarks/fp8_convergence.py --model-path qwen3-0.6b --iters 150 --seq-length 512 \
    --mbs 16 --extra=--no-compile --parallel 3 --json-out "$OUT/fp8_convergence.json"
step torchrun_overhead 150 $PY benchmarks/torchrun_overhead.py --rounds 1 --iters 30
echo "=== status"; cat "$OUT/status.txt"; cat "$OUT/gpu.txt"
echo "=== fp8-check"; tail -6 "$OUT/fp8_check.log"
echo "=== fp8 numerics"; tail -16 "$OUT/fp8_numerics.log"
echo "=== megadlms train qwen3-1.7b"; grep -E "^iter|model " "$OUT/train_qwen3_1p7b.log" | tail -5
echo "=== CUDA graphs vs eager"; tail -5 "$OUT/cuda_graph_check.log"
echo "=== generate"; tail -8 "$OUT/generate.log"
echo "=== fp8 convergence"; tail -5 "$OUT/fp8_convergence.log"
echo "=== torchrun overhead"; tail -6 "$OUT/torchrun_overhead.log"
