"""How a model's experts are spread over ranks: :class:`ExpertParallel`."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from colibri.distributed._placement import Placement

__all__ = ["DEFAULT_START_TIMEOUT", "DEFAULT_TIMEOUT", "ExpertParallel", "options"]

#: Seconds rank 0 waits for a rank's answer.
DEFAULT_TIMEOUT = 120.0
#: Seconds every rank waits for the others to join and agree at start (ranks start at
#: different times: by hand on several machines, or each loading its checkpoint).
DEFAULT_START_TIMEOUT = 600.0


@dataclass
class ExpertParallel:
    """Options of ``from_pretrained(..., expert_parallel=...)``.

    Attributes
    ----------
    placement : Placement or path, optional
        Which rank owns which expert (:meth:`Placement.save` writes one); default:
        :func:`place` from every rank's budget and ``usage`` (read on rank 0).
    usage : mapping, optional
        ``{layer: UsageStats or counts [E]}`` for :func:`place` (rank 0's is used).
    timeout : float
        Seconds rank 0 waits for any rank's answer; past it the wait ends in a
        :class:`DistributedError` naming the rank.
    start_timeout : float
        Seconds every rank waits for the others to join the group and agree on the model at
        start (a :class:`DistributedError` past it).
    group : torch.distributed.ProcessGroup, optional
        A gloo group to use (default: the default group, which colibri initialises with gloo
        from torchrun's environment, ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
        ``MASTER_PORT``, when it is not yet).
    """

    placement: Placement | str | os.PathLike | None = None
    usage: Mapping[int, Any] | None = None
    timeout: float = DEFAULT_TIMEOUT
    start_timeout: float = DEFAULT_START_TIMEOUT
    group: Any = None


def options(value: Any) -> ExpertParallel | None:
    """``expert_parallel=`` as :class:`ExpertParallel` (None or False: off; True: defaults;
    a dict: its fields), or a ValueError naming what is wrong."""
    if value is None or value is False:
        return None
    if value is True:
        value = ExpertParallel()
    elif isinstance(value, Mapping):
        unknown = sorted(set(value) - set(ExpertParallel.__dataclass_fields__))
        if unknown:
            raise ValueError(
                f"from_pretrained(): expert_parallel has no option {unknown[0]!r} (options: "
                f"{', '.join(ExpertParallel.__dataclass_fields__)})"
            )
        value = ExpertParallel(**value)
    if not isinstance(value, ExpertParallel):
        raise ValueError(
            "from_pretrained(): expert_parallel must be True, a dict of options or a "
            f"colibri.distributed.ExpertParallel (got {type(value).__name__})"
        )
    for name in ("timeout", "start_timeout"):
        t = getattr(value, name)
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"expert_parallel: {name} must be positive seconds (got {t!r})")
    return value
