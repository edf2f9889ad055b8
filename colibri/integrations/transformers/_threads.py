"""One thread pool at a time: a decoding step runs torch's operations on the calling thread.

A decoding step's heavy work is colibri's: the paged experts and, on colibri's kernel, the
other linears, each on colibri's pool (``include/colibri/pool.h``: the caller and its
helpers). What torch runs between them (norms, rotary embeddings, attention over one row,
the residual adds) is a few microseconds of work an operation, and torch's OpenMP workers
spin after each one, waiting for the next, on the very cores colibri's helpers need. So
while a model from :func:`from_pretrained` runs a step of at most :data:`DECODE_ROWS` tokens,
torch's intra-op threads are set to one, and put back as they were after the step, or,
inside ``model.generate``, at its next longer step or when it returns (sampling between two
steps is tiny torch operations too); longer steps (prompts) keep torch's threads for its
GEMMs. The demo's Q8_0 GGUF on a 2-core Xeon,
colibri's kernel on the linears, 2 colibri threads: 75.8 ms a token with torch's 2 threads,
55.8 with one (linears on torch: 69.3 and 64.8).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["DECODE_ROWS", "install", "one_thread"]

#: Most tokens a step may have to run torch on one thread (colibri's linear kernel's rows).
DECODE_ROWS = 8
_STATE = "_colibri_threads"


class _Switch:
    """The forward hooks' state: torch's thread count to put back, if switched; inside
    ``generate`` it is put back only by a longer step or when ``generate`` returns (the
    sampling between two decoding steps is torch's tiny operations too)."""

    __slots__ = ("before", "generating", "rows")

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.before: int | None = None
        self.generating = 0

    def enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if torch.compiler.is_compiling() or _tokens(args, kwargs) > self.rows:
            self.leave()  # a prompt: torch's own threads
            return
        threads = torch.get_num_threads()
        if self.before is None and threads > 1:
            self.before = threads
            torch.set_num_threads(1)

    def after(self, *_) -> None:
        if not self.generating:
            self.leave()

    def leave(self) -> None:
        if self.before is not None:
            torch.set_num_threads(self.before)
            self.before = None

    def generate(self, generate: Callable) -> Callable:
        """``generate`` with torch's threads put back when it returns."""

        @functools.wraps(generate)
        def run(*args, **kwargs):
            self.generating += 1
            try:
                return generate(*args, **kwargs)
            finally:
                self.generating -= 1
                if not self.generating:
                    self.leave()

        return run


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
    model.register_forward_hook(switch.after, always_call=True)
    if callable(getattr(model, "generate", None)):
        model.generate = switch.generate(model.generate)
