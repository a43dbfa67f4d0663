"""The SFT example's data generator and scorer (the training itself is the example's run.sh)."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / "sft" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_heldout_prompts_never_in_training_and_scoring(tmp_path):
    _load("make_data").main(["--out", str(tmp_path), "--train", "300", "--heldout", "40"])
    train = [json.loads(x) for x in (tmp_path / "train.jsonl").read_text().splitlines()]
    held = [json.loads(x) for x in (tmp_path / "heldout_prompts.jsonl").read_text().splitlines()]
    assert len(train) == 300 and len(held) == 40
    assert not {r["prompt"] for r in train} & {r["prompt"].split("\n")[0][3:] for r in held}
    r = train[0]
    assert r["response"].split() == r["prompt"].removeprefix("Reverse: ").split()[::-1]
    out = tmp_path / "out.jsonl"
    out.write_text("".join(json.dumps({**h, "completion": h["answer"] if i % 4 == 0 else "9"}) + "\n"
                           for i, h in enumerate(held)))
    assert _load("score").exact_match(str(out)) == (10, 40)


def test_the_digit_range_is_an_option(tmp_path):
    make_data = _load("make_data")
    make_data.main(["--out", str(tmp_path), "--train", "200", "--heldout", "30", "--min-digits", "2",
                    "--max-digits", "3"])
    train = [json.loads(x) for x in (tmp_path / "train.jsonl").read_text().splitlines()]
    sizes = {len(r["response"].split()) for r in train}
    assert sizes == {2, 3}
    # more held-out lists than exist is refused (1-digit lists: 10)
    with pytest.raises(SystemExit):
        make_data.main(["--out", str(tmp_path), "--heldout", "10", "--min-digits", "1", "--max-digits", "1"])
