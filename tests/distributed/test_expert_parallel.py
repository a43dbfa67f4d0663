"""Expert parallelism: MoE blocks with their experts split over 2 ranks compute what one rank computes (fp32 and FP8
experts); a run with --expert-model-parallel-size 2 trains the curve of one process, and checkpoints resume at another
EP size (2 -> 1; 1 -> 2 on 4 ranks under ZeRO-3, each expert sharded over 2). Bad sizes are refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from megadlms.config import ConfigError, TransformerConfig
from megadlms.distributed.config import ParallelConfig
from megadlms.distributed.expert_parallel import check_expert_parallel
from megadlms.distributed.init import init_parallel
from megadlms.training.config import RunConfig
from megadlms.training.run_plan import RunPlan

from .ep_worker import CASES
from .launch import TINY, launch, train_iterations, train_losses

RTOL = 1e-5  # fp32: only the order of floating-point sums differs between the runs
# tiny-moe at TINY's shapes: a dense first layer, then 4 experts (top-2) of width 32. Micro-batches of one sequence
# in every run: the auxiliary loss is a statistic of the micro-batch
TINY_MOE = ["--model-path", "tiny-moe", *TINY[2:], "--moe-layer-freq", "0,1", "--num-moe-experts", "4",
            "--moe-ffn-hidden-size", "32", "--train-iters", "4", "--save-interval", "2", "--micro-batch-size", "1"]


def grad_norms(save) -> list[float]:
    lines = (save / "metrics.jsonl").read_text().splitlines()
    return [r["grad_norm"] for r in map(json.loads, lines) if r["split"] == "train"]


@pytest.fixture(scope="module")
def blocks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ep") / "results.json"
    launch(2, [str(out)], script="tests/distributed/ep_worker.py", rerun_after_native_crash=True)
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", list(CASES))
def test_expert_parallel_block_matches_one_rank(blocks, case):
    r = blocks[case]
    assert r["all_to_all"] and r["global_experts"] == 2 * r["local_experts"]
    assert r["out"] < 1e-6 and r["eval_out"] < 1e-6, r  # the same scales on one rank and two: FP8 too
    # FP8 weight gradients scale each expert over its rows, which expert parallelism gathers from both ranks
    assert r["grads"] < (5e-2 if case == "fp8_rowwise" else 1e-5), r
    if case == "collapsed_router":  # every token to one expert: one rank receives all 2 x 32 rows, the other none
        assert all(sorted(layer) == [0, 64] for layer in r["received"]), r
    else:
        assert all(min(layer) > 0 for layer in r["received"]), r


def test_expert_parallel_training_matches_one_process_and_reshards(tmp_path):
    def run(name: str, nproc: int, *flags: str):
        save = tmp_path / name
        launch(nproc, TINY_MOE + ["--save", str(save), *flags], rerun_after_native_crash=True,
               clean_before_rerun=[save])
        return save

    single = run("single", 1)
    reference = train_losses(single)
    assert len(reference) == 4
    ep2 = run("ep2", 2, "--expert-model-parallel-size", "2")
    assert train_losses(ep2) == pytest.approx(reference, rel=RTOL)
    # the gradient norm over the dense and the expert meshes, clipped (to 1.0) as on one process
    assert grad_norms(ep2) == pytest.approx(grad_norms(single), rel=RTOL) and min(grad_norms(single)) > 1.0
    # the checkpoint holds every expert under one name and its global shape: it loads at any EP size
    from megadlms.training import checkpoint as ckpt

    state = ckpt.load_model_from_checkpoint(ep2 / "iter_0000002")[0].state_dict()
    assert state["layers.1.mlp.experts.gate_proj"].shape == (4, 32, 64)
    on_1 = run("ep2_on_1", 1, "--load", str(ep2), "--ckpt-step", "2")
    # 4 ranks: 2 copies of the experts, each sharded over 2 ranks (their gradients reduced over the copies)
    on_zero3 = run("single_on_ep2_x_zero3", 4, "--expert-model-parallel-size", "2", "--data-parallel-sharding-strategy",
                   "optim_grads_params", "--load", str(single), "--ckpt-step", "2")
    for save in (on_1, on_zero3):
        assert train_iterations(save) == [3, 4]
        assert train_losses(save) == pytest.approx(reference[2:], rel=RTOL)


def test_bad_expert_parallel_sizes_are_refused_in_one_line():
    moe = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=64, vocab_size=96, num_moe_experts=6)
    check_expert_parallel(moe, 3)
    with pytest.raises(ConfigError, match=r"^--num-moe-experts 6 is not divisible by --expert-model-parallel-size 4 "
                                          r".*use an expert-parallel size in \[1, 2, 3, 6\]$"):
        check_expert_parallel(moe, 4)
    dense = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                              ffn_hidden_size=64, vocab_size=96)
    with pytest.raises(ConfigError, match="^--expert-model-parallel-size 2 shards the experts of an MoE model, and "
                                          "this model is dense; add --num-moe-experts"):
        check_expert_parallel(dense, 2)
    with pytest.raises(ConfigError, match="\n  --expert-model-parallel-size 2 takes data parallelism alone for now, "
                                          "not --tensor-model-parallel-size 2; drop one of them\n"):
        RunPlan(RunConfig(parallel=ParallelConfig(expert_model_parallel_size=2, tensor_model_parallel_size=2)),
                moe, world_size=4).check()
    with pytest.raises(ConfigError, match="not --context-parallel-size 2"):
        RunPlan(RunConfig(parallel=ParallelConfig(expert_model_parallel_size=2, context_parallel_size=2)), moe,
                world_size=4).check()
    with pytest.raises(ConfigError, match="--expert-model-parallel-size 0 must be >= 1"):
        ParallelConfig(expert_model_parallel_size=0)
    with pytest.raises(ConfigError, match="^--expert-model-parallel-size 2 needs at least 2 processes; launch with "
                                          "torchrun --nproc_per_node=2"):
        init_parallel("cpu", ep_size=2)  # no torchrun: a world of one process
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ConfigError, match="^world size 1 is not divisible by --expert-model-parallel-size 2; "
                                              "launch a multiple of 2 processes$"):
            init_parallel("cpu", ep_size=2)
    finally:
        dist.destroy_process_group()
    assert torch.distributed.is_initialized() is False
