"""The code reward's runner: passes and fails on the tests, refuses network, writes outside its folder and new
processes, kills on timeout."""

import time

from megadlms.rl.code_runner import run_program
from megadlms.rl.rewards import RewardSet


def test_a_program_passes_or_fails_its_tests():
    assert run_program("def add(a, b):\n    return a + b", "assert add(2, 3) == 5").passed
    assert not run_program("def add(a, b):\n    return a - b", "assert add(2, 3) == 5").passed


def test_network_writes_outside_and_processes_are_refused(tmp_path):
    r = run_program("import socket\nsocket.create_connection(('127.0.0.1', 9))", "")
    assert not r.passed and "refused in the sandbox: socket" in r.output
    outside = tmp_path / "x.txt"
    r = run_program(f"open({str(outside)!r}, 'w').write('x')", "")
    assert not r.passed and "outside its folder" in r.output and not outside.exists()
    assert run_program("open('inside.txt', 'w').write('x')\nassert open('inside.txt').read() == 'x'", "").passed
    r = run_program("import subprocess\nsubprocess.run(['true'])", "")
    assert not r.passed and "subprocess.Popen" in r.output


def test_a_program_past_its_time_is_killed():
    t0 = time.perf_counter()
    r = run_program("while True:\n    pass", "", timeout=1.0)
    assert r.timed_out and not r.passed and time.perf_counter() - t0 < 4


def test_the_code_reward_reads_the_last_python_block():
    rs = RewardSet.parse("code_tests")
    text = "Here:\n```python\ndef sq(x):\n    return x * x\n```"
    assert rs([text, "def sq(x): return x"], [{"tests": "assert sq(3) == 9"}] * 2) == [1.0, 0.0]
    assert rs.fields() == ("tests",)
