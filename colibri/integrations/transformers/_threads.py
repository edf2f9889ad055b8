"""One thread pool at a time: a decoding step runs torch's operations on the calling thread.

A decoding step's heavy work is colibri's: the paged experts and, on colibri's kernel, the
other linears, each on colibri's pool (``include/colibri/pool.h``: the caller and its
helpers). What torch runs between them (norms, rotary embeddings, attention over one row,
the residual adds) is a few microseconds of work an operation, and torch's OpenMP workers
spin after each one, waiting for the next, on the very cores colibri's helpers need. So
while a model from :func:`from_pretrained` runs a step of at most :data:`DECODE_ROWS` tokens,
torch's intra-op threads are set to one, and put back as they were after the step; longer
steps (prompts) keep torch's threads for its GEMMs. The demo's Q8_0 GGUF on a 2-core Xeon,
colibri's kernel on the linears, 2 colibri threads: 75.8 ms a token with torch's 2 threads,
55.8 with one (linears on torch: 69.3 and 64.8).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

__all__ = ["DECODE_ROWS", "install", "one_thread"]

#: Most tokens a step may have to run torch on one thread (colibri's linear kernel's rows).
DECODE_ROWS = 8
_STATE = "_colibri_threads"


class _Switch:
    """The forward hooks' state: torch's thread count to put back, if switched."""

    __slots__ = ("before", "rows")

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.before: int | None = None

    def enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.leave()  # a step that raised left torch on one thread
        if torch.compiler.is_compiling() or _tokens(args, kwargs) > self.rows:
            return
        threads = torch.get_num_threads()
        if threads > 1:
            self.before = threads
            torch.set_num_threads(1)

    def leave(self, *_) -> None:
        if self.before is not None:
            torch.set_num_threads(self.before)
            self.before = None


def _tokens(args: tuple, kwargs: dict) -> int:
    """Tokens of a forward's input: ``input_ids [B, S]`` or ``inputs_embeds [B, S, H]``."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if isinstance(ids, torch.Tensor):
        return ids.numel()
    embeds = kwargs.get("inputs_embeds")
    if isinstance(embeds, torch.Tensor) and embeds.dim() > 0:
        return embeds.numel() // max(embeds.shape[-1], 1)
    return DECODE_ROWS + 1  # unknown: leave torch's threads alone


@contextlib.contextmanager
def one_thread():
    """torch on one intra-op thread inside the block, as in a decoding step."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def install(model: nn.Module, rows: int = DECODE_ROWS) -> None:
    """Run ``model``'s forward on one torch thread for steps of at most ``rows`` tokens."""
    if _STATE in model.__dict__:
        return
    switch = model.__dict__[_STATE] = _Switch(rows)
    model.register_forward_pre_hook(switch.enter, with_kwargs=True)
    model.register_forward_hook(switch.leave, always_call=True)
