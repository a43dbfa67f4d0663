"""One spelling per concept: train's flag works in every command that has the concept; the command's older
spelling stays an alias of the same flag."""

import argparse

import pytest

from megadlms.cli import convert, export, generate
from megadlms.cli import eval as eval_cli
from megadlms.data import preprocess
from megadlms.training.args import build_parser


def _parser(add_arguments) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)
    return parser


SOURCE = ["--load", "ck"]
CASES = {  # command: (parser, arguments it requires, train's spelling, the alias, the value's dest)
    "generate-ckpt-step": (generate.add_arguments, SOURCE, "--ckpt-step", "--iteration", "iteration"),
    "eval-ckpt-step": (eval_cli.add_arguments, SOURCE, "--ckpt-step", "--iteration", "iteration"),
    "export-ckpt-step": (export.add_arguments, SOURCE + ["--save", "out"], "--ckpt-step", "--iteration", "ckpt_step"),
    "generate-micro-batch": (generate.add_arguments, SOURCE, "--micro-batch-size", "--batch-size", "batch_size"),
    "eval-micro-batch": (eval_cli.add_arguments, SOURCE, "--micro-batch-size", "--batch-size", "batch_size"),
    "preprocess-workers": (preprocess.add_arguments, ["--input", "x.jsonl", "--output-prefix", "o"], "--num-workers",
                           "--workers", "workers"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_train_spelling_and_alias_set_the_same_value(case):
    add, required, spelling, alias, dest = CASES[case]
    assert spelling in {s for a in build_parser()._actions for s in a.option_strings}  # train's own flag
    parser = _parser(add)
    assert getattr(parser.parse_args(required + [spelling, "7"]), dest) == 7
    assert getattr(parser.parse_args(required + [alias, "5"]), dest) == 5


@pytest.mark.parametrize("action", ["hf-to-megadlms", "megadlms-to-hf", "merge-lora", "verify"])
def test_convert_takes_the_ckpt_step_spelling(action):
    parser = _parser(convert.add_arguments)
    required = {"hf-to-megadlms": ["--hf-model", "h", "--save", "s"], "megadlms-to-hf": ["--load", "l", "--save", "s"],
                "merge-lora": ["--load", "l", "--save", "s"], "verify": ["--load", "l", "--hf-model", "h"]}[action]
    assert parser.parse_args([action, *required, "--ckpt-step", "3"]).iteration == 3
    assert parser.parse_args([action, *required, "--iteration", "4"]).iteration == 4


def test_eval_refuses_trains_eval_iters_naming_its_own_flag(capsys):
    # train's --eval-iters counts global batches; eval's --eval-samples counts windows: not the same concept
    code = eval_cli.main(["--load", "no/such/ck", "--ppl", "--eval-iters", "3"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "use --eval-samples N (train's --eval-iters 3 scores 3 x global-batch-size windows)" in err
