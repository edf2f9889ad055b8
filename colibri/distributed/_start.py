"""Starting an expert-parallel model: join the group, agree, then serve or drive."""

from __future__ import annotations

from colibri.distributed._client import Remote
from colibri.distributed._group import join
from colibri.distributed._handshake import agree
from colibri.distributed._options import options
from colibri.distributed._serve import serve
from colibri.distributed._wire import DistributedError

__all__ = ["start"]


def start(value, pager, layers: dict, source, *, num_threads: int, read_ahead: str):
    """What ``from_pretrained(..., expert_parallel=value)`` does once the pager is open:
    rank 0 gets the :class:`Remote` that computes its experts modules; every other rank
    serves rank 0 until it closes its model, then gets None. ``layers``: ``{layer: (E,
    torch path, fused kernel's activation)}``, None for a layer computed its own way.

    Raises
    ------
    DistributedError
        No group, a layer colibri cannot spread, a mismatch between the ranks (version,
        checkpoint, placement) or a rank gone; raised on every rank that is still there.
    """
    opts = options(value)
    own = sorted(layer for layer, how in layers.items() if how is None)
    if own:
        raise DistributedError(
            f"expert parallel: the experts of layer {own[0]} are computed their own way "
            "(gpt-oss: biases, clamped activation), which colibri does not spread over ranks "
            "yet; load this model without expert_parallel"
        )
    group, rank, world = join(opts.group, opts.start_timeout)
    counts = {layer: how[0] for layer, how in layers.items()}
    placement = agree(group, rank, world, opts, source, counts, pager.budget_bytes,
                      pager.capacity)  # fmt: skip
    if rank == 0:
        return Remote(group, world, placement, opts.timeout, layers, pager, num_threads,
                      read_ahead != "off")  # fmt: skip
    serve(group, rank, pager, layers, placement.experts_of(rank), num_threads,
          read_ahead != "off")  # fmt: skip
    return None
