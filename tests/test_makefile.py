"""The Makefile's first set-up says what it installs before each slow step (`make demo` on a new machine)."""

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_each_install_step_is_announced_first(tmp_path):
    venv = tmp_path / "venv"
    # a make of its own, not a sub-make of `make test` (which would print its directory lines)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    lines = subprocess.run(["make", "--no-print-directory", "-n", "-B", f"{venv}/.installed-stamp", f"VENV={venv}"],
                           cwd=ROOT, check=True, capture_output=True, text=True, env=env).stdout.splitlines()
    slow = [i for i, line in enumerate(lines) if "pip install" in line or "-m venv" in line]
    assert len(slow) == 3, lines  # the venv, torch, megadlms[dev]
    for i in slow:  # the announcement is on the step's line or the line before it
        assert "echo \"make: " in lines[i] or "echo \"make: " in lines[i - 1], lines[i]
    assert lines[-1] == f'echo "make: {venv} is ready"'
