"""Which rank owns which expert of each layer: :class:`Placement` and :func:`place`.

Each layer's experts are dealt to the ranks so that every rank's expected load (the tokens
routed to its experts, from :class:`colibri.UsageStats` counts, uniform without them) is
proportional to its budget, and so is the number of experts it holds: greedy, hottest expert
first, to the rank whose load after taking it is the smallest share of its budget, among the
ranks that still have room (``ceil(E * budget share)`` experts a layer). Deterministic: ties go
to the lower expert id and the lower rank.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence

import numpy as np

from colibri import _json
from colibri._atomic_file import write_atomically
from colibri._errors import FormatError
from colibri._regular import read_regular

__all__ = ["Placement", "place"]

_FORMAT = "colibri.Placement"
_VERSION = 1


class Placement:
    """The owner rank of every expert of every paged layer.

    Parameters
    ----------
    owners : mapping
        ``{layer: [rank of expert 0, rank of expert 1, ...]}`` (int ranks in
        ``[0, num_ranks)``).
    num_ranks : int
        Ranks of the group (every rank need not own experts).

    Raises
    ------
    ValueError
        A rank outside ``[0, num_ranks)``, or a layer without experts.
    """

    __slots__ = ("_owners", "num_ranks")

    def __init__(self, owners: Mapping[int, Sequence[int]], num_ranks: int) -> None:
        if type(num_ranks) is not int or num_ranks < 1:
            raise ValueError(f"Placement: num_ranks must be an int >= 1 (got {num_ranks!r})")
        self.num_ranks = num_ranks
        self._owners: dict[int, np.ndarray] = {}
        for layer, ranks in sorted(owners.items()):
            arr = np.asarray(ranks, dtype=np.int64)
            if arr.ndim != 1 or arr.size == 0:
                raise ValueError(f"Placement: layer {layer} must list one rank per expert")
            bad = np.flatnonzero((arr < 0) | (arr >= num_ranks))
            if bad.size:
                raise ValueError(
                    f"Placement: layer {layer} expert {int(bad[0])} goes to rank "
                    f"{int(arr[bad[0]])}, outside the {num_ranks} ranks"
                )
            self._owners[int(layer)] = arr

    @property
    def layers(self) -> tuple[int, ...]:
        """The layers placed, ascending."""
        return tuple(self._owners)

    def owners(self, layer: int) -> np.ndarray:
        """``[E]`` int64: the rank of each expert of ``layer``."""
        return self._owners[layer]

    def experts_of(self, rank: int) -> dict[int, np.ndarray]:
        """``{layer: ascending expert ids}`` that ``rank`` owns."""
        return {layer: np.flatnonzero(o == rank) for layer, o in self._owners.items()}

    def expected_load(self, usage: Mapping[int, np.ndarray] | None = None) -> np.ndarray:
        """``[num_ranks]`` float64: each rank's share of the routed tokens (``usage``:
        ``{layer: counts [E]}``; uniform without it), summed over the layers."""
        total = np.zeros(self.num_ranks)
        for layer, o in self._owners.items():
            counts = _counts(usage, layer, o.size)
            total += np.bincount(o, weights=counts, minlength=self.num_ranks)
        return total

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Placement)
            and self.num_ranks == other.num_ranks
            and self._owners.keys() == other._owners.keys()
            and all(np.array_equal(v, other._owners[k]) for k, v in self._owners.items())
        )

    def __repr__(self) -> str:
        held = [sum(len(e) for e in self.experts_of(r).values()) for r in range(self.num_ranks)]
        return f"Placement(num_ranks={self.num_ranks}, layers={len(self._owners)}, experts={held})"

    def to_dict(self) -> dict:
        """The JSON document :meth:`save` writes."""
        return {
            "format": _FORMAT,
            "version": _VERSION,
            "num_ranks": self.num_ranks,
            "layers": {str(layer): o.tolist() for layer, o in self._owners.items()},
        }

    def save(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> None:
        """Write the placement as JSON, atomically.

        Raises
        ------
        FileExistsError
            ``path`` exists and ``overwrite`` is false.
        """
        payload = (json.dumps(self.to_dict()) + "\n").encode()
        write_atomically(path, lambda f: f.write(payload), overwrite=overwrite)

    @classmethod
    def load_file(cls, path: str | os.PathLike[str]) -> Placement:
        """Read a placement :meth:`save` wrote.

        Raises
        ------
        FormatError
            (a ``ValueError``) Not a colibri placement, not strict JSON, or inconsistent; the
            message names the file and the key.
        """
        name = os.fspath(path)
        document = _json.parse(
            read_regular(name, "the placement", _json.MAX_BYTES), name, what="the placement"
        )
        try:
            if not isinstance(document, dict) or document.get("format") != _FORMAT:
                raise ValueError(f"not a colibri placement (missing 'format': {_FORMAT!r})")
            if document.get("version") != _VERSION:
                raise ValueError(
                    f"unsupported version {_json.show(document.get('version'))} (this colibri "
                    f"reads {_VERSION})"
                )
            num_ranks = _json.integer(
                _json.field(document, "num_ranks", name), name, "num_ranks", lo=1, hi=1 << 20
            )
            layers = _json.mapping(_json.field(document, "layers", name), name, "layers")
            owners = {}
            for key, ranks in layers.items():
                if not key.isdigit():
                    raise ValueError(f"layer key {key!r} is not a layer index")
                owners[int(key)] = _json.int_list(
                    ranks, name, f"layers[{key}]", hi=num_ranks - 1, min_len=1
                )
            return cls(owners, num_ranks)
        except FormatError:
            raise
        except ValueError as error:
            message = str(error).removeprefix("Placement: ")
            raise FormatError(f"{name}: invalid placement: {message}") from None


def _counts(usage: Mapping[int, np.ndarray] | None, layer: int, num_experts: int) -> np.ndarray:
    """Layer ``layer``'s expected load per expert: its usage counts, else uniform (ones)."""
    if usage is None or layer not in usage:
        return np.ones(num_experts)
    counts = getattr(usage[layer], "counts", usage[layer])  # UsageStats or an array
    counts = np.asarray(counts, dtype=np.float64)
    if counts.shape != (num_experts,) or not np.isfinite(counts).all() or (counts < 0).any():
        raise ValueError(
            f"place(): usage of layer {layer} must be {num_experts} non-negative counts (got "
            f"shape {counts.shape})"
        )
    return counts


