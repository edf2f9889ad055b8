"""Argument checks shared across colibri, each with one message format naming the fix."""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np


def _cpu_count() -> int:
    """The machine's CPUs (1 when unknown)."""
    return os.cpu_count() or 1


# read once: os.cpu_count() costs ~18 us, and thread counts are checked on every kernel call
_CPUS = _cpu_count()


def check_int(name: str, value: Any, low: int, high: int | None = None, hint: str = "") -> int:
    """``value`` as an int in ``[low, high]`` (a bool is not an int); ``hint`` ends the message."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int (got {value!r})")
    value = int(value)
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"between {low} and {high}"
        raise ValueError(f"{name} must be {bound} (got {value}){hint}")
    return value


def check_threads(value: Any, name: str = "num_threads") -> int:
    """A thread count: an int between 1 and 4x the machine's CPUs.

    More threads than that only oversubscribe the cores, and a count in the thousands makes
    torch's and OpenMP's thread pools crash (``torch.set_num_threads(3000)`` is a SIGSEGV),
    so the bound is checked before any pool sees the value.
    """
    threads = check_int(name, value, 1)
    cpus = _CPUS
    if threads > 4 * cpus:
        raise ValueError(
            f"{name} must be at most {4 * cpus}, 4x this machine's {cpus} CPUs (got {threads}); "
            "more threads only oversubscribe the cores"
        )
    return threads


def check_page_size_kb(value: Any, where: str = "") -> int:
    """A pager page size in KiB: a power of two >= 4 (the OS page; slots and reads align
    to it). ``where`` prefixes the message (``"Pager(): "``)."""
    page = check_int(f"{where}page_size_kb", value, 4)
    if page & (page - 1):
        raise ValueError(
            f"{where}page_size_kb must be a power of two >= 4 (got {page}); 4, 32 and 64 are common"
        )
    return page


def check_float(name: str, value: Any, positive: bool = False) -> float:
    """``value`` as a finite float (and > 0 when ``positive``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number (got {value!r})")
    value = float(value)
    if not math.isfinite(value) or (positive and value <= 0):
        raise ValueError(
            f"{name} must be a finite{' positive' if positive else ''} number (got {value})"
        )
    return value


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    """``value`` itself, if it is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))} (got {value!r})")
    return value
