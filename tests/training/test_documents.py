"""Training with attention plans: SFT on packed chat windows, attention annealing, exact resume of both."""

import numpy as np
import torch

from megadlms.data.indexed import IndexedDatasetBuilder
from megadlms.data.sft import loss_mask_prefix
from megadlms.training.args import parse_train_args
from megadlms.training.documents import AttentionPlan, attended_pairs
from megadlms.training.trainer import setup, train

SMALL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
         "--seq-length", "24", "--device", "cpu", "--no-compile", "--num-workers", "0", "--eval-iters", "0",
         "--log-interval", "1", "--no-progress", "--no-generate-sample", "--split", "100,0,0"]


def test_anneal_opens_future_keys_on_schedule():
    plan = AttentionPlan(anneal_iters=4, seed=0)
    shares = []
    tokens = torch.zeros(1, 64, dtype=torch.long)
    for it in range(5):
        plan.begin_step(it, 64)
        mask, pos = plan.for_batch(tokens, None)
        if mask is None:
            shares.append(None)
            continue
        m = mask[0, 0]
        assert m[torch.ones(64, 64, dtype=torch.bool).tril()].all() and pos is None  # causal keys always open
        shares.append(m.triu(1).sum().item() / (64 * 63 / 2))
    assert shares[-1] is None and shares[3] == 1.0
    assert np.allclose(shares[:3], [0.25, 0.5, 0.75], atol=0.05)  # (i + 1) / N of the future keys, drawn
    plan.load_state_dict(AttentionPlan(anneal_iters=4, seed=0).state_dict())
    plan.begin_step(0, 64)
    first = AttentionPlan(anneal_iters=4, seed=0)
    first.begin_step(0, 64)
    assert torch.equal(plan._open_upper, first._open_upper)


def _chat_data(tmp_path):
    prefix = str(tmp_path / "c_chat_document")
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(prefix, np.uint16) as t, IndexedDatasetBuilder(loss_mask_prefix(prefix), np.uint8) as m:
        for _ in range(60):
            n, plen = int(rng.integers(5, 12)), int(rng.integers(2, 4))
            t.add_document(rng.integers(3, 4000, n))
            m.add_document((np.arange(n) >= plen).astype(np.uint8))
    return prefix


def _losses(state):
    return [h["loss"] for h in state.history if "loss" in h and "eval_loss" not in h]


def test_sft_with_annealing_resumes_exactly(tmp_path):
    common = SMALL + ["--sft", "--data-path", _chat_data(tmp_path), "--micro-batch-size", "2",
                      "--global-batch-size", "4", "--train-iters", "4", "--model-running-mode", "difflm-shift",
                      "--attention-anneal-iters", "3", "--lr", "3e-3"]
    trainer = setup(parse_train_args(common + ["--save", str(tmp_path / "a")]))
    straight = trainer.run()
    train(parse_train_args(common + ["--save", str(tmp_path / "b"), "--save-interval", "2", "--exit-interval", "2"]))
    resumed = train(parse_train_args(common + ["--save", str(tmp_path / "b"), "--load", str(tmp_path / "b")]))
    assert len(_losses(straight)) == 4
    assert _losses(resumed) == _losses(straight)[2:]
    assert all(np.isfinite(_losses(straight)))
    # TFLOP/s counts attention over each conversation's own pairs: below the whole-window count, above the linears
    per_token = [m["tflops_per_device"] * 1e12 / m["tokens_per_s"] for m in straight.history]
    mc = trainer.model_config
    assert all(6 * mc.num_matmul_params() < f < mc.flops_per_token() for f in per_token)


def test_attended_pairs_count_each_document_alone():
    seg = torch.tensor([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1]])
    assert attended_pairs(seg, document_masks=True, causal=False) == (9 + 4 + 1) + 36
    assert attended_pairs(seg, document_masks=True, causal=True) == (6 + 3 + 1) + 21
    assert attended_pairs(seg, document_masks=False, causal=False) == 2 * 36


def test_sft_validates_at_default_flags(tmp_path):
    """SFT at the default validation (--eval-iters 10, an evaluation at the start and at the end), in both
    objectives: the validation goes through the same objective as the step."""
    i, j = SMALL.index("--eval-iters"), SMALL.index("--split")
    flags = SMALL[:i] + SMALL[i + 2:j] + SMALL[j + 2:]
    for mode in ("difflm-noshift", "vanilla"):
        trainer = setup(parse_train_args(flags + ["--sft", "--data-path", _chat_data(tmp_path), "--split", "80,20,0",
                                                  "--micro-batch-size", "2", "--train-iters", "2",
                                                  "--model-running-mode", mode]))
        state = trainer.run()
        evals = [h["eval_loss"] for h in state.history if "eval_loss" in h]
        assert len(evals) == 2 and all(np.isfinite(evals)) and all(0 < x < 20 for x in evals), (mode, evals)
        assert trainer.evaluate() == evals[-1]  # the same batches and noise every evaluation


def test_sft_validation_through_flex_attention_equals_the_dense_mask(tmp_path, monkeypatch):
    """The GPU's attention path for packed documents (FlexAttention BlockMasks) run forward on the CPU: the SFT
    validation loss equals the dense-mask path's (FlexAttention has no CPU backward: the training step is the GPU
    check's, benchmarks/attention_grad_check.py)."""
    from megadlms.training import documents

    argv = SMALL + ["--sft", "--data-path", _chat_data(tmp_path), "--micro-batch-size", "2", "--train-iters", "2",
                    "--lr", "3e-3"]
    argv[argv.index("--eval-iters") + 1] = "2"
    argv[argv.index("--split") + 1] = "50,50,0"
    trainer = setup(parse_train_args(argv))
    trainer.run()
    dense = trainer.evaluate()
    build = documents.build_attention_mask
    monkeypatch.setattr(documents, "build_attention_mask", lambda *a, **k: build(*a, **{**k, "flex": True}))
    flex = trainer.evaluate()
    assert abs(flex - dense) <= 1e-5 * abs(dense), (flex, dense)
