"""The life of a model as a user runs it, through the `megadlms` commands at their default flags (only the sizes of
the model, the data and the runs are small), in BF16 and in FP8:

 1. pre-train a tiny autoregressive model on the bundled corpus (`train --model-running-mode vanilla`), as a real
    `python -m megadlms` process: it must also exit, its data-loading workers included;
 2. export it to Hugging Face and import it back with an added mask token (how an AR model is prepared for DLM
    adaptation);
 3. adapt it to a masked-diffusion LM (`--model-running-mode difflm-shift`, attention annealing);
 4. tokenize a small chat set (`preprocess --chat`, with a prompt template: the bundled tokenizer has none);
 5. SFT with validation at its defaults (at iteration 0 and at the end);
 6. `ckpt verify` every checkpoint;
 7. `eval`: a local multiple-choice task made from the corpus's held-out documents, and the validation ELBO (--ppl);
 8. `generate` with each sampler that decodes the model;
 9. export to Hugging Face: transformers loads it (stock architecture, no remote code) and its logits are ours;
10. and a block-diffusion model (`--model-running-mode bd3lm --block-size 4`) the same way.
The FP8 SFT losses follow the BF16 ones step by step.

The commands run in this process through `megadlms.cli.main` (what `python -m megadlms` runs), except the first
pre-training; the training runs load their data with the default 2 worker processes. Precision flags: `--bf16`
(the default on a GPU; on the CPU the default is fp32) and, for FP8, `--fp8-format hybrid` on top of it with the
default recipe (delayed scaling), as an FP8 run on a GPU has it.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megadlms import cli
from megadlms.data.preprocess import BUNDLED_CORPUS
from megadlms.eval import demo_task

ROOT = Path(__file__).resolve().parents[1]
PRECISIONS = {"bf16": ["--bf16"], "fp8": ["--bf16", "--fp8-format", "hybrid"]}
ITERS = 10
# The model's size. --max-position-embeddings 64: the Hugging Face round trip (step 2) imports
# seq_length = max_position_embeddings, so the adaptation and the SFT (`--use-checkpoint-args`) train on 64-token
# windows without a --seq-length of their own.
SIZE = ["--model-path", "tiny", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
        "--seq-length", "64", "--max-position-embeddings", "64"]
GEN = ["--gen-length", "16", "--block-length", "16"]  # the default 128 new tokens do not fit 64 positions
TEMPLATE = "Q: {prompt}\nA: "  # the bundled tokenizer has no chat template
ADDED_MASK = "<|dlm_mask|>"  # the bundled tokenizer has <|mask|> already; the adaptation adds a token of its own
FP8_SFT_RTOL = 0.005  # the FP8-against-unquantized loss tolerance of tests/training/test_trainer.py
# transformers' logits against ours: `megadlms convert --verify`'s tolerance (max|dlogit| <= 1e-4 * max(1, max|logit|))
LOGIT_TOL = 1e-4

ITER_LINE = re.compile(r"^iter\s+(\d+)/(\d+) \| loss (\S+) ", re.M)
VALID_LINE = re.compile(r"^validation at iter (\d+) \| loss (\S+) ", re.M)


def megadlms(*argv) -> tuple[int, str, str]:
    """`megadlms ARGV` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main([str(a) for a in argv])
        except SystemExit as e:  # argparse's own errors
            code = e.code
    return code, out.getvalue(), err.getvalue()


def ok(*argv) -> tuple[str, str]:
    """Run `megadlms ARGV`; it must exit 0. (stdout, stderr)."""
    code, out, err = megadlms(*argv)
    assert code == 0, f"megadlms {' '.join(map(str, argv))} exited {code}\n{out[-3000:]}\n{err[-3000:]}"
    return out, err


