"""What every rank checks at start, before any weight is read: one colibri version, one
model, one placement, and the experts each rank owns identical to rank 0's copy."""

from __future__ import annotations

import torch.distributed as dist

from colibri.distributed._fingerprint import fingerprint
from colibri.distributed._options import ExpertParallel
from colibri.distributed._placement import Placement, place
from colibri.distributed._wire import DistributedError

__all__ = ["agree", "problems"]


def problems(infos: list[dict], expected: dict[int, dict] | None = None) -> list[str]:
    """Why the ranks' ``infos`` (rank order; ``version``, ``layers`` ``{layer: E}``,
    ``fingerprints`` ``{(layer, e): digest}`` of the experts each owns) cannot work together,
    against rank 0's ``expected`` fingerprints of each rank's experts; empty when they can."""
    found = []
    first = infos[0]
    for rank, info in enumerate(infos[1:], start=1):
        if info["version"] != first["version"]:
            found.append(
                f"rank {rank} runs colibri {info['version']} but rank 0 runs "
                f"{first['version']}; fix: install one colibri version on every machine"
            )
        elif info["layers"] != first["layers"]:
            found.append(
                f"rank {rank}'s checkpoint has other MoE layers or expert counts than rank "
                "0's; fix: give every rank a copy of the same checkpoint"
            )
        elif expected is not None:
            bad = sorted(k for k, v in expected[rank].items() if info["fingerprints"].get(k) != v)
            if bad:
                shown = ", ".join(f"layer {layer} expert {e}" for layer, e in bad[:4])
                more = f" and {len(bad) - 4} more" if len(bad) > 4 else ""
                found.append(
                    f"rank {rank}'s checkpoint differs from rank 0's in the experts it owns "
                    f"({shown}{more}: size, dtype or bytes); fix: give every rank a copy of "
                    "the same checkpoint"
                )
    return found


def _raise(found: list[str]) -> None:
    if found:
        raise DistributedError("expert parallel: refused at start: " + "; ".join(found))


def agree(group, rank: int, world: int, opts: ExpertParallel, source, layers, budget: int,
          capacity: int):  # fmt: skip
    """Exchange and check what the ranks hold, then the placement rank 0 decides (``budget``
    bytes and ``capacity`` experts: this rank's pager's); every rank raises the same
    :class:`DistributedError` on a mismatch. Returns the :class:`Placement`."""
    import colibri

    info = {"version": colibri.__version__, "layers": dict(layers), "budget": int(budget),
            "capacity": int(capacity)}  # fmt: skip
    infos: list = [None] * world
    dist.all_gather_object(infos, info, group=group)
    found = problems([{**i, "fingerprints": {}} for i in infos])
    placement = None
    if rank == 0 and not found:
        try:
            placement = _placement(opts, layers, infos, world)
        except (ValueError, OSError) as exc:
            found = [f"rank 0: {exc}"]
    shared = [found, placement.to_dict() if placement is not None else None]
    dist.broadcast_object_list(shared, src=dist.get_global_rank(group, 0), group=group)
    _raise(shared[0])
    placement = Placement.from_dict(shared[1])
    owned = [(layer, int(e)) for layer, ids in placement.experts_of(rank).items() for e in ids]
    info["fingerprints"] = fingerprint(source, owned)
    dist.all_gather_object(infos, info, group=group)
    if rank == 0:
        expected = {}
        for r in range(1, world):
            keys = [(layer, int(e)) for layer, ids in placement.experts_of(r).items() for e in ids]
            expected[r] = fingerprint(source, keys)
        found = problems(infos, expected)
    verdict = [found]
    dist.broadcast_object_list(verdict, src=dist.get_global_rank(group, 0), group=group)
    _raise(verdict[0])
    return placement


def _placement(opts: ExpertParallel, layers: dict, infos: list[dict], world: int) -> Placement:
    """The options' placement (loaded and checked against the model), else :func:`place`
    from the ranks' budgets and capacities."""
    chosen = opts.placement
    if chosen is None:
        budgets, capacities = [i["budget"] for i in infos], [i["capacity"] for i in infos]
        return place(layers, budgets, opts.usage, capacities)
    if not isinstance(chosen, Placement):
        chosen = Placement.load_file(chosen)
    if chosen.num_ranks != world:
        raise ValueError(f"the placement is for {chosen.num_ranks} ranks, this group has {world}")
    for layer, e in layers.items():
        if layer not in chosen.layers or chosen.owners(layer).size != e:
            raise ValueError(
                f"the placement does not place layer {layer}'s {e} experts; fix: make one for "
                "this model (colibri.distributed.place)"
            )
    return chosen
