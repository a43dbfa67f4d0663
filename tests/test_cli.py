"""Errors in what the user asked for: a flag out of range, a missing file, a wrong folder. The command line
prints one line naming the value and the fix (exit status 2, no traceback); a bug keeps its traceback."""

import subprocess
import sys
from pathlib import Path

import pytest

from megadlms import cli
from megadlms.config import ConfigError
from megadlms.errors import MegaDLMsError
from megadlms.training.args import parse_train_args

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("flags,message", [
    (["--log-interval", "0"], "--log-interval 0 must be >= 1"),
    (["--train-iters", "0"], "--train-iters 0 must be >= 1"),
    (["--micro-batch-size", "0"], "--micro-batch-size 0 must be >= 1"),
    (["--global-batch-size", "0"], "--global-batch-size 0 must be >= 1"),
    (["--lr", "-1"], "--lr -1.0 must be >= 0.0"),
    (["--lr", "nan"], "--lr nan must be >= 0.0"),
    (["--weight-decay", "-0.1"], "--weight-decay -0.1 must be >= 0.0"),
    (["--clip-grad", "-1"], "--clip-grad -1.0 must be >= 0.0"),
    (["--lr-warmup-iters", "-5"], "--lr-warmup-iters -5 must be >= 0"),
    (["--eval-iters", "-1"], "--eval-iters -1 must be >= 0"),
    (["--fp8-margin", "-1"], "--fp8-margin -1 must be >= 0"),
    (["--fp8-amax-history-len", "0"], "--fp8-amax-history-len 0 must be >= 1"),
    (["--seed", "-1"], "--seed -1 must be >= 0"),
    (["--seed", str(2**32)], "must be below 2\\*\\*32"),
    (["--adam-beta2", "1"], "--adam-beta2 1.0 must be in \\[0, 1\\)"),
    (["--adam-eps", "0"], "--adam-eps 0.0 must be > 0"),
])
def test_out_of_range_flags_are_named(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_train_args(flags)


def test_zero_means_never_for_intervals_and_counts():
    args = parse_train_args(["--eval-interval", "0", "--save-interval", "0", "--exit-interval", "0", "--eval-iters",
                             "0", "--loss-chunk-tokens", "0", "--weight-decay", "0", "--clip-grad", "0", "--seed", "0"])
    t = args.train
    assert t.eval_interval == args.checkpoint.save_interval == t.exit_interval == t.loss_chunk_tokens == 0


def test_flags_without_a_config_apply_on_top_of_the_demo(caplog):
    caplog.set_level("INFO", logger="megadlms.training.args")
    demo = parse_train_args([])
    flagged = parse_train_args(["--no-progress", "--train-iters", "300"])
    assert flagged.train.no_progress and flagged.train.train_iters == 300
    expect = {**demo.to_flat(), "no_progress": True, "train_iters": 300}
    assert flagged.to_flat() == expect  # the rest is the demo's: hidden 128, seq 64, runs/demo, the closing sample
    assert (flagged.model.hidden_size, flagged.model.seq_length, flagged.checkpoint.save) == (128, 64, "runs/demo")
    assert flagged.train.generate_sample
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["configuration: the demo configuration (megadlms/assets/demo.yaml)",
                     "configuration: the demo configuration (megadlms/assets/demo.yaml) with your flags on top: "
                     "--no-progress --train-iters 300"]


@pytest.mark.parametrize("flags", [["--model-path", "tiny"], ["--data-path=corpus_text_document"],
                                   ["--model-p", "qwen3-0.6b"], ["--train-data-path", "a", "--valid-data-path", "b"],
                                   ["--load", "base", "--finetune", "--use-checkpoint-args"],
                                   ["--tokenizer-model", "tok/tokenizer.json"]])
def test_a_model_or_data_of_ones_own_starts_from_the_flag_defaults(caplog, flags):
    caplog.set_level("INFO", logger="megadlms.training.args")
    c = parse_train_args(flags + ["--no-progress"])
    assert (c.model.hidden_size, c.train.train_iters, c.checkpoint.save, c.train.generate_sample) == (
        None, 1000, None, False)
    assert caplog.records[-1].getMessage().startswith("configuration: the flags' defaults with your flags on top")


def test_a_config_file_is_named_in_the_first_line(tmp_path, caplog):
    caplog.set_level("INFO", logger="megadlms.training.args")
    run = tmp_path / "run.yaml"
    run.write_text("train-iters: 7\n")
    assert parse_train_args(["--config", str(run), "--seed", "3"]).train.train_iters == 7
    assert caplog.records[-1].getMessage() == f"configuration: {run} with your flags on top: --seed 3"


def test_the_demo_rule_is_in_the_help_and_a_short_demo_names_the_warmup():
    from megadlms.training.args import build_parser

    assert "starts from the demo configuration (megadlms/assets/demo.yaml)" in " ".join(
        build_parser().format_help().split())
    with pytest.raises(ConfigError) as e:
        parse_train_args(["--train-iters", "40"])
    assert str(e.value) == ("--lr-warmup-iters 60 exceeds --lr-decay-iters 40 (default: --train-iters); pass "
                            "--lr-warmup-iters 40 or less (the demo configuration, megadlms/assets/demo.yaml, sets "
                            "--lr-warmup-iters)")
    with pytest.raises(ConfigError, match=r"--lr-warmup-iters 50 exceeds --lr-decay-iters 40 \(default: "
                                          r"--train-iters\); pass --lr-warmup-iters 40 or less$"):
        parse_train_args(["--train-iters", "40", "--lr-warmup-iters", "50"])  # the user's own value: no blame


def test_the_demo_run_says_so_first(tmp_path, caplog, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MEGADLMS_CACHE", str(tmp_path / "cache"))
    caplog.set_level("INFO", logger="megadlms")
    argv = ["train", "--no-progress", "--device", "cpu", "--train-iters", "2", "--lr-warmup-iters", "1",
            "--eval-iters", "0", "--num-workers", "0", "--no-generate-sample", "--save", "demo"]
    assert cli.main(argv) == 0
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == ("configuration: the demo configuration (megadlms/assets/demo.yaml) with your flags on top: "
                        + " ".join(argv[1:]))
    model = next(line for line in lines if line.startswith("model tiny:"))
    assert "hidden 128, seq 64" in model and "global batch 16" in model  # the demo's model and batch
    assert (tmp_path / "demo" / "iter_0000002").is_dir()


def test_every_error_class_keeps_its_builtin_base():
    from megadlms.data.dataset import DataError
    from megadlms.data.indexed import IndexedDatasetError
    from megadlms.data.preprocess import PreprocessError
    from megadlms.data.tokenizer import TokenizerError
    from megadlms.fp8.export import ExportFolderError
    from megadlms.fp8.hardware import FP8UnsupportedError
    from megadlms.interop.hf import InteropError
    from megadlms.jsonl import JSONLinesError
    from megadlms.training.checkpoint import CheckpointError

    builtin = {ConfigError: ValueError, DataError: ValueError, IndexedDatasetError: ValueError,
               PreprocessError: ValueError, TokenizerError: ValueError, InteropError: ValueError,
               CheckpointError: RuntimeError, FP8UnsupportedError: RuntimeError, ExportFolderError: FileNotFoundError,
               JSONLinesError: ValueError}
    for cls, base in builtin.items():
        assert issubclass(cls, MegaDLMsError) and issubclass(cls, base), cls


def test_cli_prints_the_error_alone(tmp_path, capsys):
    assert cli.main(["train", "--no-progress", "--adam-beta1", "1.5"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "megadlms train: error: --adam-beta1 1.5 must be in [0, 1), e.g. 0.9 / 0.95"
    # an error found while the run is set up: the data path
    missing = tmp_path / "nothing_text_document"
    assert cli.main(["train", "--no-progress", "--device", "cpu", "--data-path", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"megadlms train: error: --data-path {missing}: no dataset there") and "Traceback" not in err
    # a subcommand: export of a folder that holds no checkpoint
    assert cli.main(["export", "--load", str(tmp_path), "--save", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megadlms export: error: ") and "Traceback" not in err


@pytest.mark.parametrize("name, fix", [
    ("bundled-*/demo_corpus_text_document", "a shell pattern in it matches no file"),
    ("corpus_text_document.bin", "the prefix without .bin/.idx: --data-path {tmp}/corpus_text_document"),
    ("nothing_text_document", "pass the prefix of `megadlms preprocess` output"),
])
def test_a_data_path_that_names_no_dataset_is_one_line_and_makes_no_folder(tmp_path, capsys, name, fix):
    for ext in (".bin", ".idx"):
        (tmp_path / f"corpus_text_document{ext}").write_bytes(b"")  # what the .bin example points next to
    before = sorted(tmp_path.rglob("*"))
    path = tmp_path / name
    assert cli.main(["train", "--no-progress", "--device", "cpu", "--data-path", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"megadlms train: error: --data-path {path}: no dataset there")
    assert fix.format(tmp=tmp_path) in err
    assert sorted(tmp_path.rglob("*")) == before  # no `bundled-*/cache` or `cache` folder left behind


def test_a_bug_keeps_its_traceback(monkeypatch):
    import megadlms.training.trainer as trainer

    def broken(args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(trainer, "train", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["train", "--no-progress"])


def test_pretrain_script_exit_status():
    proc = subprocess.run([sys.executable, "pretrain_difflm.py", "--micro-batch-size", "0"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == "pretrain_difflm.py: error: --micro-batch-size 0 must be >= 1"
    assert "Traceback" not in proc.stderr
