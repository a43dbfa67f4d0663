"""Every GPU benchmark script runs end to end in its CPU smoke form (a broken script must not cost device time).

Each runs in its own process, as on the GPU machine, and must exit 0 and print its result table."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SMOKES = {
    # (torchao's variant where torchao is installed)
    "fp8_block": (["--smoke", "--variants", "bf16,fp8-delayed,fp8-tensorwise,fp8-tensorwise-amax,bf16+graphs,"
                   "fp8-delayed+graphs"
                   + (",torchao" if importlib.util.find_spec("torchao") else "")], "fp8-delayed+graphs "),
    "fp8_numerics": (["--device", "cpu", "--small"], "budgets:"),
    "generate": (["--device", "cpu", "--preset", "tiny", "--gen-length", "16", "--block-length", "8", "--steps", "16",
                  "--prompt-length", "8", "--batch-sizes", "1", "2"], "fast dual"),
    "fp8_convergence": (["--smoke", "--iters", "3", "--variants", "bf16,fp8 delayed/hybrid", "--parallel", "2",
                         "--log-dir", "logs/new"], "validation loss by mask ratio t"),  # a log folder made here
    "train_throughput": (["--smoke", "--steps", "1", "--warmup", "1", "--accum", "2"], "tiny/fp8"),
    "cuda_graph_check": (["--smoke"], "fp8 tensorwise "),
    # the count's wait is timed: on the CPU the count is ready at once
    "host_sync_probe": (["--smoke", "--fp8"], "host ms waiting for the count:   0.0"),
    "fp8_attention": (["--smoke"], "tiny | "),
    "bd3lm_likelihood": (["--smoke"], "ordering AR <= B=4 <= B=16 <= MDLM: "),
    "moe_block": (["--smoke"], "qwen3-30b-a3b    | fp8-tensorwise  | "),
    "fp8_grouped_check": (["--smoke", "--gemms"], "qwen3-30b-a3b    | down       | wgrad | "),
    "lora_memory": (["--smoke"], "fp8 vs bf16 base: peak memory"),
    "fp8_cpu_speed": (["--smoke"], "fp8 rowwise      | "),
    # both kinds of run (the trainer's, LoRA's) in the slower precision; BF16 beside FP8 is the same code
    "step_breakdown": (["--smoke", "--warmup", "1", "--steps", "1", "--workloads", "pretrain,lora", "--precisions",
                        "fp8"], "lora: one step's CPU (op self time) time by category"),
    "attention_grad_check": (["--device", "cpu", "--model-path", "tiny", "--layers", "1", "--seq-length", "64",
                              "--batches", "2", "--plans", "documents,bd3lm", "--variants", "eager-dense"],
                             "attention gradients: ok"),
}


def _env(**extra: str) -> dict[str, str]:
    """The scripts' environment: this checkout first on the path, one OpenMP thread (the smokes' matrices are
    tiny: a second thread only contends with the other test worker)."""
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "OMP_NUM_THREADS": "1", **extra}


@pytest.mark.parametrize("name", list(SMOKES))
def test_benchmark_smoke(name, tmp_path):
    args, expect = SMOKES[name]
    env = _env(MEGADLMS_CACHE=str(tmp_path / "cache"), OUT=str(tmp_path / "out"))
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), *args], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert expect in res.stdout, res.stdout[-3000:]
    # a table row of a failed variant or configuration (the scripts go on to the next one and exit 0)
    assert " ERROR " not in res.stdout and "FAILED" not in res.stdout, res.stdout[-3000:]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_fp8_cast_sweep_smoke(tmp_path):
    """The cast sweep in Triton's interpreter on the CPU: one tile, the formulations checked and timed (rounded in
    fp32 arithmetic: the interpreter's emulation of the FP8 conversion does not round to nearest even)."""
    env = _env(TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fp8_cast_sweep.py"), "--smoke", "--tiles",
                          "64x64x4", "--modes", "0,1", "--roundings", "sw"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "WRONG" not in res.stdout and "swiglu bwd llama" in res.stdout.splitlines()[-1], res.stdout[-3000:]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_fp8_cast_sweep_amax_smoke(tmp_path):
    """The amax sweeps (current scaling's amax kernel, the fused MLP's amax passes) in Triton's interpreter: every
    tile agrees with torch, and each tensor gets its summary line."""
    env = _env(TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fp8_cast_sweep.py"), "--smoke", "--kinds",
                          "amax,swiglu_amax"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    lines = res.stdout.splitlines()
    assert "WRONG" not in res.stdout and res.stdout.count(" ok") == 16, res.stdout[-3000:]
    assert sum(line.startswith("swiglu amax bwd llama") for line in lines) == 1, res.stdout[-3000:]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_adamw_speed_smoke(tmp_path):
    """The optimizer benchmark with the AdamW kernel in Triton's interpreter: it runs, and StreamingAdamW agrees with
    torch's fused AdamW."""
    env = _env(TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "adamw_speed.py"), "--smoke"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    err = float(re.search(r"steps: ([0-9.e+-]+);", res.stdout).group(1))
    assert "StreamingAdamW " in res.stdout and err < 1e-3, res.stdout[-3000:]
    assert "FP8 weight amaxes kept by the step: exact" in res.stdout, res.stdout[-3000:]


def test_graph_pool_peak_sites_replays_a_snapshot():
    """The graph pool's peak from a snapshot's allocation history: only allocations inside graph-pool segments
    (mapped before them), grouped by the innermost MegaDLMs line."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from train_throughput import graph_pool_peak_sites

    ours = [{"filename": "/x/megadlms/fp8/linear.py", "line": 10, "name": "forward"}]
    inductor = [{"filename": "/tmp/torchinductor/ab.py", "line": 3, "name": "call"}]
    ev = [{"action": "alloc", "addr": 1100, "size": 999, "frames": ours},  # before the pool's segment: not counted
          {"action": "free_requested", "addr": 1100, "size": 999},
          # a default-pool segment at the same address, freed before the pool maps it: not the pool's allocations
          {"action": "segment_alloc", "addr": 1000, "size": 1000},
          {"action": "alloc", "addr": 1000, "size": 900, "frames": ours},
          {"action": "free_requested", "addr": 1000, "size": 900},
          {"action": "segment_free", "addr": 1000, "size": 1000},
          {"action": "segment_alloc", "addr": 1000, "size": 1000},
          {"action": "alloc", "addr": 1100, "size": 300, "frames": ours},
          {"action": "alloc", "addr": 5000, "size": 700, "frames": ours},  # the default pool
          {"action": "alloc", "addr": 1500, "size": 200, "frames": inductor},
          {"action": "free_requested", "addr": 1100, "size": 300},
          {"action": "alloc", "addr": 1100, "size": 100, "frames": ours}]
    snap = {"segments": [{"address": 1000, "total_size": 1000, "segment_pool_id": (1, 1)},
                         {"address": 5000, "total_size": 1000, "segment_pool_id": (0, 0)}],
            "device_traces": [ev]}
    got = graph_pool_peak_sites(snap, 5)
    assert got["peak_gib"] == round(500 / 2**30, 2)
    assert [(n, w) for _, n, w in got["sites"]] == [(1, "fp8/linear.py:10 forward"), (1, "ab.py:3 call")]
    assert [g for g, _, _ in got["sites"]] == [round(300 / 2**30, 3), round(200 / 2**30, 3)]


def test_step_time_breakdown_of_a_result():
    """The timed steps' time per step: wall, host per train_step (mean, max), the collector's and loader's share per
    step, and the GPU time between step starts (min, median, max)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from train_throughput import step_time_breakdown

    r = {"ms_per_step": 300.0, "host_step_ms": [100.0, 290.0, 310.0, 300.0], "gc_ms": 8.0, "data_wait_ms": 2.0,
         "gpu_step_ms": [305.0, 295.0, 330.0, 300.0]}
    got = step_time_breakdown(r)
    assert got["host per train_step (mean)"] == 250.0 and got["host per train_step (max)"] == 310.0
    assert got["gc over the timed steps / step"] == 2.0 and got["data loader wait / step"] == 0.5
    assert (got["GPU between step starts (min)"], got["GPU between step starts (median)"],
            got["GPU between step starts (max)"]) == (295.0, 305.0, 330.0)
    # a CPU run has no CUDA events: no GPU rows
    assert "GPU between step starts (min)" not in step_time_breakdown({**r, "gpu_step_ms": []})


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_fp8_store_check_smoke(tmp_path):
    """The transposed-store check in Triton's interpreter: every kernel and formulation runs, and the interpreter's
    stores are right (a counting error would show here as a bad call)."""
    env = _env()
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fp8_store_check.py"), "--smoke"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = [line.split() for line in res.stdout.splitlines() if line.startswith(("cast ", "swiglu "))]
    assert len(rows) == 16, res.stdout[-3000:]  # 2 formulations of 8 kernel variants
    counts = [r[:-1] if r[-1] == "yes" else r for r in rows]  # "yes": the formulation training runs
    assert all(r[-5:] == ["2", "0", "0", "None", "0"] for r in counts), res.stdout[-3000:]
    assert sum(r[-1] == "yes" for r in rows) == 8  # one per kernel variant


def test_bd3lm_likelihood_gives_bd3lm_options_to_the_bd3lm_variants_only():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bd3lm_likelihood
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    argv = ["--no-bd3lm-antithetic", "--ignore-bos", "--bd3lm-clip-min", "0.3", "--bd3lm-clip-max=0.8",
            "--diffusion-loss", "full-vocab", "--bd3lm-clip-search-widths", "0.5", "0.6"]
    assert bd3lm_likelihood.without_bd3lm_flags(argv) == ["--ignore-bos", "--diffusion-loss", "full-vocab"]


def test_fp8_block_runs_torchao_by_default_only_where_it_is_installed(monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import fp8_block
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    assert fp8_block.default_variants() == "bf16,fp8-delayed,fp8-tensorwise"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "torchao" else real(name, *a))
    assert fp8_block.default_variants() == "bf16,fp8-delayed,fp8-tensorwise,torchao"


def test_synthetic_corpus_holds_no_special_ids(tmp_path):
    """The benchmarks' synthetic corpus draws ordinary ids only: no mask id (its target makes the loss non-finite),
    no pad id, and the EOD id only as each document's last token."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from train_throughput import write_corpus

    from megadlms.data import IndexedDataset, load_tokenizer

    tok = load_tokenizer()
    write_corpus(tmp_path / "c", vocab=128000, n_tokens=40_000)
    docs = IndexedDataset(tmp_path / "c")
    body = np.concatenate([docs[i][:-1] for i in range(len(docs))])
    assert body.size >= 30_000 and all(docs[i][-1] == tok.eod_id for i in range(len(docs)))
    assert not np.isin(body, [tok.eod_id, tok.mask_id, tok.pad_id]).any()
    assert body.max() == tok.vocab_size - 1 and body.min() == 3  # the rest of the vocabulary is drawn


def test_timed_steps_with_a_non_finite_loss_or_a_skipped_step_fail_the_benchmark():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from train_throughput import check_timed_steps

    check_timed_steps("ok", [8.1, 7.9], 0)
    with pytest.raises(SystemExit, match=r"tiny/fp8: 0 of 2 timed steps skipped, non-finite loss at steps \[1\]"):
        check_timed_steps("tiny/fp8", [8.1, float("nan")], 0)
    with pytest.raises(SystemExit, match="tiny/bf16: 1 of 2 timed steps skipped"):
        check_timed_steps("tiny/bf16", [8.1, 0.0], 1)


def test_torchrun_overhead_refuses_log_intervals_with_skipped_steps(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from torchrun_overhead import interval_throughput

    rows = [{"split": "train", "iteration": 2, "loss": 8.0, "tokens_per_s": 10.0},
            {"split": "train", "iteration": 4, "loss": 7.0, "tokens_per_s": 12.0}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert interval_throughput(tmp_path, 1) == [12.0]
    rows[1].update(loss=float("nan"), skipped_steps=2)
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(SystemExit, match=r"plain: non-finite loss or skipped steps .* iterations \[4\]"):
        interval_throughput(tmp_path, 1, "plain")


def test_sft_paths_table_fails_on_a_logged_non_finite_loss(tmp_path):
    """sft_paths.sh's table reads the runs' logs; a run that logged `loss nan` or skipped steps makes it exit 1."""
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "data").mkdir(parents=True)
    (work / "data" / "reverse_chat_document.idx").touch()  # the data is there: nothing is built
    out.mkdir()
    good = ("iter      1/2 | loss 11.9800 | lr 1e-4 | 75,706 tok/s\n"
            "iter      2/2 | loss 8.5100 | lr 1e-4 | 75,800 tok/s\n")
    (out / "sft_bf16.log").write_text(good)
    env = _env(OUT=str(out), SFT_WORK=str(work), PY=sys.executable)
    cmd = ["bash", str(ROOT / "benchmarks" / "sft_paths.sh"), "2", "none"]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "75,800" in res.stdout, res.stdout + res.stderr
    (out / "sft_fp8.log").write_text(good.replace("loss 8.5100 |", "loss nan | skipped 1 |"))
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and "sft_fp8.log: iter      2/2 | loss nan" in res.stderr, res.stdout + res.stderr


def test_memory_fit_sizes_runs_from_the_free_memory():
    """The benchmarks' sizes from the free memory: llama3-8b with 16 layers trains at micro-batch 1 on an 80 GB card
    (2 ran out of memory there) and more on a 141 GB one; LLaDA-8B SFT under full recompute fits 18 of its 32 layers
    on 79 GiB and all of them on 139 GiB; concurrent runs from one run's measured share."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from memory_fit import GIB, concurrent_runs, fitting_layers, fitting_micro_batch, training_memory
    from train_throughput import config_of

    llama16 = config_of(CONFIGS_LLAMA16, 4096)
    assert fitting_micro_batch(llama16, 4096, 4, 79 * GIB, fp8=True) == 1
    assert fitting_micro_batch(llama16, 4096, 4, 139 * GIB, fp8=True) == 4
    assert fitting_micro_batch(llama16, 4096, 4, None) == 4  # no GPU: as asked
    from megadlms.presets import load_model_config

    llada = load_model_config("llada-8b", seq_length=4096)
    mem = training_memory(llada.replace(num_layers=16), 4096, recompute=True)
    assert abs(mem.total(1) / GIB / 67.64 - 1) < 0.02  # measured on an H100: 67.64 GiB allocated at its peak
    assert fitting_layers(llada, 4096, 1, 79 * GIB, recompute=True) == 18
    assert fitting_layers(llada, 4096, 1, 139 * GIB, recompute=True) == 32
    # the first run took 30 of 80 GiB: one more at 1.25 x 30 fits the 50 left; of 140 GiB, two more
    assert concurrent_runs(80 * GIB, 50 * GIB, 3) == 2
    assert concurrent_runs(140 * GIB, 110 * GIB, 8) == 3
    assert concurrent_runs(80 * GIB, 70 * GIB, 3) == 3 and concurrent_runs(80 * GIB, 10 * GIB, 3) == 1


CONFIGS_LLAMA16 = ["--model-path", "llama3-8b", "--num-layers", "16"]


def test_step_breakdown_categories_and_ceiling():
    """Kernels go to the host scope that launched them, else to a category by name; the GPU's idle time is the
    profiled step less its kernels; the ceiling is the step with the layers' GEMMs at twice the speed."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from step_breakdown import breakdown, ceiling

    items = [("sm90_xmma_gemm_bf16bf16_bf16f32", None, 6.0), ("nvjet_tst_128x256", None, 1.0),
             ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", None, 2.0),
             ("cast_transpose_kernel", None, 0.5), ("rowwise_cast_kernel", None, 0.25),
             ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", None, 0.25), ("triton_tem_fused_0", None, 0.25),
             ("nvjet_tst_256x128", "lm head + loss", 1.5), ("_adamw_kernel", "optimizer", 0.25),
             ("cast_transpose_kernel", "fp8 scales + weight casts", 0.25), ("mystery", None, 0.25)]
    b = breakdown(items, wall_ms=14.0)
    assert (b["gemm"], b["attention"], b["fp8 casts"], b["norms + elementwise"]) == (7.0, 2.25, 0.75, 0.25)
    assert (b["lm head + loss"], b["optimizer"], b["fp8 scales + weight casts"], b["other"]) == (1.5, 0.25, 0.25, 0.25)
    assert b["kernels"] == 12.5 and b["idle (host gaps)"] == 1.5 and b["step (profiled)"] == 14.0
    c = ceiling(b)
    assert c["untouched share"] == 0.5 and c["ceiling"] == 14.0 / 10.5


def test_fp8_convergence_reports_the_gap_per_mask_ratio(capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from fp8_convergence import report_by_mask_ratio

    base = {"variant": "bf16", "eval_by_t": {"0.05": 10.0, "0.95": 4.0}}
    fp8 = {"variant": "fp8 delayed/hybrid", "eval_by_t": {"0.05": 10.02, "0.95": 4.04}}
    report_by_mask_ratio([base, fp8], base)
    out = capsys.readouterr().out
    assert fp8["worst_bucket_gap_pct"] == pytest.approx(1.0)
    assert " +0.2 " in out and " +1.0!" in out  # within the 0.5% budget at t=0.05, past it at t=0.95


def test_step_breakdown_finds_the_largest_fitting_micro_batch():
    """--fit probes from the estimate up while runs fit, or down until one does; a failure other than memory stops
    it loudly."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from step_breakdown import largest_fitting

    def runner(limit, calls):
        def run(w, prec, batch=None, layers=None, profile=True, label=""):
            n = layers if layers is not None else batch
            calls.append(n)
            if n > limit:
                return {"name": w, "error": "out of memory", "oom": True}
            return {"name": w, "peak_gib": 10.0 * n, "reserved_gib": 11.0 * n}
        return run

    calls = []
    got = largest_fitting(runner(3, calls), "llada-sft", "fp8", "micro-batch", 2)
    assert got["largest"] == 3 and calls == [2, 3, 4]
    assert got["runs"] == {2: (20.0, 22.0), 3: (30.0, 33.0), 4: "out of memory"}
    calls = []
    assert largest_fitting(runner(16, calls), "llada-sft", "bf16", "layers", 18)["largest"] == 16
    assert calls == [18, 17, 16]
    calls = []
    assert largest_fitting(runner(0, calls), "llada-sft", "bf16", "micro-batch", 2)["largest"] == 0
    assert calls == [2, 1]

    def broken(w, prec, **kw):
        return {"name": w, "error": "rc=1", "oom": False}

    with pytest.raises(SystemExit, match="other than memory"):
        largest_fitting(broken, "sft", "fp8", "micro-batch", 1)


def test_step_breakdown_summary_row(capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from step_breakdown import breakdown, report

    b = breakdown([("sm90_xmma_gemm_bf16", None, 6.0), ("fmha", None, 2.0)], wall_ms=10.0)
    f = breakdown([("sm90_xmma_gemm_e4m3", None, 3.0), ("cast_transpose_kernel", None, 1.0), ("fmha", None, 2.0)],
                  wall_ms=7.0)
    runs = {"bf16": {"name": "sft/bf16", "tokens_per_s": 1000.0, "peak_gib": 40.0, "reserved_gib": 44.0,
                     "breakdown": b},
            "fp8": {"name": "sft/fp8", "tokens_per_s": 1400.0, "peak_gib": 30.0, "reserved_gib": 34.0,
                    "breakdown": f}}
    report({"sft": runs}, "GPU")
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("sft  "))
    # 1.4x; memory 0.75x; 40% of the BF16 step outside its GEMMs; ceiling 10 / (10 - 3) ms
    assert row.split() == ["sft", "1000", "1400", "1.400", "40.00", "30.00", "0.75", "44.00", "34.00", "40.0%", "1.43"]


def test_lora_memory_ids_leave_out_the_mask_id():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from lora_memory import random_ids

    from megadlms.presets import load_model_config

    cfg = load_model_config("tiny").replace(vocab_size=8, mask_token_id=3)
    ids = random_ids(cfg, (4000,), "cpu")
    assert sorted(ids.unique().tolist()) == [0, 1, 2, 4, 5, 6, 7]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_fp8_cast_sweep_rowwise_smoke(tmp_path):
    """The rowwise casts' sweep in Triton's interpreter: every tile agrees bitwise with the torch casts."""
    env = _env(TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fp8_cast_sweep.py"), "--smoke", "--kinds",
                          "rowwise"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "WRONG" not in res.stdout and res.stdout.count(" ok") == 6, res.stdout[-3000:]
    assert res.stdout.splitlines()[-1].startswith("qwen gate weight fp32"), res.stdout[-3000:]


def test_step_breakdown_charges_gpu_kernels_to_the_scope_that_launched_them():
    """On a GPU each kernel event is linked to the host op that launched it; a kernel under the LM head's range is
    charged to it, one under no range (or linked to none, as a CUDA-graph replay's may be) by its name."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from step_breakdown import breakdown, profiled_items

    def ev(i, name, start, end, device=DeviceType.CPU, link=0):
        return FunctionEvent(id=i, name=name, thread=0, start_us=start, end_us=end, device_type=device,
                             linked_correlation_id=link)

    scope, head_mm, mm = ev(1, "lm head + loss", 0, 100), ev(2, "aten::mm", 10, 20), ev(3, "aten::mm", 200, 210)
    head_mm.set_cpu_parent(scope)
    kernels = [ev(10, "nvjet_tst_256x128", 20, 1520, DeviceType.CUDA, link=2),
               ev(11, "nvjet_tst_128x256", 300, 2300, DeviceType.CUDA, link=3),
               ev(12, "triton_tem_fused_0", 2400, 3400, DeviceType.CUDA)]

    class Prof:
        def events(self):
            return [scope, head_mm, mm, *kernels]

    items = profiled_items(Prof(), cuda=True)
    assert items == [("nvjet_tst_256x128", "lm head + loss", 1.5), ("nvjet_tst_128x256", None, 2.0),
                     ("triton_tem_fused_0", None, 1.0)]
    b = breakdown(items, wall_ms=5.0)
    assert (b["lm head + loss"], b["gemm"], b["attention"], b["idle (host gaps)"]) == (1.5, 2.0, 1.0, 0.5)
