"""The held-out demo multiple-choice task: documents outside the training split, one true continuation each."""

import json

import pytest

from megadlms.config import ConfigError
from megadlms.eval import demo_task


def test_items_from_heldout_documents(tmp_path):
    texts = demo_task.heldout_documents()
    assert len(texts) == 200  # the last 1% of the 20,000 demo documents (split 98,1,1)
    items = demo_task.make_items(texts, choices=4, seed=3, limit=50)
    assert len(items) == 50 and {it["label"] for it in items} == {0, 1, 2, 3}
    for it, text in zip(items, [t for t in texts if len(t.split()) >= 22]):
        words = text.split()
        assert it["context"] == " ".join(words[:16])
        assert it["choices"][it["label"]] == " " + " ".join(words[16:22])
        assert len(set(it["choices"])) == 4
    assert demo_task.make_items(texts, seed=3, limit=50) == items  # seeded
    path = demo_task.write_task(tmp_path, items)
    spec = json.loads(path.read_text())
    assert spec["output_type"] == "multiple_choice" and spec["task"] == "demo_heldout_mc"
    rows = (tmp_path / "demo_heldout_mc.jsonl").read_text().splitlines()
    assert [json.loads(r) for r in rows] == items
    with pytest.raises(ConfigError, match="--choices 1 must be >= 2"):
        demo_task.make_items(texts, choices=1)
