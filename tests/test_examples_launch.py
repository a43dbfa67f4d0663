"""The launch scripts of examples/: they parse, refuse a machine without the GPUs asked for in one line, and the
command they build is one `megadlms train` accepts (the header's short run included)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megadlms.training.args import parse_train_args

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ["train_single_node.sh", "train_slurm.sbatch", "find_python.sh", "sft/run.sh", "rl/run.sh"]
ENV = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}


def _run(script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "examples" / script), *args], env={**ENV, **env}, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_script_parses(script):
    subprocess.run(["bash", "-n", str(ROOT / "examples" / script)], check=True)


def test_single_node_refuses_more_gpus_than_torch_sees_in_one_line():
    out = _run("train_single_node.sh", GPUS="99")
    assert out.returncode == 1 and out.stdout == "" and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("train_single_node.sh: GPUS=99, but torch sees ")
    assert "this script trains on GPUs (on a CPU, 'megadlms train' trains the demo)" in out.stderr


def test_single_node_header_run_is_a_command_train_accepts():
    out = _run("train_single_node.sh", "--log-interval", "1", DRY_RUN="1", GPUS="2", ITERS="100")
    assert out.returncode == 0, out.stderr
    words = out.stdout.split()
    assert words[:5] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    config = parse_train_args(words[words.index("pretrain_difflm.py") + 1:])  # the warm-up fits the short run
    assert (config.train.train_iters, config.train.lr_warmup_iters, config.train.log_interval) == (100, 10, 1)
    assert config.checkpoint.save == "runs/qwen3-1.7b-dlm" and config.checkpoint.load is None


def test_an_example_without_megadlms_says_how_to_get_it(tmp_path):
    out = _run("sft/run.sh", str(tmp_path / "work"), PYTHON=str(tmp_path / "no-python"))
    assert out.returncode == 1 and out.stderr.count("\n") == 1
    assert out.stderr.startswith(f"run.sh: {tmp_path / 'no-python'} cannot import megadlms: run 'make test' in ")
