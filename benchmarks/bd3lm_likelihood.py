"""Likelihood bounds of AR, BD3-LM (block sizes 4 and 16 by default) and masked diffusion (MDLM) after training the
same model on the same data for the same steps from the same seed (the bundled demo corpus by default).

Every variant is scored on the same tokens: tokens 1..L-1 of each validation window, conditioned on token 0.
AR gives their exact NLL; the diffusion models an upper bound on it (the NELBO, with token 0 never masked;
t ~ U[eps, 1], per block for BD3-LM, the same noise draws for every variant), under SUBS (the [MASK] logit -inf,
the training default) and, beside it, with [MASK] kept in the softmax (full vocabulary). Also printed: each
trainer's own validation number (AR: next-token NLL; diffusion: the NELBO of the whole window, whose first block
has no context) and the training loss averaged over all steps.

With --options, BD3-LM (the first of --blocks) is trained again once per training option of the paper that
MegaDLMs offers, each alone against the defaults, and scored the same way: the full-vocabulary cross-entropy
(against SUBS), independent t (against antithetic), --ignore-bos, and the clip-interval search (the interval it
adopted is printed).

    python benchmarks/bd3lm_likelihood.py                  # the comparison in docs/block_diffusion.md
    python benchmarks/bd3lm_likelihood.py --options --skip-baselines --blocks 4    # one row per option
    python benchmarks/bd3lm_likelihood.py --smoke          # seconds: a 2-step run of every variant and option
    python benchmarks/bd3lm_likelihood.py --train-args="--no-bd3lm-antithetic --ignore-bos"   # other options
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megadlms.diffusion import bd3lm  # noqa: E402
from megadlms.diffusion.objective import subs_logits  # noqa: E402
from megadlms.training.args import parse_train_args  # noqa: E402
from megadlms.training.trainer import setup  # noqa: E402

EPS = 1e-3
# each of the paper's training options that MegaDLMs offers, alone against the defaults (SUBS, antithetic t, the
# first token masked, the linear schedule): (row name, its training flags)
OPTIONS = [("defaults", []), ("full-vocab CE", ["--diffusion-loss", "full-vocab"]),
           ("iid t", ["--no-bd3lm-antithetic"]), ("ignore-bos", ["--ignore-bos"]),
           ("clip search", ["--bd3lm-clip-search"])]


def without_bd3lm_flags(argv: list[str]) -> list[str]:
    """`argv` less the bd3lm-only flags (--bd3lm-*, --no-bd3lm-*) and their values."""
    out: list[str] = []
    dropping = False
    for tok in argv:
        if tok.startswith("--"):
            dropping = tok.split("=")[0].removeprefix("--no-").removeprefix("--").startswith("bd3lm-")
        if not dropping:
            out.append(tok)
    return out


def train_variant(mode: str, block: int | None, a: argparse.Namespace, extra: list[str] | None = None
                  ) -> tuple[object, float, float]:
    """Train one variant (with the training flags `extra`); returns (trainer, the training loss averaged over the
    run (one log interval), the trainer's validation loss)."""
    argv = ["--model-path", "tiny", "--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
            "--ffn-hidden-size", str(3 * a.hidden), "--seq-length", str(a.seq_length), "--micro-batch-size",
            str(a.batch), "--train-iters", str(a.iters), "--lr", str(a.lr), "--min-lr", str(a.lr / 10),
            "--lr-warmup-iters", str(max(1, a.iters // 15)), "--lr-decay-style", "cosine", "--weight-decay", "0.01",
            "--seed", str(a.seed), "--device", "cpu", "--no-compile", "--num-workers", "0", "--no-progress",
            "--log-interval", str(a.iters), "--eval-iters", str(a.eval_batches), "--eval-interval", "0",
            "--difflm-varilen-prob", "0", "--no-generate-sample", "--model-running-mode", mode]
    if mode != "vanilla":  # --train-args' bd3lm options go to the BD3-LM variants (the trainer refuses them elsewhere)
        argv += shlex.split(a.train_args) if mode == "bd3lm" else without_bd3lm_flags(shlex.split(a.train_args))
    if block is not None:
        argv += ["--block-size", str(block), "--bd3lm-clip-min", str(a.bd3lm_clip[0]),
                 "--bd3lm-clip-max", str(a.bd3lm_clip[1])]
    if extra:
        argv += extra
        if "--bd3lm-clip-search" in extra:  # it chooses during validation: four validations over the run
            argv += ["--eval-interval", str(max(1, a.iters // 4))]
    trainer = setup(parse_train_args(argv))
    state = trainer.run()
    train_loss = [m["loss"] for m in state.history if "loss" in m and "eval_loss" not in m][-1]
    valid = [m["eval_loss"] for m in state.history if "eval_loss" in m][-1]
    return trainer, train_loss, valid


@torch.no_grad()
def same_token_bound(trainer, mode: str, block: int | None, a: argparse.Namespace) -> tuple[float, float, float]:
    """Nats per token of tokens 1..L-1 given token 0, averaged over the validation windows and noise draws (SUBS),
    the standard error of that mean over the windows, and the same mean with [MASK] in the softmax."""
    model, n = trainer.base_model.eval(), a.seq_length
    mask_id = trainer.model_config.mask_token_id
    loader = trainer.loaders.valid
    loader.load_state_dict({"consumed_samples": 0})
    it = iter(loader)
    g = torch.Generator().manual_seed(1234)  # the same noise for every variant
    per_window, full_window = [], []
    for _ in range(a.eval_batches):
        tokens = next(it)[:, :n]
        rows = tokens.shape[0]
        if mode == "vanilla":
            ce = F.cross_entropy(model(tokens[:, :-1]).float().transpose(1, 2), tokens[:, 1:], reduction="none")
            per_window.append(ce.sum(1) / (n - 1))
            full_window.append(per_window[-1])
            continue
        total, total_full = torch.zeros(rows), torch.zeros(rows)
        for _ in range(a.noise_samples):
            per = n // block if mode == "bd3lm" else 1
            t = EPS + (1 - EPS) * torch.rand(rows, per, generator=g)
            u = torch.rand(rows, n, generator=g)
            u[:, 0] = 2.0  # token 0 is the condition: never masked
            if mode == "bd3lm":
                noisy, w = bd3lm.mask_blocks(tokens, t, u, block_size=block, mask_token_id=mask_id)
                cfg = bd3lm.Bd3lmConfig(block_size=block, seq_length=n, mask_token_id=mask_id)
                kwargs = bd3lm.forward_kwargs(cfg, torch.device("cpu"), flex=False)
                logits = model(torch.cat([noisy, tokens], dim=1), **kwargs)[:, :n]
            else:
                masked = u < t
                noisy, w = torch.where(masked, mask_id, tokens), masked.float() / t
                logits = model(noisy)
            logits = logits.float()
            ce_full = F.cross_entropy(logits.transpose(1, 2), tokens, reduction="none")
            ce = F.cross_entropy(subs_logits(logits, mask_id).transpose(1, 2), tokens, reduction="none")
            total += (torch.where(w > 0, ce, 0.0) * w).sum(1) / a.noise_samples
            total_full += (ce_full * w).sum(1) / a.noise_samples
        per_window.append(total / (n - 1))
        full_window.append(total_full / (n - 1))
    values = torch.cat(per_window).double()
    return float(values.mean()), float(values.std() / values.numel() ** 0.5), float(torch.cat(full_window).mean())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=4e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--blocks", type=int, nargs="+", default=[4, 16])
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--noise-samples", type=int, default=8, help="noise draws per window for the diffusion bounds")
    p.add_argument("--bd3lm-clip", type=float, nargs=2, default=[1e-3, 1.0], metavar=("MIN", "MAX"),
                   help="BD3-LM training noise t ~ U[MIN, MAX] (default: the linear schedule)")
    p.add_argument("--train-args", default="", help="extra training flags of the diffusion variants (give it "
                   "with =), e.g. --train-args=\"--no-bd3lm-antithetic --ignore-bos --diffusion-loss full-vocab\"")
    p.add_argument("--skip-baselines", action="store_true", help="train only the BD3-LM variants")
    p.add_argument("--options", action="store_true", help="then BD3-LM (the first of --blocks) once per training "
                   "option: full-vocab CE, iid t, --ignore-bos, the clip search")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--smoke", action="store_true", help="2 steps, 1 evaluation batch: checks the script runs")
    a = p.parse_args()
    if a.smoke:
        a.iters, a.eval_batches, a.noise_samples, a.hidden, a.seq_length = 2, 1, 1, 32, 32
        a.options = True
    torch.set_num_threads(a.threads)
    variants = [(f"BD3-LM B={b}", "bd3lm", b) for b in a.blocks]
    if not a.skip_baselines:
        variants = [("AR", "vanilla", None)] + variants + [("MDLM", "difflm-noshift", None)]
    print(f"{a.iters} steps x {a.batch} x {a.seq_length} tokens, {a.layers} layers x hidden {a.hidden}, seed {a.seed}; "
          f"bound on tokens 1..{a.seq_length - 1} given token 0 over {a.eval_batches} validation batches "
          f"({a.noise_samples} noise draws each); BD3-LM training t ~ U[{a.bd3lm_clip[0]}, {a.bd3lm_clip[1]}]"
          + (f"; diffusion training flags: {a.train_args}" if a.train_args else ""))
    print(f"{'variant':<14} | {'train loss':>10} | {'trainer valid':>13} | {'same-token bound':>16} | "
          f"{'std err':>7} | {'ppl bound':>9} | {'full-vocab bound':>16} | {'minutes':>7}")
    bounds = []
    for name, mode, block in variants:
        t0 = time.perf_counter()
        trainer, train_loss, valid = train_variant(mode, block, a)
        bound, err, full = same_token_bound(trainer, mode, block, a)
        bounds.append(bound)
        print(f"{name:<14} | {train_loss:>10.4f} | {valid:>13.4f} | {bound:>16.4f} | {err:>7.4f} | "
              f"{math.exp(bound):>9.2f} | {full:>16.4f} | "
              f"{(time.perf_counter() - t0) / 60:>7.1f}", flush=True)
    if not a.skip_baselines:
        ordered = all(x <= y for x, y in zip(bounds, bounds[1:]))
        chain = " <= ".join(["AR"] + [f"B={b}" for b in a.blocks] + ["MDLM"])
        print(f"ordering {chain}: {'holds' if ordered else 'does not hold'}")
    if a.options:
        block = a.blocks[0]
        print(f"\nBD3-LM B={block}, one training option at a time (bounds: SUBS and full vocabulary, as above)")
        print(f"{'option':<14} | {'train loss':>10} | {'trainer valid':>13} | {'same-token bound':>16} | "
              f"{'std err':>7} | {'ppl bound':>9} | {'full-vocab bound':>16} | {'minutes':>7}")
        for name, flags in OPTIONS:
            t0 = time.perf_counter()
            trainer, train_loss, valid = train_variant("bd3lm", block, a, flags)
            bound, err, full = same_token_bound(trainer, "bd3lm", block, a)
            print(f"{name:<14} | {train_loss:>10.4f} | {valid:>13.4f} | {bound:>16.4f} | {err:>7.4f} | "
                  f"{math.exp(bound):>9.2f} | {full:>16.4f} | {(time.perf_counter() - t0) / 60:>7.1f}", flush=True)
            if "--bd3lm-clip-search" in flags:
                cfg = trainer.objective.config  # type: ignore[attr-defined]  # a BlockDiffusion objective
                print(f"  clip search: training ended on t ~ U[{cfg.clip_min:g}, {cfg.clip_max:g}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
