"""RL with an FP8 model: the reference model keeps no high-precision duplicate of the FP8 layers' weights (shared
with a LoRA run's FP8 base; a frozen FP8 copy, 1 byte a weight, otherwise); rollouts and reference forwards record
no FP8 amaxes; FP8 runs track unquantized ones."""

import json
import random

import pytest
import torch

from megadlms.build import build_model
from megadlms.config import TransformerConfig
from megadlms.fp8 import Float8Linear
from megadlms.fp8.frozen import FrozenFP8Linear, frozen_copy, frozen_state_dict, load_frozen_state_dict
from megadlms.fp8.kernels.primitives import round_up16
from megadlms.lora import LoraConfig, apply_lora
from megadlms.training.args import parse_train_args
from megadlms.training.documents import AttentionPlan
from megadlms.training.objectives import Sharding
from megadlms.training.rl_objectives import PreferenceOptimisation

CFG = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                        vocab_size=40, seq_length=16, max_position_embeddings=16, mask_token_id=1,
                        attn_mask_type="bidirectional", fp8=True, fp8_format="hybrid")


def storages(module):
    """{storage address: bytes} of every parameter and buffer (persistent or not) of `module`."""
    tensors = [*module.parameters(), *module.buffers()]
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def objective():
    return PreferenceOptimisation(CFG, AttentionPlan(), Sharding(micro_batch_size=1), flex=False,
                                  loss_chunk_tokens=0, autocast=lambda: torch.autocast("cpu", enabled=False),
                                  samples=2, beta=0.1, eps=1e-3, pad_id=0)


def amax_histories(model):
    return {n: b.clone() for n, b in model.named_buffers() if n.endswith("fp8_amax_history")}


def test_with_lora_on_an_fp8_base_the_reference_is_the_policy_storage():
    torch.manual_seed(0)
    model = apply_lora(build_model(CFG), LoraConfig(rank=2, base="fp8"))
    obj = objective()
    obj.bind(model)
    with obj.reference() as ref:
        assert ref is model and not ref.training  # the same modules, adapters off, in eval mode
        assert storages(ref) == storages(model)
    assert model.training  # as it was after the block
    frozen = [m for m in model.modules() if isinstance(m, FrozenFP8Linear)]
    assert len(frozen) == 14 and all(m.weight_fp8.element_size() == 1 for m in frozen)
    # the base's layer weights exist once, in FP8: no tensor of a layer weight's shape in a wider dtype
    shapes = {(m.out_features, m.in_features) for m in frozen}
    assert not [t for t in [*model.parameters(), *model.buffers()] if tuple(t.shape) in shapes and
                t.element_size() > 1]
    assert obj.state_dict() == {"reference": None}


def test_full_parameter_fp8_keeps_a_frozen_fp8_reference_one_byte_a_weight():
    torch.manual_seed(0)
    policy = build_model(CFG)
    fp8 = [m for m in policy.modules() if isinstance(m, Float8Linear)]
    fp8_storage = {p.untyped_storage().data_ptr() for m in fp8 for p in [*m.parameters(), *m.buffers()]}
    other_bytes = sum(n for ptr, n in storages(policy).items() if ptr not in fp8_storage)
    obj = objective()
    obj.bind(policy)
    with obj.reference() as ref:
        assert ref is not policy and not ref.training and not any(p.requires_grad for p in ref.parameters())
    assert not set(storages(ref)) & set(storages(policy))  # a copy, sharing nothing the optimizer changes
    frozen = [m for m in ref.modules() if isinstance(m, FrozenFP8Linear)]
    assert len(frozen) == len(fp8) == 14 and not any(isinstance(m, Float8Linear) for m in ref.modules())
    frozen_bytes = sum(sum(storages(m).values()) for m in frozen)
    weights = sum(m.weight.numel() for m in fp8)
    assert all(m.in_features % 16 == 0 and m.out_features % 16 == 0 for m in fp8)  # no padding here
    assert frozen_bytes == weights + 4 * len(fp8) == sum(round_up16(m.out_features) * round_up16(m.in_features) + 4
                                                         for m in fp8)
    # the embedding, norms and head (BF16 in the policy's FP8 run) are copied as they are; nothing else
    assert sum(storages(ref).values()) - frozen_bytes == other_bytes
    assert frozen_bytes < 0.51 * 2 * weights  # half of a BF16 copy of those weights (a quarter of fp32)

    ids = torch.randint(2, 40, (2, 16))
    with torch.no_grad():
        want, got = policy(ids).float(), ref(ids).float()
    # the fresh policy (no delayed scales yet: each cast scaled from its own amax, a fused group's weights from the
    # group's) and its copy compute alike, bit for bit
    assert torch.equal(got, want)

    # saved and restored exactly (a resumed run keeps its first reference)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.1)
    state = obj.state_dict()["reference"]
    assert {f"layers.0.self_attn.q_proj.{b}" for b in ("weight_fp8", "weight_scale_inv")} <= set(state)
    again = frozen_copy(policy)
    load_frozen_state_dict(again, state)
    with torch.no_grad():
        assert torch.equal(again(ids), got)
    assert all(torch.equal(frozen_state_dict(again)[k], v) for k, v in state.items())
    with pytest.raises(KeyError, match="not saved from a frozen copy"):
        load_frozen_state_dict(frozen_copy(policy), {k: v for k, v in state.items() if "weight_fp8" not in k})


