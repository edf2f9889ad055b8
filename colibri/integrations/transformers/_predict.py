"""Guessing the next MoE layer's experts, so that their weights are read ahead.

While layer l computes, layer l+1's router applied to layer l's input (``"gate"``) or the
experts layer l+1 used at the previous step (``"previous"``) names the experts layer l+1 will
probably need; :func:`colibri.layer.run_experts` hands them to the store's read-ahead. Both
guesses are scored against what layer l+1 then uses, whichever one reads ahead.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from colibri.integrations.transformers._checkpoint import layer_index
from colibri.integrations.transformers._patch import _STATE, patched_routers

__all__ = ["READ_AHEAD_MODES", "PredictionStats", "Predictor", "link_layers"]

READ_AHEAD_MODES = ("gate", "previous", "off")


@dataclass
class PredictionStats:
    """How well a guess named the next MoE layer's experts.

    ``recall`` = guessed experts that were then used / experts used, over every step (one
    step: one forward of one layer; sets of unique experts); ``precision`` = guessed experts
    that were used / experts guessed.
    """

    used: int = 0
    predicted: int = 0
    correct: int = 0

    @property
    def recall(self) -> float:
        return self.correct / self.used if self.used else 0.0

    @property
    def precision(self) -> float:
        return self.correct / self.predicted if self.predicted else 0.0


class Predictor:
    """The guesses of one model: made per layer call, scored when the guessed layer runs.

    Parameters
    ----------
    mode : str
        The guess that reads ahead: ``"gate"``, ``"previous"`` or ``"off"``.
    """

    def __init__(self, mode: str) -> None:
        if mode not in READ_AHEAD_MODES:
            raise ValueError(f"read_ahead must be one of {READ_AHEAD_MODES} (got {mode!r})")
        self.mode = mode
        self.stats = {"gate": PredictionStats(), "previous": PredictionStats()}
        self._last: dict[int, np.ndarray] = {}  # the experts each layer used last
        self._pending: dict[tuple[str, int], np.ndarray] = {}

    def reset(self) -> None:
        """Zero the scores (what each layer used last is kept)."""
        self.stats = {"gate": PredictionStats(), "previous": PredictionStats()}

    def observe(self, layer: int, used: np.ndarray) -> None:
        """Score the guesses made for ``layer`` against ``used`` (unique ids, ascending)."""
        for mode in ("gate", "previous"):
            guess = self._pending.pop((mode, layer), None)
            if guess is None:
                continue
            stats = self.stats[mode]
            stats.used += len(used)
            stats.predicted += len(guess)
            stats.correct += len(np.intersect1d(guess, used, assume_unique=True))
        self._last[layer] = used

    def guess(
        self, nxt: tuple[int, nn.Module, nn.Module], hidden_states: torch.Tensor
    ) -> tuple[int, np.ndarray] | None:
        """Guess the experts of the next layer ``nxt = (layer, router, block)`` from this
        layer's input; returns ``(layer, ids)`` of the mode that reads ahead, or None."""
        layer, router, block = nxt
        guesses = {}
        last = self._last.get(layer)
        if last is not None:
            guesses["previous"] = last
        if self.mode == "gate":
            ids = route_only(router, block, hidden_states)
            if ids is not None:
                flat = ids.reshape(-1).numpy()
                flat = flat[(flat >= 0) & (flat < 1 << 30)]
                experts, votes = np.unique(flat, return_counts=True)
                guesses["gate"] = experts[np.argsort(-votes, kind="stable")]
        for mode, guess in guesses.items():
            self._pending[(mode, layer)] = np.sort(guess)
        guess = guesses.get(self.mode)
        return None if guess is None else (layer, np.asarray(guess, dtype=np.int64))


@functools.cache
def _extra_arguments(forward: Any) -> tuple[str, ...]:
    """The required arguments of a routing kind's ``forward`` after (router, routing,
    hidden_states): what the block passes to its router."""
    names = []
    for parameter in list(inspect.signature(forward).parameters.values())[3:]:
        if parameter.default is not inspect.Parameter.empty:
            break
        names.append(parameter.name)
    return tuple(names)


def route_only(router: nn.Module, block: nn.Module, hidden_states: torch.Tensor):
    """The expert ids ``[T, k]`` colibri would choose at ``router`` for ``hidden_states``,
    through the patched routing (no hooks run, nothing recorded); None where the block
    computes an argument of its router itself. Arguments the block passes to its router
    (MiniMax-M2's, AFMoE's selection bias) are read from ``block``."""
    state = router.__dict__.get(_STATE)
    if state is None:
        return None
    args = []
    for name in _extra_arguments(state.kind.forward):
        value = getattr(block, name, None)
        if value is None:
            return None  # the block computes it: no cheap guess
        args.append(value)
    with torch.no_grad():
        result = state.kind.forward(router, state.routing, hidden_states, *args)
    for item in result if isinstance(result, tuple) else (result,):
        if isinstance(item, torch.Tensor) and not item.is_floating_point() and item.dim() == 2:
            return item
    return None


def link_layers(model: nn.Module, layers: dict[int, Any]) -> dict[int, tuple[int, Any, Any]]:
    """For each paged layer index, the next paged layer's ``(layer, router, block)`` (the
    router colibri patched, and the module that calls it)."""
    routers = {}
    modules = dict(model.named_modules())
    for record in patched_routers(model):
        layer = layer_index(record.name)
        if layer is not None:
            owner = record.name.rpartition(".")[0]
            routers[layer] = (modules[record.name], modules[owner] if owner else model)
    order = sorted(layers)
    return {
        here: (there, *routers[there])
        for here, there in zip(order, order[1:], strict=False)
        if there in routers
    }
