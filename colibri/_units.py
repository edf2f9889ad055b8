"""Sizes and this process's memory: one meaning of every unit, one reader of ``/proc``.

Units: ``B``; decimal ``kB``/``KB``, ``MB``, ``GB``, ``TB`` (powers of 1000); binary ``KiB``,
``MiB``, ``GiB``, ``TiB`` (powers of 1024); a bare ``K``, ``M``, ``G``, ``T`` is binary (as
``free -g`` and ``docker -m 512m`` mean it). Case does not matter.
"""

from __future__ import annotations

import re
import sys
from typing import NamedTuple

__all__ = ["ProcessMemory", "format_bytes", "parse_size", "process_memory"]

_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
    "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
    "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}  # fmt: skip
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*")


def parse_size(value: int | str, what: str = "size") -> int:
    """Bytes from an int or a string with a unit.

    Parameters
    ----------
    value : int or str
        ``805306368``, ``"768MiB"``, ``"3GiB"`` (3 * 2**30), ``"3GB"`` (3 * 10**9), ``"512M"``
        (binary).
    what : str
        The argument's name, for the message.

    Returns
    -------
    int
        A positive number of bytes.

    Raises
    ------
    ValueError
        Not a positive size; the message names ``what`` and gives examples.
    """
    if isinstance(value, int) and not isinstance(value, bool) or _is_numpy_int(value):
        if value > 0:
            return int(value)
    elif isinstance(value, str):
        m = _SIZE.fullmatch(value)
        if m and m[2].lower() in _UNITS:
            size = int(float(m[1]) * _UNITS[m[2].lower()])
            if size > 0:
                return size
    raise ValueError(
        f"{what} must be a positive size in bytes or with a unit, e.g. 805306368, '768MiB', "
        f"'3GiB' (2**30 bytes) or '3GB' (10**9 bytes) (got {value!r})"
    )


def _is_numpy_int(value: object) -> bool:
    np = sys.modules.get("numpy")
    return np is not None and isinstance(value, np.integer)


def format_bytes(n: float) -> str:
    """``n`` bytes in binary units: ``"365.6 MiB"``, ``"2.86 GiB"``."""
    if abs(n) >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    return f"{n / (1 << 20):.1f} MiB"


class ProcessMemory(NamedTuple):
    """This process's memory in bytes; None where the OS does not say.

    Attributes
    ----------
    rss : int or None
        Resident set now (``VmRSS``).
    peak : int or None
        Resident set high-water mark (``VmHWM``; ``ru_maxrss`` off Linux).
    anon : int or None
        Anonymous resident bytes (``RssAnon``: heaps, read pools).
    file : int or None
        File-backed resident bytes (``RssFile``: mapped weight pages, shared with the page
        cache).
    """

    rss: int | None
    peak: int | None
    anon: int | None
    file: int | None


_STATUS = {"VmRSS": "rss", "VmHWM": "peak", "RssAnon": "anon", "RssFile": "file"}


def process_memory() -> ProcessMemory:
    """This process's memory now (``/proc/self/status`` on Linux).

    Off Linux only ``peak`` is known (``getrusage``), where the OS reports it.
    """
    found: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in _STATUS:
                    found[_STATUS[key]] = int(value.split()[0]) * 1024
    except OSError:
        pass
    if "peak" not in found:
        try:
            import resource
        except ImportError:  # Windows
            pass
        else:
            scale = 1 if sys.platform == "darwin" else 1024
            found["peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    return ProcessMemory(**{name: found.get(name) for name in ProcessMemory._fields})
