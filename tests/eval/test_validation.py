"""The validation ELBO report: one entry per model kind, and the table that sets them side by side."""

import math
from types import SimpleNamespace

import pytest

from megadlms.eval.validation import format_ppl_table, model_report

DLM = SimpleNamespace(block_size=None, attn_mask_type="bidirectional")
AR = SimpleNamespace(block_size=None, attn_mask_type="causal")
BD3 = SimpleNamespace(block_size=4, attn_mask_type="bidirectional")


def test_each_kind_reports_its_bound():
    dlm = model_report(DLM, [2.0, 3.0, 4.0])
    assert dlm["mode"] == "masked diffusion" and dlm["elbo"] == 3.0 and dlm["elbo_ppl"] == pytest.approx(math.e ** 3)
    ar = model_report(AR, [1.5])
    assert ar == {"mode": "autoregressive", "nll": 1.5, "ppl": pytest.approx(math.exp(1.5))}
    bd3 = model_report(BD3, [2.5])
    assert bd3["mode"] == "block diffusion (block 4)" and bd3["nelbo"] == bd3["elbo"] == 2.5
    assert model_report(AR, [1e6])["ppl"] == pytest.approx(math.exp(50))  # capped, not an overflow


def test_table_puts_models_side_by_side():
    report = {"data_path": "d", "windows": 3, "seq_length": 16, "mask_ratios": [0.5, 1.0],
              "models": {"a": model_report(DLM, [2.0, 4.0]), "b": model_report(AR, [1.0])}}
    lines = format_ppl_table(report).splitlines()
    assert lines[0] == "validation ELBO: 3 windows x 16 tokens of d"
    assert lines[2:6] == ["| mask ratio | a | b |", "|---|---|---|", "| 0.5 | 2.0000 | - |", "| 1 | 4.0000 | - |"]
    assert lines[6].endswith("| 3.0000 | 1.0000 |") and lines[7].endswith(f"| {math.exp(3):.3f} | {math.e:.3f} |")
