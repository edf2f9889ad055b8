"""Rank 0's side: each paged experts module's forward, its rows sent to the ranks that own
their experts and the answers combined exactly as one process sums them."""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from colibri.distributed._compute import combine, compute, split
from colibri.distributed._placement import Placement
from colibri.distributed._wire import (
    DTYPES,
    FAILED,
    HEADER,
    OP_EXPERTS,
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
        Who owns which expert.
    world : int
        Ranks of the group.
    sent_bytes, received_bytes : int
        Bytes of rows and answers exchanged with the other ranks so far.
    """

    def __init__(self, group, world: int, placement: Placement, timeout: float, layers: dict,
                 pager, num_threads: int, read_ahead: bool) -> None:  # fmt: skip
        self.link = Link(group, timeout)
        self.world = world
        self.placement = placement
        self.layers = layers  # {layer: (E, torch path, fused kernel's activation)}
        self.pager, self.num_threads, self.read_ahead = pager, num_threads, read_ahead
        self.sequence = 0
        self.sent_bytes = self.received_bytes = 0
        self.broken: str | None = None
        self.closed = False

    def __call__(self, layer: int, hidden_states: torch.Tensor, ids_np: np.ndarray,
                 weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """Layer ``layer``'s experts: ``hidden_states [T, H]`` routed to ``ids_np [T, k]``
        (numpy, -1: no expert) with ``weights [T, k]`` -> ``[T, H]``, bit for bit one
        process's."""
        if self.broken is not None:
            raise DistributedError(f"expert parallel: the group failed earlier: {self.broken}")
        if self.closed:
            raise DistributedError("expert parallel: the model was closed; its ranks stopped")
        rows = split(ids_np)
        owners = self.placement.owners(layer)[rows.experts]
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
            mine = np.flatnonzero(owners == 0)
            if mine.size:
                try:
                    y[mine], torch_path[mine] = self._local(layer, x, rows, mine)
                except Exception as exc:  # the other ranks' answers are read all the same
                    refused = exc
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
        tokens = torch.from_numpy(rows.tokens[sel])
        header = torch.tensor([OP_EXPERTS, layer, sel.size, x.shape[-1], DTYPES.index(x.dtype),
                               0, self.sequence, 0], dtype=torch.int64)  # fmt: skip
        part = x[tokens]
        self.sent_bytes += part.numel() * part.element_size() + sel.size * 8 + HEADER * 8
        experts = torch.from_numpy(rows.experts[sel])
        return self.link.send(rank, [header, part, experts], f"sending layer {layer}'s rows")

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
                self.link.wait(rank, self.link.send(rank, [stop], "stopping"), "stopping")
