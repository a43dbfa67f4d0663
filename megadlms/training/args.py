"""Command-line flags of `megadlms train` / `pretrain_difflm.py`, with Megatron-LM names.

Generated, not written: each flag is a field of one of `RunConfig`'s sections, whose metadata gives its help and
spelling (`megadlms.settings`; the model flags are TransformerConfig fields, `MODEL_FLAGS`), and the parsed flags
build the `RunConfig` the Python API takes; no logic hides here. `--config FILE.yaml` supplies
defaults (keys = flag names, dashes or underscores); flags given on the command line win. Without `--config`
the bundled demo config (megadlms/assets/demo.yaml) supplies them, unless a flag names a model, tokenizer or
data of your own (`OWN_RUN_DESTS`: `--model-path`, `--use-checkpoint-args`, `--tokenizer-model`, `--data-path`,
`--train/valid/test-data-path`): then the flags' own defaults do.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
from importlib import resources
from typing import Any, Sequence

import yaml

from ..config import ConfigError, TransformerConfig
from ..data.args import DATA_GROUP, SFT_GROUP
from ..distributed.config import PARALLEL_GROUP
from ..settings import add_setting_arguments
from .config import (
    EVAL_GROUP,
    FP8_GROUP,
    LORA_GROUP,
    MODEL_FLAGS,
    MODEL_GROUP,
    MOE_GROUP,
    OBJECTIVE_GROUP,
    RL_GROUP,
    TRAIN_GROUP,
    ModelConfig,
    RunConfig,
)

# the --help groups, in order, and the group of each section's settings that name none of their own
HELP_GROUPS = (MODEL_GROUP, MOE_GROUP, OBJECTIVE_GROUP, TRAIN_GROUP, FP8_GROUP, LORA_GROUP, RL_GROUP, EVAL_GROUP,
               DATA_GROUP, SFT_GROUP, PARALLEL_GROUP)
SECTION_GROUPS = {"objective": OBJECTIVE_GROUP, "train": TRAIN_GROUP, "fp8": FP8_GROUP, "lora": LORA_GROUP,
                  "rl": RL_GROUP, "checkpoint": EVAL_GROUP, "data": DATA_GROUP, "parallel": PARALLEL_GROUP}

DEMO_CONFIG = "demo.yaml"
DEMO_CONFIG_NAME = "megadlms/assets/demo.yaml"  # as messages name it
# flags naming a model, tokenizer or data of the user's own: with any of them a run without --config starts from the
# flags' defaults instead of the demo configuration
OWN_RUN_DESTS = ("model_path", "use_checkpoint_args", "tokenizer_model", "data_path", "train_data_path",
                 "valid_data_path", "test_data_path")
DEMO_RULE = (f"Without --config, the run starts from the demo configuration ({DEMO_CONFIG_NAME}) and the flags "
             "given override it, unless one of them names a model, tokenizer or data of your own (--model-path, "
             "--use-checkpoint-args, --tokenizer-model, --data-path, --train/valid/test-data-path): then the "
             "defaults shown here apply.")

log = logging.getLogger(__name__)


class TrainHelpFormatter(argparse.HelpFormatter):
    """`--help` with each default shown once, where there is one: never "(default: None)" or "(default: False)",
    and not again where the help text already speaks of the default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = action.default in (None, False, argparse.SUPPRESS) or not action.option_strings
        if "%(default)" in text:  # BooleanOptionalAction's own suffix (Python < 3.14)
            return text.replace(" (default: %(default)s)", "") if unset else text
        if unset or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


# argument placeholders in --help: by kind of value (the dest in capitals, argparse's own, doubles each long flag)
METAVARS = {"save": "DIR", "load": "DIR", "tensorboard_dir": "DIR", "wandb_save_dir": "DIR",
            "data_cache_path": "DIR", "data_path": "PREFIX", "train_data_path": "PREFIX",
            "valid_data_path": "PREFIX", "test_data_path": "PREFIX", "tokenizer_model": "PATH",
            "model_path": "NAME|PATH", "device": "DEVICE", "rl_reward": "NAME[:W],...",
            "lora_targets": "q,k,v,...", "moe_layer_freq": "N|0,1,..", "split": "A,B,C"}


