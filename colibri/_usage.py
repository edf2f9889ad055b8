"""Expert usage statistics: selection counts and the co-activation matrix.

A token routed to ``k`` experts adds one to ``counts[e]`` for each chosen expert ``e`` and one
to ``coactivation[a, b]`` for each ordered pair of chosen experts (``a == b`` included), so
``coactivation`` is symmetric and its diagonal equals ``counts``. Statistics from several runs
or several layers add up (``a + b``): the result describes all their routed tokens together.

Saved as ``.npz`` (compact) or ``.json`` (readable); the format follows the file's suffix.
"""

from __future__ import annotations

import json
import os
import struct
import zipfile
import zlib
from collections.abc import Iterable

import numpy as np

from colibri import _json
from colibri._atomic_file import write_atomically
from colibri._errors import FormatError

__all__ = ["UsageStats"]

_FORMAT = "colibri.UsageStats"
_VERSION = 1
# Tokens per chunk when counting pairs (bounds the temporary index arrays).
_CHUNK_TOKENS = 1 << 16
# Bounds on what a loaded file may hold: expert ids are int32; unpacked .npz members.
_MAX_EXPERTS = 1 << 14
_MAX_NPZ_BYTES = 1 << 31


def _integer_array(value: object, name: str, ndim: int) -> np.ndarray:
    array = np.asarray(value)
    if array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.integer):
        raise TypeError(
            f"UsageStats: {name} must be an integer array (got dtype {array.dtype}); "
            f"pass counts as np.int64"
        )
    if array.ndim != ndim:
        raise ValueError(
            f"UsageStats: {name} must have {ndim} dimensions (got shape {array.shape})"
        )
    if array.size and array.min() < 0:
        raise ValueError(f"UsageStats: {name} must not be negative (min {array.min()})")
    if array.dtype == np.uint64 and array.size and array.max() > np.iinfo(np.int64).max:
        raise ValueError(f"UsageStats: {name} overflows int64")
    out = array.astype(np.int64, copy=True)
    out.flags.writeable = False
    return out


