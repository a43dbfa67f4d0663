"""VRPO: the shared (antithetic) noise lowers the variance of the policy-minus-reference estimate; the loss of a
hand-made pair is its definition; a tiny model raises the chosen-vs-rejected margin."""

import copy
import json
import math

import pytest
import torch
from torch import nn

from megadlms.config import TransformerConfig
from megadlms.model import TransformerLM
from megadlms.rl.data import Record
from megadlms.rl.vrpo import dpo_loss, elbo_estimates, elbo_noise, masked_rows
from megadlms.training.args import parse_train_args
from megadlms.training.documents import AttentionPlan
from megadlms.training.objectives import Sharding
from megadlms.training.rl_objectives import PreferenceOptimisation, StepSeed, record_generator

MASK = 1
CFG = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=2, num_query_groups=2, ffn_hidden_size=64,
                        vocab_size=16, seq_length=16, max_position_embeddings=16, mask_token_id=MASK,
                        attn_mask_type="bidirectional")


def estimate(model, seq, start, g, n):
    p, masked = elbo_noise(n, seq.shape[0] - start, g)
    x, w = masked_rows(seq, start, p, masked, mask_id=MASK)
    with torch.no_grad():
        return elbo_estimates(model(x), seq.expand(n, -1), w, n)[0]


def test_shared_noise_lowers_the_variance_of_the_log_ratio():
    torch.manual_seed(0)
    ref = TransformerLM(CFG).eval()
    policy = copy.deepcopy(ref)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    seq = torch.randint(2, 16, (12,))
    shared, independent = [], []
    for r in range(40):
        g = torch.Generator().manual_seed(r)
        shared.append(estimate(policy, seq, 4, g, 4) - estimate(ref, seq, 4, g.manual_seed(r), 4))
        independent.append(estimate(policy, seq, 4, torch.Generator().manual_seed(1000 + r), 4)
                           - estimate(ref, seq, 4, torch.Generator().manual_seed(2000 + r), 4))
    var_shared, var_indep = torch.stack(shared).var(), torch.stack(independent).var()
    assert var_shared < 0.1 * var_indep, (var_shared, var_indep)
    # and the means agree (both estimate the same difference of ELBOs)
    assert abs(torch.stack(shared).mean() - torch.stack(independent).mean()) < 4 * math.sqrt(var_indep / 40)


def test_stratified_timesteps_cover_the_unit_interval():
    p, masked = elbo_noise(8, 50, torch.Generator().manual_seed(3), eps=0.0)
    assert torch.equal((p * 8).floor(), torch.arange(8.0))  # one timestep in each eighth
    assert masked.shape == (8, 50)


class Table(nn.Module):
    """logits [B, S, V] from a fixed table, whatever the input (so the loss can be written out by hand)."""

    def __init__(self, seed):
        super().__init__()
        self.table = nn.Parameter(torch.randn(8, 16, generator=torch.Generator().manual_seed(seed)))

    def forward(self, ids, attention_mask=None, position_ids=None):
        return self.table[: ids.shape[1]].expand(ids.shape[0], -1, -1)


def objective(n=3, beta=0.5):
    sharding = Sharding(micro_batch_size=1)
    return PreferenceOptimisation(CFG, AttentionPlan(), sharding, flex=False, loss_chunk_tokens=0,
                                  autocast=lambda: torch.autocast("cpu", enabled=False), samples=n, beta=beta,
                                  eps=1e-3, pad_id=0)


