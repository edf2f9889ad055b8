"""``budget="auto"``: the expert budget the memory this process may use leaves.

The process may use ``min(cgroup limit, MemAvailable + what it holds now)`` bytes in all
(:mod:`colibri._memory`; the limit counts what the process already holds, ``MemAvailable``
does not). From that go what it holds now (the interpreter, torch, the model's skeleton:
its anonymous memory; the libraries' code and other mapped files are page cache the kernel
takes back under the limit, the part a run keeps touching is in the margin), the model's
resident (non-expert) weights in their compute dtype, and a margin of 96 MiB + 2% for what a
run adds on top (torch's kernels and caches, activations, the KV cache, the allocator's
slack: 45-50 MiB measured on a tiny model). The rest is the budget, if it holds at least one
layer's top-k experts; and no more than what holds every expert (the pager keeps state per
slot: a budget of the machine's memory for a tiny model would cost more than the model).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from colibri._errors import BudgetError
from colibri._memory import usable_memory
from colibri._units import format_bytes, process_memory
from colibri._validate import check_page_size_kb

__all__ = ["MARGIN_BYTES", "MARGIN_SHARE", "AutoBudget", "auto_budget", "for_model"]

MARGIN_BYTES = 96 << 20
MARGIN_SHARE = 0.02


class AutoBudget(NamedTuple):
    """A budget sized by ``budget="auto"`` and what it was sized from, in bytes."""

    nbytes: int
    usable: int  # memory the process may use in all
    source: str  # which limit that is
    in_use: int  # the process's anonymous memory when the budget was chosen
    resident: int  # the model's resident (non-expert) weights, still to load
    margin: int
    capped: bool  # every expert fits: the budget is what holds them all

    def __str__(self) -> str:
        f = format_bytes
        left = self.usable - self.in_use - self.resident - self.margin
        head = f"{f(self.nbytes)} for experts"
        if self.capped:
            head += f" (all of them) of {f(left)}"
        return (
            f"--budget auto: {head} = {f(self.usable)} this process may use ({self.source}) - "
            f"{f(self.in_use)} in use - {f(self.resident)} of resident weights - "
            f"{f(self.margin)} margin (96 MiB + 2%)"
        )


def resident_bytes(checkpoint: Any, plan: dict, dtype: Any, kept: dict = ()) -> int:
    """Bytes the tensors of ``plan`` (:func:`_plan_resident`) take once loaded: floating
    tensors (block-quantized GGUF ones dequantized) in ``dtype``, the others and those filling
    the model tensors named in ``kept`` (kept block-quantized) as stored."""
    total = 0
    for names in plan.values():
        for name, target in names:
            info = checkpoint.tensors[name]
            if target in kept:
                total += info.nbytes
                continue
            count = math.prod(info.shape)
            floating = info.dtype.startswith(("F", "BF")) or info.block[1] > 0
            total += count * dtype.itemsize if floating and dtype is not None else info.nbytes
    return total


def top_k(model: Any) -> int:
    """The most experts a token uses in any MoE layer of ``model`` (its routers' ``top_k``,
    else config.json's ``num_experts_per_tok``; 1 when neither says)."""
    ks = [m.top_k for m in model.modules() if isinstance(getattr(m, "top_k", None), int)]
    config = model.config.get_text_config()
    return max(ks, default=0) or int(getattr(config, "num_experts_per_tok", 0) or 1)


def auto_budget(resident: int, floor: int, ceiling: int) -> AutoBudget:
    """The expert budget this process can afford.

    Parameters
    ----------
    resident : int
        Bytes of the model's resident weights, not loaded yet.
    floor : int
        Bytes of one layer's top-k experts as the pager holds them: the least that runs.
    ceiling : int
        Bytes that hold every expert: the most worth having.

    Raises
    ------
    BudgetError
        The OS says nothing of its memory, or what it leaves is below ``floor``.
    """
    memory = process_memory()
    in_use = (memory.anon if memory.anon is not None else memory.rss) or 0
    limit = usable_memory(in_use)
    if limit is None:
        raise BudgetError(
            "budget='auto' needs Linux's /proc/meminfo or a cgroup memory limit, and neither "
            "is here; give the budget in bytes (e.g. budget='3GiB')"
        )
    usable, source = limit
    margin = MARGIN_BYTES + int(usable * MARGIN_SHARE)
    left = usable - in_use - resident - margin
    chosen = AutoBudget(min(left, ceiling), usable, source, in_use, resident, margin,
                        left > ceiling)  # fmt: skip
    if left < floor:
        f = format_bytes
        raise BudgetError(
            f"budget='auto': this process may use {f(usable)} ({source}); that cannot hold "
            f"the model's non-expert weights ({f(resident)}) + one layer's top-k experts "
            f"({f(floor)}) on top of the {f(in_use)} in use and a {f(margin)} margin; run "
            "where more memory is free (or with a higher memory limit)"
        )
    return chosen


def for_model(model: Any, checkpoint: Any, plan: dict, source: Any, page_size_kb: int,
              dtype: Any, kept: dict = ()) -> AutoBudget:  # fmt: skip
    """:func:`auto_budget` for a model ``from_pretrained`` is loading: its resident weights
    from ``plan`` (``kept``: those kept block-quantized); its floor one layer's top-k of the
    largest expert, its ceiling all of the experts, each taken as the pager's slot for the
    largest (its three matrices rounded out to whole pages: at most two pages more each)."""
    page = check_page_size_kb(page_size_kb, "from_pretrained(): ") * 1024
    slot = source.max_expert_nbytes + 6 * page
    resident = resident_bytes(checkpoint, plan, dtype, kept)
    return auto_budget(resident, top_k(model) * slot, len(source.experts) * slot)