class UsageStats:
    """How often each expert was chosen, alone and together with every other expert.

    Parameters
    ----------
    counts : array_like of int, shape [E]
        Number of routed tokens that chose each expert.
    coactivation : array_like of int, shape [E, E]
        ``coactivation[a, b]``: number of tokens that chose both ``a`` and ``b``. Symmetric;
        the diagonal equals ``counts``.
    tokens : int
        Number of routed tokens (summed over layers when statistics of several layers are
        merged).

    Raises
    ------
    TypeError, ValueError
        A field has the wrong type, shape or sign, the matrix is not symmetric, its diagonal
        differs from ``counts``, or a count exceeds ``tokens`` (or a pair count exceeds either
        expert's count).
    """

    __slots__ = ("_coactivation", "_counts", "_tokens")

    def __init__(self, counts: object, coactivation: object, tokens: int) -> None:
        counts_ = _integer_array(counts, "counts", 1)
        co = _integer_array(coactivation, "coactivation", 2)
        e = counts_.shape[0]
        if e == 0:
            raise ValueError("UsageStats: counts is empty; statistics need at least one expert")
        if co.shape != (e, e):
            raise ValueError(
                f"UsageStats: coactivation must have shape [E, E] = ({e}, {e}) to match counts "
                f"(got {co.shape})"
            )
        if isinstance(tokens, (bool, np.bool_)) or not isinstance(tokens, (int, np.integer)):
            raise TypeError(f"UsageStats: tokens must be an int (got {type(tokens).__name__})")
        tokens = int(tokens)
        if tokens < 0:
            raise ValueError(f"UsageStats: tokens must not be negative (got {tokens})")
        if not np.array_equal(co, co.T):
            a, b = np.argwhere(co != co.T)[0]
            raise ValueError(
                f"UsageStats: coactivation must be symmetric (entry [{a}, {b}] = {co[a, b]} but "
                f"[{b}, {a}] = {co[b, a]})"
            )
        diagonal = np.diagonal(co)
        if not np.array_equal(diagonal, counts_):
            e_bad = int(np.flatnonzero(diagonal != counts_)[0])
            raise ValueError(
                f"UsageStats: coactivation's diagonal must equal counts (expert {e_bad}: "
                f"{diagonal[e_bad]} vs {counts_[e_bad]})"
            )
        if counts_.max() > tokens:
            e_bad = int(np.argmax(counts_))
            raise ValueError(
                f"UsageStats: expert {e_bad} was counted {counts_[e_bad]} times but only "
                f"{tokens} tokens were routed"
            )
        bound = np.minimum(counts_[:, None], counts_[None, :])
        if np.any(co > bound):
            a, b = np.argwhere(co > bound)[0]
            raise ValueError(
                f"UsageStats: experts {a} and {b} were chosen together {co[a, b]} times, more "
                f"than one of them was chosen at all"
            )
        self._counts = counts_
        self._coactivation = co
        self._tokens = tokens

    # -- reading -------------------------------------------------------------------------------

    @property
    def counts(self) -> np.ndarray:
        """Selections per expert, ``[E]`` int64 (read-only)."""
        return self._counts

    @property
    def coactivation(self) -> np.ndarray:
        """Tokens that chose both experts, ``[E, E]`` int64, symmetric (read-only)."""
        return self._coactivation

    @property
    def tokens(self) -> int:
        """Number of routed tokens."""
        return self._tokens

    @property
    def num_experts(self) -> int:
        """Number of experts ``E``."""
        return int(self._counts.shape[0])

    @property
    def frequency(self) -> np.ndarray:
        """Share of tokens that chose each expert, ``[E]`` float64 (zeros when no tokens)."""
        return self._counts / max(self._tokens, 1)

    def __repr__(self) -> str:
        return (
            f"UsageStats(num_experts={self.num_experts}, tokens={self._tokens}, "
            f"selections={int(self._counts.sum())})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, UsageStats):
            return NotImplemented
        return (
            self._tokens == other._tokens
            and np.array_equal(self._counts, other._counts)
            and np.array_equal(self._coactivation, other._coactivation)
        )

    __hash__ = None  # type: ignore[assignment]

    # -- building ------------------------------------------------------------------------------

    @classmethod
    def empty(cls, num_experts: int) -> UsageStats:
        """Statistics of zero tokens for ``num_experts`` experts."""
        if isinstance(num_experts, bool) or not isinstance(num_experts, (int, np.integer)):
            raise TypeError(f"UsageStats.empty: num_experts must be an int (got {num_experts!r})")
        if num_experts < 1:
            raise ValueError(f"UsageStats.empty: num_experts must be >= 1 (got {num_experts})")
        n = int(num_experts)
        return cls(np.zeros(n, np.int64), np.zeros((n, n), np.int64), 0)

    @classmethod
    def from_ids(cls, ids: object, num_experts: int) -> UsageStats:
        """Count the routed expert ids of ``T`` tokens.

        Parameters
        ----------
        ids : array_like of int, shape [T, k] (or [k] for one token)
            The experts chosen for each token, as ``ctx.route`` returns them. Any object
            ``np.asarray`` accepts (torch CPU tensors included).
        num_experts : int
            ``E``; every id must lie in ``[0, E)``.

        Raises
        ------
        ValueError
            An id is out of range, or a token lists the same expert twice.
        """
        empty = cls.empty(num_experts)
        e = empty.num_experts
        ids_ = np.asarray(ids)
        if ids_.dtype == np.bool_ or not np.issubdtype(ids_.dtype, np.integer):
            raise TypeError(f"UsageStats.from_ids: ids must be integers (got dtype {ids_.dtype})")
        if ids_.ndim == 1:
            ids_ = ids_[None, :]
        if ids_.ndim != 2:
            raise ValueError(f"UsageStats.from_ids: ids must be [T, k] (got shape {ids_.shape})")
        t, k = ids_.shape
        if t == 0 or k == 0:
            return cls(empty.counts, empty.coactivation, t)
        low, high = int(ids_.min()), int(ids_.max())
        if low < 0 or high >= e:
            bad = low if low < 0 else high
            raise ValueError(
                f"UsageStats.from_ids: expert id {bad} is out of range for num_experts={e}"
            )
        ids_ = ids_.astype(np.intp, copy=False)
        if k > 1:
            ordered = np.sort(ids_, axis=1)
            repeated = np.any(ordered[:, 1:] == ordered[:, :-1], axis=1)
            if repeated.any():
                row = int(np.flatnonzero(repeated)[0])
                raise ValueError(
                    f"UsageStats.from_ids: token {row} lists an expert twice ({ids_[row].tolist()})"
                )
        counts = np.bincount(ids_.ravel(), minlength=e).astype(np.int64)
        pairs = np.zeros(e * e, np.int64)
        first, second = np.triu_indices(k, 1)
        for start in range(0, t, _CHUNK_TOKENS):
            chunk = ids_[start : start + _CHUNK_TOKENS]
            pairs += np.bincount((chunk[:, first] * e + chunk[:, second]).ravel(), minlength=e * e)
        upper = pairs.reshape(e, e)
        co = upper + upper.T
        co[np.diag_indices(e)] = counts
        return cls(counts, co, t)

    def merge(self, *others: UsageStats) -> UsageStats:
        """Statistics of all tokens of ``self`` and ``others`` together (runs or layers)."""
        total = self
        for other in others:
            total = total + other
        return total

    def __add__(self, other: object) -> UsageStats:
        if not isinstance(other, UsageStats):
            return NotImplemented
        if other.num_experts != self.num_experts:
            raise ValueError(
                f"UsageStats: cannot merge statistics of {self.num_experts} and "
                f"{other.num_experts} experts"
            )
        return UsageStats(
            self._counts + other._counts,
            self._coactivation + other._coactivation,
            self._tokens + other._tokens,
        )

    @classmethod
    def sum(cls, stats: Iterable[UsageStats]) -> UsageStats:
        """Merge an iterable of statistics (at least one)."""
        items = list(stats)
        if not items:
            raise ValueError("UsageStats.sum: nothing to merge (got an empty iterable)")
        return items[0].merge(*items[1:])

    # -- files ---------------------------------------------------------------------------------

    def save(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> None:
        """Write to ``path`` atomically: ``.npz`` or ``.json`` by suffix.

        Raises
        ------
        FileExistsError
            ``path`` exists and ``overwrite`` is false.
        ValueError
            The suffix is neither ``.npz`` nor ``.json``.
        """
        kind = _kind(path, "save")
        if kind == "json":
            document = {
                "format": _FORMAT,
                "version": _VERSION,
                "num_experts": self.num_experts,
                "tokens": self._tokens,
                "counts": self._counts.tolist(),
                "coactivation": self._coactivation.tolist(),
            }
            payload = json.dumps(document, separators=(",", ":")).encode()
            write_atomically(path, lambda f: f.write(payload), overwrite=overwrite)
        else:
            arrays = {
                "format": np.array(_FORMAT),
                "version": np.array(_VERSION, np.int64),
                "tokens": np.array(self._tokens, np.int64),
                "counts": self._counts,
                "coactivation": self._coactivation,
            }
            write_atomically(path, lambda f: np.savez_compressed(f, **arrays), overwrite=overwrite)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> UsageStats:
        """Read statistics saved by :meth:`save`, validating every field.

        Raises
        ------
        ValueError
            The file is not colibri usage statistics or its contents are inconsistent; the
            message names the file and the field.
        """
        kind = _kind(path, "load")
        name = os.fspath(path)
        fields = _read_json(name) if kind == "json" else _read_npz(name)
        try:
            if fields.get("format") != _FORMAT:
                raise ValueError(
                    f"not colibri usage statistics (format {_json.show(fields.get('format'))})"
                )
            if fields.get("version") != _VERSION:
                raise ValueError(
                    f"unsupported version {_json.show(fields.get('version'))} (this colibri "
                    f"reads {_VERSION})"
                )
            for key in ("counts", "coactivation", "tokens"):
                if key not in fields:
                    raise ValueError(f"field {key!r} is missing")
            counts = np.asarray(fields["counts"])
            if counts.dtype == object or counts.dtype.kind not in "iu":
                raise ValueError("field 'counts' must hold integers")
            tokens = fields["tokens"]
            if isinstance(tokens, np.ndarray):
                if tokens.shape != () or not np.issubdtype(tokens.dtype, np.integer):
                    raise ValueError("field 'tokens' must be one integer")
                tokens = int(tokens)
            stats = cls(counts, _matrix(fields["coactivation"]), tokens)
            if "num_experts" in fields and fields["num_experts"] != stats.num_experts:
                raise ValueError(
                    f"num_experts is {_json.show(fields['num_experts'])} but counts has "
                    f"{stats.num_experts} entries"
                )
        except FormatError:
            raise
        except (ValueError, TypeError) as error:
            message = str(error).removeprefix("UsageStats: ")
            raise FormatError(f"{name}: invalid usage statistics: {message}") from None
        return stats


def _kind(path: str | os.PathLike[str], verb: str) -> str:
    suffix = os.path.splitext(os.fspath(path))[1].lower()
    if suffix not in (".npz", ".json"):
        raise ValueError(
            f"UsageStats.{verb}: {os.fspath(path)!r} must end in .npz or .json (got {suffix!r})"
        )
    return suffix[1:]


def _read_json(name: str) -> dict:
    what = "the usage statistics"
    document = _json.mapping(_json.load(name, what=what), name, what)
    for key in ("tokens", "num_experts"):
        if key in document:
            _json.integer(document[key], name, key)
    if "counts" in document:
        _json.int_list(document["counts"], name, "counts", min_len=1, max_len=_MAX_EXPERTS)
        rows = _json.sequence(document.get("coactivation"), name, "coactivation")
        for i, row in enumerate(rows):
            _json.int_list(row, name, f"coactivation[{i}]", max_len=_MAX_EXPERTS)
    return document


def _read_npz(name: str) -> dict:
    try:
        with open(name, "rb") as f, zipfile.ZipFile(f) as archive:
            declared = sum(info.file_size for info in archive.infolist())
            if declared > _MAX_NPZ_BYTES:
                raise FormatError(
                    f"{name}: the archive unpacks to {declared} bytes, more than the "
                    f"{_MAX_NPZ_BYTES} allowed"
                )
            for info in archive.infolist():
                if info.flag_bits & 0x1:  # zipfile would raise RuntimeError, wanting a password
                    raise FormatError(
                        f"{name}: member {info.filename!r} is marked encrypted; UsageStats.save "
                        "writes plain archives, so the file is corrupt or not colibri's"
                    )
                _check_member(name, archive, info)
            f.seek(0)
            with np.load(f, allow_pickle=False) as npz:
                fields = {key: npz[key] for key in npz.files}
    except FormatError:
        raise
    except FileNotFoundError:
        raise
    except (OSError, zipfile.BadZipFile, EOFError, ValueError, zlib.error, struct.error,
            NotImplementedError) as error:  # fmt: skip
        raise FormatError(f"{name}: not a readable .npz archive ({error})") from None
    for key in ("format", "version"):
        if key in fields:
            value = fields[key]
            fields[key] = value.item() if value.shape == () else value.tolist()
    return fields


def _check_member(name: str, archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> None:
    """Refuse an .npy member whose header claims more data than the member holds."""
    with archive.open(info) as member:
        version = np.lib.format.read_magic(member)
        if version not in ((1, 0), (2, 0)):
            raise ValueError(f"member {info.filename!r} has .npy version {version}")
        read = (
            np.lib.format.read_array_header_1_0
            if version == (1, 0)
            else (np.lib.format.read_array_header_2_0)
        )
        shape, _, dtype = read(member)
    if dtype.hasobject or np.prod(shape, dtype=object) * dtype.itemsize > info.file_size:
        raise FormatError(
            f"{name}: member {info.filename!r} declares {dtype} {list(shape)}, more than its "
            f"{info.file_size} bytes hold (or objects, which are never loaded)"
        )


def _matrix(value: object) -> np.ndarray:
    if (
        isinstance(value, list)
        and value
        and not all(isinstance(row, list) and len(row) == len(value) for row in value)
    ):
        raise ValueError("field 'coactivation' must be a square list of lists")
    matrix = np.asarray(value)
    if matrix.dtype == object or matrix.dtype.kind == "f":
        raise ValueError("field 'coactivation' must hold integers")
    return matrix
