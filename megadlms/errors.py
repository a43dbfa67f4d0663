"""The base of MegaDLMs' errors about what the user asked for.

Every error that a flag, a file or the hardware can cause derives from `MegaDLMsError` as well as from the
builtin it has always been (ValueError, RuntimeError), so library callers keep catching what they caught. Its
message names the value, why it cannot work and the fix; the command-line entry points print that message
alone (`megadlms train: error: ...`, exit status 2), while any other exception, a bug, keeps its traceback.
"""

from __future__ import annotations


class MegaDLMsError(Exception):
    """Something the user asked for cannot be done; the message says what and how to fix it."""
