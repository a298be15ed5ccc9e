"""A mistake in what the user gave ends a command with one `error: ...` block and exit status 2, the way
jsonargparse ends `lightning-megatron` for an option it cannot parse; every other exception is a bug and keeps its
traceback.

A mistake is what the package's own validation raises on purpose: a `ValueError` (or one of the package's
subclasses of it: `BridgeError`, `DataValidationError`, `VLOptionError`, `MTPRestoreError`), a `TypeError` (a
class in the config that does not fit: a strategy that is not `MegatronStrategy`), a `FileNotFoundError` (a data
file) or a `FileExistsError` (an export folder), raised by a `raise` statement in the package's own source. Its
message names the option and the fix, so the traceback adds nothing a user can act on. The same exception types
raised inside a library (a shape mismatch deep in torch) still show their traceback. `JSONARGPARSE_DEBUG=true`,
jsonargparse's own switch for raising instead of exiting, shows the traceback of a mistake too. Imports nothing but
the standard library.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]
INPUT_ERRORS = (ValueError, TypeError, FileNotFoundError, FileExistsError)
EXIT_STATUS = 2  # jsonargparse's (and argparse's) status for a bad option


def is_input_error(error: BaseException) -> bool:
    """Whether `error` is one of the package's own refusals of its input (see the module docstring)."""
    if not isinstance(error, INPUT_ERRORS) or error.__traceback__ is None:
        return False
    raised_at = traceback.extract_tb(error.__traceback__)[-1]
    in_package = Path(raised_at.filename).resolve().is_relative_to(PACKAGE)
    return in_package and (raised_at.line or "").startswith("raise ")


def _debugging() -> bool:
    return os.environ.get("JSONARGPARSE_DEBUG", "").lower() == "true"


@contextlib.contextmanager
def input_errors_reported(on_the_command_line: bool = True) -> Iterator[None]:
    """Run a command's body; a mistake in its input prints `error: <message>` on stderr and exits with status 2.

    `on_the_command_line=False` (a command's `main` called from Python with its arguments, as tests and notebooks
    do) lets the exception through as it is, for the caller to catch."""
    try:
        yield
    except INPUT_ERRORS as error:
        if not on_the_command_line or _debugging() or not is_input_error(error):
            raise
        sys.stderr.write(f"error: {error}\n")
        raise SystemExit(EXIT_STATUS) from None
