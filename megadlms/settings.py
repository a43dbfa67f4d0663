"""Settings declared once: a dataclass field carries its help text and flag spelling, and the command line is
generated from the fields (torchtitan's job-config idea).

    @dataclass
    class TrainConfig:
        lr: float = setting(3e-4, "peak learning rate")

    add_setting_arguments(groups, TrainConfig, "training")  # --lr X  peak learning rate (default: 0.0003)

A field's flag is `--` + its name with dashes (`lr_warmup_iters` -> `--lr-warmup-iters`), its dest the field's name,
its default the field's default; the value type comes from the annotation (`int`, `float`, `str`, `bool`, `list[...]`
and their `| None`). A bool that defaults to True or None also gets its `--no-` form. Metadata changes the rest:
more spellings (`flags`), `choices` (or a function returning them, asked when the parser is built), a `metavar`, a
parser `type`, the `--help` group the flag is listed in, `negatable`, `flag_default` and `consts` (extra flags that
store a constant, e.g. `--enable-cuda-graph` for `--cuda-graphs on`).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, Callable, Sequence

_NO_DEFAULT: Any = dataclasses.MISSING


def setting(default: Any = _NO_DEFAULT, help: str = "", *, default_factory: Callable[[], Any] | None = None,
            flags: Sequence[str] = (), choices: Sequence[Any] | Callable[[], Sequence[Any]] | None = None,
            metavar: str | None = None,
            type: Callable[[str], Any] | None = None, group: str | None = None, negatable: bool | None = None,
            consts: dict[str, Any] | None = None, flag_default: Any = _NO_DEFAULT) -> Any:
    """A dataclass field that is also a command-line flag (see the module docstring for each argument;
    flag_default: the flag's unset value where the parser resolves it, e.g. from the configuration file used)."""
    metadata = {"help": help, "flags": tuple(flags), "choices": choices, "metavar": metavar, "type": type,
                "group": group, "negatable": negatable, "consts": consts or {}, "flag_default": flag_default}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def is_setting(f: dataclasses.Field) -> bool:
    return "help" in f.metadata


def flag_name(field_name: str) -> str:
    """The command-line spelling of a field: `lr_warmup_iters` -> `--lr-warmup-iters`."""
    return "--" + field_name.replace("_", "-")


def field_default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def _value_type(hint: Any) -> tuple[Any, bool]:
    """(the annotation without None, whether it is a list)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        hint = args[0]
    if typing.get_origin(hint) is list:
        return typing.get_args(hint)[0], True
    return hint, False


def parser_groups(parser: argparse.ArgumentParser) -> Callable[[str], Any]:
    """groups(title) for `add_setting_arguments`: the parser's argument group of that title, made on first use."""
    groups: dict[str, Any] = {}

    def group(title: str) -> Any:
        if title not in groups:
            groups[title] = parser.add_argument_group(title)
        return groups[title]

    return group


def add_setting_arguments(groups: Callable[[str], Any], kind: type, default_group: str,
                          names: Sequence[str] | None = None, meta: dict[str, dict[str, Any]] | None = None,
                          optional: bool = False) -> None:
    """Add a flag for each setting of the dataclass `kind`, or for `names` with their metadata in `meta` (fields of
    a class declared without flag metadata, e.g. the model's architecture). groups(title): the argparse group of
    that title; optional: every flag defaults to None (unset: the value comes from elsewhere)."""
    hints = typing.get_type_hints(kind)
    fields = {f.name: f for f in dataclasses.fields(kind)}
    for name in names if names is not None else [n for n, f in fields.items() if is_setting(f)]:
        f = fields[name]
        info = dict(f.metadata) if is_setting(f) else (meta or {})[name]
        hint, many = _value_type(hints[name])
        default = None if optional else field_default(f)
        if info.get("flag_default", _NO_DEFAULT) is not _NO_DEFAULT:
            default = info["flag_default"]
        kwargs: dict[str, Any] = {"dest": name, "default": default, "help": info["help"] or None}
        flags = (flag_name(name), *info.get("flags", ()))
        if hint is bool:
            negatable = info.get("negatable")
            if negatable if negatable is not None else default is not False:
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["action"] = "store_true"
        else:
            kwargs["type"] = info.get("type") or (hint if hint in (int, float) else None)
            choices = info.get("choices")
            if choices:
                kwargs["choices"] = tuple(choices() if callable(choices) else choices)
            if info.get("metavar"):
                kwargs["metavar"] = info["metavar"]
            if many:
                kwargs["nargs"] = "+" if hint is float else "*"
        group = groups(info.get("group") or default_group)
        group.add_argument(*flags, **kwargs)
        for flag, const in info.get("consts", {}).items():
            group.add_argument(flag, dest=name, action="store_const", const=const,
                               help=f"same as {flag_name(name)} {const}")
