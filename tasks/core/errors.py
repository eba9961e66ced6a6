"""The one root of draftline's errors.

Every error a stage, the store or a command raises is a `DraftlineError` (with the built-in base it
always had, so `except ValueError` in a caller keeps working): the command line catches this one class
and prints its message, which names the problem and the fix. `tasks.core.stopping.Stopped` is not one:
it is the run being asked to stop, not a mistake.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
from collections.abc import Callable, Iterable, Iterator

DISK_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)  # a full disk, a file-size limit, a quota


class DraftlineError(Exception):
    """A problem draftline can name: the message says what is wrong and what to change."""


class ConfigError(DraftlineError, ValueError):
    """A config (or an option naming part of one) that cannot be used; the message names each field and the fix."""


@contextlib.contextmanager
def full_disk_as(error: Callable[[OSError], BaseException]) -> Iterator[None]:
    """A full disk (DISK_FULL) inside becomes ERROR(the OSError), raised without the OSError's traceback: a message
    that names the disk and the fix (the store's, a spill file's, the part cache's). Other errors pass as they are."""
    try:
        yield
    except OSError as exc:
        if isinstance(exc, DraftlineError) or exc.errno not in DISK_FULL:
            raise
        raise error(exc) from None


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The one of CHOICES a typo of WORD most likely meant, or None."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.75)
    return close[0] if close else None


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """` (did you mean X?)` for the closest of CHOICES (a typo's distance), or nothing."""
    near = closest(word, choices)
    return f" (did you mean {near}?)" if near else ""
