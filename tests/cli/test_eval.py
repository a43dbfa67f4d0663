"""`megadlms eval`: harness tasks written to --output-path, --ppl per mask ratio side by side, one-line errors."""

import json
import sys
import zlib

import pytest
import torch

from megadlms.cli import eval as cli
from megadlms.config import TransformerConfig
from megadlms.data import default_tokenizer_path, load_tokenizer, preprocess_jsonl
from megadlms.eval import likelihood as lk
from megadlms.eval.validation import validation_windows
from megadlms.model import TransformerLM
from megadlms.training.checkpoint import save_model_checkpoint


def run_cli(argv, capsys):
    code = cli.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_eval_writes_the_results_table(eval_files, tmp_path, capfd, monkeypatch):
    monkeypatch.chdir(tmp_path)  # outside a git checkout: git's "fatal: not a git repository" stays off stderr
    argv = ["--load", str(eval_files["dlm"]), "--tasks", "tiny_mc", "--include-path", str(eval_files["tasks"]),
            "--model-args", "mc_num=2,greedy=off", "--device", "cpu", "--limit", "2", "--output-path", str(tmp_path)]
    code, out, err = run_cli(argv, capfd)
    assert code == 0, err
    assert "not a git repository" not in err and json.loads((tmp_path / "results.json").read_text())["git_hash"] is None
    results = json.loads((tmp_path / "results.json").read_text())["results"]["tiny_mc"]
    row = next(line for line in out.splitlines() if line.startswith("|tiny_mc|"))
    assert row.split("|")[3:6] == ["none  ", "     0", "acc   "]
    assert float(row.split("|")[7]) == results["acc,none"]
    assert (tmp_path / "results.md").read_text().strip() in out
    assert results["acc,none"] in (0.0, 0.5, 1.0)


