#!/usr/bin/env python
"""The field's own models end to end on the CPU: a tiny random LLaDA and a tiny random Dream, each

 1. written as a folder in its own format (LLaDA's `LLaDAModelLM` config.json and tensor names, Dream's
    `DreamModel` ones; random weights, the bundled tokenizer), as a released checkpoint would be downloaded;
 2. imported (`convert hf-to-megadlms --verify`): bidirectional, its mask token, Dream's shift recorded;
 3. fine-tuned with `train --sft` on a small instruction set (prompts never masked), stopped half-way
    (`--exit-interval`) and resumed, and checked bit for bit against the same run without the stop;
 4. exported back to its own format (`convert megadlms-to-hf`);
 5. evaluated from the export (`eval --ppl`: the ELBO per mask ratio, Dream's scored with its shift);
 6. sampled from the export (`generate`: LLaDA's sampler for LLaDA, Dream's `--sampler dream --alg entropy`).

    python examples/field_models/run.py [--work DIR] [--iters 20] [--families llada,dream] [--fp32]

BF16 by default (`--bf16`, as on a GPU; slow on some CPUs: `--fp32`). The models are random and tiny, so the
text is noise: the example shows the commands and what each checks, not quality. With real weights, start at
step 2 with the downloaded folder (`--hf-model ./LLaDA-8B-Instruct`, `./Dream-v0-Instruct-7B`).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from megadlms import cli
from megadlms.config import TransformerConfig
from megadlms.data.tokenizer import default_tokenizer_path
from megadlms.interop import save_hf_model
from megadlms.model import TransformerLM
from megadlms.training.checkpoint import complete_iterations, load_model_from_checkpoint

TEMPLATE = "Q: {prompt}\nA: "  # the bundled tokenizer has no chat template
WORDS = "red green blue cat dog sun moon tree river stone bird fish wind snow rain star".split()
MASK_ID = 1  # <|mask|> in the bundled tokenizer
# family -> the model's shape beyond the common one (LLaDA: no biases, no shift; Dream: q/k/v bias, shifted)
FAMILIES: dict[str, dict[str, Any]] = {
    "llada": dict(untie_embeddings_and_output_weights=True),
    "dream": dict(untie_embeddings_and_output_weights=True, add_qkv_bias=True, diffusion_shift=True),
}
ARCHITECTURE = {"llada": "LLaDAModelLM", "dream": "DreamModel"}


def megadlms(*argv: Any, quiet: bool = True) -> str:
    """Run `megadlms ARGV` in this process (what `python -m megadlms ARGV` runs); its stdout. Fails loudly."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out if quiet else sys.stdout), contextlib.redirect_stderr(err):
        code = cli.main([str(a) for a in argv])
    if code != 0:
        raise SystemExit(f"megadlms {' '.join(map(str, argv))} exited {code}:\n{out.getvalue()[-2000:]}"
                         f"\n{err.getvalue()[-2000:]}")
    return out.getvalue() + err.getvalue()


def make_folder(family: str, out: Path, *, seq: int, seed: int = 0) -> Path:
    """A tiny random model of `family` saved in that family's own format, with the bundled tokenizer."""
    torch.manual_seed(seed)
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=64, vocab_size=4096, seq_length=seq, max_position_embeddings=seq,
                            init_method_std=0.05, mask_token_id=MASK_ID, **FAMILIES[family])
    with warnings.catch_warnings():  # the models' own modeling code (auto_map) is not needed here
        warnings.filterwarnings("ignore", message=".*auto_map")
        save_hf_model(TransformerLM(cfg), cfg, out, tokenizer_dir=default_tokenizer_path(), hf_format=family)
    return out


def make_data(folder: Path, n: int, seed: int = 0) -> tuple[Path, Path]:
    """An instruction set (reverse a few words) as chat records, and the same texts as plain documents."""
    rng = random.Random(seed)
    chat, text = folder / "chat.jsonl", folder / "text.jsonl"
    with chat.open("w") as c, text.open("w") as t:
        for _ in range(n):
            words = rng.sample(WORDS, rng.randint(2, 4))
            prompt, response = "Reverse: " + " ".join(words), " ".join(reversed(words))
            c.write(json.dumps({"prompt": prompt, "response": response}) + "\n")
            t.write(json.dumps({"text": TEMPLATE.format(prompt=prompt) + response}) + "\n")
    return chat, text


def state(load: Path) -> dict[str, torch.Tensor]:
    return load_model_from_checkpoint(load)[0].state_dict()


