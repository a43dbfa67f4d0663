"""The RL example script parses, and its `megadlms train` and `megadlms generate` commands name only flags those
commands have."""

import argparse
import re
import subprocess
from pathlib import Path

from megadlms.cli import generate
from megadlms.training.args import build_parser

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "rl" / "run.sh"


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def _block(text: str, start: str) -> str:
    """The lines from the one that starts with `start` to the next blank line (a command or an array)."""
    lines = text.splitlines()
    i = next(n for n, line in enumerate(lines) if line.lstrip().startswith(start))
    out = []
    for line in lines[i:]:
        if not line.strip():
            break
        out.append(line)
    return "\n".join(out)


def test_the_script_parses_and_its_flags_exist():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    text = SCRIPT.read_text()
    train = _block(text, "MODEL=(").split("GEN=(")[0] + _block(text, "$MEGADLMS train")
    used = set(re.findall(r"(--[a-z0-9-]+)", train))
    assert "--rl" in used and used <= _flags(build_parser()), used - _flags(build_parser())
    gen = _block(text, "GEN=(") + _block(text, "$MEGADLMS generate")
    used = set(re.findall(r"(--[a-z0-9-]+)", gen))
    gen_flags = _flags(generate.add_arguments(argparse.ArgumentParser()))
    assert "--prompt-file" in used and used <= gen_flags, used - gen_flags
