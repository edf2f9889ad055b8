"""What crosses the network: point-to-point messages over torch.distributed, bounded in time.

Every message is one byte buffer: a header of :data:`HEADER` int64 words, then its payload.
Rank 0 asks a rank for one layer's experts (the rows, their expert ids, and the ids of the
next layer's experts the rank holds and rank 0 predicts, to read ahead once it has
answered); the rank answers with, per row, its expert's output (float32) and whether it came
from the torch path (see :mod:`._compute`), or an error message. A read-ahead hint alone gets
no answer; a request for the rank's pager counters gets them as JSON text.

A message crosses whole when it fits :data:`FIRST` bytes (every decoding step's does): the
receiver posts a buffer that large and reads the length from the header. Each extra message
costs the receiver a wake-up: on a 2-core VM over loopback, three 18 KiB messages each way
took 0.71 ms (median; 4.6 ms at the 90th percentile), one each way 0.19 ms. Larger messages
(a long prompt's rows) send their rest as a second message of the length the header gives.
Every wait of rank 0 is bounded by the user's timeout, and a peer that is gone or silent
becomes a :class:`DistributedError` naming the rank, never a hang.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from colibri._errors import ColibriError

__all__ = ["DTYPES", "FIRST", "HEADER", "DistributedError", "Link", "Message", "header"]

#: The header's words: ``[op, layer, rows, hidden, dtype code, hint layer, hints, sequence,
#: status, payload bytes]``.
HEADER = 10
#: Bytes of a message's first part (the receiver's buffer).
FIRST = 256 << 10
#: Dtypes of the rows sent, by code.
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
OP_STOP, OP_EXPERTS, OP_READ_AHEAD, OP_STATS, OP_ANSWER = 0, 1, 2, 3, 4
OK, FAILED = 0, 1
_FIELDS = ("op", "layer", "rows", "hidden", "code", "hint_layer", "hints", "sequence", "status")
_MOST = 1 << 40  # payload bytes a header may claim


def header(op: int, **fields: int) -> list[int]:
    """A message's header (without its length): ``op`` and the named fields (0 if absent:
    ``layer``, ``rows``, ``hidden``, ``code``, ``hint_layer``, ``hints``, ``sequence``,
    ``status``)."""
    return [op, *(int(fields.get(name, 0)) for name in _FIELDS[1:])]


class Message:
    """A received message: its header's fields and its payload's parts.

    Attributes
    ----------
    op, layer, rows, hidden, code, hint_layer, hints, sequence, status : int
        The header (see :data:`HEADER`).
    payload : numpy.ndarray
        uint8 [payload bytes], owned by this message.
    """

    __slots__ = ("code", "hidden", "hint_layer", "hints", "layer", "op", "payload", "rows",
                 "sequence", "status")  # fmt: skip

    def __init__(self, header: list[int], payload: np.ndarray) -> None:
        (self.op, self.layer, self.rows, self.hidden, self.code, self.hint_layer, self.hints,
         self.sequence, self.status, _) = header  # fmt: skip
        self.payload = payload

    def parts(self, *shapes: tuple[tuple[int, ...], np.dtype]) -> list[np.ndarray]:
        """The payload cut into arrays of these ``(shape, dtype)``, in order (views)."""
        found, at = [], 0
        for shape, dtype in shapes:
            dtype = np.dtype(dtype)
            size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if at + size > self.payload.size:
                raise ValueError(f"a message of {self.payload.size} bytes is too short")
            found.append(self.payload[at : at + size].view(dtype).reshape(shape))
            at += size
        return found


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
        self._buffers: dict[int, torch.Tensor] = {}  # peer: the first part's buffer

    def send(self, peer: int, head: Sequence[int], parts: Sequence, what: str) -> list:
        """Start sending one message to ``peer``: ``head`` (from :func:`header`) and the bytes
        of ``parts`` (numpy arrays or CPU tensors, each as its C-ordered bytes) as the
        payload; the works to :meth:`wait` on."""
        arrays = [_bytes_of(part) for part in parts]
        size = sum(a.size for a in arrays)
        head = np.array([*head, size], np.int64).view(np.uint8)
        data = torch.from_numpy(np.concatenate([head, *arrays]))
        pieces = [data] if data.numel() <= FIRST else [data[:FIRST], data[FIRST:]]
        try:
            to = self._global[peer]
            return [dist.isend(piece, to, group=self.group) for piece in pieces]
        except RuntimeError as exc:
            raise self.failure(peer, what, exc) from None

    def recv(self, peer: int, what: str) -> Message:
        """The next message from ``peer``, within the timeout."""
        buffer = self._buffers.get(peer)
        if buffer is None:
            buffer = self._buffers[peer] = torch.empty(FIRST, dtype=torch.uint8)
        try:
            self._wait(dist.irecv(buffer, self._global[peer], group=self.group))
        except RuntimeError as exc:
            raise self.failure(peer, what, exc) from None
        first = buffer.numpy()
        fields = first[: HEADER * 8].view(np.int64).tolist()
        size = fields[-1]
        if not 0 <= size <= _MOST:
            raise DistributedError(
                f"expert parallel: rank {peer}: {what}: a message claims {size} bytes; the "
                "ranks run different colibri versions or the connection is corrupt"
            )
        payload = np.empty(size, np.uint8)
        payload[: min(size, FIRST - HEADER * 8)] = first[HEADER * 8 : HEADER * 8 + size]
        if HEADER * 8 + size > FIRST:
            rest = torch.from_numpy(payload[FIRST - HEADER * 8 :])
            try:
                self._wait(dist.irecv(rest, self._global[peer], group=self.group))
            except RuntimeError as exc:
                raise self.failure(peer, what, exc) from None
        return Message(fields, payload)

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
        data = np.frombuffer(text.encode()[:65536], np.uint8)
        head = header(OP_ANSWER, sequence=sequence, status=status)
        self.wait(peer, self.send(peer, head, [data], "answering"), "answering")


def _bytes_of(part) -> np.ndarray:
    """``part`` (a numpy array or a CPU tensor) as uint8 bytes, C order."""
    if isinstance(part, torch.Tensor):
        part = part.detach().contiguous()
        part = part.view(torch.uint8) if part.element_size() == 1 else part
        if part.dtype in (torch.bfloat16, torch.float16):
            part = part.view(torch.int16)
        part = part.numpy()
    return np.ascontiguousarray(part).reshape(-1).view(np.uint8)