def _short_metavars(p: argparse.ArgumentParser) -> None:
    """Placeholders that say the kind of value (N, X, DIR, ...) instead of the dest in capitals."""
    for action in p._actions:
        if not action.option_strings or action.nargs == 0 or action.metavar is not None or action.choices:
            continue
        kind = "N" if action.type is int else "X" if action.type is float else "VALUE"
        action.metavar = METAVARS.get(action.dest, kind)


def add_train_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Fill `p` with the flags of `megadlms train`: one per setting of `RunConfig`'s sections (their fields carry
    the help and spelling, `megadlms.settings`), the model flags of `MODEL_FLAGS`, `--config` and `--fp8-hybrid`."""
    p.formatter_class = TrainHelpFormatter
    p.usage = "%(prog)s [-h] [--config FILE.yaml] [--FLAG VALUE ...]"
    p.epilog = DEMO_RULE
    p.add_argument("--config", metavar="FILE.yaml", help="YAML file of flag values (keys = flag names)")
    groups = {title: p.add_argument_group(title) for title in HELP_GROUPS}
    groups[MODEL_GROUP].description = "The architecture: a preset or config file, and flags that override its values."
    group = groups.__getitem__
    sections = RunConfig.sections()
    add_setting_arguments(group, ModelConfig, MODEL_GROUP)  # --model-path
    add_setting_arguments(group, TransformerConfig, MODEL_GROUP, names=list(MODEL_FLAGS), meta=MODEL_FLAGS,
                          optional=True)
    for name, title in SECTION_GROUPS.items():
        add_setting_arguments(group, sections[name], title)
    groups[FP8_GROUP].add_argument("--fp8-hybrid", action="store_true", help="same as --fp8-format hybrid")
    _short_metavars(p)
    return p


def build_parser(prog: str = "megadlms train") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Pre-train or fine-tune a diffusion (or AR) language model.")
    return add_train_arguments(p)


def apply_yaml_defaults(p: argparse.ArgumentParser, path: str) -> None:
    """Set parser defaults from a YAML file whose keys are flag names."""
    try:
        with open(path) as f:
            values = yaml.safe_load(f) or {}
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--config {path}: not a text file (YAML expected)") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"--config {path} is not valid YAML{where}: {problem}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag names to values, got {type(values).__name__}")
    actions = {a.dest: a for a in p._actions}
    defaults = {}
    for key, value in values.items():
        dest = str(key).lstrip("-").replace("-", "_")
        if dest not in actions:
            raise ConfigError(f"--config {path}: unknown key {key!r} (keys are flag names, e.g. train-iters)")
        _check_yaml_value(path, key, value, actions[dest])
        kind = actions[dest].type
        if kind in (int, float) and isinstance(value, (int, float)):
            value = int(value) if kind is int else float(value)  # 3.0 for an int flag is 3; argparse converts strings
        defaults[dest] = value
    p.set_defaults(**defaults)


def _check_yaml_value(path: str, key: Any, value: Any, action: argparse.Action) -> None:
    """A YAML value of the flag's type (strings are converted by argparse as on the command line)."""
    if value is None or isinstance(value, str):
        return
    if isinstance(value, list) and action.nargs in ("+", "*"):  # a list flag (--data-path A B): each item checked
        for item in value:
            _check_yaml_value(path, key, item, action)
        return
    typ = action.type
    bad = isinstance(value, (list, dict)) or (typ in (int, float) and (isinstance(value, bool) or not isinstance(
        value, (int, float)))) or (typ is int and isinstance(value, float) and not value.is_integer())
    if bad:
        raise ConfigError(f"--config {path}: {key}: {value!r} is not a valid {getattr(typ, '__name__', 'value')} "
                          f"for --{action.dest.replace('_', '-')}")
    if action.choices is not None and value not in action.choices:
        raise ConfigError(f"--config {path}: {key}: {value!r} is not one of {list(action.choices)}")


