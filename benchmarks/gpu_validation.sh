#!/usr/bin/env bash
# The GPU checks of what the CPU cannot run, in four parts of one command each (each under 9 minutes on one
# H100/H200). Logs go to $OUT (or ./gpu_validation_logs); a short table prints last.
#     bash benchmarks/gpu_validation.sh correctness   FP8 numerics on the real kernels; the gradients of every
#                                                     attention plan (compiled FlexAttention) against dense eager;
#                                                     CUDA-graph replays against eager, masks included
#     bash benchmarks/gpu_validation.sh speed         the 8B-class block per recipe; the trainer on qwen3-1.7b;
#                                                     packed SFT against pre-training, BF16 and FP8, losses side
#                                                     by side
#     bash benchmarks/gpu_validation.sh quality       FP8 vs BF16 loss curves, the samplers, torchrun overhead
#     bash benchmarks/gpu_validation.sh models        the MoE block (BF16 vs FP8, grouped GEMMs); LoRA on an FP8 base
#                                                     against a BF16 base at llada-8b shapes (memory, tokens/s)
#     bash benchmarks/gpu_validation.sh moe           the MoE experts' FP8 path: grouped casts against torch, grouped
#                                                     GEMMs and a layer's gradients against fp32, per recipe; each
#                                                     grouped GEMM timed, BF16 and FP8; the grouped casts'
#                                                     bandwidth against a copy's; the MoE block
#     bash benchmarks/gpu_validation.sh e2e           FP8 against BF16 where users run it, each with the kernel time
#                                                     by category and peak memory: the 8B-class block per recipe,
#                                                     the trainer (qwen3-1.7b), pre-training and packed SFT
#                                                     (qwen3-0.6b), LLaDA-8B packed SFT with recompute (16 layers;
#                                                     LLADA_LAYERS=N), LoRA on LLaDA-8B (E2E_WORKLOADS=a,b: some)
#     bash benchmarks/gpu_validation.sh llada         LLaDA-8B packed SFT at seq 4096, BF16 and FP8, activation
#                                                     recompute: losses, tokens/s, MFU, peak memory; as many of
#                                                     its 32 layers as the free memory holds (LLADA_LAYERS=N: N)
set -u
PART=${1:-correctness}
export OUT=${OUT:-gpu_validation_logs}; mkdir -p "$OUT"
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
case "$PART" in
correctness)
    step fp8_check 45 $PY -m megadlms fp8-check
    step fp8_numerics 80 $PY benchmarks/fp8_numerics.py
    step attention_grads 220 $PY benchmarks/attention_grad_check.py --plans documents,bd3lm,anneal \
        --variants eager-flex,compiled-flex,fp8-compiled-flex
    step cuda_graph_check 220 $PY benchmarks/cuda_graph_check.py --iters 8 \
        --variants "bf16,fp8 delayed,bf16 documents,fp8 documents,bf16 bd3lm,fp8 bd3lm"
    echo "=== status"; cat "$OUT/status.txt"; cat "$OUT/gpu.txt"
    echo "=== fp8-check"; tail -6 "$OUT/fp8_check.log"
    echo "=== fp8 numerics"; tail -16 "$OUT/fp8_numerics.log"
    echo "=== CUDA graphs vs eager"; tail -9 "$OUT/cuda_graph_check.log"
    echo "=== attention gradients against dense eager"; tail -24 "$OUT/attention_grads.log"
    ;;
speed)
    step fp8_block 200 $PY benchmarks/fp8_block.py --no-attention-bench --no-gemm-bench --iters 10 --warmup 3 \
        --variants bf16+graphs,fp8-delayed+graphs,fp8-tensorwise+graphs,fp8-blockwise+graphs,fp8-rowwise+graphs \
        --profile ""
    step train_throughput 150 $PY benchmarks/train_throughput.py --configs qwen3-1.7b/bf16,qwen3-1.7b/fp8 \
        --steps 10 --warmup 3 --timeout 70
    step sft_paths 200 bash benchmarks/sft_paths.sh 10 bf16,fp8,pretrain_bf16,pretrain_fp8
    echo "=== status"; cat "$OUT/status.txt"; cat "$OUT/gpu.txt"
    echo "=== block"; tail -12 "$OUT/fp8_block.log"
    echo "=== trainer qwen3-1.7b"; tail -6 "$OUT/train_throughput.log"
    echo "=== packed SFT and pre-training, qwen3-0.6b"; tail -16 "$OUT/sft_paths.log"
    ;;
