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
    OK,
    OP_ANSWER,
    OP_EXPERTS,
    OP_READ_AHEAD,
    OP_STATS,
    OP_STOP,
    Link,
    header,
)

__all__ = ["IDLE", "counters", "prefetch_guess", "serve"]

#: Seconds a serving rank waits for rank 0's next request (rank 0 may sit idle between
#: generations; a rank 0 that is gone ends the wait at once, as a closed connection).
IDLE = 7 * 24 * 3600.0
#: The numpy dtype whose bytes carry each row dtype (half precisions as int16).
_NUMPY = {torch.float32: np.float32, torch.float64: np.float64, torch.bfloat16: np.int16,
          torch.float16: np.int16}  # fmt: skip


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
        ask = link.recv(0, "waiting for requests")
        if ask.op == OP_STOP:
            return answered
        if ask.op == OP_STATS:
            link.send_text(0, OK, ask.sequence, json.dumps(counters(pager, answered)))
            continue
        if ask.op == OP_READ_AHEAD:
            (hints,) = ask.parts(((ask.hints,), np.int64))
            _read_ahead(pager, read_ahead, ask.hint_layer, hints, mine)
            continue
        try:
            if ask.op != OP_EXPERTS or not 0 <= ask.code < len(DTYPES):
                raise ValueError(
                    f"request {ask.op} (dtype {ask.code}) is not one this colibri knows: run "
                    "the same colibri version on every rank"
                )
            dtype = DTYPES[ask.code]
            ids, hints, x = ask.parts(((ask.rows,), np.int64), ((ask.hints,), np.int64),
                                      ((ask.rows, ask.hidden), _NUMPY[dtype]))  # fmt: skip
            x = torch.from_numpy(x).view(dtype)
            if ask.layer not in layers:
                raise KeyError(f"layer {ask.layer} has no paged experts here")
            stray = sorted(set(ids.tolist()) - set(mine.get(ask.layer, ()).tolist()))
            if stray:
                raise KeyError(f"layer {ask.layer} experts {stray[:8]} are not this rank's")
            num_experts, torch_path, activation = layers[ask.layer]
            y, took = compute(pager, ask.layer, x, ids, torch_path=torch_path,
                              kernel_activation=activation, num_experts=num_experts,
                              num_threads=num_threads, read_ahead=read_ahead)  # fmt: skip
        except (ColibriError, KeyError, ValueError, OSError, MemoryError) as exc:
            link.send_text(0, FAILED, ask.sequence, f"rank {rank}: {type(exc).__name__}: {exc}")
            continue
        answer = header(OP_ANSWER, rows=ask.rows, sequence=ask.sequence, status=OK)
        link.wait(0, link.send(0, answer, [y, took.view(np.uint8)], "answering"), "answering")
        answered += 1
        _read_ahead(pager, read_ahead, ask.hint_layer, hints, mine)


def _read_ahead(pager, read_ahead: bool, layer: int, ids: np.ndarray, mine: dict) -> None:
    """Rank 0's hint: the predicted experts of ``layer`` this rank holds, read ahead."""
    if read_ahead and ids.size:
        prefetch_guess(pager, layer, ids[np.isin(ids, mine.get(layer, ()))])