def run_family(family: str, work: Path, *, iters: int, precision: list[str], seq: int, records: int) -> dict:
    """Steps 1-6 for one family under `work/family`; returns what each step produced."""
    w = work / family
    w.mkdir(parents=True, exist_ok=True)
    # 1. the folder a user would download
    folder = make_folder(family, w / "original", seq=seq)
    # 2. import, verified against the folder before anything is written
    megadlms("convert", "hf-to-megadlms", "--hf-model", folder, "--save", w / "base", "--verify")
    tokenizer = w / "base" / "iter_0000000" / "tokenizer"
    chat, text = make_data(w, records)
    megadlms("preprocess", "--chat", "--input", chat, "--output-prefix", w / "chat", "--tokenizer-model", tokenizer,
             "--prompt-template", TEMPLATE, "--no-progress")
    megadlms("preprocess", "--input", text, "--output-prefix", w / "text", "--tokenizer-model", tokenizer,
             "--append-eod", "--no-progress")
    # 3. SFT: once straight through, once stopped half-way and resumed; the two must agree bit for bit
    sft = ["train", "--load", w / "base", "--finetune", "--use-checkpoint-args", "--sft",
           "--data-path", w / "chat_chat_document", "--split", "90,10,0", "--train-iters", iters,
           "--micro-batch-size", 4, "--lr", "1e-3", "--lr-warmup-iters", 1, "--log-interval", 1,
           "--eval-interval", iters, "--eval-iters", 1, "--device", "cpu", "--no-compile", "--num-workers", 0,
           "--no-progress", "--no-generate-sample", *precision]
    log = megadlms(*sft, "--save", w / "sft_straight")
    megadlms(*sft, "--save", w / "sft", "--exit-interval", iters // 2)
    stopped = complete_iterations(w / "sft")[-1]
    resume = [x for x in sft if x != "--finetune"]  # the same command on its own checkpoint: a resume
    resume[resume.index(w / "base")] = w / "sft"
    resumed_log = megadlms(*resume, "--save", w / "sft")
    first = re.search(r"^iter\s+(\d+)/", resumed_log, re.M)
    if first is None or int(first[1]) != stopped + 1:
        raise SystemExit(f"the second run did not resume from iteration {stopped}:\n{resumed_log[-2000:]}")
    a, b = state(w / "sft_straight"), state(w / "sft")
    exact = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # 4. back to the family's own format
    megadlms("convert", "megadlms-to-hf", "--load", w / "sft", "--save", w / "export")
    arch = json.loads((w / "export" / "config.json").read_text())["architectures"][0]
    # 5. the ELBO per mask ratio, from the export
    megadlms("eval", "--ppl", "--hf-model", w / "export", "--data-path", w / "text_text_document", "--split",
             "0,100,0", "--eval-samples", 4, "--seq-length", seq, "--micro-batch-size", 4, "--output-path", w / "ppl",
             "--device", "cpu")
    ppl = next(iter(json.loads((w / "ppl" / "ppl.json").read_text())["models"].values()))
    # 6. sampling from the export with the family's sampler
    sampler = ["--sampler", "reference", "--block-length", 8] if family == "llada" else \
        ["--sampler", "dream", "--alg", "entropy"]
    megadlms("generate", "--hf-model", w / "export", "--prompt", "Reverse: cat sun", "--chat", "--prompt-template",
             TEMPLATE, "--gen-length", 8, "--steps", 8, *sampler, "--device", "cpu", "--no-progress",
             "--output-file", w / "generated.jsonl")
    completion = json.loads((w / "generated.jsonl").read_text().splitlines()[0])
    return dict(family=family, architecture=arch, resumed_at=stopped, resume_exact=exact,
                elbo=ppl["elbo"], elbo_ppl=ppl["elbo_ppl"], completion=completion, train_log=log)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/megadlms_field_models"))
    p.add_argument("--iters", type=int, default=20, help="SFT iterations (stopped and resumed at half)")
    p.add_argument("--families", default="llada,dream")
    p.add_argument("--fp32", action="store_true", help="train in fp32 instead of BF16")
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--records", type=int, default=200, help="instruction records")
    a = p.parse_args(argv)
    if a.iters < 2:
        p.error("--iters must be >= 2 (the run stops at half and resumes)")
    results = []
    for family in a.families.split(","):
        r = run_family(family, a.work, iters=a.iters, precision=[] if a.fp32 else ["--bf16"], seq=a.seq_length,
                       records=a.records)
        results.append(r)
        print(f"{family}: exported as {r['architecture']}; SFT resumed at iteration {r['resumed_at']}, "
              f"{'bit-identical to' if r['resume_exact'] else 'DIFFERENT from'} the uninterrupted run; "
              f"ELBO {r['elbo']:.3f} (ppl {r['elbo_ppl']:.1f}); generated {r['completion']['completion']!r}")
    return results


if __name__ == "__main__":
    sys.exit(0 if all(r["resume_exact"] for r in main()) else 1)
