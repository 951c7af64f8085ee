"""The library's warnings, kept from cutting its work short where the caller made them errors.

Under ``python -W error`` (or pytest's ``filterwarnings = error``) ``warnings.warn`` raises. Raised
in the middle of a capture, one of our notes (forward hooks that keep what they see) ended the
capture as if the library had failed: its key served eagerly for good, reported as a bug of ours.
``say`` holds a warning the filters turn into an exception, and the call that said it raises it
(``raise_held``) once its work is done: the caller gets the error they asked for, and what the
library decided (a capture installed, a key refused) stands.
"""

from __future__ import annotations

import threading
import warnings

_held = threading.local()


def say(message: str, stacklevel: int) -> None:
    """``warnings.warn(message)``, pointed ``stacklevel`` frames above the caller; where the
    filters raise it, held for ``raise_held`` (the first one of a call)."""
    try:
        warnings.warn(message, stacklevel=stacklevel + 1)
    except Warning as raised:
        if getattr(_held, "warning", None) is None:
            _held.warning = raised


def raise_held() -> None:
    """Raise the warning ``say`` held in this thread, if any (at the end of a call's work)."""
    raised = getattr(_held, "warning", None)
    if raised is not None:
        _held.warning = None
        raise raised
