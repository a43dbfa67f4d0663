"""A run's --save folder belongs to it: another configuration is refused in one line, a resume or a rerun of the
same settings is not; a run without --save says that it keeps nothing."""

import logging

import pytest

from megadlms.cli import main
from megadlms.config import ConfigError
from megadlms.training.args import parse_train_args
from megadlms.training.save_folder import check_save_folder
from megadlms.training.trainer import train

TINY = ["--model-path", "tiny", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
        "--num-query-groups", "1", "--ffn-hidden-size", "64", "--seq-length", "16", "--micro-batch-size", "2",
        "--device", "cpu", "--no-compile", "--num-workers", "0", "--eval-iters", "0", "--no-progress",
        "--no-generate-sample", "--lr-warmup-iters", "0"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    save = tmp_path_factory.mktemp("save") / "run"
    train(parse_train_args(TINY + ["--train-iters", "2", "--save", str(save)]))
    return save


def test_another_configuration_is_refused_in_one_line(run_dir, capsys):
    metrics = (run_dir / "metrics.jsonl").read_text()
    code = main(["train", *TINY, "--train-iters", "3", "--lr", "1e-3", "--save", str(run_dir)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert (f"--save {run_dir} holds another run's checkpoints (the latest at iteration 2); this run differs in "
            f"--train-iters 2 there, 3 here, --lr 0.0003 there, 0.001 here: save this run to a new folder "
            f"(--save {run_dir}_2), or resume that run with --load {run_dir}") in err
    assert (run_dir / "latest_checkpointed_iteration.txt").read_text() == "2\n"  # nothing written
    assert (run_dir / "metrics.jsonl").read_text() == metrics


def test_a_resume_and_a_rerun_of_the_same_settings_are_allowed(run_dir, caplog):
    resume = parse_train_args(TINY + ["--train-iters", "5", "--save", str(run_dir), "--load", str(run_dir)])
    check_save_folder(resume)  # a resume may change flags (a longer run)
    check_save_folder(parse_train_args(TINY + ["--train-iters", "2", "--save", str(run_dir)]))
    train(parse_train_args(TINY + ["--train-iters", "3", "--save", str(run_dir), "--load", str(run_dir)]))
    assert (run_dir / "latest_checkpointed_iteration.txt").read_text() == "3\n"
    with caplog.at_level(logging.INFO, logger="megadlms"):  # the latest checkpoint's --load names its own folder
        check_save_folder(parse_train_args(TINY + ["--train-iters", "3", "--log-interval", "7",
                                                   "--save", str(run_dir)]))
    assert "holds an earlier run of these settings (iteration 3): starting it over" in caplog.text
    with pytest.raises(ConfigError, match=r"differs in --load None there, .*, --finetune False there, True here"):
        check_save_folder(parse_train_args(TINY + ["--train-iters", "3", "--save", str(run_dir), "--load",
                                                   str(run_dir), "--finetune"]))


def test_a_folder_without_checkpoints_is_free_and_no_save_is_said(tmp_path, caplog):
    (tmp_path / "metrics.jsonl").write_text("")  # a requeued job's first attempt, ended before its first save
    with_save, without = parse_train_args(TINY + ["--save", str(tmp_path)]), parse_train_args(TINY)
    with caplog.at_level(logging.INFO, logger="megadlms"):
        check_save_folder(with_save)
        assert not caplog.text
        check_save_folder(without)
    assert caplog.text.count("no --save folder: this run keeps no checkpoint (add --save DIR to keep") == 1
