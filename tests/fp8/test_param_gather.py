"""FP8 parameter all-gather under FSDP2 (--fp8-param-gather): bitwise the losses of gathering in high precision on
2 and 4 gloo ranks for every recipe that has it, 1 byte per weight element on the wire (+ fp32 block scales), the
trainer path with a checkpoint resumed under the flag, and the checks that refuse what cannot be exact."""

from __future__ import annotations

import json
import multiprocessing

import pytest
import torch

from megadlms.build import apply_fp8, construct_model
from megadlms.config import ConfigError, TransformerConfig
from megadlms.distributed.config import ParallelConfig
from megadlms.distributed.init import ParallelContext
from megadlms.distributed.parallelize import apply_fp8_param_gather
from megadlms.fp8 import fp8_step
from megadlms.fp8.formats.blockwise import dequantize_blocks, quantize_blocks
from megadlms.fp8.integrations.param_gather import (
    Float8GatheredWeight,
    Float8GatherWeight,
    ParamGatherError,
    ScaleGroup,
    check_gather_shardable,
    gathered_fp8,
)
from megadlms.fp8.tensor import Scaling
from megadlms.training.config import FP8Config, RunConfig
from tests.distributed.launch import train_iterations, train_losses

from .param_gather_worker import RECIPES
from .param_gather_worker import main as worker_main

WORLD = 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """4 ranks forked from this process (torch already imported: they start in well under a second)."""
    out = tmp_path_factory.mktemp("param_gather")
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=worker_main, args=(r, WORLD, str(out / "init"), str(out))) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
    assert [p.exitcode for p in procs] == [0] * WORLD, "a rank failed (its traceback is in the captured output)"
    return out, json.loads((out / "library.json").read_text())


@pytest.mark.parametrize("shards", [2, WORLD])
@pytest.mark.parametrize("recipe", [r for r, _ in RECIPES])
def test_fp8_gather_trains_exactly_like_the_high_precision_gather(runs, shards, recipe):
    _, lib = runs
    hp, fp8 = lib[f"{shards}/{recipe}/hp"], lib[f"{shards}/{recipe}/fp8"]
    assert fp8["losses"] == hp["losses"]  # bitwise: each gathered FP8 weight is the cast of the whole weight
    assert len(set(hp["losses"])) == len(hp["losses"])  # the weights changed between the steps


@pytest.mark.parametrize("shards", [2, WORLD])
@pytest.mark.parametrize("recipe", [r for r, _ in RECIPES])
def test_all_gather_sends_one_byte_per_weight_element(runs, shards, recipe):
    _, lib = runs
    hp, fp8 = lib[f"{shards}/{recipe}/hp"], lib[f"{shards}/{recipe}/fp8"]
    exp = hp["expected"]
    root = [exp["root"], "torch.float32"]
    assert len(hp["sent"]) == len(fp8["sent"]) > 0
    assert {tuple(s) for s in hp["sent"]} == {tuple(root), (exp["layer_hp"], "torch.float32")}
    # the layer's gather: its FP8 linears' weights as 1 byte each (the fp32 norms and block scales beside them)
    assert fp8["sent"] == [root if s == root else [exp["layer_fp8"], "torch.uint8"] for s in hp["sent"]]
    assert exp["layer_fp8"] < exp["layer_hp"] / 3.9


def test_trainer_gathers_in_fp8_with_the_same_losses_and_resumes_a_checkpoint(runs):
    out, _ = runs
    hp = train_losses(out / "hp")
    assert len(hp) == 3
    assert train_losses(out / "fp8") == hp
    # the checkpoint saved with the flag holds the plain master weights: it resumes without the flag
    assert train_iterations(out / "resumed") == [3]
    assert train_losses(out / "resumed") == hp[2:]


# ------------------------------------------------------------------------------------------------ one process

def _model(recipe: str = "tensorwise", fmt: str = "hybrid", hidden: int = 128) -> torch.nn.Module:
    cfg = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=2, num_query_groups=1,
                            ffn_hidden_size=hidden, vocab_size=32, seq_length=8, fp8=True, fp8_format=fmt,
                            fp8_recipe=recipe)
    torch.manual_seed(0)
    return apply_fp8(construct_model(cfg), cfg)


def test_blockwise_needs_whole_row_blocks_per_shard():
    check_gather_shardable("w", (512, 64), "blockwise", 4)
    with pytest.raises(ParamGatherError, match=r"384 rows.*multiple of 256"):
        check_gather_shardable("w", (384, 128), "blockwise", 2)
    with pytest.raises(ParamGatherError, match="not rowwise"):
        check_gather_shardable("w", (256, 128), "rowwise", 2)
    check_gather_shardable("w", (100, 32), "tensorwise", 3)  # any shape: the scale is one number


