"""`megadlms plot`: curves of several runs (one with FP8 telemetry) in one image; one-line errors."""

import json

import matplotlib.image
import pytest

from megadlms.eval import plot


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


def test_two_runs_on_one_figure(tmp_path, capsys):
    fp8, bf16 = write_run(tmp_path / "fp8", True), write_run(tmp_path / "bf16", False, offset=0.1)
    recs = plot.read_metrics(fp8)
    assert [r["iteration"] for r in recs["train"]] == [10, 20, 30, 40] and len(recs["valid"]) == 2
    out = tmp_path / "curves.png"
    assert plot.main([str(fp8), str(bf16), "--output", str(out), "--title", "FP8 vs BF16"]) == 0
    img = matplotlib.image.imread(out)
    assert img.shape[:2] == (2 * 396, 3 * 572)  # 2 rows x 3 panels: loss, valid, tokens/s; amax, underflow
    assert f"wrote {out}" in capsys.readouterr().err
    plain = tmp_path / "plain.png"
    plot.plot_runs([str(bf16)], str(plain))
    assert matplotlib.image.imread(plain).shape[:2] == (396, 3 * 572)  # no FP8 telemetry: one row


def test_bad_input_is_one_line(tmp_path, capsys):
    assert plot.main([str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no metrics.jsonl there" in err
    run = write_run(tmp_path / "r", False)
    assert plot.main([str(run), "--labels", "a,b", "--output", str(tmp_path / "x.png")]) == 2
    assert "--labels has 2 names for 1 runs" in capsys.readouterr().err
    (run / "metrics.jsonl").write_text("{not json\n")
    with pytest.raises(plot.ConfigError, match=r"metrics.jsonl:1 is not valid JSON"):
        plot.read_metrics(run)
