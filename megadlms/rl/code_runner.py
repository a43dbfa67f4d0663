"""The code reward's runner: a completion's program and the record's unit tests in a child Python process.

The child runs in a fresh temporary folder (its working directory, removed afterwards) with `python -I` (no user
site, no PYTHON* variables), under resource limits (CPU seconds, address space, file size, set by the child before
anything else runs) and an audit hook that
refuses, before the program runs: sockets (no network), opening files for writing outside the folder, and starting
processes. The wall-clock `timeout` kills the child's whole process group. The hook guards against what model
programs do by accident; it is not a security boundary against hostile code (run untrusted code in a container).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass

# Runs first in the child: the audit hook, then the program and its tests in one namespace.
_PRELUDE = textwrap.dedent('''
    import os, resource, sys
    _cpu, _mem, _fsize = (int(v) for v in sys.argv[1:4])
    resource.setrlimit(resource.RLIMIT_CPU, (_cpu, _cpu))
    resource.setrlimit(resource.RLIMIT_AS, (_mem, _mem))
    resource.setrlimit(resource.RLIMIT_FSIZE, (_fsize, _fsize))
    _root = os.path.realpath(os.getcwd())

    def _guard(event, args):
        if event.startswith("socket.") or event in ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn",
                                                     "os.spawn", "os.fork", "os.forkpty", "pty.spawn"):
            raise PermissionError(f"refused in the sandbox: {event}")
        if event == "open" and len(args) > 1 and args[0] is not None and not isinstance(args[0], int):
            mode, flags = args[1], (args[2] if len(args) > 2 else 0)
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
            path = os.path.realpath(os.fsdecode(args[0]))
            if writing and os.path.commonpath([path, _root]) != _root:
                raise PermissionError(f"refused in the sandbox: writing {path} outside its folder")
        if event in ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "shutil.rmtree", "os.truncate"):
            path = args[0]
            if isinstance(path, (str, bytes, os.PathLike)):
                path = os.path.realpath(os.fsdecode(path))
                if os.path.commonpath([path, _root]) != _root:
                    raise PermissionError(f"refused in the sandbox: {event} {path} outside its folder")

    sys.addaudithook(_guard)
    _source = open("program.py").read()
    exec(compile(_source, "program.py", "exec"), {"__name__": "__main__"})
''')


@dataclass
class RunResult:
    passed: bool  # exit status 0: the program and every test ran without an exception
    timed_out: bool
    output: str  # the child's stderr tail (why it failed)


def run_program(program: str, tests: str, *, timeout: float = 5.0, memory_mb: int = 1024,
                file_mb: int = 16) -> RunResult:
    """Run `program` then `tests` (asserts) in a sandboxed child; passed when it exits 0 within `timeout` s."""
    with tempfile.TemporaryDirectory(prefix="megadlms_code_") as folder:
        with open(os.path.join(folder, "program.py"), "w") as f:
            f.write(program + "\n\n" + tests + "\n")
        with open(os.path.join(folder, "prelude.py"), "w") as f:
            f.write(_PRELUDE)
        cpu = max(1, int(timeout) + 1)
        # a session of its own (no preexec_fn: the trainer's process has threads): the timeout kills its group
        proc = subprocess.Popen([sys.executable, "-I", "prelude.py", str(cpu), str(memory_mb << 20),
                                 str(file_mb << 20)], cwd=folder, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, env={"PATH": "/usr/bin:/bin"}, start_new_session=True)
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return RunResult(False, True, f"killed after {timeout:g} s")
        return RunResult(proc.returncode == 0, False, err.decode("utf-8", "replace")[-2000:])
