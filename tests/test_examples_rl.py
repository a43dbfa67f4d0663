"""The RL example script parses, and names only flags that `megadlms train` has."""

import re
import subprocess
from pathlib import Path

from megadlms.training.args import build_parser

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "rl" / "run.sh"


def test_the_script_parses_and_its_flags_exist():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    flags = {s for a in build_parser()._actions for s in a.option_strings}
    used = set(re.findall(r"(--[a-z0-9-]+)", SCRIPT.read_text()))
    assert used <= flags, used - flags