@pytest.mark.parametrize("argv, message", [
    (["--tasks", "nope"], "unknown task(s) ['nope']"),
    (["--tasks", "tiny_mc", "--include-path", "/no/such/dir"], "--include-path /no/such/dir is not a folder"),
    ([], "no tasks: pass --tasks"),
    (["--ppl", "--data-path", "/no/such/corpus_text_document"],
     "--data-path /no/such/corpus_text_document: no dataset there"),
    (["--ppl", "--data-path", "x", "--mask-ratios", "0.5,2"], "every ratio must be in (0, 1]"),
    (["--tasks", "tiny_mc", "--model-args", "mc_num=0"], "mc_num=0 must be a positive integer"),
    (["--ppl", "--tokenizer-type", "SentencePieceTokenizer"], "--tokenizer-type 'SentencePieceTokenizer' is not"),
    (["--tasks", "tiny_mc", "--model-args", "mcnum=3"], "unknown --model-args key(s) ['mcnum']; the keys are"),
    (["--tasks", "tiny_mc", "--model-args", "gen_length=10,block_length=4"], "gen_length=10 is not divisible"),
])
def test_bad_input_is_one_line(eval_files, capsys, monkeypatch, argv, message):
    import lm_eval.tasks

    class LocalOnly(lm_eval.tasks.TaskManager):  # the harness's own task index (slow to build) left out
        def __init__(self, include_path=None, include_defaults=True, **kw):
            super().__init__(include_path=include_path, include_defaults=False, **kw)

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", LocalOnly)
    argv = ["--load", str(eval_files["dlm"]), "--device", "cpu"] + argv
    if "--include-path" not in argv and "--ppl" not in argv:
        argv += ["--include-path", str(eval_files["tasks"])]
    code, _, err = run_cli(argv, capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith("megadlms eval: error: ") and message in err


def test_the_tokenizer_flags_reach_the_harness_model():
    args = cli.add_arguments(__import__("argparse").ArgumentParser()).parse_args(
        ["--load", "ck", "--tokenizer-model", "tok", "--tasks", "x"])
    assert cli.model_kwargs(args)["tokenizer"] == "tok" and "tokenizer_model" not in cli.model_kwargs(args)


def test_model_args_keys_of_a_flag_are_kept_or_refused():
    parse = cli.add_arguments(__import__("argparse").ArgumentParser()).parse_args
    kwargs = cli.model_kwargs(parse(["--load", "ck", "--model-args", "dtype=bf16,seed=7,mc_num=4"]))
    assert (kwargs["dtype"], kwargs["seed"], kwargs["mc_num"], kwargs["device"]) == ("bf16", 7, 4, "auto")
    assert cli.model_kwargs(parse(["--load", "ck", "--dtype", "bf16", "--model-args", "dtype=bf16"]))["dtype"] == "bf16"
    with pytest.raises(cli.ConfigError, match=r"^--model-args dtype=fp32 contradicts --dtype bf16; give the value"):
        cli.model_kwargs(parse(["--load", "ck", "--dtype", "bf16", "--model-args", "dtype=fp32"]))
    with pytest.raises(cli.ConfigError, match="--model-args batch_size=4 contradicts --micro-batch-size 16"):
        cli.model_kwargs(parse(["--load", "ck", "--batch-size", "16", "--model-args", "batch_size=4"]))


def test_missing_harness_names_the_extra(eval_files, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    code, _, err = run_cli(["--load", str(eval_files["dlm"]), "--tasks", "x"], capsys)
    assert code == 2 and "megadlms eval needs the 'lm_eval' package: pip install 'megadlms[eval]'" in err


def test_ppl_compares_two_checkpoints_per_mask_ratio(eval_files, tmp_path, capsys):
    tok = load_tokenizer()
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"Lily and Tom played with ball number {i} in the sunny park."})
                            + "\n" for i in range(12)))
    preprocess_jsonl(docs, tmp_path / "corpus", tok, append_eod=True, progress=False)
    prefix = str(tmp_path / "corpus_text_document")
    argv = ["--ppl", "--load", str(eval_files["dlm"]), "--compare", str(eval_files["dlm2"]), "--data-path", prefix,
            "--split", "0,1,0", "--eval-samples", "3", "--seq-length", "16", "--mask-ratios", "0.25,0.5,1.0",
            "--device", "cpu", "--output-path", str(tmp_path / "out"), "--data-cache-path", str(tmp_path / "cache")]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    report = json.loads((tmp_path / "out" / "ppl.json").read_text())
    assert report["windows"] == 3 and report["mask_ratios"] == [0.25, 0.5, 1.0]
    windows = validation_windows(tok, data_path=prefix, seq_length=16, samples=3, split="0,1,0",
                                 data_cache_path=str(tmp_path / "cache"))
    for name, model in ((str(eval_files["dlm"]), eval_files["models"]["dlm"]),
                        (str(eval_files["dlm2"]), eval_files["models"]["dlm2"])):
        # the default: SUBS, the [MASK] logit -inf (the training default)
        nll = lk.elbo_nll(model, [([], w[:16]) for w in windows], mask_id=1, ratios=[0.25, 0.5, 1.0], seed=1234,
                          subs_mask_id=1)
        expect = (nll.sum(0) / (3 * 16)).tolist()
        got = report["models"][name]
        assert got["loss_per_ratio"] == pytest.approx(expect, rel=1e-5)
        assert got["elbo"] == pytest.approx(sum(expect) / 3, rel=1e-6)
        assert f"{got['elbo_ppl']:.3f}" in out
    a, b = (report["models"][k]["loss_per_ratio"] for k in report["models"])
    assert a != b and "| 0.25 | " in out and "perplexity (upper bound" in out
    assert report["loss"] == "subs" and "(diffusion CE: SUBS, [MASK] out of the softmax)" in out
    # LLaDA's full-vocabulary CE on request: a looser bound
    code, out, err = run_cli(argv + ["--diffusion-loss", "full-vocab"], capsys)
    assert code == 0, err
    full = json.loads((tmp_path / "out" / "ppl.json").read_text())["models"][str(eval_files["dlm"])]
    nll = lk.elbo_nll(eval_files["models"]["dlm"], [([], w[:16]) for w in windows], mask_id=1,
                      ratios=[0.25, 0.5, 1.0], seed=1234)
    assert full["loss_per_ratio"] == pytest.approx((nll.sum(0) / (3 * 16)).tolist(), rel=1e-5)
    assert all(f > s for f, s in zip(full["loss_per_ratio"], a)) and "full vocabulary, [MASK] kept" in out
    # an autoregressive checkpoint reports its exact NLL beside the masked-diffusion bound
    argv[argv.index("--compare") + 1] = str(eval_files["ar"])
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    ar = json.loads((tmp_path / "out" / "ppl.json").read_text())["models"][str(eval_files["ar"])]
    exact = lk.ar_loglikelihood(eval_files["models"]["ar"], [(w[:1], w[1:17]) for w in windows])
    assert ar["mode"] == "autoregressive" and ar["nll"] == pytest.approx(-sum(lp for lp, _ in exact) / 48, rel=1e-6)
    assert "| 0.25 | " in out and f"{ar['ppl']:.3f}" in out
    # the training objective (the trainer's step and validation methods): for AR the same exact NLL; for masked
    # diffusion an estimate of the same bound with sampled noise
    assert ar["objective_loss"] == pytest.approx(ar["nll"], rel=1e-5) and "training objective" in out
    # --ignore-bos: each window's first token is the never-masked prefix, and the bound is per token of the rest
    argv[argv.index("--compare") + 1] = str(eval_files["dlm2"])
    code, out, err = run_cli(argv + ["--ignore-bos"], capsys)
    assert code == 0, err
    got = json.loads((tmp_path / "out" / "ppl.json").read_text())["models"][str(eval_files["dlm"])]
    nll = lk.elbo_nll(eval_files["models"]["dlm"], [(w[:1], w[1:16]) for w in windows], mask_id=1,
                      ratios=[0.25, 0.5, 1.0], seed=1234, subs_mask_id=1)
    assert got["loss_per_ratio"] == pytest.approx((nll.sum(0) / (3 * 15)).tolist(), rel=1e-5)
    dlm = json.loads((tmp_path / "out" / "ppl.json").read_text())["models"][str(eval_files["dlm"])]
    assert 0.5 * dlm["elbo"] < dlm["objective_loss"] < 2 * dlm["elbo"]


