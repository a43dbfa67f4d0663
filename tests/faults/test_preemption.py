"""Preemption: SIGTERM / SIGINT / SIGUSR1 finish the step, save and exit 0 with a line naming the checkpoint; the
resumed run continues the unbroken run's losses bit for bit; a second signal exits at once;
--exit-duration-in-mins saves and stops before the wall time."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megadlms.training import checkpoint as ckpt
from megadlms.training.preemption import RunControl

from .conftest import TINY, logged_losses, tiny_trainer

ROOT = Path(__file__).resolve().parents[2]
ITERS = 5


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory) -> dict[int, float]:
    save = tmp_path_factory.mktemp("unbroken")
    tiny_trainer("--train-iters", str(ITERS), "--save", str(save)).run()
    return logged_losses(save)


def _signal_after_step(trainer, k: int, sig: int) -> None:
    step = trainer.train_step

    def stepping():
        out = step()
        if trainer.state.iteration == k:
            os.kill(os.getpid(), sig)  # a real signal, delivered to the handler between two bytecodes
        return out
    trainer.train_step = stepping


@pytest.mark.parametrize("sig,step", [
    (signal.SIGTERM, random.Random(0).randint(1, ITERS - 1)),
    (signal.SIGINT, random.Random(1).randint(1, ITERS - 1)),
    (signal.SIGUSR1, random.Random(2).randint(1, ITERS - 1)),
], ids=["SIGTERM->saved-exit0-bitwise-resume", "SIGINT->saved-exit0-bitwise-resume",
        "SIGUSR1->saved-exit0-bitwise-resume"])
def test_signal_saves_and_resume_is_bitwise(tmp_path, capsys, unbroken, sig, step):
    save = tmp_path / "ck"
    before = signal.getsignal(sig)
    trainer = tiny_trainer("--train-iters", str(ITERS), "--save", str(save))
    _signal_after_step(trainer, step, sig)
    state = trainer.run()
    out = capsys.readouterr().out
    assert state.iteration == step and signal.getsignal(sig) is before  # handlers put back
    name = signal.Signals(sig).name
    assert f"received {name}: finishing this step, then saving a checkpoint and exiting" in out
    assert (f"stopped at iteration {step} on {name}: saved checkpoint {ckpt.iteration_dir(save, step)}; resume with "
            f"--load {save}") in out
    assert ckpt.complete_iterations(save) == [step]
    tiny_trainer("--train-iters", str(ITERS), "--save", str(save), "--load", str(save)).run()
    assert logged_losses(save) == unbroken  # every iteration's loss, bit for bit


def test_exit_duration_saves_before_the_wall_time(tmp_path, capsys):
    save = tmp_path / "ck"
    state = tiny_trainer("--train-iters", "50", "--save", str(save), "--exit-duration-in-mins", "1e-9").run()
    assert state.iteration == 1 and ckpt.complete_iterations(save) == [1]
    assert "stopped at iteration 1 on the time limit of --exit-duration-in-mins: saved checkpoint" in \
        capsys.readouterr().out


def test_without_save_the_line_says_nothing_was_saved(capsys):
    trainer = tiny_trainer("--train-iters", "4")
    _signal_after_step(trainer, 1, signal.SIGTERM)
    assert trainer.run().iteration == 1
    assert "stopped at iteration 1 on SIGTERM: nothing saved (no --save)" in capsys.readouterr().out


def test_no_exit_signal_handler_leaves_signals_alone():
    trainer = tiny_trainer("--train-iters", "1", "--no-exit-signal-handler")
    before = signal.getsignal(signal.SIGTERM)
    trainer.control.install()
    assert signal.getsignal(signal.SIGTERM) is before
    trainer.control.uninstall()


def test_a_second_signal_exits_at_once():
    pid = os.fork()
    if pid == 0:  # the child: two signals while "saving"
        code = 3
        try:
            control = RunControl(__import__("torch").device("cpu"), distributed=False)
            control.install()
            os.kill(os.getpid(), signal.SIGTERM)
            code = 4 if control.received == "SIGTERM" else 5
            os.kill(os.getpid(), signal.SIGTERM)  # the default action: the process ends here
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, status


def test_sigterm_to_the_command_exits_zero_with_a_checkpoint(tmp_path):
    """The real command in its own process group, with a data-loading worker, stopped as a scheduler stops a job:
    SIGTERM to every process of the group."""
    save = tmp_path / "ck"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    argv = [a if a != "0" or TINY[i - 1] != "--num-workers" else "1" for i, a in enumerate(TINY)]
    proc = subprocess.Popen([sys.executable, "-m", "megadlms", "train", *argv, "--train-iters", "100000",
                             "--save", str(save)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("iter "):
            os.killpg(proc.pid, signal.SIGTERM)
            break
    rest, _ = proc.communicate(timeout=120)
    out = "".join(lines) + rest
    assert proc.returncode == 0, out
    stopped = [x for x in out.splitlines() if x.startswith("stopped at iteration")]
    assert len(stopped) == 1 and " on SIGTERM: saved checkpoint " in stopped[0], out
    n = int(stopped[0].split()[3])
    assert ckpt.find_checkpoint(save) == ckpt.iteration_dir(save, n) and ckpt.verify_checkpoint(
        ckpt.iteration_dir(save, n)) == []