quality)
    step generate 120 $PY benchmarks/generate.py
    # up to 3 runs at once: as many as the free memory holds beside the first, the rest after them
    step fp8_convergence 300 $PY benchmarks/fp8_convergence.py --model-path qwen3-0.6b --iters 150 \
        --seq-length 512 --mbs 16 --extra=--no-compile --parallel 3 --json-out "$OUT/fp8_convergence.json"
    step torchrun_overhead 150 $PY benchmarks/torchrun_overhead.py --rounds 1 --iters 30
    echo "=== status"; cat "$OUT/status.txt"; cat "$OUT/gpu.txt"
    echo "=== generate"; tail -8 "$OUT/generate.log"
    echo "=== fp8 convergence"; grep -h "at a time" "$OUT/fp8_convergence.log"
    sed -n '/train loss/,/^training loss/p' "$OUT/fp8_convergence.log"
    echo "=== torchrun overhead"; tail -6 "$OUT/torchrun_overhead.log"
    ;;
models)
    step moe_block 200 $PY benchmarks/moe_block.py
    step lora_memory 200 $PY benchmarks/lora_memory.py --no-build-on-cpu
    echo "=== status"; cat "$OUT/status.txt"; cat "$OUT/gpu.txt"
    echo "=== MoE block"; tail -10 "$OUT/moe_block.log"
    echo "=== LoRA, FP8 vs BF16 base"; tail -8 "$OUT/lora_memory.log"
    ;;
moe)
    step fp8_grouped_check 200 $PY benchmarks/fp8_grouped_check.py
    step fp8_grouped_gemms 60 $PY benchmarks/fp8_grouped_check.py --gemms
    step fp8_grouped_cast 150 $PY benchmarks/fp8_grouped_cast.py --sweep
    step moe_block 200 $PY benchmarks/moe_block.py
    echo "=== status"; cat "$OUT/status.txt"; cat "$OUT/gpu.txt"
    echo "=== FP8 experts against torch casts and fp32"; tail -40 "$OUT/fp8_grouped_check.log"
    echo "=== grouped GEMMs alone, BF16 and FP8 (rowwise)"; tail -13 "$OUT/fp8_grouped_gemms.log"
    echo "=== grouped cast bandwidth"; tail -14 "$OUT/fp8_grouped_cast.log"
    echo "=== MoE block"; tail -10 "$OUT/moe_block.log"
    ;;
e2e)
    # about 8 minutes in all: the workloads the budget leaves out say so in the table (run them with
    # `python3 benchmarks/step_breakdown.py --workloads NAME,...`)
    step fp8_block 120 $PY benchmarks/fp8_block.py --no-attention-bench --no-gemm-bench --iters 10 --warmup 3 \
        --variants bf16+graphs,fp8-rowwise+graphs --profile bf16+graphs,fp8-rowwise+graphs
    step step_breakdown 360 $PY benchmarks/step_breakdown.py --workloads ${E2E_WORKLOADS:-trainer,pretrain,sft,llada-sft,lora} \
        --warmup 3 --steps 2 --llada-layers "${LLADA_LAYERS:-16}" --budget 340 --out "$OUT/step_breakdown"
    echo "=== status"; cat "$OUT/status.txt"; cat "$OUT/gpu.txt"
    echo "=== block (B=2 S=4096, 8B-class): GPU ms by kernel class, then the table"
    grep -A1 "^profile " "$OUT/fp8_block.log"; tail -5 "$OUT/fp8_block.log"
    echo "=== where each workload's step goes, BF16 beside FP8 (table last)"
    grep -E "^[a-z-]+/(bf16|fp8)(:| )" "$OUT/step_breakdown.log"
    sed -n '/one step.s GPU time/,$p' "$OUT/step_breakdown.log"
    ;;
llada)
    # full fine-tuning keeps ~16 bytes a parameter (fp32 weights, gradients, AdamW moments): ~130 GB for 8.0B
    # parameters before activations, more than one H100 holds: the layers that fit are measured there
    LAYERS=${LLADA_LAYERS:-$($PY benchmarks/memory_fit.py llada-8b --seq 4096 --recompute --fp8 --print layers)}
    step llada_sft 500 env OUT="$OUT/llada_sft" SFT_MODEL=llada-8b SFT_MBS=1 \
        SFT_EXTRA="--recompute-granularity full --num-layers $LAYERS" \
        bash benchmarks/sft_paths.sh 6 bf16,fp8
    echo "=== status"; cat "$OUT/status.txt"; cat "$OUT/gpu.txt"
    echo "=== LLaDA-8B packed SFT ($LAYERS of 32 layers, seq 4096, micro-batch 1, recompute): the last line of each"\
         "run, then the table"
    grep -h "iter      6/6" "$OUT"/llada_sft/sft_*.log
    tail -12 "$OUT/llada_sft.log"
    ;;
*)
    echo "gpu_validation.sh: unknown part '$PART'; use correctness, speed, quality, models, moe, e2e or llada" >&2
    exit 2
    ;;
esac