def check_training_log(out: str, save: Path, iters: int = ITERS) -> dict[str, list[float]]:
    """The run's printed and recorded losses: finite, a validation at iteration 0 and at the end, the last one lower.
    Returns {"train": [loss per logged iteration], "valid": [validation losses]}."""
    printed = [(int(i), float(loss)) for i, total, loss in ITER_LINE.findall(out) if int(total) == iters]
    valid = [(int(i), float(loss)) for i, loss in VALID_LINE.findall(out)]
    assert printed and printed[-1][0] == iters, out
    assert [i for i, _ in valid] == [0, iters], out  # the validation at the start and at the end
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    train = [r["loss"] for r in rows if r["split"] == "train"]
    recorded_valid = [(r["iteration"], r["loss"]) for r in rows if r["split"] == "valid"]
    assert [i for i, _ in recorded_valid] == [0, iters]
    losses = train + [loss for _, loss in recorded_valid]
    assert all(math.isfinite(x) and 0 < x < 20 for x in losses), losses
    assert [round(x, 4) for x in train[-len(printed):]] == pytest.approx([x for _, x in printed], abs=1e-4)
    assert [round(x, 4) for _, x in recorded_valid] == pytest.approx([x for _, x in valid], abs=1e-4)
    assert recorded_valid[-1][1] < recorded_valid[0][1]  # it learned something
    return {"train": train, "valid": [loss for _, loss in recorded_valid]}


def latest(save: Path) -> Path:
    return save / f"iter_{ITERS:07d}"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ----------------------------------------------------------------------------------------------- shared data


def chat_records(n: int) -> list[dict]:
    """`n` prompt / response records from the bundled corpus's first (training) documents: the first six words of
    a document, then as many of the next as fill a 64-token window (template and EOD included). Conversations
    that fill their window leave little EOD padding, which `--sft-pad eos` trains on as response: with shorter
    ones a model this briefly fine-tuned answers every prompt with EOD (an empty completion)."""
    from megadlms.data import load_tokenizer

    tok = load_tokenizer()
    records = []
    with gzip.open(BUNDLED_CORPUS, "rt", encoding="utf-8") as f:
        for line in f:
            words = json.loads(line)["text"].split()
            prompt = "Continue: " + " ".join(words[:6])
            used = len(tok.encode(TEMPLATE.format(prompt=prompt))) + 1  # + EOD
            response: list[str] = []
            for w in words[6:]:
                if used + len(tok.encode(" ".join(response + [w]))) > 62:  # a margin for merges at the seam
                    break
                response.append(w)
            if len(response) >= 8:
                records.append({"prompt": prompt, "response": " ".join(response)})
            if len(records) == n:
                return records
    raise AssertionError(f"the bundled corpus has fewer than {n} documents of 14 words")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """What both precisions use: chat records and held-out prompts from the bundled corpus, held-out text tokenized
    for `eval --ppl`, the local multiple-choice task; the corpus tokenized into a cache of this module's own."""
    root = tmp_path_factory.mktemp("lifecycle_data")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MEGADLMS_CACHE", str(root / "cache"))  # the bundled corpus tokenized here, not in ~/.cache
        mp.setenv("HF_HUB_OFFLINE", "1")  # the eval task's data is a local file: never ask the hub
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        heldout = demo_task.heldout_documents()  # the corpus's test split, which training never sees
        chat = root / "chat.jsonl"
        chat.write_text("".join(json.dumps(r) + "\n" for r in chat_records(300)))
        prompts = root / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": "Continue: " + " ".join(t.split()[:6])}) + "\n"
                                   for t in heldout[:6]))
        text = root / "heldout.jsonl"
        text.write_text("".join(json.dumps({"text": t}) + "\n" for t in heldout[:60]))
        # the bundled tokenizer's ids; the adapted model's tokenizer only adds a token after them
        ok("preprocess", "--input", text, "--output-prefix", root / "heldout", "--append-eod")
        assert demo_task.main(["--output-dir", str(root / "tasks"), "--limit", "6"]) == 0
        yield {"root": root, "chat": chat, "prompts": prompts, "text": root / "heldout_text_document",
               "tasks": root / "tasks"}


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory):
    """trained(precision): steps 1-5 of that precision, run once per module: {step name: (stdout, stderr)} and the
    checkpoint folders."""
    runs: dict[str, dict] = {}

    def get(precision: str) -> dict:
        if precision not in runs:
            runs[precision] = _train_chain(precision, tmp_path_factory.mktemp(f"lifecycle_{precision}"), data)
        return runs[precision]
    return get


