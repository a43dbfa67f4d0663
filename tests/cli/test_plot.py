"""`megadlms plot`: writes the image and says where; bad input is one line."""

import json
import sys

import matplotlib.image

from megadlms.cli import plot


def write_run(path):
    path.mkdir()
    rows = [{"split": "train", "iteration": it, "loss": 5.0 - it / 20, "tokens_per_s": 1000.0} for it in (10, 20)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_plot_writes_the_image(tmp_path, capsys):
    out = tmp_path / "curves.png"
    assert plot.main([str(write_run(tmp_path / "a")), "--output", str(out), "--title", "a run"]) == 0
    assert matplotlib.image.imread(out).shape[:2] == (396, 3 * 572)
    assert f"wrote {out}" in capsys.readouterr().err


def test_bad_input_is_one_line(tmp_path, capsys):
    assert plot.main([str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("megadlms plot: error: ") and "no metrics.jsonl there" in err
    run = write_run(tmp_path / "r")
    (run / "metrics.jsonl").write_text("[1, 2]\n")
    assert plot.main([str(run), "--output", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "metrics.jsonl:1 is a JSON list, expected an object" in err


def test_missing_matplotlib_names_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert plot.main([str(write_run(tmp_path / "a")), "--output", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err == "megadlms plot: error: megadlms plot needs the 'matplotlib' package: pip install 'megadlms[plot]'\n"
