"""FP8 parameter all-gather under FSDP2: the same losses as gathering in high precision (bitwise, 2 gloo ranks),
1 byte per weight element on the wire (+ fp32 block scales), and the shard checks."""

from __future__ import annotations

import json
import multiprocessing

import pytest
import torch

from megadlms.fp8.param_gather import (
    Float8GatherWeight,
    ParamGatherError,
    check_gather_shardable,
    quantize_weight_tensorwise,
)

from .param_gather_worker import main as worker_main

SHAPES = [(256, 128), (256, 256)]
WORLD = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both ranks forked from this process (torch already imported: the ranks start in well under a second)."""
    out = tmp_path_factory.mktemp("param_gather")
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=worker_main, args=(r, WORLD, str(out / "init"), str(out))) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0] * WORLD, "a rank failed (its traceback is in the captured output)"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("kind", ["tensorwise", "blockwise"])
def test_fp8_gather_trains_exactly_like_the_high_precision_gather(runs, kind):
    for rank in runs:
        hp, fp8 = rank[f"{kind}/hp"], rank[f"{kind}/fp8"]
        assert fp8["losses"] == hp["losses"]  # bitwise: the gathered FP8 weight is the cast of the whole weight
        assert hp["losses"][-1] < hp["losses"][0]  # it trained
        # one byte per weight element instead of four, plus one fp32 scale per 128x128 block for blockwise
        shard = {4 * n * k // WORLD: n * k // WORLD + (4 * (n // WORLD // 128) * (k // 128) if kind == "blockwise"
                                                       else 0) for n, k in SHAPES}
        assert len(hp["bytes"]) == len(fp8["bytes"]) > 0
        assert set(hp["bytes"]) == set(shard)
        assert fp8["bytes"] == [shard[b] for b in hp["bytes"]]


def test_blockwise_needs_whole_row_blocks_per_shard():
    check_gather_shardable("w", (512, 64), "blockwise", 4)
    with pytest.raises(ParamGatherError, match=r"384 rows.*multiple of 256"):
        check_gather_shardable("w", (384, 128), "blockwise", 2)
    with pytest.raises(ParamGatherError, match="tensorwise, blockwise"):
        check_gather_shardable("w", (256, 128), "delayed", 2)
    check_gather_shardable("w", (100, 30), "tensorwise", 3)  # any shape: the scale is one number


def test_shard_casts_with_the_reduced_amax_concatenate_to_the_whole_cast():
    w = torch.randn(96, 64)
    whole, s = quantize_weight_tensorwise(w, w.abs().amax())
    parts = [quantize_weight_tensorwise(p, w.abs().amax()) for p in w.chunk(3)]
    assert torch.equal(torch.cat([q for q, _ in parts]).view(torch.uint8), whole.view(torch.uint8))
    assert all(torch.equal(ps, s) for _, ps in parts)


def test_wrapped_weight_behaves_as_its_high_precision_tensor():
    w = torch.randn(8, 4)
    p = torch.nn.Parameter(Float8GatherWeight(w.clone(), "tensorwise"))
    assert isinstance(p.data, Float8GatherWeight) and isinstance(p.detach()[:4], Float8GatherWeight)
    with torch.no_grad():
        p.mul_(2.0)
    assert torch.equal(p._tensor, 2 * w)