# dests that steer parsing and are no RunConfig field
PARSE_ONLY = ("help", "config", "fp8_hybrid")


def run_config_from_args(args: argparse.Namespace) -> RunConfig:
    """The RunConfig of parsed flags: each dest goes to the section field of the same name."""
    return RunConfig.from_flat({k: v for k, v in vars(args).items() if k not in PARSE_ONLY})


def names_own_run(p: argparse.ArgumentParser, argv: Sequence[str]) -> bool:
    """Whether `argv` gives one of the OWN_RUN_DESTS flags (also abbreviated or as --flag=value)."""
    unset = object()
    saved = {d: p.get_default(d) for d in OWN_RUN_DESTS}
    p.set_defaults(**{d: unset for d in OWN_RUN_DESTS})
    try:
        given, _ = p.parse_known_args(list(argv))
    finally:
        p.set_defaults(**saved)
    return any(getattr(given, d) is not unset for d in OWN_RUN_DESTS)


def parse_train_args(argv: Sequence[str] | None, prog: str = "megadlms train",
                     parser: argparse.ArgumentParser | None = None) -> RunConfig:
    """Parse the flags of `megadlms train` over defaults from `--config FILE.yaml`, else from the demo
    configuration unless a flag names a model, tokenizer or data of the user's own (`OWN_RUN_DESTS`); logs which.

    parser: one that `add_train_arguments` has filled (default: a new one named `prog`)."""
    p = parser if parser is not None else build_parser(prog)
    argv = list(argv or [])
    config = None
    if "--config" in argv:
        config = argv[argv.index("--config") + 1]
    elif any(a.startswith("--config=") for a in argv):
        config = next(a.split("=", 1)[1] for a in argv if a.startswith("--config="))
    elif not {"-h", "--help"} & set(argv) and not names_own_run(p, argv):  # the demo, with the flags on top
        config = str(resources.files("megadlms.assets") / DEMO_CONFIG)
    if config:
        apply_yaml_defaults(p, config)
    args = p.parse_args(argv)
    if args.fp8_hybrid:
        if args.fp8_format not in (None, "hybrid"):
            p.error(f"--fp8-hybrid conflicts with --fp8-format {args.fp8_format}; pass one of them")
        args.fp8_format = "hybrid"
    if args.generate_sample is None:  # on for the demo
        args.generate_sample = bool(config and config.endswith(DEMO_CONFIG))
    try:
        run_config = run_config_from_args(args)
    except ConfigError as e:
        raise _blame_config_file(e, argv, config) from None
    if os.environ.get("RANK", "0") == "0":  # under torchrun, once
        log.info("configuration: %s", describe_configuration(argv, config))
    return run_config


def _blame_config_file(e: ConfigError, argv: Sequence[str], config: str | None) -> ConfigError:
    """`e`, naming the config file (or the demo configuration) when the flag its message starts with came from there."""
    flag = str(e).split(" ", 1)[0]
    if config is None or not flag.startswith("--") or any(a == flag or a.startswith(flag + "=") for a in argv):
        return e
    demo = config == str(resources.files("megadlms.assets") / DEMO_CONFIG)
    where = f"the demo configuration, {DEMO_CONFIG_NAME}," if demo else config
    return ConfigError(f"{e} ({where} sets {flag})")


def describe_configuration(argv: Sequence[str], config: str | None) -> str:
    """Where a run's settings come from, for its first log line."""
    if config is None:
        return f"the flags' defaults with your flags on top (`--help` lists the defaults): {shlex.join(argv)}"
    demo = config == str(resources.files("megadlms.assets") / DEMO_CONFIG)
    what = f"the demo configuration ({DEMO_CONFIG_NAME})" if demo else config
    others = [a for a in argv if a != "--config" and a != config and not a.startswith("--config=")]
    return f"{what} with your flags on top: {shlex.join(others)}" if others else what
