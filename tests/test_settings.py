"""megadlms.settings: each training setting is declared once, as a field; the flags are generated from the fields."""

from __future__ import annotations

import dataclasses

import pytest

from megadlms.config import ConfigError
from megadlms.settings import field_default, is_setting
from megadlms.training.args import PARSE_ONLY, build_parser, parse_train_args
from megadlms.training.config import MODEL_FLAGS, RunConfig

OWN = ["--model-path", "tiny"]


def _fields() -> dict[str, dataclasses.Field]:
    return {f.name: f for kind in RunConfig.sections().values() for f in dataclasses.fields(kind) if is_setting(f)}


def test_each_flag_takes_its_help_and_default_from_its_field():
    fields = _fields()
    actions = [a for a in build_parser()._actions if a.dest not in PARSE_ONLY and a.help is not None
               and not a.help.startswith("same as")]
    assert {a.dest for a in actions} == set(fields) | set(MODEL_FLAGS)
    for a in actions:
        if a.dest in MODEL_FLAGS:  # a TransformerConfig field: unset (None) keeps the preset's value
            assert a.default is None and a.help == MODEL_FLAGS[a.dest]["help"], a.dest
            continue
        f = fields[a.dest]
        assert a.help == f.metadata["help"], a.dest
        flag_default = f.metadata["flag_default"]
        assert a.default == (field_default(f) if flag_default is dataclasses.MISSING else flag_default), a.dest


@pytest.mark.parametrize("flags, read, value", [
    (["--enable-cuda-graph"], lambda c: c.train.cuda_graphs, "on"),  # Megatron's spelling
    (["--cuda-graphs", "off"], lambda c: c.train.cuda_graphs, "off"),
    (["--no-bd3lm-antithetic", "--model-running-mode", "bd3lm"], lambda c: c.objective.bd3lm_antithetic, False),
    (["--fp8-hybrid"], lambda c: c.fp8.fp8_format, "hybrid"),
    (["--no-exit-signal-handler"], lambda c: c.train.exit_signal_handler, False),
    (["--no-fp8-fuse-mlp"], lambda c: c.fp8.fp8_fuse_mlp, False),
    (["--use-distributed-optimizer"], lambda c: c.parallel.sharding_strategy, "optim"),
    (["--moe-layer-freq", "0,1"], lambda c: c.model.moe_layer_freq, [0, 1]),
    (["--no-qk-layernorm"], lambda c: c.model.overrides, {"qk_layernorm": False}),
    (["--data-path", "0.3", "a", "0.7", "b"], lambda c: c.data.data_path, ["0.3", "a", "0.7", "b"]),
    (["--bd3lm-clip-search-widths", "0.5", "0.6"], lambda c: c.objective.bd3lm_clip_search_widths, [0.5, 0.6]),
    (["--reset-attention-mask"], lambda c: c.data.reset_attention_mask, True),
    (["--bf16"], lambda c: c.train.bf16, True),
])
def test_every_spelling_keeps_working(flags, read, value):
    assert read(parse_train_args(OWN + flags)) == value


def test_overrides_apply_with_replace_and_are_validated_again():
    base = RunConfig()
    changed = base.replace(lr=1e-3, num_layers=2, **{"fp8-format": "e4m3"})
    assert (changed.train.lr, changed.model.overrides, changed.fp8.fp8_format) == (1e-3, {"num_layers": 2}, "e4m3")
    assert base.train.lr == 3e-4 and base.model.overrides == {}  # the original is unchanged
    assert changed.replace(num_layers=None).model.overrides == {}  # None: back to the preset's value
    with pytest.raises(ConfigError, match="--lr -1.0 must be >= 0.0"):
        base.replace(lr=-1.0)
    with pytest.raises(ConfigError, match="unknown setting 'learning_rate'"):
        base.replace(learning_rate=1.0)


def test_the_checkpoint_record_holds_every_flag_and_reads_back():
    config = parse_train_args(OWN + ["--num-layers", "3", "--lr", "0.01", "--sft", "--tensor-model-parallel-size", "2"])
    flat = config.to_flat()
    assert set(flat) == set(RunConfig.section_of())  # every flag dest, the unset model flags as None
    assert flat["num_layers"] == 3 and flat["hidden_size"] is None
    assert RunConfig.from_flat(flat) == config