def _train_chain(precision: str, work: Path, data: dict) -> dict:
    prec = PRECISIONS[precision]
    logs = {}
    # 1. AR pre-training on the bundled corpus, a real process (it must exit: its loader workers ignore SIGTERM)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1", "MEGADLMS_CACHE": str(data["root"] / "cache")}
    argv = [sys.executable, "-m", "megadlms", "train", "--model-running-mode", "vanilla", *SIZE,
            "--train-iters", str(ITERS), "--save", str(work / "ar"), *prec]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=180)  # it takes seconds
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"`megadlms train` did not exit within 180 s:\n{e.stdout}\n{e.stderr}") from None
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    logs["pretrain"] = (proc.stdout, proc.stderr)
    # 2. to Hugging Face and back, adding a mask token; both conversions check themselves against transformers
    logs["export_ar"] = ok("convert", "megadlms-to-hf", "--load", work / "ar", "--save", work / "ar_hf", "--verify")
    logs["import_default_token"] = megadlms("convert", "hf-to-megadlms", "--hf-model", work / "ar_hf",
                                            "--save", work / "refused", "--add-mask-token")
    logs["import_ar"] = ok("convert", "hf-to-megadlms", "--hf-model", work / "ar_hf", "--save", work / "ar_base",
                           "--add-mask-token", ADDED_MASK, "--verify")
    # 3. AR -> DLM: the imported architecture (its vocabulary grew by the mask row) and tokenizer (with the token)
    base = work / "ar_base" / "iter_0000000"
    logs["adapt"] = ok("train", "--load", work / "ar_base", "--finetune", "--use-checkpoint-args",
                       "--tokenizer-model", base / "tokenizer", "--model-running-mode", "difflm-shift",
                       "--attention-anneal-iters", "4", "--train-iters", ITERS, "--save", work / "shift", *prec)
    # 4. the chat data, tokenized by the model's tokenizer
    tokenizer = latest(work / "shift") / "tokenizer"
    logs["preprocess"] = ok("preprocess", "--chat", "--input", data["chat"], "--output-prefix", work / "chat",
                            "--tokenizer-model", tokenizer, "--prompt-template", TEMPLATE)
    # 5. SFT, validated at its defaults (10 batches at iteration 0 and at the end); every step's loss logged
    #    (--log-interval 1) for the step-by-step comparison of FP8 with BF16
    logs["sft"] = ok("train", "--sft", "--load", work / "shift", "--finetune", "--use-checkpoint-args",
                     "--tokenizer-model", tokenizer, "--data-path", work / "chat_chat_document", "--split", "90,10,0",
                     "--train-iters", ITERS, "--log-interval", "1", "--save", work / "sft", *prec)
    return {"work": work, "logs": logs, "tokenizer": tokenizer,
            "losses": {name: check_training_log(logs[name][0], work / save)
                       for name, save in (("pretrain", "ar"), ("adapt", "shift"), ("sft", "sft"))}}


# ----------------------------------------------------------------------------------------------- helpers


def plain_model(load: Path):
    """Our model of a checkpoint in fp32 as the exports write it: FP8-trained layers as plain ones (the master
    weights; what `megadlms convert` exports and checks)."""
    from megadlms.interop.hf import model_from_state_dict, plain_state_dict
    from megadlms.training.checkpoint import load_model_from_checkpoint

    model, cfg, _ = load_model_from_checkpoint(load)
    return model_from_state_dict(cfg.replace(fp8=False), plain_state_dict(model, cfg)).eval(), cfg


