"""What crosses the network: point-to-point tensors over torch.distributed, bounded in time.

Rank 0 asks a rank for one layer's experts with a header, the rows and their expert ids; the
rank answers with a header and, per row, its expert's output (float32) and whether it came
from the torch path (see :mod:`._compute`), or an error message. A read-ahead hint (a header
and the expert ids of the next layer the rank holds and rank 0 predicts) gets no answer; a
request for the rank's pager counters gets them as JSON text. Every wait of rank 0 is
bounded by the user's timeout, and a peer that is gone or silent becomes a
:class:`DistributedError` naming the rank, never a hang.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from colibri._errors import ColibriError

__all__ = ["DTYPES", "HEADER", "DistributedError", "Link"]

#: The header's length: ``[op, layer, rows, hidden, dtype code, kernel, sequence, 0]``.
HEADER = 8
#: Dtypes of the rows sent, by code.
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
OP_STOP, OP_EXPERTS, OP_READ_AHEAD, OP_STATS = 0, 1, 2, 3
OK, FAILED = 0, 1


class DistributedError(ColibriError, RuntimeError):
    """A rank of an expert-parallel model failed, vanished, timed out or does not match rank
    0 (checkpoint, colibri version, placement); the message names the rank and the cause."""


class Link:
    """Rank-to-rank messages over ``group`` (peers named by their rank in it), each wait
    bounded by ``timeout`` seconds (None: the group's own)."""

    def __init__(self, group, timeout: float | None) -> None:
        self.group = group
        self.timeout = None if timeout is None else datetime.timedelta(seconds=timeout)
        size = dist.get_world_size(group)
        self._global = [dist.get_global_rank(group, r) for r in range(size)]

    def send(self, peer: int, tensors: Sequence[torch.Tensor], what: str) -> list:
        """Start sending ``tensors`` to ``peer``; the works to :meth:`wait` on."""
        try:
            to = self._global[peer]
            return [dist.isend(t.contiguous(), to, group=self.group) for t in tensors]
        except RuntimeError as exc:
            raise self.failure(peer, what, exc) from None

    def recv(self, peer: int, tensor: torch.Tensor, what: str) -> torch.Tensor:
        """Receive ``tensor`` from ``peer`` within the timeout."""
        try:
            self._wait(dist.irecv(tensor, self._global[peer], group=self.group))
        except RuntimeError as exc:
            raise self.failure(peer, what, exc) from None
        return tensor

    def wait(self, peer: int, works: list, what: str) -> None:
        """Wait for sends started by :meth:`send`."""
        try:
            for work in works:
                self._wait(work)
        except RuntimeError as exc:
            raise self.failure(peer, what, exc) from None

    def _wait(self, work) -> None:
        if self.timeout is None:
            work.wait()
        else:
            work.wait(timeout=self.timeout)

    def failure(self, peer: int, what: str, exc: BaseException) -> DistributedError:
        text = str(exc)
        if "Timed out" in text or "timed out" in text:
            cause = f"no answer within the timeout of {self.timeout.total_seconds():g} s"
            fix = "the rank is stuck or overloaded; raise timeout= (--timeout) if it is slow"
        else:
            first = re.sub(r"^\[[^\]]*\] ", "", text.splitlines()[0] if text else "")
            cause = f"the connection failed ({first.split('. This is typically')[0][:200]})"
            fix = "the rank died or its network dropped; see that rank's log"
        return DistributedError(f"expert parallel: rank {peer}: {what}: {cause}; {fix}")

    def send_text(self, peer: int, status: int, sequence: int, text: str) -> None:
        """An answer without rows: ``status`` and ``text`` (an error message, or a rank's
        counters as JSON)."""
        data = torch.from_numpy(np.frombuffer(text.encode()[:65536], np.uint8).copy())
        header = torch.tensor([status, sequence, 0, data.numel()], dtype=torch.int64)
        self.wait(peer, self.send(peer, [header, data], "sending an error"), "sending an error")
