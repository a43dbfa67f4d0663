"""Metric sinks: W&B gets the scalars TensorBoard gets (a real offline run), jsonl records; a missing extra."""

import json
import math
import sys
import time

import pytest

from megadlms.errors import MissingExtraError
from megadlms.training import metrics
from megadlms.training.args import parse_train_args


def test_eval_line_labels_a_bound_and_an_exact_perplexity():
    assert metrics.format_eval_line(600, 2.5204, bound=True) == "validation at iter 600 | loss 2.5204 | ELBO ppl 12.43"
    assert metrics.format_eval_line(600, 2.5204, bound=False) == "validation at iter 600 | loss 2.5204 | ppl 12.43"
    assert metrics.format_eval_line(0, 1e4, bound=False).endswith(f"| ppl {math.exp(50):.2f}")  # capped, finite


def test_wandb_offline_run_logs_the_tensorboard_scalars(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    args = parse_train_args(["--wandb-project", "proj", "--wandb-exp-name", "tiny-run", "--save", str(tmp_path)])
    cfg = metrics.WandbConfig.from_run(args)
    assert (cfg.project, cfg.exp_name, cfg.save_dir) == ("proj", "tiny-run", str(tmp_path))
    sinks = metrics.MetricSinks(None, str(tmp_path), wandb=cfg)
    sinks.write(10, {"iteration": 10, "loss": 2.5, "tokens_per_s": 1234.0, "mfu": None, "fp8/input_amax": 3.0})
    sinks.write(20, {"iteration": 20, "loss": 1.75}, prefix="valid")
    sinks.close()
    deadline, blob = time.monotonic() + 30, b""
    while b"valid/loss" not in blob and time.monotonic() < deadline:
        # W&B's service writes the offline run file in the background, also after finish() returns
        runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
        assert len(runs) <= 1
        blob = runs[0].read_bytes() if runs else b""  # protobuf records: keys and values appear as text
        time.sleep(0.05)
    for key in (b"train/loss", b"train/tokens_per_s", b"train/fp8/input_amax", b"valid/loss", b"1.75", b"tiny-run"):
        assert key in blob
    assert b"train/mfu" not in blob and b"train/iteration" not in blob
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["split"], r["loss"]) for r in rows] == [("train", 2.5), ("valid", 1.75)]


def test_wandb_missing_is_a_one_line_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import fails as if not installed
    with pytest.raises(MissingExtraError, match=r"--wandb-project needs the 'wandb' package: pip install "
                                                r"'megadlms\[wandb\]'"):
        metrics.MetricSinks(None, None, wandb=metrics.WandbConfig(project="p"))
    assert metrics.MetricSinks(None, None, wandb=metrics.WandbConfig()).wandb is None  # off without a project
