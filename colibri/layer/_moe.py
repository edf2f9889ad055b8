"""A framework-agnostic Mixture-of-Experts layer: gate → route → the expert engine.

::

    hidden [T, H] ──gate [E, H]──► logits [T, E] ──route──► ids [T, k], weights [T, k]
          │                                                    │
          └────────────► run_experts(store, ...) ◄─────────────┘
                              │ (+ shared expert)
                              ▼
                         out [T, H], the input's dtype and framework

The layer converts its input once (any DLPack framework, float32/float64/float16/bfloat16)
and hands the rows to :func:`colibri.layer.run_experts`, the engine every front end shares.
Expert weights come from an :class:`~colibri.layer.ExpertStore`: a :class:`colibri.Pager`
(paged from a file under a memory budget) or :class:`InMemoryExperts` (stacked arrays).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from colibri._dlpack import import_host, to_caller
from colibri.formats import ExpertWeights
from colibri.layer._engine import ExpertStore, run_experts
from colibri.layer._expert import (
    activation_function,
    check_expert,
    compute_rows,
    float_host,
    gated_ffn,
    host_expert,
    round_to,
)

__all__ = ["InMemoryExperts", "MoELayer"]


class InMemoryExperts:
    """Expert weights held in memory as stacked arrays (an :class:`ExpertStore`).

    Parameters
    ----------
    gate, up : [E, I, H] or [L, E, I, H]
    down : [E, H, I] or [L, E, H, I]
        One layer (3-D, layer index 0) or ``L`` layers (4-D), one float dtype. Any host
        array or DLPack tensor (torch CPU tensors are viewed without a copy).
    """

    def __init__(self, gate: Any, up: Any, down: Any) -> None:
        stacked = host_expert((gate, up, down), "InMemoryExperts")
        arrays = list(stacked)
        if arrays[0].ndim == 3:
            arrays = [a[None] for a in arrays]
        g, u, d = arrays
        if g.ndim != 4 or u.shape != g.shape or d.shape != g.shape[:2] + g.shape[3:1:-1]:
            raise ValueError(
                "InMemoryExperts(): expected gate and up [E, I, H] and down [E, H, I] (or with "
                f"a leading layer axis); got gate {g.shape}, up {u.shape}, down {d.shape}"
            )
        self.gate, self.up, self.down = g, u, d
        self.dtype = stacked.dtype
        self.num_layers, self.num_experts, self.intermediate_size, self.hidden_size = g.shape

    @property
    def capacity(self) -> int:
        """Every expert of a layer is held at once."""
        return self.num_experts

    @property
    def slot_bytes(self) -> int:
        """Bytes of one expert's three matrices."""
        return self.gate[0, 0].nbytes + self.up[0, 0].nbytes + self.down[0, 0].nbytes

    @contextlib.contextmanager
    def load(self, layer: int, expert_ids: Sequence[int]) -> Iterator[Mapping[int, ExpertWeights]]:
        """Yield ``{e: ExpertWeights}`` for the requested experts (views, no copies)."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range: the store holds {self.num_layers}")
        experts = {}
        for e in expert_ids:
            e = int(e)
            if not 0 <= e < self.num_experts:
                raise IndexError(
                    f"expert {e} out of range: layer {layer} has {self.num_experts} experts"
                )
            experts[e] = ExpertWeights(
                self.gate[layer, e], self.up[layer, e], self.down[layer, e], self.dtype
            )
        yield experts

    def advise(self, layer: int, expert_ids: Sequence[int]) -> int:
        """Nothing to read ahead: the weights are in memory."""
        return 0


class _Unstored:
    """The store of a layer whose ``expert_fn`` carries its own weights: every expert is
    ``None``."""

    def __init__(self, num_experts: int) -> None:
        self.capacity = num_experts
        self.slot_bytes = 0

    @contextlib.contextmanager
    def load(self, layer: int, expert_ids: Sequence[int]) -> Iterator[Mapping[int, None]]:
        yield dict.fromkeys((int(e) for e in expert_ids), None)

    def advise(self, layer: int, expert_ids: Sequence[int]) -> int:
        return 0


_RouteFn = Callable[[np.ndarray], tuple[Any, Any]]


class MoELayer:
    """A sparse MoE block: gate → colibri routing → the expert engine (+ shared expert).

    Parameters
    ----------
    gate_weight : [E, H]
        Router weight (``logits = hidden @ gate_weight.T + gate_bias``).
    experts : ExpertStore or None
        Weight store (``colibri.Pager``, ``InMemoryExperts``); may be None when
        ``expert_fn`` carries its own weights.
    top_k : int
    layer : int
        Layer index passed to ``experts.load``.
    gate_bias : [E] or None
    activation : str or callable
        "silu" (SwiGLU, default), "gelu" (GeGLU, exact), "gelu_tanh" (GeGLU, tanh), "relu".
    router : colibri.Context, callable or None
        ``logits [T, E] -> (ids [T, k], weights [T, k])``; a Context is used through its
        ``route``. None: ``colibri.init(E, top_k, **route_options)``.
    expert_fn : callable or None
        ``expert_fn(expert_id, x, weights) -> y``: run every expert in your framework. ``x``
        is ``[n, H]`` in the input's framework (float32, or float64 for float64 input),
        ``weights`` the store's :class:`ExpertWeights` (None without a store); ``y`` is
        ``[n, H]``. Default: colibri's fused kernel for decode-size experts, numpy (BLAS)
        for the rest.
    shared_expert : ExpertWeights or (gate, up, down) or None
        An always-on expert added to every token.
    shared_expert_gate : [1, H] or [H] or None
        Scales the shared expert by ``sigmoid(hidden @ shared_expert_gate.T)`` (Qwen2-MoE).
    num_threads : int or None
        Threads of colibri's kernels (None: colibri's default).
    read_ahead : bool
        Have the store read a step's later chunks ahead while the first ones compute
        (``store.advise``: the OS page cache for a :class:`colibri.Pager`, no budget).
    **route_options
        Passed to ``colibri.init`` when ``router`` is None (scoring, normalize, ...).

    Returns
    -------
    Calling the layer, ``layer(hidden [T, H])`` returns ``out [T, H]`` in the input's dtype
    and framework (numpy, torch, jax, ...), zero-copy where the framework allows.

    Raises
    ------
    ValueError
        ``gate_weight`` is not ``[E, H]``, ``top_k`` is outside ``[1, E]``, neither
        ``experts`` nor ``expert_fn`` is given, or (when called) ``hidden`` is not
        ``[T, H]`` floating point; each message names the argument and its shape.
    IndexError, KeyError
        The store lacks ``layer`` or a routed expert.

    Examples
    --------
    >>> import numpy as np, colibri
    >>> rng = np.random.default_rng(0)
    >>> E, H, I = 8, 16, 32
    >>> experts = colibri.InMemoryExperts(
    ...     rng.standard_normal((E, I, H), np.float32),  # gate
    ...     rng.standard_normal((E, I, H), np.float32),  # up
    ...     rng.standard_normal((E, H, I), np.float32),  # down
    ... )
    >>> moe = colibri.MoELayer(rng.standard_normal((E, H), np.float32), experts, top_k=2)
    >>> out = moe(rng.standard_normal((3, H), np.float32))
    >>> out.shape, out.dtype
    ((3, 16), dtype('float32'))
    """

    def __init__(
        self,
        gate_weight: Any,
        experts: ExpertStore | None,
        top_k: int,
        *,
        layer: int = 0,
        gate_bias: Any = None,
        activation: str | Callable = "silu",
        router: Any = None,
        expert_fn: Callable | None = None,
        shared_expert: Any = None,
        shared_expert_gate: Any = None,
        num_threads: int | None = None,
        read_ahead: bool = True,
        **route_options: Any,
    ) -> None:
        self.gate_weight = _float32_matrix(gate_weight, "gate_weight")
        if self.gate_weight.ndim != 2:
            raise ValueError(
                f"MoELayer(): gate_weight must be [E, H] (got {self.gate_weight.shape})"
            )
        self.num_experts, self.hidden_size = self.gate_weight.shape
        if not isinstance(top_k, (int, np.integer)) or not 1 <= top_k <= self.num_experts:
            raise ValueError(
                f"MoELayer(): top_k must be in [1, {self.num_experts}] (got {top_k!r})"
            )
        self.top_k = int(top_k)
        if experts is None and expert_fn is None:
            raise ValueError("MoELayer(): give experts (a Pager or InMemoryExperts) or expert_fn")
        if experts is not None:
            _check_store(experts)
        self.experts = experts
        self.layer = int(layer)
        self.gate_bias = None
        if gate_bias is not None:
            self.gate_bias = _float32_matrix(gate_bias, "gate_bias")
            if self.gate_bias.shape != (self.num_experts,):
                raise ValueError(
                    f"MoELayer(): gate_bias must be [{self.num_experts}] "
                    f"(got {self.gate_bias.shape})"
                )
        activation_function(activation)  # an unknown name fails here, not at the first call
        self.activation = activation
        self.expert_fn = expert_fn
        self.shared_expert = None
        if shared_expert is not None:
            self.shared_expert = host_expert(shared_expert, "MoELayer")
            check_expert("MoELayer", self.hidden_size, self.shared_expert)
        self.shared_expert_gate = None
        if shared_expert_gate is not None:
            sg = _float32_matrix(shared_expert_gate, "shared_expert_gate")
            self.shared_expert_gate = sg.reshape(1, -1)
            if self.shared_expert_gate.shape[1] != self.hidden_size:
                raise ValueError(
                    f"MoELayer(): shared_expert_gate must be [1, {self.hidden_size}]"
                    f" (got {sg.shape})"
                )
        self.num_threads = num_threads
        self.read_ahead = bool(read_ahead)
        self._route = self._make_router(router, route_options)

    def _make_router(self, router: Any, options: dict) -> _RouteFn:
        if router is not None:
            if options:
                raise ValueError(
                    f"MoELayer(): routing options {sorted(options)} conflict with "
                    "an explicit router; set them on the router instead"
                )
            return router.route if hasattr(router, "route") else router
        from colibri.routing import init

        return init(self.num_experts, self.top_k, **options).route

    def router_logits(self, hidden: np.ndarray) -> np.ndarray:
        """[T, E] float32 gate logits for float32 ``hidden [T, H]``."""
        logits = hidden @ self.gate_weight.T
        if self.gate_bias is not None:
            logits += self.gate_bias
        return logits

    def route(self, hidden: Any) -> tuple[np.ndarray, np.ndarray]:
        """ids [T, k] and weights [T, k] float32 (numpy) for ``hidden [T, H]``."""
        x = compute_rows(*self._input(hidden))
        return self._route_rows(x.astype(np.float32, copy=False))

    def _route_rows(self, x32: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ids, weights = self._route(self.router_logits(x32))
        ids, _ = import_host(ids)
        weights, _ = import_host(weights)
        return ids, np.asarray(weights, np.float32)

    def _input(self, hidden: Any) -> tuple[np.ndarray, str]:
        arr, name = float_host(hidden, "hidden states", "MoELayer")
        if arr.ndim != 2 or arr.shape[1] != self.hidden_size:
            raise ValueError(
                f"MoELayer(): hidden states must be [T, {self.hidden_size}] "
                f"(got {tuple(arr.shape)}); flatten batch and sequence first"
            )
        return arr, name

    def __call__(self, hidden: Any) -> Any:
        return self.forward(hidden)

    def forward(self, hidden: Any) -> Any:
        """The block's output for ``hidden [T, H]``, same dtype and framework as the input.

        float16/bfloat16 inputs are computed in float32 and rounded once at the end.
        """
        arr, name = self._input(hidden)
        x = compute_rows(arr, name)
        x32 = x if x.dtype == np.float32 else x.astype(np.float32)
        ids, weights = self._route_rows(x32)
        ids = np.asarray(ids)
        if ids.ndim != 2 or ids.shape[0] != x.shape[0] or weights.shape != ids.shape:
            raise ValueError(
                f"MoELayer(): the router returned ids {tuple(ids.shape)} and weights "
                f"{tuple(weights.shape)}; expected [{x.shape[0]}, k] each"
            )
        if np.any(ids < 0):
            bad = np.argwhere(ids < 0)[0]
            raise ValueError(
                f"MoELayer(): the router chose expert {ids[tuple(bad)]} for token {bad[0]}; "
                f"expert ids must be in [0, {self.num_experts})"
            )
        threads = self.num_threads or 0
        store = self.experts if self.experts is not None else _Unstored(self.num_experts)
        fallback = out = None
        if self.expert_fn is not None:
            out = np.zeros_like(x)
            fallback = _user_experts(self.expert_fn, x, weights.reshape(-1), out, hidden)
        routed = run_experts(
            store,
            self.layer,
            x,
            ids,
            np.ascontiguousarray(weights),
            num_experts=self.num_experts,
            activation=self.activation,
            num_threads=threads,
            fallback=fallback,
            kernel=self.expert_fn is None,
            read_ahead=self.read_ahead,
        )
        if out is None:
            out = routed if routed is not None else np.zeros_like(x)
        if self.shared_expert is not None:
            shared = gated_ffn(x, self.shared_expert, self.activation, num_threads=threads)
            if self.shared_expert_gate is not None:
                shared *= 0.5 * (1.0 + np.tanh(0.5 * (x @ self.shared_expert_gate.T)))  # sigmoid
            out += shared
        return to_caller(round_to(out, name), hidden, name)


def _user_experts(expert_fn, x, flat_weights, out, like):
    """The engine's fallback around a user's ``expert_fn`` (rows in the caller's framework)."""

    def run(e: int, weights: Any, tokens: np.ndarray, assignments: np.ndarray) -> None:
        y = compute_rows(*float_host(expert_fn(e, to_caller(x[tokens], like), weights),
                                     f"expert_fn({e})'s result", "MoELayer"))  # fmt: skip
        if y.shape != (len(tokens), x.shape[1]):
            raise ValueError(
                f"expert_fn({e}) returned shape {tuple(y.shape)}; "
                f"expected [{len(tokens)}, {x.shape[1]}]"
            )
        np.add.at(out, tokens, flat_weights[assignments, None] * y)

    return run


def _float32_matrix(a: Any, what: str) -> np.ndarray:
    """A router weight or bias as float32 numpy (bfloat16 converted), no copy for float32."""
    arr, name = float_host(a, what, "MoELayer")
    return np.ascontiguousarray(compute_rows(arr, name), np.float32)


def _check_store(store: Any) -> None:
    """What the engine uses of a store is there (TypeError naming what is missing)."""
    missing = [a for a in ("capacity", "slot_bytes", "load", "advise") if not hasattr(store, a)]
    if missing:
        raise TypeError(
            f"MoELayer(): experts must be an ExpertStore (a colibri.Pager, InMemoryExperts, or "
            f"an object with capacity, slot_bytes, load() and advise()); "
            f"{type(store).__name__} lacks {', '.join(missing)}"
        )