def test_ppl_of_a_chat_dataset_is_one_line_naming_what_it_scores(eval_files, tmp_path, capsys):
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"prompt": "Who saw the birds?", "response": "Tom saw them."}) + "\n")
    preprocess_jsonl(chats, tmp_path / "sft", load_tokenizer(), chat=True, prompt_template="Q: {prompt}\nA: ",
                     progress=False)
    argv = ["--ppl", "--load", str(eval_files["dlm"]), "--data-path", str(tmp_path / "sft_chat_document"),
            "--device", "cpu"]
    code, _, err = run_cli(argv, capsys)
    assert code == 2 and err.count("\n") == 1 and "sft_chat_document is a chat dataset" in err, err
    assert "scored on plain-text datasets" in err and "add --sft" not in err  # no flag `eval` does not have


def test_ppl_without_a_data_path_scores_the_bundled_corpus(eval_files, tmp_path, capsys, monkeypatch):
    from megadlms.data import bundled_dataset

    monkeypatch.setenv("MEGADLMS_CACHE", str(tmp_path))
    argv = ["--ppl", "--load", str(eval_files["dlm"]), "--eval-samples", "2", "--seq-length", "16",
            "--tokenizer-model", str(default_tokenizer_path() / "tokenizer.json"), "--tokenizer-type",
            "HuggingFaceTokenizer",  # the tokenizer flags of `train`: the checkpoint's own tokenizer, by its file
            "--mask-ratios", "0.5,1.0", "--device", "cpu", "--output-path", str(tmp_path / "out")]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    assert "no --data-path: the validation split of the bundled demo corpus" in err
    report = json.loads((tmp_path / "out" / "ppl.json").read_text())
    prefix = bundled_dataset(load_tokenizer(), tmp_path, progress=False)  # where training tokenized it
    assert report["data_path"] == prefix and report["split"] == "98,1,1"  # training's split of the bundled corpus
    windows = validation_windows(load_tokenizer(), data_path=prefix, seq_length=16, samples=2, split="98,1,1")
    nll = lk.elbo_nll(eval_files["models"]["dlm"], [([], w[:16]) for w in windows], mask_id=1, ratios=[0.5, 1.0],
                      seed=1234, subs_mask_id=1)
    got = report["models"][str(eval_files["dlm"])]["loss_per_ratio"]
    assert got == pytest.approx((nll.sum(0) / 32).tolist(), rel=1e-5)


def test_ppl_of_a_block_diffusion_checkpoint_is_its_nelbo(tmp_path, capsys):
    from megadlms.diffusion.bd3lm import nelbo

    tok = load_tokenizer()
    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=64, vocab_size=4096, seq_length=16, init_method_std=0.2, mask_token_id=1,
                            block_size=4)
    model = TransformerLM(cfg).eval()
    save_model_checkpoint(tmp_path / "bd3lm", model, cfg, tokenizer_dir=default_tokenizer_path())
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"Tom saw {i} red birds in the tall green tree."}) + "\n"
                            for i in range(8)))
    preprocess_jsonl(docs, tmp_path / "corpus", tok, append_eod=True, progress=False)
    argv = ["--ppl", "--load", str(tmp_path / "bd3lm"), "--data-path", str(tmp_path / "corpus_text_document"),
            "--split", "0,1,0", "--eval-samples", "2", "--seq-length", "16", "--device", "cpu",
            "--output-path", str(tmp_path / "out"), "--data-cache-path", str(tmp_path / "cache")]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    report = json.loads((tmp_path / "out" / "ppl.json").read_text())["models"][str(tmp_path / "bd3lm")]
    assert report["mode"] == "block diffusion (block 4)" and "NELBO" in out
    windows = validation_windows(tok, data_path=str(tmp_path / "corpus_text_document"), seq_length=16, samples=2,
                                 split="0,1,0", data_cache_path=str(tmp_path / "cache"))
    expect = 0.0
    for w in windows:  # each window's noise from the seed and its own tokens
        g = torch.Generator().manual_seed(1234 * 1_000_003 + zlib.crc32(str(w[:16]).encode()))
        with torch.no_grad():
            expect += float(nelbo(model, torch.tensor([w[:16]]), block_size=4, mask_token_id=1, generator=g)[0])
    assert report["nelbo"] == pytest.approx(expect / len(windows), rel=1e-6)