def test_the_loss_of_a_hand_made_pair_is_its_definition():
    n, beta, seed = 3, 0.5, 77
    obj = objective(n, beta)
    policy = Table(0)
    obj.bind(policy)
    with obj.reference() as ref:  # the copy is taken now; then the policy moves away from it
        assert ref is not policy
    with torch.no_grad():
        policy.table.copy_(Table(1).table)
    ref_table = obj._reference.table.detach()
    rec = Record("x:1", prompt=[5, 6], chosen=[7, 8, 0], rejected=[9, 10, 11, 0])
    batch = next(obj.micro_batches(iter([[rec]]), StepSeed(torch.empty(0), torch.empty(0), torch.zeros(1),
                                                           seed=seed), 1, torch.device("cpu")))
    loss = obj.loss(policy, batch, lambda: None)

    g = record_generator(seed, 0, torch.device("cpu"))
    est = {}
    for side, resp in (("w", rec.chosen), ("l", rec.rejected)):
        p, masked = elbo_noise(n, len(resp), g)
        seq = rec.prompt + resp
        for name, table in (("pi", policy.table.detach()), ("ref", ref_table)):
            # SUBS (the default --diffusion-loss): [MASK] has no probability
            logp = torch.log_softmax(table.index_fill(-1, torch.tensor([CFG.mask_token_id]), -math.inf), -1)
            total = 0.0
            for k in range(n):
                total += sum(float(logp[2 + i, seq[2 + i]]) / float(p[k])
                             for i in range(len(resp)) if masked[k, i])
            est[name, side] = total / n
    margin = (est["pi", "w"] - est["ref", "w"]) - (est["pi", "l"] - est["ref", "l"])
    expected = -math.log(1 / (1 + math.exp(-beta * margin)))
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert obj.metrics()["rl/margin"] == pytest.approx(margin, rel=1e-5)
    # the prompt is never masked; padding (the chosen row is one shorter) is never scored
    assert bool((batch.inputs[:, :2] == torch.tensor([5, 6])).all())
    assert bool((batch.weights[:n, -1] == 0).all())
    # the DPO function on its own
    losses, m = dpo_loss(torch.tensor([2.0]), torch.tensor([1.0]), torch.tensor([0.5]), torch.tensor([1.0]), 0.1)
    assert m.item() == pytest.approx(1.5) and losses.item() == pytest.approx(-math.log(1 / (1 + math.exp(-0.15))))


SMALL = ["--model-path", "tiny", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--num-query-groups", "2", "--ffn-hidden-size", "128", "--seq-length", "32", "--device", "cpu",
         "--no-compile", "--num-workers", "0", "--eval-iters", "0", "--log-interval", "1", "--no-progress",
         "--lr-warmup-iters", "0", "--no-generate-sample", "--lr-decay-style", "constant"]


def reverse_pairs(path, count=16):
    import random

    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(count):
            d = [str(rng.randrange(10)) for _ in range(rng.randint(3, 5))]
            f.write(json.dumps({"prompt": "Q: Reverse: " + " ".join(d) + "\nA: ", "chosen": " ".join(reversed(d)),
                                "rejected": " ".join(d) + " " + d[0]}) + "\n")
    return path


def margin_on(trainer, records):
    obj = trainer.objective
    obj.metrics()
    noise = StepSeed(torch.empty(0), torch.empty(0), torch.zeros(1), seed=5)
    batch = next(obj.micro_batches(iter([records]), noise, 1, torch.device("cpu")))
    with torch.no_grad():
        obj.loss(trainer.model, batch, lambda: None)
    return obj.metrics()["rl/margin"]


def test_a_tiny_model_raises_the_margin(tmp_path):
    from megadlms.training.trainer import setup

    data = reverse_pairs(tmp_path / "pairs.jsonl", count=8)  # every step sees all pairs
    trainer = setup(parse_train_args(SMALL + ["--rl", "vrpo", "--rl-data", str(data), "--micro-batch-size", "8",
                                              "--train-iters", "12", "--vrpo-samples", "8", "--lr", "1e-3",
                                              "--dpo-beta", "0.1"]))
    records = trainer.loaders.train.records
    assert margin_on(trainer, records) == 0.0  # the reference is the starting policy
    state = trainer.run()
    assert margin_on(trainer, records) > 2.0  # 0 at the start
    logged = [m for m in state.history if "rl/margin" in m]
    assert len(logged) == 12 and {"rl/accuracy", "rl/chosen_reward", "rl/rejected_reward"} <= set(logged[0])


def test_with_lora_the_reference_is_the_base_with_adapters_off():
    from megadlms.lora import LoraConfig, apply_lora

    torch.manual_seed(0)
    base = TransformerLM(CFG).eval()
    x = torch.randint(2, 16, (2, 8))
    with torch.no_grad():
        expected = base(x)
    model = apply_lora(copy.deepcopy(base), LoraConfig(rank=2, base="keep"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.fill_(0.1)  # the adapters now change the output
    obj = objective()
    obj.bind(model)
    with torch.no_grad(), obj.reference() as ref:
        assert ref is model and torch.allclose(ref(x), expected, atol=1e-6)
    with torch.no_grad():
        assert not torch.allclose(model(x), expected, atol=1e-3)  # the adapters are back on
    assert obj.state_dict() == {"reference": None}  # nothing to checkpoint: the base is the reference
