"""The one root of draftline's errors.

Every error a stage, the store or a command raises is a `DraftlineError` (with the built-in base it
always had, so `except ValueError` in a caller keeps working): the command line catches this one class
and prints its message, which names the problem and the fix. `tasks.core.stopping.Stopped` is not one:
it is the run being asked to stop, not a mistake.
"""

from __future__ import annotations


class DraftlineError(Exception):
    """A problem draftline can name: the message says what is wrong and what to change."""