def place(
    num_experts: Mapping[int, int],
    budgets: Sequence[int],
    usage: Mapping[int, object] | None = None,
) -> Placement:
    """Deal each layer's experts to the ranks, balancing expected load against budgets.

    Parameters
    ----------
    num_experts : mapping
        ``{layer: E}`` of every paged layer.
    budgets : sequence of int
        Each rank's expert budget in bytes (rank order); a rank with budget 0 owns nothing.
    usage : mapping, optional
        ``{layer: UsageStats or counts [E]}``: how often each expert was routed to (a
        calibration run, a previous run); uniform for the layers it lacks.

    Returns
    -------
    Placement
        Each rank's load (``sum counts``) and expert count in a layer close to its budget
        share.

    Raises
    ------
    ValueError
        No rank with a positive budget, or usage counts that do not fit a layer.
    """
    share = np.asarray([max(int(b), 0) for b in budgets], dtype=np.float64)
    if share.size == 0 or share.sum() <= 0:
        raise ValueError(f"place(): budgets must hold a positive budget (got {list(budgets)})")
    share /= share.sum()
    owners = {}
    for layer, e in sorted(num_experts.items()):
        counts = _counts(usage, layer, int(e))
        room = np.asarray([math.ceil(int(e) * s - 1e-9) for s in share], dtype=np.int64)
        load = np.zeros(share.size)
        held = np.zeros(share.size, dtype=np.int64)
        mine = np.empty(int(e), dtype=np.int64)
        scale = np.divide(1.0, share, out=np.full(share.size, np.inf), where=share > 0)
        for expert in np.argsort(-counts, kind="stable"):
            after = np.where((held < room) & (share > 0), (load + counts[expert]) * scale, np.inf)
            if np.isinf(after).all():  # pragma: no cover - sum(room) >= E by the ceiling
                after = np.where(share > 0, load * scale, np.inf)
            # least loaded share first, then the rank holding the smallest share of its room
            rank = int(np.lexsort((np.arange(share.size), held / np.maximum(room, 1), after))[0])
            mine[expert] = rank
            load[rank] += counts[expert]
            held[rank] += 1
        owners[layer] = mine
    return Placement(owners, len(budgets))
