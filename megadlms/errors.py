"""Errors in what the user asked for (`MegaDLMsError`), and how the command line reports them (`report_errors`).

Every error that a flag, a file or the hardware can cause derives from `MegaDLMsError` as well as from the
builtin it has always been (ValueError, RuntimeError), so library callers keep catching what they caught. Its
message names the value, why it cannot work and the fix; the command-line entry points print that message
alone (`megadlms train: error: ...`, exit status 2), while any other exception, a bug, keeps its traceback.
"""

from __future__ import annotations

import errno
import importlib
import sys
from collections.abc import Callable
from types import ModuleType

# file-system errors a path the user gave (or the machine's state) causes, not a bug: reported as one line
USER_ERRNOS = frozenset({errno.ENOENT, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT, errno.EROFS,
                         errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.ENAMETOOLONG, errno.EIO})


class MegaDLMsError(Exception):
    """Something the user asked for cannot be done; the message says what and how to fix it."""


def report_errors(prog: str, run: Callable[[], int | None]) -> int:
    """`run()`'s exit status; a `MegaDLMsError` is printed as argparse prints a bad flag, `PROG: error: MESSAGE`,
    with status 2 and no traceback; so is an OSError of a named file that the user or the machine causes (no such
    folder, no permission, a full disk). Other exceptions keep theirs."""
    try:
        return int(run() or 0)
    except MegaDLMsError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if e.errno not in USER_ERRNOS or not e.filename:
            raise
        print(f"{prog}: error: {e.filename}: {e.strerror}; check the path, its permissions and the free space",
              file=sys.stderr)
        return 2


class MissingExtraError(MegaDLMsError, ImportError):
    """An optional dependency is not installed; the message names the pip extra that brings it."""


def import_extra(module: str, extra: str, feature: str) -> ModuleType:
    """`importlib.import_module(module)`, or a one-line `MissingExtraError` naming `pip install megadlms[EXTRA]`."""

    try:
        return importlib.import_module(module)
    except ImportError as e:
        if e.name is not None and e.name.split(".")[0] != module.split(".")[0]:
            raise  # the package is there but one of its own imports failed: keep the traceback
        raise MissingExtraError(f"{feature} needs the {module.split('.')[0]!r} package: pip install "
                                f"'megadlms[{extra}]'") from e
