"""The one strict JSON reader for every file colibri loads.

safetensors headers, sharded indexes, raw manifests, partitions, usage statistics and traces
all go through :func:`parse` (bytes) or :func:`load` (a path), then through the field checkers
below. What a file may not do, each refused with a :class:`~colibri.FormatError` naming the
file, the key and what was expected:

- be larger than ``max_bytes`` (checked before reading), not UTF-8, or not JSON;
- nest deeper than ``MAX_DEPTH`` (checked before parsing, so never a ``RecursionError``);
- repeat a key in an object (``json`` would keep the last one silently);
- use ``NaN``/``Infinity`` (not JSON) or numbers of more than 4300 digits;
- hold a field of the wrong type, or an integer outside its range (every integer colibri uses
  fits in int64).

Keys are shown as paths: ``experts[3].matrices.gate.offset``.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from colibri._errors import FormatError

__all__ = [
    "INT32_MAX",
    "INT64_MAX",
    "MAX_BYTES",
    "MAX_DEPTH",
    "field",
    "int_list",
    "integer",
    "load",
    "mapping",
    "parse",
    "sequence",
    "show",
    "string",
]

#: Largest JSON document colibri agrees to parse (safetensors uses the same bound).
MAX_BYTES = 100 * 1024 * 1024
#: Deepest nesting accepted; colibri's own files nest at most 4 levels.
MAX_DEPTH = 32
INT64_MAX = (1 << 63) - 1
#: Largest layer or expert index (ids are int32).
INT32_MAX = (1 << 31) - 1

_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_INNERMOST = re.compile(rb"\[\]|\{\}")
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


def show(value: object, limit: int = 60) -> str:
    """A short picture of ``value`` for messages (hostile values can be huge)."""
    if isinstance(value, list):
        return f"a list of {len(value)} items"
    if isinstance(value, dict):
        return f"an object of {len(value)} keys"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _depth_exceeds(data: bytes, max_depth: int) -> bool:
    """Whether brackets outside strings nest deeper than ``max_depth``.

    Each pass drops the innermost bracket pairs, one nesting level. A pass that drops nothing
    means unbalanced brackets: False, and the JSON parser names the syntax error.
    """
    brackets = _STRINGS.sub(b"", data).translate(None, _NOT_BRACKETS)
    for _ in range(max_depth):
        if not brackets:
            return False
        inner = _INNERMOST.sub(b"", brackets)
        if len(inner) == len(brackets):
            return False
        brackets = inner
    return bool(brackets) and _INNERMOST.search(brackets) is not None


def _constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def parse(data: bytes, source: str, *, what: str, max_depth: int = MAX_DEPTH) -> Any:
    """Parse ``data`` (the bytes of ``source``) strictly.

    Parameters
    ----------
    data : bytes
        The whole document.
    source : str
        The file name, for messages.
    what : str
        What the document is (``"the safetensors header"``), for messages.

    Raises
    ------
    FormatError
        Not UTF-8, not JSON, nested deeper than ``max_depth``, a key repeated, ``NaN``.
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise FormatError(f"{source}: {what} is not UTF-8 JSON ({error})") from None
    if _depth_exceeds(data, max_depth):
        raise FormatError(
            f"{source}: {what} nests deeper than {max_depth} levels; the file is corrupt or hostile"
        )

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(pairs)
        if len(out) != len(pairs):
            seen: set[str] = set()
            repeated = next(k for k, _ in pairs if k in seen or seen.add(k))
            raise FormatError(
                f"{source}: {what} names the key {show(repeated)} twice; keys must be unique"
            )
        return out

    try:
        return json.loads(text, object_pairs_hook=unique, parse_constant=_constant)
    except FormatError:
        raise
    except (ValueError, RecursionError) as error:  # JSONDecodeError, NaN, > 4300 digits
        raise FormatError(f"{source}: {what} is not valid JSON ({error})") from None


def load(
    path: str | os.PathLike[str], *, what: str, max_bytes: int = MAX_BYTES,
    max_depth: int = MAX_DEPTH,
) -> Any:  # fmt: skip
    """Read and :func:`parse` the JSON file ``path``, refusing more than ``max_bytes``.

    Raises
    ------
    FormatError
        See :func:`parse`; also a file over ``max_bytes``.
    FileNotFoundError, OSError
        The file cannot be read.
    """
    name = os.fspath(path)
    with open(name, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise FormatError(f"{name}: {what} is {size} bytes, more than the {max_bytes} allowed")
        data = f.read(max_bytes + 1)  # the file may grow meanwhile
    if len(data) > max_bytes:
        raise FormatError(f"{name}: {what} is more than the {max_bytes} bytes allowed")
    return parse(data, name, what=what, max_depth=max_depth)


# -- field checkers: each raises FormatError("<file>: '<key>' must be <expected> (got ...)") --


def _fail(source: str, key: str, expected: str, value: object) -> FormatError:
    return FormatError(f"{source}: {key!r} must be {expected} (got {show(value)})")


def mapping(value: object, source: str, key: str) -> dict[str, Any]:
    """``value`` if it is a JSON object."""
    if not isinstance(value, dict):
        raise _fail(source, key, "an object", value)
    return value


def sequence(
    value: object, source: str, key: str, *, min_len: int = 0, max_len: int | None = None
) -> list[Any]:
    """``value`` if it is a JSON list of ``min_len .. max_len`` items."""
    if not isinstance(value, list):
        raise _fail(source, key, "a list", value)
    if len(value) < min_len or (max_len is not None and len(value) > max_len):
        span = f"exactly {min_len}" if min_len == max_len else f"at least {min_len}"
        if max_len is not None and max_len != min_len:
            span = f"{min_len} to {max_len}"
        raise _fail(source, key, f"a list of {span} items", value)
    return value


def string(value: object, source: str, key: str) -> str:
    """``value`` if it is a JSON string."""
    if not isinstance(value, str):
        raise _fail(source, key, "a string", value)
    return value


def integer(value: object, source: str, key: str, *, lo: int = 0, hi: int = INT64_MAX) -> int:
    """``value`` if it is a JSON integer (not a bool, not a float) in ``[lo, hi]``."""
    if type(value) is not int or not lo <= value <= hi:
        bound = f"an integer in [{lo}, {hi}]" if hi != INT64_MAX else f"an integer >= {lo}"
        raise _fail(source, key, bound + " that fits in int64", value)
    return value


def int_list(
    value: object, source: str, key: str, *, lo: int = 0, hi: int = INT64_MAX,
    min_len: int = 0, max_len: int | None = None,
) -> list[int]:  # fmt: skip
    """``value`` if it is a list of integers in ``[lo, hi]``."""
    items = sequence(value, source, key, min_len=min_len, max_len=max_len)
    for i, item in enumerate(items):
        integer(item, source, f"{key}[{i}]", lo=lo, hi=hi)
    return items


def field(
    document: dict[str, Any], name: str, source: str, prefix: str = "", *, required: bool = True,
    default: Any = None,
) -> Any:  # fmt: skip
    """``document[name]``; a missing required key is a FormatError naming it."""
    if name in document:
        return document[name]
    if required:
        raise FormatError(f"{source}: {prefix + name!r} is missing")
    return default
