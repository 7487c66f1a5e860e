"""The base class of errors caused by the user's input rather than by a bug.

The command line prints these as one line (``bertpipe: error: ...``) and exits with status 2;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

__all__ = ["BertpipeError"]


class BertpipeError(Exception):
    """Bad input, config or environment; the message says which and what to do."""