@pytest.mark.parametrize("flag", [None, "subs"])
def test_ppl_of_an_imported_llada_uses_its_recorded_loss_unless_told(flag, tmp_path, capsys):
    """LLaDA records the full-vocabulary CE it was trained with: `eval --ppl` scores with it (LLaDA's own
    likelihood), and with SUBS when --diffusion-loss subs asks."""
    import shutil
    from pathlib import Path

    from megadlms.interop import load_hf_model
    from tests.interop.helpers import write_tokenizer

    hf = tmp_path / "llada"
    shutil.copytree(Path(__file__).parents[1] / "interop" / "data" / "llada_llama", hf)
    tok = load_tokenizer(str(write_tokenizer(hf, n_ids=300)))
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": " ".join(f"w{(7 * i + j) % 290 + 3}" for j in range(20))}) + "\n"
                            for i in range(6)))
    preprocess_jsonl(docs, tmp_path / "corpus", tok, append_eod=True, progress=False)
    prefix = str(tmp_path / "corpus_text_document")
    argv = ["--ppl", "--hf-model", str(hf), "--data-path", prefix, "--split", "0,1,0", "--eval-samples", "2",
            "--seq-length", "16", "--mask-ratios", "0.5,1.0", "--device", "cpu", "--output-path",
            str(tmp_path / "out"), "--data-cache-path", str(tmp_path / "cache")]
    code, out, err = run_cli(argv + (["--diffusion-loss", flag] if flag else []), capsys)
    assert code == 0, err
    report = json.loads((tmp_path / "out" / "ppl.json").read_text())
    assert report["loss"] == (flag or "full-vocab")
    assert ("SUBS, [MASK] out of the softmax" if flag else "full vocabulary, [MASK] kept") in out
    windows = validation_windows(tok, data_path=prefix, seq_length=16, samples=2, split="0,1,0",
                                 data_cache_path=str(tmp_path / "cache"))
    model, cfg = load_hf_model(hf)
    nll = lk.elbo_nll(model, [([], w[:16]) for w in windows], mask_id=cfg.mask_token_id, ratios=[0.5, 1.0],
                      seed=1234, subs_mask_id=cfg.mask_token_id if flag else None)
    got = report["models"][str(hf)]
    assert got["loss"] == report["loss"]
    assert got["loss_per_ratio"] == pytest.approx((nll.sum(0) / 32).tolist(), rel=1e-5)


def test_ppl_of_an_hf_export_scores_windows_of_the_trained_length(tmp_path, capsys):
    """A model trained at 48 tokens (positions up to 256), exported to Hugging Face: `eval --ppl --hf-model` scores
    48-token windows, as `--load` of the checkpoint does, with the same bound."""
    from megadlms.cli.convert import main as convert
    from tests.eval.conftest import save_tiny

    save_tiny(tmp_path / "ck", seed=3, max_position_embeddings=256)
    assert convert(["megadlms-to-hf", "--load", str(tmp_path / "ck"), "--save", str(tmp_path / "hf")]) == 0
    tok = load_tokenizer()
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"Lily and Tom played with ball number {i} in the sunny park."})
                            + "\n" for i in range(16)))
    preprocess_jsonl(docs, tmp_path / "corpus", tok, append_eod=True, progress=False)
    reports = []
    for source in ("--load", "--hf-model"):
        path = tmp_path / ("ck" if source == "--load" else "hf")
        argv = ["--ppl", source, str(path), "--data-path", str(tmp_path / "corpus_text_document"), "--split",
                "0,1,0", "--eval-samples", "2", "--mask-ratios", "0.5,1.0", "--device", "cpu", "--output-path",
                str(tmp_path / source.strip("-")), "--data-cache-path", str(tmp_path / "cache")]
        code, out, err = run_cli(argv, capsys)
        assert code == 0, err
        reports.append(json.loads((tmp_path / source.strip("-") / "ppl.json").read_text()))
    assert [r["seq_length"] for r in reports] == [48, 48] and "2 windows x 48 tokens" in out
    a, b = (next(iter(r["models"].values())) for r in reports)
    assert b["loss_per_ratio"] == pytest.approx(a["loss_per_ratio"], rel=1e-5)
