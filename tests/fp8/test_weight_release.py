"""Without a weight cache (`cache_weight=False`: one micro-batch per step, CUDA-graph capture, FSDP) each FP8
layer's FP8 weight is freed when that layer's backward returns, not kept until the whole autograd graph goes."""

from __future__ import annotations

import copy
import weakref

import pytest
import torch

from megadlms.config import TransformerConfig
from megadlms.fp8 import (
    DelayedScaling,
    Float8CurrentScaling,
    Float8Linear,
    Float8RowwiseScaling,
    convert_to_fp8,
    fp8_autocast,
    fp8_modules,
    fp8_step,
)
from megadlms.model import TransformerLM

from .test_fused_mlp import _torch_kernels

WEIGHT_ATTRS = ("wcache", "wgu", "wd")  # what the FP8 autograd functions keep of the step's FP8 weights


def _fp8_nodes(out: torch.Tensor) -> list:
    """The autograd nodes of `out`'s graph that hold FP8 weights."""
    seen, stack, found = set(), [out.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if any(hasattr(node, a) for a in WEIGHT_ATTRS):
            found.append(node)
        stack.extend(n for n, _ in node.next_functions)
    return found


def _weight_refs(nodes: list) -> list[weakref.ref]:
    """Weak references to every FP8 weight tensor (the rows and the dgrad operand's data) the nodes hold."""
    refs = []
    for node in nodes:
        for a in WEIGHT_ATTRS:
            w = getattr(node, a, None)
            if w is None:
                continue
            for name in ("rows", "dgrad"):
                v = getattr(w, name, None)
                if v is not None:
                    refs.append(weakref.ref(v.data))
    return refs


@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling(), Float8RowwiseScaling()],
                         ids=["delayed", "current", "rowwise"])
def test_a_layer_without_cache_frees_its_fp8_weight_after_its_backward(recipe):
    torch.manual_seed(0)
    grads = []
    for cache in (True, False):
        layer = Float8Linear(48, 32, recipe=recipe, cache_weight=cache)
        layer.weight.data = torch.randn(32, 48, generator=torch.Generator().manual_seed(1))
        x = torch.randn(21, 48, generator=torch.Generator().manual_seed(2), requires_grad=True)
        with fp8_autocast(fp8_recipe=recipe):
            y = layer(x)
        refs = _weight_refs(_fp8_nodes(y))
        assert refs and all(r() is not None for r in refs)
        y.backward(torch.ones_like(y))
        alive = [r() is not None for r in refs]
        assert all(alive) if cache else not any(alive)  # with the cache, the layer keeps them for the next micro-batch
        grads.append((x.grad, layer.weight.grad))
    for a, b in zip(*grads):
        assert torch.equal(a, b)  # the same numbers either way


def _cfg() -> TransformerConfig:
    return TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                             ffn_hidden_size=96, vocab_size=128, seq_length=32,
                             untie_embeddings_and_output_weights=True)


def _fp8_lm(monkeypatch) -> tuple[TransformerLM, torch.Tensor]:
    """A small FP8 model with the fused q/k/v, gate/up and MLP paths (torch standing in for the Triton kernels),
    and token ids for it."""
    _torch_kernels(monkeypatch)
    torch.manual_seed(0)
    return convert_to_fp8(TransformerLM(_cfg()), DelayedScaling()), torch.randint(0, 128, (2, 16))


def _with_cache(base: TransformerLM, cache: bool) -> TransformerLM:
    model = copy.deepcopy(base)
    for m in fp8_modules(model):
        m.cache_weight = cache
    return model


def test_fused_projections_and_fused_mlp_free_their_fp8_weights_layer_by_layer(monkeypatch):
    """The fused q/k/v and gate/up GEMMs and the fused MLP (torch standing in for its Triton kernels): every FP8
    weight of the graph is gone after the backward, and the step computes what the cached model computes."""
    base, ids = _fp8_lm(monkeypatch)
    results = []
    for cache in (True, False):
        model = _with_cache(base, cache)
        for step in range(2):  # the second step runs the fused MLP (it needs the scales of a first fp8_step)
            out = model(ids)
            nodes = _fp8_nodes(out)
            refs = _weight_refs(nodes)
            out.float().logsumexp(-1).mean().backward()
            if step == 1:
                assert {a for n in nodes for a in WEIGHT_ATTRS if hasattr(n, a)} == set(WEIGHT_ATTRS)
                alive = sum(r() is not None for r in refs)
                assert alive == (len(refs) if cache else 0), (cache, alive, len(refs))
            else:
                fp8_step(model)
        results.append([p.grad for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_a_second_backward_through_released_weights_is_a_clear_error():
    for cache in (True, False):
        layer = Float8Linear(32, 32, cache_weight=cache)
        x = torch.randn(16, 32, requires_grad=True)
        with fp8_autocast():
            y = layer(x)
        y.sum().backward(retain_graph=True)
        if cache:
            y.sum().backward()
        else:
            with pytest.raises(RuntimeError, match="released after its first backward.*cache_weight=True"):
                y.sum().backward()


def test_without_cache_the_transposed_weight_is_made_in_the_backward(monkeypatch):
    """Uncached, the forward holds only q: W^T for the input gradient is transposed from it in the backward (with the
    cache it is made in the forward's cast, for every micro-batch of the step). Same gradients either way."""
    base, ids = _fp8_lm(monkeypatch)
    grads = []
    for cache in (True, False):
        model = _with_cache(base, cache)
        for _ in range(2):
            out = model(ids)
            held = [getattr(n, a) for n in _fp8_nodes(out) for a in WEIGHT_ATTRS if getattr(n, a, None) is not None]
            transposes = [w.dgrad for w in held]
            assert held and all((t is not None) == cache for t in transposes), cache
            out.float().logsumexp(-1).mean().backward()
            fp8_step(model)
        grads.append([p.grad.clone() for p in model.parameters()])
        model.zero_grad()
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_saved_activations_hold_no_memory_that_no_backward_reads(monkeypatch):
    """Every storage the autograd graph keeps is read back whole: a saved view (v as a column block of the fused
    q/k/v GEMM's output) must not keep the rest of its storage (q's and k's columns) alive until the backward."""
    model, ids = _fp8_lm(monkeypatch)
    for step in range(2):  # the second step runs the fused MLP
        saved: dict[int, list[torch.Tensor]] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.numel() > 1:
                saved.setdefault(t.untyped_storage().data_ptr(), []).append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(ids)
        for views in saved.values():
            storage_bytes = views[0].untyped_storage().nbytes()
            read = {(v.storage_offset(), v.shape, v.stride()): v.numel() * v.element_size() for v in views}
            assert sum(read.values()) >= storage_bytes, [tuple(v.shape) for v in views]
        out.float().logsumexp(-1).mean().backward()
        fp8_step(model)