def transformers_logits_match(folder: Path, load: Path, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    """transformers' AutoModelForCausalLM of an export (no remote code) against our model of the checkpoint:
    max|dlogit| / max(1, max|logit|), and transformers' logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    conf = json.loads((folder / "config.json").read_text())
    assert "auto_map" not in conf and not list(folder.glob("*.py"))  # the stock architecture: no code to trust
    assert AutoConfig.from_pretrained(str(folder)).is_causal is False  # bidirectional, from config.json alone
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ours, _ = plain_model(load)
    with torch.no_grad():
        theirs, mine = hf(input_ids=ids).logits, ours(ids)
    return float((theirs - mine).abs().max() / max(1.0, float(mine.abs().max()))), theirs


def probe_ids(tokenizer_dir: Path, mask_id: int) -> torch.Tensor:
    """A few tokens: a held-out-style prompt followed by masks, as a sampler's first forward sees them."""
    from megadlms.data import load_tokenizer

    ids = load_tokenizer(str(tokenizer_dir)).encode("Q: Continue: Once upon a time, there was a\nA: ")
    return torch.tensor([ids + [mask_id] * 6])


def generated(path: Path, err: str, sampler: str, prompts: int, new_tokens: int) -> list[str]:
    """The completions of `generate --output-file`: one per prompt, text produced, the sampler named."""
    rows = read_jsonl(path)
    assert len(rows) == prompts and all({"prompt", "completion", "num_tokens"} <= set(r) for r in rows)
    assert all(0 < r["num_tokens"] <= new_tokens and r["completion"].strip() for r in rows), rows
    produced = re.search(rf"\[{sampler}\] (\d+) tokens in ", err)  # the summary line (after a progress bar's \r)
    assert produced and int(produced[1]) > 0, err
    return [r["completion"] for r in rows]


def check_ppl(out_dir: Path, name: Path) -> dict:
    report = json.loads((out_dir / "ppl.json").read_text())["models"][str(name)]
    values = [v for v in report.values() if isinstance(v, float)] + report.get("loss_per_ratio", [])
    assert values and all(math.isfinite(v) and v > 0 for v in values), report
    return report


# ----------------------------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_lifecycle(precision, trained, data):
    run = trained(precision)
    work, logs, losses = run["work"], run["logs"], run["losses"]
    n_prompts = len(read_jsonl(data["prompts"]))

    # 1. pre-training: finite losses, validations at iteration 0 and at the end, a checkpoint (check_training_log)
    assert "causal attention" in logs["pretrain"][1] and (latest(work / "ar") / "meta.json").is_file()
    if precision == "fp8":
        assert "FP8 hybrid/delayed" in logs["pretrain"][1]

    # 2. the Hugging Face round trip: each conversion matches transformers' logits; the bundled tokenizer's own
    #    <|mask|> is refused for --add-mask-token in one line naming the fix, a new token gets a row of its own
    for step in ("export_ar", "import_ar"):
        assert "-> PASSED" in logs[step][0], logs[step]
    code, _, err = logs["import_default_token"]
    assert code == 2 and err.count("\n") == 1 and "pass --mask-token 1 instead of --add-mask-token" in err
    assert f"added '{ADDED_MASK}' as id 4096 (embedding rows: 4224)" in logs["import_ar"][0]
    imported = json.loads((work / "ar_base" / "iter_0000000" / "meta.json").read_text())["config"]
    assert (imported["vocab_size"], imported["mask_token_id"], imported["attn_mask_type"]) == (4224, 4096, "causal")

    # 3. the adaptation trained a bidirectional shifted DLM with the added mask token
    shift = json.loads((latest(work / "shift") / "meta.json").read_text())["config"]
    assert (shift["attn_mask_type"], shift["diffusion_shift"], shift["mask_token_id"]) == ("bidirectional", True, 4096)
    assert shift["seq_length"] == 64 and shift["vocab_size"] == 4224

    # 4. chat preprocessing: tokens and loss masks
    assert f"{300} documents" in logs["preprocess"][0]
    assert all((work / f"chat_chat_document{s}").is_file() for s in (".bin", ".idx", "_lossmask.bin", "_lossmask.idx"))

    # 5. SFT: every step logged (finite), the validation at iteration 0 and at the end, the mode kept from the model
    assert len(losses["sft"]["train"]) == ITERS
    sft_cfg = json.loads((latest(work / "sft") / "meta.json").read_text())["config"]
    assert (sft_cfg["diffusion_shift"], sft_cfg["mask_token_id"], sft_cfg["fp8"]) == (True, 4096, precision == "fp8")

    # 6. every checkpoint of the chain is whole
    for save in ("ar", "ar_base", "shift", "sft"):
        out, _ = ok("ckpt", "verify", work / save)
        assert re.search(r"^iter_\d{7}: ok \(\d+ files match their checksums\)$", out, re.M), out
        assert "1 of 1 checkpoint folders whole" in out

    # 7. evaluation: the multiple-choice task (LLaDA's Monte-Carlo likelihood at its defaults) and the ELBO per ratio
    out, _ = ok("eval", "--load", work / "sft", "--tasks", "demo_heldout_mc", "--include-path", data["tasks"],
                "--output-path", work / "eval_mc")
    acc = json.loads((work / "eval_mc" / "results.json").read_text())["results"]["demo_heldout_mc"]["acc,none"]
    assert 0 <= acc <= 1 and acc * 6 == pytest.approx(round(acc * 6))  # 6 items
    assert re.search(r"^\|demo_heldout_mc\|.*\|acc +\|", out, re.M), out
    ok("eval", "--ppl", "--load", work / "sft", "--data-path", data["text"], "--output-path", work / "eval_ppl")
    report = check_ppl(work / "eval_ppl", work / "sft")
    assert len(report["loss_per_ratio"]) == 10  # the default ratios 0.1 ... 1.0
    assert report["elbo"] == pytest.approx(sum(report["loss_per_ratio"]) / 10, rel=1e-6)
    assert report["elbo_ppl"] == pytest.approx(math.exp(report["elbo"]), rel=1e-6)

    # 8. generation with each sampler of a masked-diffusion model, prompts rendered as in the chat data
    chat = ["--prompt-file", data["prompts"], "--chat", "--prompt-template", TEMPLATE, *GEN]
    texts = {}
    for sampler in ("reference", "fast"):
        _, err = ok("generate", "--load", work / "sft", *chat, "--sampler", sampler,
                    "--output-file", work / f"gen_{sampler}.jsonl")
        texts[sampler] = generated(work / f"gen_{sampler}.jsonl", err, sampler, n_prompts, 16)
    if precision == "fp8":  # the FP8 inference export runs its FP8 weights
        out, _ = ok("export", "--load", work / "sft", "--save", work / "sft_fp8_export", "--fp8")
        assert "FP8 E4M3 linears" in out
        _, err = ok("generate", "--fp8-export", work / "sft_fp8_export", *chat,
                    "--output-file", work / "gen_fp8_export.jsonl")
        generated(work / "gen_fp8_export.jsonl", err, "reference", n_prompts, 16)

    # 9. the Hugging Face export: transformers loads it with its tokenizer; the logits are ours
    out, _ = ok("convert", "megadlms-to-hf", "--load", work / "sft", "--save", work / "sft_hf")
    hf_conf = json.loads((work / "sft_hf" / "config.json").read_text())
    assert (hf_conf["mask_token_id"], hf_conf["model_running_mode"], hf_conf["is_causal"]) == (4096, "difflm-shift",
                                                                                               False)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(work / "sft_hf"))
    assert tok.mask_token == ADDED_MASK and tok.convert_tokens_to_ids(ADDED_MASK) == 4096
    ids = probe_ids(run["tokenizer"], 4096)
    diff, _ = transformers_logits_match(work / "sft_hf", work / "sft", ids)
    assert diff <= LOGIT_TOL, diff
    if precision == "bf16":  # both fp32 on the CPU: the export samples the same tokens as the checkpoint
        _, err = ok("generate", "--hf-model", work / "sft_hf", *chat, "--sampler", "reference",
                    "--output-file", work / "gen_hf.jsonl")
        assert generated(work / "gen_hf.jsonl", err, "reference", n_prompts, 16) == texts["reference"]
    else:  # the FP8 Hugging Face export: transformers dequantizes its block-scaled E4M3 weights on the CPU
        out, _ = ok("export", "--load", work / "sft", "--save", work / "sft_fp8_hf", "--hf", "--fp8")
        assert "per-block scales" in out
        q = json.loads((work / "sft_fp8_hf" / "config.json").read_text())["quantization_config"]
        assert (q["quant_method"], q["weight_block_size"]) == ("fp8", [128, 128])
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(work / "sft_fp8_hf"), dtype=torch.float32).eval()
        ours, _ = plain_model(work / "sft")
        with torch.no_grad():
            theirs, mine = hf(input_ids=ids).logits.float(), ours(ids)
        rel = float((theirs - mine).norm() / mine.norm())
        assert 0 < rel < 0.05, rel  # E4M3 weights: close to the master weights, not equal
        # our own --hf-model loader refuses the quantized export in one line naming what runs FP8 weights
        code, _, err = megadlms("generate", "--hf-model", work / "sft_fp8_hf", *chat)
        assert code == 2 and err.count("\n") == 1 and "quantization_config" in err and "--fp8-export" in err, err


