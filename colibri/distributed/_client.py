"""Rank 0's side: each paged experts module's forward, its rows sent to the ranks that hold
their experts and the answers combined exactly as one process sums them; meanwhile each rank
is told which of its experts the next layer is predicted to need, which it reads ahead while
rank 0 combines and runs the next attention."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable

import numpy as np
import torch

from colibri.distributed._compute import combine, compute, split
from colibri.distributed._placement import Placement
from colibri.distributed._serve import counters, prefetch_guess
from colibri.distributed._wire import (
    DTYPES,
    FAILED,
    HEADER,
    OP_EXPERTS,
    OP_READ_AHEAD,
    OP_STATS,
    OP_STOP,
    DistributedError,
    Link,
)

__all__ = ["Remote"]


class Remote:
    """``model.colibri.remote``: computes a paged experts module over the ranks.

    Attributes
    ----------
    placement : Placement
        Who holds which expert (owners and replicas).
    world : int
        Ranks of the group.
    sent_bytes, received_bytes : int
        Bytes of rows, read-ahead hints and answers exchanged with the other ranks so far.
    rows_sent : int
        Rows (token, expert) computed by the other ranks so far.
    """

    def __init__(self, group, world: int, placement: Placement, timeout: float, layers: dict,
                 pager, num_threads: int, read_ahead: bool) -> None:  # fmt: skip
        self.link = Link(group, timeout)
        self.world = world
        self.placement = placement
        self.layers = layers  # {layer: (E, torch path, fused kernel's activation)}
        self.pager, self.num_threads, self.read_ahead = pager, num_threads, read_ahead
        self.sequence = 0
        self.sent_bytes = self.received_bytes = self.rows_sent = 0
        self.hints: dict[int, list] = {}  # rank: read-ahead sends not yet waited for
        self.broken: str | None = None
        self.closed = False

    def __call__(self, layer: int, hidden_states: torch.Tensor, ids_np: np.ndarray,
                 weights: torch.Tensor,
                 next_layer: Callable | None = None) -> torch.Tensor:  # fmt: skip
        """Layer ``layer``'s experts: ``hidden_states [T, H]`` routed to ``ids_np [T, k]``
        (numpy, -1: no expert) with ``weights [T, k]`` -> ``[T, H]``, bit for bit one
        process's. ``next_layer()``: the next layer's predicted ``(layer, ids)`` or None
        (:func:`colibri.layer.run_experts`' argument), called once the rows are sent; each
        rank gets the ids it holds and reads them ahead (rank 0 too, once its share is
        computed)."""
        if self.broken is not None:
            raise DistributedError(f"expert parallel: the group failed earlier: {self.broken}")
        if self.closed:
            raise DistributedError("expert parallel: the model was closed; its ranks stopped")
        rows = split(ids_np)
        owners = self.placement.route(layer, rows.experts)
        n, hidden = rows.experts.size, hidden_states.shape[-1]
        y = np.empty((n, hidden), np.float32)
        torch_path = np.empty(n, bool)
        x = hidden_states.detach()
        self.sequence += 1
        refused = None  # a rank's (or rank 0's own) error: raised once every answer is in
        try:
            pending = {}
            for rank in range(1, self.world):
                sel = np.flatnonzero(owners == rank)
                if sel.size:
                    pending[rank] = (sel, self._ask(rank, layer, x, rows, sel))
            guess = next_layer() if next_layer is not None else None
            own = self._hint(*guess) if guess is not None else None
            mine = np.flatnonzero(owners == 0)
            if mine.size:
                try:
                    y[mine], torch_path[mine] = self._local(layer, x, rows, mine)
                except Exception as exc:  # the other ranks' answers are read all the same
                    refused = exc
            if own is not None and refused is None:
                prefetch_guess(self.pager, *own)
            for rank, (sel, works) in pending.items():
                self.link.wait(rank, works, f"sending layer {layer}'s rows")
                answer = self._answer(rank, layer, sel.size, hidden)
                if isinstance(answer, DistributedError):
                    refused = refused or answer
                else:
                    y[sel], torch_path[sel] = answer
        except DistributedError as exc:  # the connection: the group cannot go on
            self.broken = str(exc)
            raise
        if refused is not None:
            raise refused
        return combine(hidden_states, weights, rows, y, torch_path)

    def _ask(self, rank: int, layer: int, x, rows, sel) -> list:
        self._settle(rank)
        self.rows_sent += sel.size
        tokens = torch.from_numpy(rows.tokens[sel])
        header = torch.tensor([OP_EXPERTS, layer, sel.size, x.shape[-1], DTYPES.index(x.dtype),
                               0, self.sequence, 0], dtype=torch.int64)  # fmt: skip
        part = x[tokens]
        self.sent_bytes += part.numel() * part.element_size() + sel.size * 8 + HEADER * 8
        experts = torch.from_numpy(rows.experts[sel])
        return self.link.send(rank, [header, part, experts], f"sending layer {layer}'s rows")

    def _hint(self, layer: int, ids: np.ndarray) -> tuple[int, np.ndarray] | None:
        """Send every other rank the predicted experts of ``layer`` it holds, in the guess's
        order (most likely first), without waiting; rank 0's own ``(layer, ids)`` back."""
        if layer not in self.placement.layers:
            return None
        ids = np.asarray(ids, dtype=np.int64)
        ids = ids[(ids >= 0) & (ids < self.placement.owners(layer).size)]
        held = self.placement.holders(layer)[ids]
        for rank in range(1, self.world):
            mine = ids[held[:, rank]]
            if mine.size:
                self._settle(rank)
                header = torch.tensor([OP_READ_AHEAD, layer, mine.size, 0, 0, 0, self.sequence,
                                       0], dtype=torch.int64)  # fmt: skip
                body = torch.from_numpy(np.ascontiguousarray(mine))
                self.sent_bytes += HEADER * 8 + mine.size * 8
                what = f"sending layer {layer}'s read-ahead"
                self.hints[rank] = self.link.send(rank, [header, body], what)
        return layer, ids[held[:, 0]]

    def _settle(self, rank: int) -> None:
        """Wait for the read-ahead hint last sent to ``rank`` (long received by now: the rank
        reads it right after answering the request before it)."""
        works = self.hints.pop(rank, None)
        if works:
            self.link.wait(rank, works, "sending a read-ahead hint")

    def rank_stats(self) -> list[dict]:
        """Every rank's pager counters (rank order; rank 0's own first): ``hits``,
        ``misses``, ``prefetched``, ``prefetch_hits``, ``advised``, ``bytes_read``,
        ``capacity``, ``answered`` (requests served; rank 0: None) and ``experts`` (the
        ``[layer, expert]`` pairs it has computed, ascending).

        Raises
        ------
        DistributedError
            A rank is gone or silent past the timeout.
        """
        if self.broken is not None or self.closed:
            raise DistributedError("expert parallel: the group failed or was closed")
        found = [counters(self.pager, None)]
        ask = torch.zeros(HEADER, dtype=torch.int64)
        ask[0] = OP_STATS
        try:
            for rank in range(1, self.world):
                self._settle(rank)
                self.link.wait(rank, self.link.send(rank, [ask], "asking for counters"),
                               "asking for counters")  # fmt: skip
                what = "waiting for its counters"
                head = self.link.recv(rank, torch.empty(4, dtype=torch.int64), what).tolist()
                text = self.link.recv(rank, torch.empty(head[3], dtype=torch.uint8), what)
                found.append(json.loads(bytes(text.numpy())))
        except DistributedError as exc:
            self.broken = str(exc)
            raise
        return found

    def _local(self, layer: int, x, rows, mine):
        num_experts, torch_path, activation = self.layers[layer]
        return compute(self.pager, layer, x[torch.from_numpy(rows.tokens[mine])],
                       rows.experts[mine], torch_path=torch_path, kernel_activation=activation,
                       num_experts=num_experts, num_threads=self.num_threads,
                       read_ahead=self.read_ahead)  # fmt: skip

    def _answer(self, rank: int, layer: int, n: int, hidden: int):
        what = f"waiting for layer {layer}'s experts"
        head = self.link.recv(rank, torch.empty(4, dtype=torch.int64), what).tolist()
        status, sequence, rows, length = head
        if status == FAILED:
            text = self.link.recv(rank, torch.empty(length, dtype=torch.uint8), what)
            return DistributedError(
                f"expert parallel: rank {rank} answered layer {layer} with an error: "
                + bytes(text.numpy()).decode(errors="replace")
            )
        if sequence != self.sequence or rows != n:
            raise DistributedError(
                f"expert parallel: rank {rank} answered request {sequence} ({rows} rows) to "
                f"request {self.sequence} ({n} rows); the group is out of step"
            )
        y = self.link.recv(rank, torch.empty((n, hidden), dtype=torch.float32), what)
        path = self.link.recv(rank, torch.empty(n, dtype=torch.uint8), what)
        self.received_bytes += y.numel() * 4 + n + 32
        return y.numpy(), path.numpy().astype(bool)

    def close(self) -> None:
        """Tell every rank to stop serving (idempotent; a failed group is left as it is)."""
        if self.closed:
            return
        self.closed = True
        if self.broken is not None:
            return
        stop = torch.zeros(HEADER, dtype=torch.int64)
        stop[0] = OP_STOP
        for rank in range(1, self.world):
            with contextlib.suppress(DistributedError):  # a rank gone: nothing to stop
                self._settle(rank)
                self.link.wait(rank, self.link.send(rank, [stop], "stopping"), "stopping")
