"""megadlms.training.cuda_graphs: replays of the layers' forward and backward, on CPU through EmulatedGraph
(a replay re-runs the captured call and writes the static outputs, as a CUDA graph replay does)."""

from __future__ import annotations

import copy
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megadlms.config import ConfigError, TransformerConfig
from megadlms.fp8 import DelayedScaling, Float8CurrentScaling, convert_to_fp8, enable_fp8_stats, fp8_step
from megadlms.fp8.state import fp8_autocast
from megadlms.model import TransformerLM
from megadlms.training.cuda_graphs import LayerGraphs


def _model(fp8: str | None = None) -> TransformerLM:
    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=96, vocab_size=128, seq_length=32, attn_mask_type="bidirectional")
    model = TransformerLM(cfg)
    if fp8 == "delayed":
        convert_to_fp8(model, DelayedScaling())
    elif fp8 == "current":
        convert_to_fp8(model, Float8CurrentScaling())
    return model


def _step(model: TransformerLM, opt: torch.optim.Optimizer, batches: list[torch.Tensor], fp8: bool) -> list[float]:
    """One optimizer step with gradient accumulation over `batches`; the losses of the micro-batches."""
    losses = []
    for ids in batches:
        loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()) / len(batches)
        loss.backward()
        losses.append(loss.item())
    opt.step()
    opt.zero_grad(set_to_none=True)
    if fp8:
        fp8_step(model)
    return losses


@pytest.mark.parametrize("fp8,per_step", [(None, False), ("delayed", False), ("current", False), ("delayed", True),
                                          ("current", True)])
@pytest.mark.parametrize("accum", [1, 3])
def test_replayed_training_matches_eager(fp8, per_step, accum):
    """per_step: the FP8 weights cast outside the graphs once per step (fp8.integrations.graph_weights), the graphs
    reading the caches; a weight the refresh missed would be a step stale and the losses would part."""
    eager = _model(fp8)
    graphed = copy.deepcopy(eager)
    graphs = LayerGraphs(graphed, emulate=True, fp8_weights_per_step=per_step)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, graphed)]
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        batches = [torch.randint(0, 128, (2, 32), generator=g) for _ in range(accum)]
        ref = _step(eager, opts[0], batches, fp8 is not None)
        got = _step(graphed, opts[1], batches, fp8 is not None)
        assert got == pytest.approx(ref, rel=1e-5, abs=1e-6), step
        graphs.arm()  # armed after the first step, as the trainer does
    assert graphs.captured is not None
    assert graphs.num_replays == 3 * accum
    if per_step:  # captured after the first step, recast after each of the two steps that followed
        assert graphs.captured.weights is not None and graphs.captured.weights.num_refreshes == 2
        assert all(m.num_weight_casts == 3 + 1 for m in graphs.captured.weights.modules)  # eager, capture, 2 refreshes
    for (name, p), q in zip(eager.named_parameters(), graphed.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)
    for b, c in zip(eager.buffers(), graphed.buffers()):
        torch.testing.assert_close(c, b)


