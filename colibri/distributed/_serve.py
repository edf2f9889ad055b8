"""The ranks other than 0: compute the rows rank 0 sends until it says stop."""

from __future__ import annotations

import torch

from colibri._errors import ColibriError
from colibri.distributed._compute import compute
from colibri.distributed._wire import DTYPES, FAILED, HEADER, OK, OP_STOP, Link

__all__ = ["IDLE", "serve"]

#: Seconds a serving rank waits for rank 0's next request (rank 0 may sit idle between
#: generations; a rank 0 that is gone ends the wait at once, as a closed connection).
IDLE = 7 * 24 * 3600.0


def serve(group, rank: int, pager, layers: dict, mine: dict, num_threads: int,
          read_ahead: bool) -> int:  # fmt: skip
    """Answer rank 0's requests until it says stop; returns how many were answered.

    ``layers``: ``{layer: (E, torch path, fused kernel's activation or None)}``; ``mine``:
    ``{layer: experts this rank owns}``. A request this rank cannot compute (an expert it
    does not own, a budget too small, a corrupt file) is answered with the error, which rank
    0 raises; the connection failing raises :class:`DistributedError` naming rank 0.
    """
    link = Link(group, IDLE)
    answered = 0
    while True:
        header = link.recv(0, torch.empty(HEADER, dtype=torch.int64), "waiting for requests")
        op, layer, n, hidden, code, _, sequence, _ = header.tolist()
        if op == OP_STOP:
            return answered
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