def test_reference_forwards_record_no_amax():
    torch.manual_seed(0)
    ids = torch.randint(2, 40, (2, 16))
    for lora in (False, True):
        model = build_model(CFG)
        if lora:  # FP8 attention-free, BF16-stored base: its other linears stay delayed-scaling Float8Linears
            model = apply_lora(model, LoraConfig(rank=2, base="bf16", targets=("q", "v")))
        before = amax_histories(model)
        obj = objective()
        obj.bind(model)
        with torch.no_grad(), obj.reference() as ref:
            ref(ids)
        after = amax_histories(model)
        assert before and all(torch.equal(before[n], after[n]) for n in before), lora


SMALL = ["--model-path", "tiny", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--num-query-groups", "2", "--ffn-hidden-size", "128", "--seq-length", "32", "--device", "cpu",
         "--no-compile", "--num-workers", "0", "--eval-iters", "0", "--log-interval", "1", "--no-progress",
         "--lr-warmup-iters", "0", "--no-generate-sample", "--lr", "3e-3", "--fp8-format", "hybrid"]


def prompts(path):
    rng = random.Random(0)
    rows = []
    for _ in range(8):
        d = [str(rng.randrange(10)) for _ in range(3)]
        rows.append({"prompt": "Q: Reverse: " + " ".join(d) + "\nA: ", "answer": " ".join(reversed(d))})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_grpo_rollouts_on_the_fp8_policy_record_no_amax_and_the_steps_keep_the_weight_scales(tmp_path):
    """The sampler runs the policy's own FP8 modules in eval mode: a rollout (and its reference terms) leaves every
    amax history as it was; the steps then record the weights' amaxes (their delayed scales follow the weights, also
    with two micro-batches a step, where the layers keep the FP8 weight a rollout cast)."""
    from megadlms.training.trainer import setup

    trainer = setup(parse_train_args(SMALL + [
        "--rl", "grpo", "--rl-data", str(prompts(tmp_path / "p.jsonl")), "--rl-reward", "position_match",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--grpo-group-size", "2", "--rl-gen-length", "4",
        "--rl-block-length", "2", "--rl-temperature", "1.0", "--train-iters", "2"]))
    model, obj = trainer.model, trainer.objective
    fp8 = [m for m in model.modules() if isinstance(m, Float8Linear)]
    assert fp8 and obj._policy is not None and obj._policy.training
    before = amax_histories(obj._policy)
    roll = obj._rollout(trainer.loaders.train.records[:2], seed=3, index=0, device=torch.device("cpu"))
    assert roll.sequences.shape[0] == 4 and len(roll.ref_logp) == 1
    after = amax_histories(obj._policy)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert obj._policy.training
    trainer.run()
    for m in fp8:  # 448 / max |W| of the step: recorded by each step's training forward, not left at 1
        assert m.fp8_scale[1].item() == pytest.approx(448 / m.weight.abs().max().item(), rel=0.05)


def test_an_fp8_vrpo_run_tracks_the_unquantized_run(tmp_path):
    """Full-parameter FP8 VRPO against the same run unquantized (as the FP8 recipes' tests compare): its frozen FP8
    reference computes as the fresh FP8 policy does (fused groups' shared weight scales included), so the first
    step's margin is exactly 0; then the losses stay within 1% (measured: 0.6% at most; twice the cross-entropy
    tests' 0.5%, as the DPO loss is a difference of four ELBO estimates, each weighting its masked tokens by 1/t)."""
    from megadlms.training.trainer import train
    from tests.rl.test_vrpo import SMALL as VRPO_SMALL
    from tests.rl.test_vrpo import reverse_pairs

    data = reverse_pairs(tmp_path / "pairs.jsonl", count=8)
    args = VRPO_SMALL + ["--rl", "vrpo", "--rl-data", str(data), "--micro-batch-size", "8", "--train-iters", "6",
                         "--vrpo-samples", "2", "--lr", "1e-3"]
    runs = [train(parse_train_args(args + extra)).history for extra in ([], ["--fp8-format", "hybrid"])]
    plain, fp8 = ([m["loss"] for m in h if "loss" in m] for h in runs)
    assert runs[1][0]["rl/margin"] == 0.0 and len(fp8) == 6 and fp8 != plain
    assert plain[-1] < 0.95 * plain[0]  # the policy moves: the comparison is not of two constant losses
    torch.testing.assert_close(torch.tensor(fp8), torch.tensor(plain), rtol=0.01, atol=0)
