"""The field-models example (examples/field_models/run.py) at a small size: a tiny random LLaDA and Dream folder in
their own formats, imported, SFT'd in BF16 with a stop and an exact resume, exported back, evaluated and sampled."""

import importlib.util
import json
import math
from pathlib import Path

import pytest
from safetensors import safe_open
from transformers import AutoTokenizer

from megadlms.data import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def _example():
    spec = importlib.util.spec_from_file_location("field_models_run", ROOT / "examples" / "field_models" / "run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.filterwarnings("ignore:.*auto_map")  # the models' own modeling code is not part of the example
def test_the_example_runs_both_families(tmp_path):
    results = {r["family"]: r for r in _example().main(["--work", str(tmp_path), "--iters", "2", "--records", "40"])}
    assert sorted(results) == ["dream", "llada"]
    for family, arch, key in (("llada", "LLaDAModelLM", "model.transformer.blocks.0.q_proj.weight"),
                              ("dream", "DreamModel", "model.layers.0.self_attn.q_proj.bias")):
        r, w = results[family], tmp_path / family
        # the folders are in the family's own format, before and after
        for folder in (w / "original", w / "export"):
            assert json.loads((folder / "config.json").read_text())["architectures"] == [arch]
            with safe_open(str(next(folder.glob("*.safetensors"))), "pt") as f:
                assert key in f.keys()
        # the imported checkpoint records the family's mode: Dream shifted, LLaDA not
        cfg = json.loads((w / "base" / "iter_0000000" / "meta.json").read_text())["config"]
        assert (cfg["diffusion_shift"], cfg["attn_mask_type"], cfg["mask_token_id"]) == (family == "dream",
                                                                                          "bidirectional", 1)
        # SFT stopped at 1 of 2 iterations and resumed, bit-identical to the run without the stop
        assert r["resumed_at"] == 1 and r["resume_exact"]
        meta = json.loads((w / "sft" / "iter_0000002" / "meta.json").read_text())
        assert meta["args"]["bf16"] and meta["args"]["sft"]
        # the export evaluates and samples; its tokenizer loads in transformers as the training one
        assert math.isfinite(r["elbo"]) and math.isclose(r["elbo_ppl"], math.exp(r["elbo"]), rel_tol=1e-6)
        assert 0 < r["completion"]["num_tokens"] <= 8
        text = "Q: Reverse: cat sun\nA: sun cat"
        assert AutoTokenizer.from_pretrained(str(w / "export"))(text)["input_ids"] == \
            load_tokenizer(w / "base" / "iter_0000000" / "tokenizer").encode(text)
