"""colibri's exception classes: one base, :class:`ColibriError`, for every error colibri raises
on purpose; each also keeps the standard base that says what kind of fault it is."""

from __future__ import annotations

__all__ = ["BudgetError", "ColibriError", "FormatError"]


class ColibriError(Exception):
    """Base of colibri's own exceptions (``except colibri.ColibriError`` catches them all)."""


class FormatError(ColibriError, ValueError):
    """A file colibri reads (weights, manifest, partition, statistics, trace) is corrupt,
    truncated, malicious or not understood; the message names the file, the key and what was
    expected."""


class BudgetError(ColibriError, MemoryError):
    """An expert store's budget cannot hold what a call needs (too small, or every slot pinned
    by live views)."""
