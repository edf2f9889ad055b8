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
    header,
)

__all__ = ["Remote"]

_NONE = np.zeros(0, np.int64)


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
            guess = next_layer() if next_layer is not None else None
            hints = self._hints(*guess) if guess is not None else {}
            pending = {}
            for rank in range(1, self.world):
                sel = np.flatnonzero(owners == rank)
                if sel.size:
                    pending[rank] = (sel, self._ask(rank, layer, x, rows, sel, hints.get(rank)))
                elif rank in hints:
                    self._hint(rank, *hints[rank])
            mine = np.flatnonzero(owners == 0)
            if mine.size:
                try:
                    y[mine], torch_path[mine] = self._local(layer, x, rows, mine)
                except Exception as exc:  # the other ranks' answers are read all the same
                    refused = exc
            if 0 in hints and refused is None:
                prefetch_guess(self.pager, *hints[0])
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

    def _ask(self, rank: int, layer: int, x, rows, sel, hint) -> list:
        """Send ``rank`` its rows of ``layer`` (and its read-ahead ``hint``, ``(layer, ids)``
        or None) as one message; the works."""
        self._settle(rank)
        self.rows_sent += sel.size
        hint_layer, hint_ids = hint if hint is not None else (0, _NONE)
        part = x[torch.from_numpy(rows.tokens[sel])]
        head = header(OP_EXPERTS, layer=layer, rows=sel.size, hidden=x.shape[-1],
                      code=DTYPES.index(x.dtype), hint_layer=hint_layer, hints=hint_ids.size,
                      sequence=self.sequence)  # fmt: skip
        experts = rows.experts[sel]
        self.sent_bytes += part.numel() * part.element_size() + (sel.size + hint_ids.size) * 8
        self.sent_bytes += HEADER * 8
        return self.link.send(rank, head, [experts, hint_ids, part],
                              f"sending layer {layer}'s rows")  # fmt: skip

    def _hints(self, layer: int, ids: np.ndarray) -> dict[int, tuple[int, np.ndarray]]:
        """The predicted experts of ``layer`` (most likely first) each rank holds:
        ``{rank: (layer, ids)}`` for the ranks that hold some (rank 0 included)."""
        if layer not in self.placement.layers:
            return {}
        ids = np.asarray(ids, dtype=np.int64)
        ids = ids[(ids >= 0) & (ids < self.placement.owners(layer).size)]
        held = self.placement.holders(layer)[ids]
        found = {}
        for rank in range(self.world):
            mine = np.ascontiguousarray(ids[held[:, rank]])
            if mine.size:
                found[rank] = (layer, mine)
        return found

    def _hint(self, rank: int, layer: int, ids: np.ndarray) -> None:
        """Send ``rank`` a read-ahead hint alone (it has no rows this layer), not waited."""
        self._settle(rank)
        self.sent_bytes += HEADER * 8 + ids.size * 8
        head = header(OP_READ_AHEAD, hint_layer=layer, hints=ids.size, sequence=self.sequence)
        self.hints[rank] = self.link.send(rank, head, [ids],
                                          f"sending layer {layer}'s read-ahead")  # fmt: skip

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
        try:
            for rank in range(1, self.world):
                self._settle(rank)
                self.link.wait(rank, self.link.send(rank, header(OP_STATS), [],
                                                    "asking for counters"),
                               "asking for counters")  # fmt: skip
                text = self.link.recv(rank, "waiting for its counters").payload
                found.append(json.loads(bytes(text)))
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
        answer = self.link.recv(rank, what)
        if answer.status == FAILED:
            return DistributedError(
                f"expert parallel: rank {rank} answered layer {layer} with an error: "
                + bytes(answer.payload).decode(errors="replace")
            )
        if answer.sequence != self.sequence or answer.rows != n:
            raise DistributedError(
                f"expert parallel: rank {rank} answered request {answer.sequence} "
                f"({answer.rows} rows) to request {self.sequence} ({n} rows); the group is "
                "out of step"
            )
        try:
            y, path = answer.parts(((n, hidden), np.float32), ((n,), np.uint8))
        except ValueError as exc:
            raise DistributedError(f"expert parallel: rank {rank}: {what}: {exc}") from None
        self.received_bytes += answer.payload.size + HEADER * 8
        return y, path.astype(bool)

    def close(self) -> None:
        """Tell every rank to stop serving (idempotent; a failed group is left as it is)."""
        if self.closed:
            return
        self.closed = True
        if self.broken is not None:
            return
        for rank in range(1, self.world):
            with contextlib.suppress(DistributedError):  # a rank gone: nothing to stop
                self._settle(rank)
                works = self.link.send(rank, header(OP_STOP), [], "stopping")
                self.link.wait(rank, works, "stopping")