def test_grad_buffer_taken_by_autograd_is_not_overwritten():
    """Without zeroing to None between steps (set_to_none=False), .grad may be the graph's own buffer; the next
    backward replay must not double it."""
    eager = _model()
    graphed = copy.deepcopy(eager)
    graphs = LayerGraphs(graphed, emulate=True)
    graphs.arm()
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(2))
    for model in (eager, graphed):
        for _ in range(3):
            model(ids).float().square().mean().backward()
    for (name, p), q in zip(eager.named_parameters(), graphed.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert graphs.num_replays == 3


def test_calls_that_differ_from_the_capture_run_eagerly():
    model = _model("delayed")
    graphs = LayerGraphs(model, emulate=True)
    ids = torch.randint(0, 128, (2, 32))
    model(ids).sum().backward()  # not armed: eager
    assert graphs.captured is None and graphs.num_eager == 1
    fp8_step(model)
    graphs.arm()
    out = model(ids)  # captured and replayed
    assert graphs.num_replays == 1
    model(ids)  # the first replay still waits for its backward: eager
    assert graphs.num_eager == 2
    out.sum().backward()
    model(ids[:, :16]).sum().backward()  # another length (a varilen micro-batch)
    with torch.no_grad():
        model(ids)
    model.eval()
    model(ids)
    model.train()
    model(ids, attention_mask=torch.ones(2, 32, dtype=torch.bool))
    enable_fp8_stats(model, True)
    model(ids)
    enable_fp8_stats(model, False)
    with fp8_autocast(enabled=False):  # the model's own context decides; replays still match
        model(ids).sum().backward()
    assert graphs.num_eager == 7
    assert graphs.num_replays == 2


def test_capture_leaves_fp8_state_as_it_was():
    """The capture's warm-up records amaxes of its sample inputs; the FP8 buffers are restored afterwards, so
    the capturing call leaves them as an eager call would."""
    model = _model("delayed")
    reference = copy.deepcopy(model)
    graphs = LayerGraphs(model, emulate=True)
    ids = torch.randint(0, 128, (2, 32))
    for m in (model, reference):
        m(ids).sum().backward()
        fp8_step(m)
    graphs.arm()
    torch.testing.assert_close(model(ids), reference(ids))
    assert graphs.num_replays == 1
    for (k, v), w in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(v, w, msg=k)


# ----------------------------------------------------------------- the trainer
SMALL = ["--model-path", "tiny",  # flags of its own run, not over the demo configuration
         "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
         "--ffn-hidden-size", "128", "--seq-length", "32", "--device", "cpu", "--no-compile", "--num-workers", "0",
         "--eval-iters", "0", "--no-progress", "--lr", "3e-3", "--no-generate-sample"]


def test_trainer_flags_on_cpu():
    from megadlms.training.args import parse_train_args
    from megadlms.training.trainer import setup

    assert setup(parse_train_args(SMALL + ["--train-iters", "1"])).layer_graphs is None  # auto: no GPU, off
    with pytest.raises(ConfigError, match="CUDA graphs need a GPU"):
        setup(parse_train_args(SMALL + ["--train-iters", "1", "--enable-cuda-graph"]))


@pytest.mark.parametrize("fp8,accum", [(False, 2), (True, 2), (True, 1)], ids=["bf16", "fp8-accum2", "fp8-accum1"])
def test_trainer_with_replayed_layers_matches_eager(monkeypatch, fp8, accum):
    """The trainer's use of the graphs (armed after the first step; cut micro-batches and FP8 telemetry steps
    eager; gradient accumulation) gives the eager run's losses and weights. FP8 weights: cached across the
    micro-batches of a step and cast outside the graphs with accumulation; without it, cast in the graph and
    not cached (freed after each layer's backward)."""
    from megadlms.fp8 import fp8_modules
    from megadlms.training import trainer as trainer_mod
    from megadlms.training.args import parse_train_args

    argv = SMALL + ["--train-iters", "6", "--micro-batch-size", "2", "--global-batch-size", str(2 * accum),
                    "--difflm-varilen-prob", "0.3", "--log-interval", "3"] + (["--fp8-format", "hybrid"] if fp8 else [])
    eager = trainer_mod.setup(parse_train_args(argv))
    assert all(m.cache_weight == (accum > 1) for m in fp8_modules(eager.model))
    eager.run()
    monkeypatch.setenv("MEGADLMS_EMULATE_CUDA_GRAPHS", "1")
    graphed = trainer_mod.setup(parse_train_args(argv + ["--cuda-graphs", "on"]))
    graphed.run()
    graphs = graphed.layer_graphs
    assert graphs.num_replays > 0 and graphs.num_eager > 0
    ref = [m["loss"] for m in eager.state.history]
    got = [m["loss"] for m in graphed.state.history]
    assert got == pytest.approx(ref, rel=1e-5)
    for (name, p), q in zip(eager.model.named_parameters(), graphed.model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_packed_documents_replay_with_each_batch_mask(monkeypatch, tmp_path, fp8):
    """SFT on packed conversations: every batch brings its own document mask, which a replay copies into the
    captured one; the losses and weights are the eager run's."""
    from megadlms.training import trainer as trainer_mod
    from megadlms.training.args import parse_train_args
    from tests.training.test_documents import _chat_data

    argv = SMALL + ["--train-iters", "4", "--micro-batch-size", "2", "--global-batch-size", "4", "--sft",
                    "--data-path", _chat_data(tmp_path), "--split", "100,0,0", "--log-interval", "1",
                    "--seq-length", "24"] + (["--fp8-format", "hybrid"] if fp8 else [])
    eager = trainer_mod.setup(parse_train_args(argv))
    eager.run()
    monkeypatch.setenv("MEGADLMS_EMULATE_CUDA_GRAPHS", "1")
    graphed = trainer_mod.setup(parse_train_args(argv + ["--cuda-graphs", "on"]))
    graphed.run()
    assert graphed.layer_graphs.num_replays == 6  # two micro-batches in each step after the first
    ref = [m["loss"] for m in eager.state.history]
    assert [m["loss"] for m in graphed.state.history] == pytest.approx(ref, rel=1e-5)
    for (name, p), q in zip(eager.model.named_parameters(), graphed.model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)


def test_block_masks_are_replayed_only_over_the_tensors_captured():
    """A BlockMask is a static input when its mask_mod reads the same tensors as the captured one (the
    AttentionPlan's refilled segment buffer); one over other tensors would run stale in a replay."""
    from torch.nn.attention.flex_attention import create_block_mask

    from megadlms.attention_masks import document_mask_mod
    from megadlms.training.cuda_graphs import _fill_mask, _mask_key, _static_mask

    seg = torch.zeros(1, 256, dtype=torch.long)
    first = create_block_mask(document_mask_mod(seg), 1, None, 256, 256, device="cpu")
    static = _static_mask(first)
    seg[0, 200:] = 1  # the next batch, in the same buffer
    again = create_block_mask(document_mask_mod(seg), 1, None, 256, 256, device="cpu")
    other = create_block_mask(document_mask_mod(seg.clone()), 1, None, 256, 256, device="cpu")
    assert _mask_key(again) == _mask_key(first) != _mask_key(other)
    assert not torch.equal(static.kv_num_blocks, again.kv_num_blocks)
    _fill_mask(static, again)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks"):
        assert torch.equal(getattr(static, name), getattr(again, name)), name
    assert _mask_key(torch.ones(1, 1, 4, 4, dtype=torch.bool)) != _mask_key(None)


@pytest.mark.parametrize("strict", [False, True])
def test_a_failed_capture_falls_back_to_eager_or_raises(monkeypatch, strict):
    from megadlms.training import cuda_graphs

    def fail(self, fn):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(cuda_graphs.EmulatedGraph, "capture", fail)
    model = _model("delayed")
    reference = copy.deepcopy(model)
    graphs = LayerGraphs(model, emulate=True, strict=strict)
    graphs.arm()
    ids = torch.randint(0, 128, (2, 32))
    if strict:
        with pytest.raises(RuntimeError, match="CUDA graph capture of the layers failed: CUDA out of memory"):
            model(ids)
        return
    for _ in range(2):
        torch.testing.assert_close(model(ids), reference(ids))
    assert graphs.failed.startswith("OutOfMemoryError") and graphs.captured is None
    graphs.arm()
    assert not graphs.armed and graphs.num_eager == 2 and graphs.num_replays == 0
    for (k, v), w in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(v, w, msg=k)  # the FP8 state is as after two eager calls


def test_replaced_or_frozen_parameters_are_captured_again():
    """Graphs read parameters at fixed addresses: a parameter moved to new storage, or one whose requires_grad
    changed, makes the next call capture again instead of replaying stale graphs."""
    eager = _model()
    graphed = copy.deepcopy(eager)
    graphs = LayerGraphs(graphed, emulate=True)
    graphs.arm()
    ids = torch.randint(0, 128, (2, 32))
    graphed(ids).sum().backward()
    first = graphs.captured
    for m in (eager, graphed):
        with torch.no_grad():
            m.layers[0].mlp.up_proj.weight.data = m.layers[0].mlp.up_proj.weight.data * 2  # new storage
        m.layers[1].self_attn.q_proj.weight.requires_grad_(False)
        m.zero_grad(set_to_none=True)
    out, ref = graphed(ids), eager(ids)
    assert graphs.captured is not first and graphs.num_replays == 2
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    ref.sum().backward()
    assert graphed.layers[1].self_attn.q_proj.weight.grad is None
    for (name, p), q in zip(eager.named_parameters(), graphed.parameters()):
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)


_FUSED_MLP_SCRIPT = """
import copy, torch
from tests.training.test_cuda_graphs import _model, _step
from megadlms.fp8.fusions.fused_mlp import FusedFloat8MLP
from megadlms.training.cuda_graphs import LayerGraphs
eager = _model("delayed")
graphed = copy.deepcopy(eager)
graphs = LayerGraphs(graphed, emulate=True, fp8_weights_per_step=True)
opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, graphed)]
g = torch.Generator().manual_seed(1)
for step in range(4):
    batches = [torch.randint(0, 128, (2, 32), generator=g) for _ in range(3)]
    assert _step(graphed, opts[1], batches, True) == _step(eager, opts[0], batches, True), step
    graphs.arm()
fused = [m.num_fused_calls for m in graphed.modules() if isinstance(m, FusedFloat8MLP)]
assert graphs.num_replays == 9 and graphs.captured.weights.num_refreshes == 2, graphs.num_replays
assert min(fused) > 0, fused
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_step_fp8_weights_with_the_fused_mlp():
    """The FP8 weights cast once per step under replays, through the fused FP8 MLP (its Triton kernels in Triton's
    interpreter, hence a process of its own): the same losses as eager, bit for bit."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    res = subprocess.run([sys.executable, "-c", _FUSED_MLP_SCRIPT], cwd=root, env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0 and "ok" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


def _allocator_settings() -> str:
    return torch._C._accelerator_getAllocatorSettings()


@pytest.mark.parametrize("env", [{}, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"},
                                 {"PYTORCH_ALLOC_CONF": "max_split_size_mb:512,expandable_segments:False"},
                                 {"MEGADLMS_GRAPH_POOL_EXPANDABLE": "0"}])
def test_the_graph_pool_is_expandable_only_during_the_capture_and_unless_the_user_chose(monkeypatch, env):
    from megadlms.training.cuda_graphs import expandable_graph_pool

    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "MEGADLMS_GRAPH_POOL_EXPANDABLE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    torch._C._accelerator_setAllocatorSettings("expandable_segments:False")
    before = _allocator_settings()
    with pytest.raises(RuntimeError, match="inside"):
        with expandable_graph_pool():
            inside = _allocator_settings()
            raise RuntimeError("inside")  # the setting is put back on errors too (a failed capture)
    assert ("expandable_segments:True" in inside) == (not env)
    assert _allocator_settings() == before


def test_fp8_weight_refresh_frees_each_fresh_cast_before_the_next(monkeypatch):
    """A refresh writes each fresh cast into the captured caches and lets it go before casting the next weight: it
    never holds a second copy of all the FP8 weights."""
    import weakref

    from megadlms.fp8.integrations.graph_weights import StepFP8Weights

    model = _model("delayed")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    with fp8_autocast(enabled=True):
        _step(model, opt, [ids], True)  # delayed scales exist from here on
        weights = StepFP8Weights(model.layers)
        weights.precast()
        captured = [c.rows.data for c in weights.captured_groups + weights.captured_single]
        before = [q.clone() for q in captured]
        _step(model, opt, [ids], True)  # the weights change and fp8_step drops the caches
        assert weights.stale()
        fresh: list[weakref.ref] = []
        for name in ("_cast_group", "_cast_single"):
            def spy(arg, cast=getattr(StepFP8Weights, name)):
                assert all(r() is None for r in fresh), "a fresh cast outlived its copy into the captured cache"
                out = cast(arg)
                fresh.append(weakref.ref(out.rows.data))
                return out
            monkeypatch.setattr(StepFP8Weights, name, staticmethod(spy))
        weights.refresh()
    assert len(fresh) == len(captured) == 8 and all(r() is None for r in fresh)
    assert not weights.stale()
    assert all(not torch.equal(a.float(), b.float()) for a, b in zip(before, captured))  # this step's values, in place
    # the caches hold q only, also after an eager micro-batch (a varilen cut) has run through them: a transpose kept
    # there would be last step's after the next refresh
    monkeypatch.undo()
    with fp8_autocast(enabled=True):
        loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        loss.backward()
    assert not weights.stale()
    assert all(c.dgrad is None for c in weights.captured_groups + weights.captured_single)


@pytest.mark.parametrize("accum", [1, 2])
def test_recomputed_layers_replay_when_asked(monkeypatch, accum):
    """Full activation recompute with FP8 layers: --cuda-graphs auto leaves the layers eager; --cuda-graphs on
    captures the checkpointed forward and the backward with its recomputation, and the run is the eager one's
    (FP8 weights cast in the graph at one micro-batch per step, outside it with accumulation)."""
    from megadlms.training import trainer as trainer_mod
    from megadlms.training.args import parse_train_args

    argv = SMALL + ["--train-iters", "4", "--micro-batch-size", "2", "--global-batch-size", str(2 * accum),
                    "--difflm-varilen-prob", "0", "--log-interval", "1", "--recompute-granularity", "full",
                    "--fp8-format", "hybrid"]
    eager = trainer_mod.setup(parse_train_args(argv))
    eager.run()
    monkeypatch.setenv("MEGADLMS_EMULATE_CUDA_GRAPHS", "1")
    assert trainer_mod.setup(parse_train_args(argv)).layer_graphs is None  # auto
    graphed = trainer_mod.setup(parse_train_args(argv + ["--cuda-graphs", "on"]))
    graphed.run()
    assert graphed.layer_graphs.num_replays == 3 * accum  # every micro-batch after the first step
    ref = [m["loss"] for m in eager.state.history]
    assert [m["loss"] for m in graphed.state.history] == pytest.approx(ref, rel=1e-5)
    for (name, p), q in zip(eager.model.named_parameters(), graphed.model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)
