"""Training curves of several runs (one with FP8 telemetry) in one image; metrics read by iteration."""

import json

import matplotlib.image
import pytest

from megadlms.config import ConfigError
from megadlms.eval import plot
from megadlms.jsonl import JSONLinesError


def write_run(path, fp8, offset=0.0):
    path.mkdir()
    rows = []
    for it in (10, 20, 30, 20, 30, 40):  # a resumed run repeats iterations 20 and 30
        rec = {"split": "train", "iteration": it, "loss": 5.0 - it / 20 + offset, "tokens_per_s": 1000.0 + it}
        if fp8:
            rec.update({"fp8/input_amax": 3.0 + it, "fp8/input_underflow": 1e-4, "fp8/weight_amax": 0.5,
                        "fp8/weight_underflow": 0.0})
        rows.append(rec)
    rows += [{"split": "valid", "iteration": 20, "loss": 4.5 + offset}, {"split": "valid", "iteration": 40,
                                                                         "loss": 3.9 + offset}]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_read_metrics_keeps_the_last_of_repeated_iterations(tmp_path):
    recs = plot.read_metrics(write_run(tmp_path / "r", False, offset=0.5))
    assert [r["iteration"] for r in recs["train"]] == [10, 20, 30, 40] and len(recs["valid"]) == 2
    assert recs["valid"][1]["loss"] == pytest.approx(4.4)


def test_two_runs_on_one_figure(tmp_path):
    fp8, bf16 = write_run(tmp_path / "fp8", True), write_run(tmp_path / "bf16", False, offset=0.1)
    out = plot.plot_runs([str(fp8), str(bf16)], str(tmp_path / "curves.png"), title="FP8 vs BF16")
    assert matplotlib.image.imread(out).shape[:2] == (2 * 396, 3 * 572)  # loss, valid, tokens/s; amax, underflow
    plain = plot.plot_runs([str(bf16)], str(tmp_path / "plain.png"))
    assert matplotlib.image.imread(plain).shape[:2] == (396, 3 * 572)  # no FP8 telemetry: one row


def test_bad_input_names_the_run_and_line(tmp_path):
    with pytest.raises(ConfigError, match="no metrics.jsonl there"):
        plot.read_metrics(tmp_path / "missing")
    run = write_run(tmp_path / "r", False)
    with pytest.raises(ConfigError, match="--labels has 2 names for 1 runs"):
        plot.plot_runs([str(run)], str(tmp_path / "x.png"), labels=["a", "b"])
    (run / "metrics.jsonl").write_text('{"iteration": 1}\n{not json\n')
    with pytest.raises(JSONLinesError, match=r"metrics.jsonl:2 is not valid JSON"):
        plot.read_metrics(run)
