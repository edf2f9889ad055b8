"""Which rank owns which expert of each layer: :class:`Placement` and :func:`place`.

Each layer's experts are dealt to the ranks so that every rank's expected load (the tokens
routed to its experts, from :class:`colibri.UsageStats` counts, uniform without them) is
proportional to its budget, and so is the number of experts it holds: greedy, hottest expert
first, to the rank whose load after taking it is the smallest share of its budget, among the
ranks that still have room (``ceil(E * budget share)`` experts a layer). Where a rank's budget
holds more experts than it owns (``capacities``), hot experts get replicas there (EPLB's
idea): the expert whose load per copy is highest first, while that load is above the layer's
mean per expert, each copy to the least loaded rank with room; rank 0 then sends each step's
rows of a replicated expert to one of its holders (:meth:`Placement.route`). Deterministic:
ties go to the lower expert id and the lower rank.
"""

from __future__ import annotations

import heapq
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
    """The owner rank of every expert of every paged layer, and the replicas of hot ones.

    Parameters
    ----------
    owners : mapping
        ``{layer: [rank of expert 0, rank of expert 1, ...]}`` (int ranks in
        ``[0, num_ranks)``).
    num_ranks : int
        Ranks of the group (every rank need not own experts).
    replicas : mapping, optional
        ``{layer: {expert: [other ranks holding a copy]}}`` (not the owner, no rank twice).

    Raises
    ------
    ValueError
        A rank outside ``[0, num_ranks)``, a layer without experts, or a replica that is not
        another rank's copy of an expert of the layer.
    """

    __slots__ = ("_owners", "_replicas", "num_ranks")

    def __init__(
        self,
        owners: Mapping[int, Sequence[int]],
        num_ranks: int,
        replicas: Mapping[int, Mapping[int, Sequence[int]]] | None = None,
    ) -> None:
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
        self._replicas: dict[int, dict[int, tuple[int, ...]]] = {}
        for layer, copies in sorted((replicas or {}).items()):
            o = self._owners.get(int(layer))
            for expert, ranks in sorted(copies.items()):
                ranks = tuple(int(r) for r in ranks)
                if o is None or not 0 <= int(expert) < o.size:
                    raise ValueError(f"Placement: replicas of layer {layer} expert {expert}, "
                                     "which the placement does not place")  # fmt: skip
                if (len(set(ranks)) != len(ranks) or int(o[expert]) in ranks
                        or any(not 0 <= r < num_ranks for r in ranks)):  # fmt: skip
                    raise ValueError(
                        f"Placement: replicas {list(ranks)} of layer {layer} expert {expert} "
                        f"must be other ranks than its owner {int(o[expert])}, each once, in "
                        f"[0, {num_ranks})"
                    )
                if ranks:
                    self._replicas.setdefault(int(layer), {})[int(expert)] = ranks

    @property
    def layers(self) -> tuple[int, ...]:
        """The layers placed, ascending."""
        return tuple(self._owners)

    def owners(self, layer: int) -> np.ndarray:
        """``[E]`` int64: the rank of each expert of ``layer``."""
        return self._owners[layer]

    def replicas(self, layer: int) -> dict[int, tuple[int, ...]]:
        """``{expert: ranks other than its owner holding a copy}`` of ``layer``."""
        return dict(self._replicas.get(layer, {}))

    def holders(self, layer: int) -> np.ndarray:
        """``[E, num_ranks]`` bool: which ranks hold each expert of ``layer`` (owner and
        replicas)."""
        o = self._owners[layer]
        held = np.zeros((o.size, self.num_ranks), bool)
        held[np.arange(o.size), o] = True
        for expert, ranks in self._replicas.get(layer, {}).items():
            held[expert, list(ranks)] = True
        return held

    def experts_of(self, rank: int) -> dict[int, np.ndarray]:
        """``{layer: ascending expert ids}`` that ``rank`` holds (owns or has a copy of)."""
        return {layer: np.flatnonzero(self.holders(layer)[:, rank]) for layer in self._owners}

    def route(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """``[N]`` int64: the rank that computes each of a step's rows, given their experts
        ``[N]``: the owner, or for a replicated expert the holder with the fewest rows so
        far (every row of one expert to one rank, as one process computes them; replicated
        experts by falling row count, then id; ties to the lower rank). Deterministic."""
        ranks = self._owners[layer][experts]
        copies = self._replicas.get(layer)
        if not copies:
            return ranks
        unique, counts = np.unique(experts, return_counts=True)
        spread = [(-int(c), int(e)) for e, c in zip(unique, counts, strict=True) if e in copies]
        load = np.bincount(ranks[~np.isin(experts, list(copies))], minlength=self.num_ranks)
        for minus_rows, expert in sorted(spread):
            held = (int(self._owners[layer][expert]), *copies[expert])
            rank = min(held, key=lambda r: (load[r], r))
            ranks[experts == expert] = rank
            load[rank] -= minus_rows
        return ranks

    def expected_load(self, usage: Mapping[int, np.ndarray] | None = None) -> np.ndarray:
        """``[num_ranks]`` float64: each rank's share of the routed tokens (``usage``:
        ``{layer: counts [E]}``; uniform without it; a replicated expert's split evenly
        over its holders), summed over the layers."""
        total = np.zeros(self.num_ranks)
        for layer, o in self._owners.items():
            held = self.holders(layer)
            counts = _counts(usage, layer, o.size) / held.sum(axis=1)
            total += counts @ held
        return total

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Placement)
            and self.num_ranks == other.num_ranks
            and self._owners.keys() == other._owners.keys()
            and all(np.array_equal(v, other._owners[k]) for k, v in self._owners.items())
            and self._replicas == other._replicas
        )

    def __repr__(self) -> str:
        held = [sum(len(e) for e in self.experts_of(r).values()) for r in range(self.num_ranks)]
        copies = sum(len(r) for c in self._replicas.values() for r in c.values())
        return (
            f"Placement(num_ranks={self.num_ranks}, layers={len(self._owners)}, experts={held}, "
            f"replicas={copies})"
        )

    def to_dict(self) -> dict:
        """The JSON document :meth:`save` writes."""
        document = {
            "format": _FORMAT,
            "version": _VERSION,
            "num_ranks": self.num_ranks,
            "layers": {str(layer): o.tolist() for layer, o in self._owners.items()},
        }
        if self._replicas:
            document["replicas"] = {
                str(layer): {str(e): list(r) for e, r in copies.items()}
                for layer, copies in self._replicas.items()
            }
        return document

    @classmethod
    def from_dict(cls, document: dict) -> Placement:
        """The placement :meth:`to_dict` described (ValueError when inconsistent)."""
        replicas = {
            int(layer): {int(e): r for e, r in copies.items()}
            for layer, copies in document.get("replicas", {}).items()
        }
        owners = {int(k): v for k, v in document["layers"].items()}
        return cls(owners, document["num_ranks"], replicas)

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
            replicas = {}
            found = _json.field(document, "replicas", name, required=False, default={})
            for key, copies in _json.mapping(found, name, "replicas").items():
                copies = _json.mapping(copies, name, f"replicas[{key}]")
                if not key.isdigit() or not all(e.isdigit() for e in copies):
                    raise ValueError(f"replicas key {key!r} or its experts are not indices")
                replicas[int(key)] = {
                    int(e): _json.int_list(r, name, f"replicas[{key}][{e}]", hi=num_ranks - 1)
                    for e, r in copies.items()
                }
            return cls(owners, num_ranks, replicas)
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
    capacities: Sequence[int] | None = None,
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
    capacities : sequence of int, optional
        How many experts each rank's budget holds (``Pager.capacity``). A rank that holds
        more than it owns gets replicas of the hot experts of the layers with ``usage``
        (see the module's docstring); without capacities, no replicas.

    Returns
    -------
    Placement
        Each rank's load (``sum counts``, a replicated expert's split over its copies) and
        expert count in a layer close to its budget share.

    Raises
    ------
    ValueError
        No rank with a positive budget, usage counts that do not fit a layer, or
        capacities that are not one count per rank.
    """
    share = np.asarray([max(int(b), 0) for b in budgets], dtype=np.float64)
    if share.size == 0 or share.sum() <= 0:
        raise ValueError(f"place(): budgets must hold a positive budget (got {list(budgets)})")
    share /= share.sum()
    scale = np.divide(1.0, share, out=np.full(share.size, np.inf), where=share > 0)
    layers = sorted((int(layer), int(e)) for layer, e in num_experts.items())
    counts = {layer: _counts(usage, layer, e) for layer, e in layers}
    rooms = {layer: np.asarray([math.ceil(e * s - 1e-9) for s in share], dtype=np.int64)
             for layer, e in layers}  # fmt: skip
    copies = {layer: np.ones(e, dtype=np.int64) for layer, e in layers}
    spare = np.zeros(share.size, dtype=np.int64)
    if capacities is not None:
        if len(capacities) != share.size:
            raise ValueError(
                f"place(): capacities must give one count per rank ({share.size}), got "
                f"{len(capacities)}"
            )
        spare = np.asarray([int(c) for c in capacities], dtype=np.int64) - sum(rooms.values())
        spare = np.where(share > 0, np.maximum(spare, 0), 0)
        hot = [layer for layer, _ in layers if usage is not None and layer in usage]
        _add_copies({layer: counts[layer] for layer in hot}, copies, int(spare.sum()),
                    int((share > 0).sum()))  # fmt: skip
    owners, replicas = {}, {}
    for layer, e in layers:
        c, n, room = counts[layer], copies[layer], rooms[layer]
        load = np.zeros(share.size)
        held = np.zeros(share.size, dtype=np.int64)
        mine = np.empty(e, dtype=np.int64)
        for expert in np.argsort(-(c / n), kind="stable"):
            has: list[int] = []
            for copy in range(int(n[expert])):
                free = (held < room) if copy == 0 else (spare > 0)
                after = np.where(free & (share > 0), (load + c[expert] / n[expert]) * scale,
                                 np.inf)  # fmt: skip
                after[has] = np.inf
                if np.isinf(after).all():
                    if copy:  # no rank with memory to spare left for this copy
                        break
                    after = np.where(share > 0, load * scale, np.inf)  # pragma: no cover
                # least loaded share first, then the rank holding the smallest share of its
                # room, then the lower rank
                rank = int(np.lexsort((np.arange(share.size), held / np.maximum(room, 1),
                                       after))[0])  # fmt: skip
                has.append(rank)
                if copy:
                    spare[rank] -= 1
            mine[expert] = has[0]
            held[has[0]] += 1
            load[has] += c[expert] / len(has)
            if len(has) > 1:
                replicas.setdefault(layer, {})[int(expert)] = has[1:]
        owners[layer] = mine
    return Placement(owners, len(budgets), replicas)


def _add_copies(hot: dict, copies: dict, extra: int, most: int) -> None:
    """Give ``extra`` more copies to the experts of ``hot`` (``{layer: counts}``), one at a
    time to the expert whose load per copy is highest (ties: lower layer, lower id), while it
    is above its layer's mean per expert and has fewer than ``most`` copies."""
    queue = [(-c[e], layer, e) for layer, c in hot.items() for e in range(c.size)]
    heapq.heapify(queue)
    while queue and extra > 0:
        minus, layer, e = heapq.heappop(queue)
        c = hot[layer]
        if -minus <= c.sum() / c.size or copies[layer][e] >= most:
            continue  # not hot (it will not get hotter per copy), or on every rank already
        copies[layer][e] += 1
        extra -= 1
        heapq.heappush(queue, (-c[e] / copies[layer][e], layer, e))
