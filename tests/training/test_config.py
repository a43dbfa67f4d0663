"""megadlms.training.config: the typed run configuration, its mapping from flags and its validation."""

import dataclasses
import re

import pytest
import yaml

from megadlms.config import ConfigError, TransformerConfig
from megadlms.training.args import PARSE_ONLY, build_parser, parse_train_args, run_config_from_args
from megadlms.training.config import (
    MODEL_FLAGS,
    CheckpointConfig,
    DiffusionConfig,
    FP8Config,
    ModelConfig,
    RunConfig,
    TrainConfig,
)
from megadlms.training.run_plan import RunPlan, resolve_model_config


def test_every_flag_is_a_field_and_the_defaults_agree():
    parser = build_parser()
    dests = {a.dest for a in parser._actions} - set(PARSE_ONLY)
    assert dests == set(RunConfig.section_of())  # and no field without a flag
    args = parser.parse_args([])
    args.generate_sample = False  # parse_train_args resolves None: on for the bundled demo only
    assert run_config_from_args(args) == RunConfig()


def test_flags_and_yaml_fill_the_sections_by_name(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"train-iters": 7, "fp8_format": "e4m3", "tensor-model-parallel-size": 2,
                                    "num-layers": 3, "save": "ck", "data-path": ["a", "b"]}))
    cfg = parse_train_args(["--config", str(path), "--train-iters", "9", "--difflm-eps", "0.01"])
    assert (cfg.train.train_iters, cfg.fp8.fp8_format, cfg.parallel.tensor_model_parallel_size) == (9, "e4m3", 2)
    assert (cfg.model.num_layers, cfg.checkpoint.save, cfg.data.data_path) == (3, "ck", ["a", "b"])
    assert cfg.objective.difflm_eps == 0.01 and cfg.train.generate_sample is False
    assert RunConfig.from_flat(cfg.to_flat()) == cfg
    with pytest.raises(ConfigError, match="unknown setting 'train_iter'"):
        RunConfig.from_flat({"train_iter": 3})