def test_fp8_sft_losses_track_bf16(trained):
    """The same seed and data: the FP8 SFT's losses step by step (and its validations) within the FP8 tolerance of the
    BF16 run's; the three trainings before it ran in their precision too."""
    bf16, fp8 = trained("bf16")["losses"]["sft"], trained("fp8")["losses"]["sft"]
    assert len(bf16["train"]) == len(fp8["train"]) == ITERS
    assert bf16["train"] != fp8["train"]  # FP8 did run
    torch.testing.assert_close(torch.tensor(fp8["train"]), torch.tensor(bf16["train"]), rtol=FP8_SFT_RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(fp8["valid"]), torch.tensor(bf16["valid"]), rtol=FP8_SFT_RTOL, atol=0)


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_block_diffusion_lifecycle(precision, data, tmp_path):
    """10. BD3-LM: pre-train with blocks of 4, verify the checkpoint, its NELBO, its sampler, its export."""
    save = tmp_path / "bd3lm"
    out, _ = ok("train", "--model-running-mode", "bd3lm", "--block-size", "4", *SIZE, "--train-iters", ITERS,
                "--save", save, *PRECISIONS[precision])
    check_training_log(out, save)
    out, _ = ok("ckpt", "verify", save)
    assert "1 of 1 checkpoint folders whole" in out

    ok("eval", "--ppl", "--load", save, "--data-path", data["text"], "--output-path", tmp_path / "ppl")
    report = check_ppl(tmp_path / "ppl", save)
    assert report["mode"] == "block diffusion (block 4)" and report["nelbo"] == report["elbo"]

    prompts = ["--prompt-file", data["prompts"], "--max-new-tokens", "16"]
    _, err = ok("generate", "--load", save, *prompts, "--output-file", tmp_path / "gen.jsonl")  # its own sampler
    n_prompts = len(read_jsonl(data["prompts"]))
    texts = generated(tmp_path / "gen.jsonl", err, "bd3lm", n_prompts, 16)

    ok("convert", "megadlms-to-hf", "--load", save, "--save", tmp_path / "hf")
    conf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (conf["model_running_mode"], conf["block_size"], conf["is_causal"]) == ("bd3lm", 4, False)
    from megadlms.data import default_tokenizer_path

    diff, _ = transformers_logits_match(tmp_path / "hf", save, probe_ids(default_tokenizer_path(), 1))
    assert diff <= LOGIT_TOL, diff  # bidirectional logits; the block structure is the sampler's
    _, err = ok("generate", "--hf-model", tmp_path / "hf", *prompts, "--output-file", tmp_path / "gen_hf.jsonl")
    texts_hf = generated(tmp_path / "gen_hf.jsonl", err, "bd3lm", n_prompts, 16)  # block by block from config.json
    if precision == "bf16":  # fp32 on both sides: the same tokens
        assert texts_hf == texts