@pytest.mark.parametrize("fp8, parallel, match", [
    (FP8Config(), ParallelConfig(use_distributed_optimizer=True), "add --fp8-format"),
    (FP8Config(fp8_format="hybrid", fp8_recipe="rowwise"), ParallelConfig(use_distributed_optimizer=True),
     "--fp8-recipe delayed, tensorwise, blockwise, not rowwise"),
    (FP8Config(fp8_format="hybrid"), ParallelConfig(), "no_shard shards none"),
    (FP8Config(fp8_format="hybrid"), ParallelConfig(use_distributed_optimizer=True, tensor_model_parallel_size=2),
     "not with --tensor-model-parallel-size 2"),
])
def test_the_flag_refuses_what_it_cannot_gather(fp8, parallel, match):
    from megadlms.training.run_plan import RunPlan

    run = RunConfig(fp8=FP8Config(**{**fp8.__dict__, "fp8_param_gather": True}), parallel=parallel)
    with pytest.raises(ConfigError, match=match):
        RunPlan(run, TransformerConfig(), world_size=4).check()


def test_one_rank_or_undividable_shapes_fail_naming_the_fix():
    zero1 = ParallelConfig(use_distributed_optimizer=True)
    with pytest.raises(ConfigError, match="one data-parallel rank"):
        apply_fp8_param_gather(_model(), ParallelContext(world_size=1), zero1)
    with pytest.raises(ParamGatherError, match=r"layers\.0\.self_attn\.q_proj\.weight has 256 rows.*multiple of 512"):
        apply_fp8_param_gather(_model("blockwise", "e4m3", hidden=256), ParallelContext(world_size=4), zero1)


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_fused_group_members_cast_with_the_fused_weights_scale(recipe):
    """The shards of q/k/v cast one by one (here each whole, one rank) concatenate to the fused path's FP8 weight."""
    model = _model(recipe)
    attn = model.layers[0].self_attn
    fused = attn.qkv_fusion
    mods = fused.members()
    if recipe == "delayed":  # scales from a history: the group's is the smallest member scale
        for i, m in enumerate(mods):
            m.fp8_amax_history[0, 1] = 0.5 * (i + 1)
        fp8_step(model)
    want = fused.fp8_weight(grad_follows=False)
    masters = [m.weight.detach().clone() for m in mods]
    group = ScaleGroup(mods)
    for i, m in enumerate(mods):
        m.weight = torch.nn.Parameter(Float8GatherWeight(m.weight.data, group, i))
    ops = [group.cast_shard(i, w, None) for i, w in enumerate(masters)]
    assert torch.equal(torch.cat([op.data for op in ops]).view(torch.uint8), want.rows.data.view(torch.uint8))
    assert all(torch.equal(op.scale_inv, want.rows.scale_inv) and op.scaling is Scaling.TENSOR for op in ops)
    # gathered in FP8, the members' rows are the fused GEMM's weight, with the group's step scales, uncached
    for m, op in zip(mods, ops):
        m.weight = torch.nn.Parameter(Float8GatheredWeight(op, group, torch.float32), requires_grad=False)
    fused.invalidate_fp8_weight_cache()
    got = fused.fp8_weight(grad_follows=True)
    assert torch.equal(got.rows.data.view(torch.uint8), want.rows.data.view(torch.uint8))
    assert torch.equal(got.rows.scale_inv, want.rows.scale_inv)
    assert [mc.rows.shape[0] for mc in got.members] == [m.out_features for m in mods] and fused.weight_cache is None
    if recipe == "delayed":
        assert torch.equal(got.step.scales, want.step.scales) and float(got.step.scales[1]) == pytest.approx(448 / 1.5)
    else:
        assert got.step is None and want.step is None


def test_gathered_weight_is_the_operand_of_the_layers_cast():
    w = torch.randn(256, 200)
    q, _ = quantize_blocks(w)  # padded to [256, 256], block scales in the GEMM's [2, 4] buffer
    gathered = Float8GatheredWeight(q.with_data(q.data[:, :200].contiguous(), q.scale_inv[:, :2].contiguous()),
                                    ScaleGroup(()), torch.float32)
    op = gathered_fp8(gathered)
    assert op.scaling is Scaling.BLOCK and torch.equal(op.data.view(torch.uint8), q.data.view(torch.uint8))
    assert torch.equal(op.scale_inv, q.scale_inv)
    assert torch.equal(gathered + 0, dequantize_blocks(q.data, q.scale_inv)[:, :200])  # other ops: dequantised
    assert gathered_fp8(w) is None


def test_wrapped_weight_is_its_high_precision_tensor_and_checkpoints_plain():
    model = _model()
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    zero1 = ParallelConfig(use_distributed_optimizer=True)
    n = apply_fp8_param_gather(model, ParallelContext(world_size=2), zero1)
    assert n == 7  # q, k, v, o, gate, up, down
    q_proj = model.layers[0].self_attn.q_proj
    assert isinstance(q_proj.weight.data, Float8GatherWeight) and isinstance(q_proj.weight[:4], Float8GatherWeight)
    with torch.no_grad():
        q_proj.weight.mul_(2.0)
    assert torch.equal(q_proj.weight._tensor, 2 * ref["layers.0.self_attn.q_proj.weight"])
    sd = model.state_dict()
    assert type(sd["layers.0.self_attn.q_proj.weight"]) is torch.Tensor  # what a checkpoint stores
    model.load_state_dict(ref)
    assert torch.equal(q_proj.weight._tensor, ref["layers.0.self_attn.q_proj.weight"])