@pytest.mark.parametrize("make, message", [
    (lambda: TrainConfig(lr=-1.0), "--lr -1.0 must be >= 0.0"),
    (lambda: TrainConfig(lr_decay_style="step"), "--lr-decay-style 'step' is not one of"),
    (lambda: TrainConfig(cuda_graphs="maybe"), "--cuda-graphs 'maybe' is not one of \\['auto', 'on', 'off'\\]"),
    (lambda: FP8Config(fp8_format="e5m2"), "--fp8-format 'e5m2' is not one of \\['e4m3', 'hybrid'\\]"),
    (lambda: FP8Config(fp8_amax_history_len=0), "--fp8-amax-history-len 0 must be >= 1"),
    (lambda: DiffusionConfig(model_running_mode="ar"), "--model-running-mode 'ar' is not one of"),
    (lambda: CheckpointConfig(use_checkpoint_args=True), "--use-checkpoint-args needs --load DIR"),
    (lambda: RunPlan(RunConfig(fp8=FP8Config(fp8_dot_product_attention=True)), TransformerConfig()).check(),
     "add --fp8-format hybrid"),
    (lambda: FP8Config(fp8_format="hybrid", fp8_recipe="blockwise"),
     "^--fp8-format hybrid with --fp8-recipe blockwise: E4M3 is what torch's blockwise GEMM takes .*e4m3$"),
    (lambda: FP8Config(fp8_format="hybrid", fp8_recipe="mxfp8"), "MXFP8 is E4M3 for every operand; use --fp8-format"),
    (lambda: FP8Config(fp8_format="e4m3", fp8_pow2_scales=True), "--fp8-pow2-scales applies to --fp8-recipe blockwise"),
])
def test_each_section_validates_itself(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def _plan(mode: str, **objective) -> RunPlan:
    """The plan of a run with these DiffusionConfig settings on a model built for `mode`."""
    model = TransformerConfig(attn_mask_type="causal" if mode == "vanilla" else "bidirectional",
                              block_size=4 if mode == "bd3lm" else None)
    return RunPlan(RunConfig(objective=DiffusionConfig(**objective)), model)


def test_bd3lm_options_are_refused_where_they_would_change_nothing():
    _plan("bd3lm", bd3lm_clip_min=0.3, bd3lm_clip_search=True, bd3lm_clip_search_widths=[0.5]).check()
    _plan("bd3lm", bd3lm_clip_search_widths=[0.5, 0.6, 0.7, 0.8, 0.9]).check()  # the defaults
    _plan("difflm-noshift", ignore_bos=True).check()  # not bd3lm's alone
    with pytest.raises(ConfigError, match=r"^--bd3lm-clip-search: only used with --model-running-mode bd3lm \(this "
                                          r"run is difflm-noshift\); drop it$"):
        _plan("difflm-noshift", bd3lm_clip_search=True).check()
    with pytest.raises(ConfigError, match=r"^--bd3lm-clip-max 0.8, --no-bd3lm-antithetic: only .* vanilla\); "
                                          r"drop them$"):
        _plan("vanilla", bd3lm_clip_max=0.8, bd3lm_antithetic=False).check()
    with pytest.raises(ConfigError, match=r"^--bd3lm-clip-search-delta: the candidates of --bd3lm-clip-search, which "
                                          r"is off; add --bd3lm-clip-search or drop it$"):
        _plan("bd3lm", bd3lm_clip_search_delta=0.1).check()


def test_model_overrides_are_the_set_transformer_fields():
    model_fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    assert set(MODEL_FLAGS) <= model_fields  # the model flags are TransformerConfig's own fields, not a mirror
    model = ModelConfig(num_layers=3, qk_layernorm=False, hidden_size=None)
    assert model.overrides == {"num_layers": 3, "qk_layernorm": False} and model.num_layers == 3
    assert model.hidden_size is None  # not overridden: the preset's
    with pytest.raises(ConfigError, match="model override 'num_layer' is not a TransformerConfig field"):
        ModelConfig(num_layer=3)
    fp8 = FP8Config(fp8_format="e4m3", fp8_recipe="tensorwise", num_layers_at_start_in_bf16=2)
    fields = fp8.model_fields()
    assert fields["fp8"] is True and fields["fp8_recipe"] == "tensorwise"
    assert TransformerConfig(**fields).bf16_edges() == (0, 0)  # the counts apply with first_last_layers_bf16 only
    both = TransformerConfig(num_layers=4, **dataclasses.replace(fp8, first_last_layers_bf16=True).model_fields())
    assert both.bf16_edges() == (2, 1)
    assert FP8Config().model_fields()["fp8"] is False


def test_model_config_of_a_run():
    run = RunConfig(model=ModelConfig(model_path="tiny", seq_length=2048), objective=DiffusionConfig(mask_token=7))
    cfg = resolve_model_config(run, vocab_size=1000, mask_id=3)
    # the tiny preset takes the tokenizer's vocabulary; a longer sequence raises the position limit
    assert (cfg.vocab_size, cfg.seq_length, cfg.max_position_embeddings) == (1000, 2048, 2048)
    assert cfg.mask_token_id == 7 and cfg.attn_mask_type == "bidirectional" and not cfg.fp8
    ar = RunConfig(objective=DiffusionConfig(model_running_mode="vanilla"), fp8=FP8Config(fp8_format="hybrid"))
    cfg = resolve_model_config(ar, vocab_size=None, mask_id=None)
    assert (cfg.vocab_size, cfg.attn_mask_type, cfg.fp8, cfg.mask_token_id) == (4096, "causal", True, None)
    qwen = RunConfig(model=ModelConfig(model_path="qwen3-0.6b", num_layers=1))
    with pytest.raises(ConfigError, match="the tokenizer has 200000 tokens but the model's vocab_size is 151936"):
        resolve_model_config(qwen, vocab_size=200000, mask_id=1)


def test_fp8_wgrad_takes_both_forms_and_the_help_names_both():
    base = ["--model-path", "tiny", "--fp8-format", "hybrid"]
    assert parse_train_args(base).fp8.fp8_wgrad is True
    assert parse_train_args(base + ["--no-fp8-wgrad"]).fp8.fp8_wgrad is False
    assert parse_train_args(base + ["--no-fp8-wgrad", "--fp8-wgrad"]).fp8.fp8_wgrad is True
    assert "--fp8-wgrad, --no-fp8-wgrad" in build_parser().format_help()  # not a lone --no- flag "(default: True)"


def test_the_help_describes_every_flag_and_shows_each_default_once():
    from megadlms.presets import PRESETS
    from megadlms.rl.rewards import REWARDS

    parser = build_parser()
    assert [a.option_strings for a in parser._actions if not a.help] == []
    text = parser.format_help()
    assert "(default: None)" not in text and "(default: False)" not in text
    entries = re.split(r"\n  (?=-)", text.split("\n\nWithout --config")[0])  # one entry per flag, no epilog
    assert [e.split()[0] for e in entries if e.count("default") > 1] == []
    assert "(default: 0.95)" in next(e for e in entries if e.startswith("--adam-beta2"))
    reward = " ".join(next(e for e in entries if e.startswith("--rl-reward")).split())
    assert all(name in reward for name in REWARDS) and all(name in text for name in PRESETS)
    assert text.splitlines()[0] == "usage: megadlms train [-h] [--config FILE.yaml] [--FLAG VALUE ...]"
    assert "MOE_SHARED_EXPERT_INTERMEDIATE_SIZE" not in text  # placeholders say the kind of value
