"""The ranks other than 0: compute the rows rank 0 sends until it says stop, and read ahead
the experts rank 0 predicts the next layer needs."""

from __future__ import annotations

import json

import numpy as np
import torch

from colibri._errors import ColibriError
from colibri.distributed._compute import compute
from colibri.distributed._wire import (
    DTYPES,
    FAILED,
    HEADER,
    OK,
    OP_READ_AHEAD,
    OP_STATS,
    OP_STOP,
    Link,
)

__all__ = ["IDLE", "counters", "prefetch_guess", "serve"]

#: Seconds a serving rank waits for rank 0's next request (rank 0 may sit idle between
#: generations; a rank 0 that is gone ends the wait at once, as a closed connection).
IDLE = 7 * 24 * 3600.0


def prefetch_guess(pager, layer: int, ids: np.ndarray) -> int:
    """Read ahead layer ``layer``'s predicted experts ``ids`` (most likely first) into the
    pager's slots (:meth:`colibri.Pager.prefetch`: a background thread, never blocking; what
    does not fit is dropped), so that they are resident when the layer's rows come. Returns
    how many fetches were queued (0 once the pager is closed)."""
    if pager.closed or not len(ids):
        return 0
    return pager.prefetch(layer, ids[: max(int(pager.capacity), 0)])


def counters(pager, answered: int | None) -> dict:
    """A rank's pager counters as :meth:`Remote.rank_stats` gives them."""
    stats = pager.stats
    names = ("hits", "misses", "prefetched", "prefetch_hits", "advised", "bytes_read")
    return {**{n: getattr(stats, n) for n in names}, "capacity": int(pager.capacity),
            "answered": answered,
            "experts": sorted([int(layer), int(e)] for layer, e in pager.usage())}  # fmt: skip


def serve(group, rank: int, pager, layers: dict, mine: dict, num_threads: int,
          read_ahead: bool) -> int:  # fmt: skip
    """Answer rank 0's requests until it says stop; returns how many were answered.

    ``layers``: ``{layer: (E, torch path, fused kernel's activation or None)}``; ``mine``:
    ``{layer: experts this rank holds}``. A read-ahead hint (when ``read_ahead``) prefetches
    the predicted experts this rank holds; it gets no answer. A request this rank cannot
    compute (an expert it does not hold, a budget too small, a corrupt file) is answered with
    the error, which rank 0 raises; the connection failing raises :class:`DistributedError`
    naming rank 0.
    """
    link = Link(group, IDLE)
    answered = 0
    while True:
        header = link.recv(0, torch.empty(HEADER, dtype=torch.int64), "waiting for requests")
        op, layer, n, hidden, code, _, sequence, _ = header.tolist()
        if op == OP_STOP:
            return answered
        if op == OP_STATS:
            link.send_text(0, OK, sequence, json.dumps(counters(pager, answered)))
            continue
        if op == OP_READ_AHEAD:
            ids = link.recv(0, torch.empty(n, dtype=torch.int64), "receiving a read-ahead").numpy()
            if read_ahead:
                prefetch_guess(pager, layer, ids[np.isin(ids, mine.get(layer, ()))])
            continue
        x = link.recv(0, torch.empty((n, hidden), dtype=DTYPES[code]), "receiving rows")
        experts = link.recv(0, torch.empty(n, dtype=torch.int64), "receiving expert ids")
        try:
            ids = experts.numpy()
            if layer not in layers:
                raise KeyError(f"layer {layer} has no paged experts here")
            stray = sorted(set(ids.tolist()) - set(mine.get(layer, ()).tolist()))
            if stray:
                raise KeyError(f"layer {layer} experts {stray[:8]} are not this rank's")
            num_experts, torch_path, activation = layers[layer]
            y, took = compute(pager, layer, x, ids, torch_path=torch_path,
                                    kernel_activation=activation, num_experts=num_experts,
                                    num_threads=num_threads, read_ahead=read_ahead)  # fmt: skip
        except (ColibriError, KeyError, ValueError, OSError, MemoryError) as exc:
            link.send_text(0, FAILED, sequence, f"rank {rank}: {type(exc).__name__}: {exc}")
            continue
        answer = torch.tensor([OK, sequence, n, 0], dtype=torch.int64)
        path = torch.from_numpy(took.view("uint8"))
        link.wait(0, link.send(0, [answer, torch.from_numpy(y), path], "answering"), "answering")
        answered += 1
