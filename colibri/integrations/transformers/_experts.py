"""colibri as a transformers experts implementation: routed experts paged, run by the engine.

transformers dispatches every experts module decorated with ``use_experts_implementation``
through ``ExpertsInterface`` by ``config._experts_implementation``; colibri registers its
forward there as ``"colibri"``. A paged model's experts modules keep their class and
configuration but not their weights: each carries the paging state of its layer, and its
forward converts the layer's tensors once and hands them to
:func:`colibri.layer.run_experts`, which loads the experts from the :class:`colibri.Pager`
under the budget and computes them (the fused kernel for decode-size experts, torch's
``linear`` on zero-copy views of the pager's memory for the rest).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import nn

from colibri._dlpack import to_caller
from colibri.integrations.transformers import _ops
from colibri.integrations.transformers._checkpoint import CheckpointError, layer_index
from colibri.integrations.transformers._linears import many
from colibri.integrations.transformers._ops import HALF_NAMES, bits_of
from colibri.integrations.transformers._predict import Predictor
from colibri.layer import ExpertWeights, HeldExperts, run_experts

__all__ = [
    "IMPLEMENTATION",
    "Paging",
    "UnsupportedCheckpointError",
    "computation",
    "expert_rows",
    "find_experts",
    "page",
]

#: The experts implementation's name in transformers' ``ExpertsInterface``.
IMPLEMENTATION = "colibri"
_ATTR = "_colibri_experts"  # the per-module paging state, outside nn.Module's registries
_KERNEL_DTYPES = set(HALF_NAMES)


class UnsupportedCheckpointError(CheckpointError):
    """A checkpoint whose routed experts colibri cannot page (the message says why)."""


@dataclass
class Paging:
    """The paging state of a model from :func:`from_pretrained` (``model.colibri``).

    Attributes
    ----------
    pager : colibri.Pager
        Serves the routed experts from the checkpoint's files.
    checkpoint : Checkpoint
        The directory, its config and tensor table.
    read_ahead : str
        How the experts of the next layer are guessed and read ahead: ``"gate"`` (layer
        l+1's router applied to layer l's input), ``"previous"`` (layer l+1's experts of the
        previous step) or ``"off"`` (no read-ahead at all, not even of a step's later
        chunks).
    resident_bytes : int
        Bytes of the tensors loaded resident (everything but the routed experts).
    expert_bytes : int
        Bytes of the routed experts in the checkpoint.
    num_threads : int
        Threads of colibri's expert kernels (0: colibri's default).
    layers : dict
        ``{layer index: routed experts}`` of every paged MoE layer.
    modules : dict
        ``{layer index: experts module}`` (the model's own, now paged).
    auto_budget : AutoBudget or None
        How ``budget="auto"`` sized the budget (None for a given budget).
    linears : dict
        ``{(out, in, dtype): LinearChoice}``: which engine runs the model's other linears of
        each shape, and the timings that chose it (``from_pretrained(linears=...)``).
    norms : list of str
        The RMSNorm modules on colibri's kernel at decode sizes.
    attention : str or None
        The model's attention implementation when colibri's kernel runs its decoding steps
        (``"colibri"``; None: transformers' own).
    decode : list of str
        The decoder layers whose one-token steps skip transformers' module calls (the same
        forwards called directly).
    """

    pager: Any
    checkpoint: Any
    read_ahead: str
    resident_bytes: int = 0
    expert_bytes: int = 0
    num_threads: int = 0
    layers: dict[int, int] = field(default_factory=dict)
    modules: dict[int, nn.Module] = field(default_factory=dict, repr=False)
    auto_budget: Any = None
    linears: dict = field(default_factory=dict)
    norms: list = field(default_factory=list)
    attention: str | None = None
    decode: list = field(default_factory=list)
    #: Experts spread over ranks (:mod:`colibri.distributed`): computes every paged experts
    #: module instead of :func:`run_experts`, ``remote(layer, x [T, H], ids [T, k] numpy,
    #: weights [T, k]) -> [T, H]``.
    remote: Callable | None = field(default=None, repr=False)
    predictor: Predictor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.predictor = Predictor(self.read_ahead)

    @property
    def stats(self):
        """The pager's counters (:class:`colibri.pager.PagerStats`)."""
        return self.pager.stats

    @property
    def prediction(self) -> dict:
        """``{"gate": PredictionStats, "previous": PredictionStats}``: how well each guess
        named the next layer's experts (``gate`` only measured with ``read_ahead="gate"``)."""
        return self.predictor.stats

    @property
    def holds_all(self) -> bool:
        """Whether the budget holds every expert: each is read once and stays, so no guess
        is worth its router pass."""
        return self.pager.capacity >= sum(self.layers.values())

    @property
    def closed(self) -> bool:
        return bool(self.pager.closed)

    def reset_stats(self) -> None:
        """Zero the pager's and the predictions' counters."""
        self.pager.reset_stats()
        self.predictor.reset()

    def close(self) -> None:
        """Release the pager (idempotent, safe in any order with :func:`unpatch`); the model
        raises a clear error if run afterwards (a distributed model's ranks stop serving)."""
        if self.remote is not None:
            self.remote.close()
        for module in self.modules.values():
            state = module.__dict__.get(_ATTR)
            if state is not None and state.held is not None:
                state.held.release()
        self.pager.close()

    def open_pager(self):
        """The pager, or a clear error once :meth:`close` was called."""
        if self.pager.closed:
            raise ValueError(
                "this model's expert pager is closed (model.colibri.close() was called); "
                "load the checkpoint again with from_pretrained()"
            )
        return self.pager


@dataclass
class _Layer:
    """One paged experts module: its layer, sizes and the model's paging state."""

    layer: int
    num_experts: int
    activation: str | None  # the fused kernel's name for the module's act_fn, if it has one
    paging: Paging
    act: Any = None  # the act_fn activation was read from (another one: read again)
    next: tuple | None = None  # (layer, router, block) of the next paged MoE block
    handle: int = 0  # names the module to the colibri::experts operator (compiled graphs)
    held: HeldExperts | None = None  # the layer's experts kept, when the budget holds all
    dispatch: Callable | None = None  # the class's forward: transformers' dispatch to ours


# -- which experts modules can be paged -----------------------------------------------------

# Families whose experts transformers computes in a way the pager cannot serve, by class.
_REFUSED = {
    "Llama4TextExperts": (
        "Llama4 stores its experts as transposed [E, H, 2I] / [E, I, H] tensors, so one "
        "expert's gate is not a contiguous byte range the pager can read. What works "
        "instead: transformers' own from_pretrained and patch(model)"
    ),
    "DbrxExperts": (
        "DBRX stores all experts of a layer as one [E*I, H] matrix per projection with its "
        "own routing inside the FFN block. What works instead: transformers' own "
        "from_pretrained and patch(model)"
    ),
}
#: Experts classes paged their own way, by class: ``(servable(module) -> reason or None,
#: page(name, module, paging) -> layer)``; their modules register here (_gpt_oss.py).
OWN_PAGING: dict[str, tuple[Callable, Callable]] = {}
# What transformers' decorator says of an experts class, and what colibri computes.
_FLAGS = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
          "has_post_expert_norm": False}  # fmt: skip


def _servable(module: nn.Module) -> str | None:
    """None if colibri computes ``module`` (a transformers experts module) exactly, else why."""
    from transformers.integrations.moe import _default_apply_gate

    name = type(module).__name__
    if name in OWN_PAGING:
        return OWN_PAGING[name][0](module)
    if name in _REFUSED:
        return _REFUSED[name]
    if not all(hasattr(module, flag) for flag in _FLAGS):
        return (
            f"{name} does not use transformers' experts interface (use_experts_implementation), "
            "so colibri cannot take over its forward"
        )
    for flag, want in _FLAGS.items():
        if getattr(module, flag) != want:
            return f"{name}.{flag} is {getattr(module, flag)!r}"
    if getattr(type(module), "_apply_gate", _default_apply_gate) is not _default_apply_gate:
        return f"{name} has its own gating (_apply_gate)"
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)):
        return f"{name} has no gate_up_proj/down_proj parameters"
    return None


def find_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every routed-experts module of ``model``: ``(qualified name, module)``.

    Raises
    ------
    UnsupportedCheckpointError
        Naming each experts module colibri cannot compute and why.
    """
    found, problems = [], []
    for name, module in model.named_modules():
        cls = type(module)
        if not cls.__name__.endswith("Experts") or not cls.__module__.startswith("transformers."):
            continue
        reason = _servable(module)
        if reason is None:
            if layer_index(name) is None:
                problems.append(f"{name}: no layer index in its name")
            found.append((name, module))
        else:
            problems.append(f"{name} ({cls.__name__}): {reason}")
    if problems:
        raise UnsupportedCheckpointError(
            "from_pretrained(): colibri cannot page these experts:\n  " + "\n  ".join(problems)
        )
    return found


def _kernel_activation(act: Any) -> str | None:
    """The fused kernel's name for an experts module's ``act_fn`` (SiLU), else None."""
    if isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation":
        return "silu"
    return None


def page(name: str, module: nn.Module, paging: Paging) -> int:
    """Make ``module`` a paged experts module of ``paging``: its weights go (they stay in the
    checkpoint, served by the pager) and its forward becomes colibri's. Returns its layer."""
    if type(module).__name__ in OWN_PAGING:
        return OWN_PAGING[type(module).__name__][1](name, module, paging)
    state = _Layer(
        layer=layer_index(name),
        num_experts=int(module.gate_up_proj.shape[0]),
        activation=_kernel_activation(module.act_fn),
        paging=paging,
        handle=_ops.handle(module),
        act=module.act_fn,
    )
    return attach(module, state, IMPLEMENTATION, experts_forward)


def _fresh(module: nn.Module, state: _Layer) -> _Layer:
    """``state`` with its activation read again when ``module``'s ``act_fn`` was replaced
    since it was read (the experts held for the old one let go): a module given another
    activation after loading computes with it, on the kernel only where it is the kernel's."""
    children = module.__dict__.get("_modules", {})  # a module act_fn, without __getattr__
    act = children["act_fn"] if "act_fn" in children else getattr(module, "act_fn", None)
    if act is not state.act:
        state.act, state.activation, state.held = act, _kernel_activation(act), None
    return state


def attach(module: nn.Module, state: _Layer, implementation: str, forward: Callable) -> int:
    """Give ``module`` the paging ``state``: ``forward`` becomes its computation (registered
    once as transformers' experts implementation ``implementation``) and its routed weights
    go (meta tensors: nothing to free, nothing to load). Returns its layer."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

    if implementation not in ALL_EXPERTS_FUNCTIONS:  # once: a wrapper put there stays
        ExpertsInterface.register(implementation, forward)
    state.paging.layers[state.layer] = state.num_experts
    state.paging.modules[state.layer] = module
    for weight in ("gate_up_proj", "down_proj"):
        del module._parameters[weight]
    module.__dict__[_ATTR] = state
    module.config._experts_implementation_internal = implementation
    state.dispatch = type(module).forward
    return state.layer


def held(module: nn.Module, dtype: torch.dtype, picked: tuple | None = None) -> HeldExperts | None:
    """The held experts (:class:`colibri.layer.HeldExperts`) that ``module``'s forward would
    compute one ``dtype`` row with, for a caller that makes the call itself
    (:mod:`._decode`): its class's forward still transformers' dispatch, which still picks
    colibri's, no forward of its own, experts already held. None otherwise: call its
    forward (which holds them at its first call). ``picked``: ``(config, function)``, what
    :func:`picked_for` gave for a config the caller read once for several layers (a token's)."""
    state = module.__dict__.get(_ATTR)
    if state is not None:
        _fresh(module, state)
    if (
        state is None
        or state.held is None
        or state.activation is None
        or dtype not in _KERNEL_DTYPES
        or "forward" in module.__dict__
        or type(module).forward is not state.dispatch
    ):
        return None
    config = module.config
    function = picked[1] if picked is not None and picked[0] is config else picked_for(config)
    if function is not experts_forward:
        return None
    state.paging.open_pager()  # a clear error once closed
    return state.held


_FUNCTIONS: list = []  # transformers' ALL_EXPERTS_FUNCTIONS, imported once


def picked_for(config: Any) -> Any:
    """The experts function transformers dispatches to for ``config`` (its
    ``_experts_implementation`` in ``ALL_EXPERTS_FUNCTIONS``; None when none)."""
    if not _FUNCTIONS:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        _FUNCTIONS.append(ALL_EXPERTS_FUNCTIONS)
    return _FUNCTIONS[0].get(implementation(config, "experts"))


def implementation(config: Any, kind: str) -> Any:
    """``config._{kind}_implementation`` (``kind`` ``"attn"`` or ``"experts"``), read where
    transformers keeps it (``_{kind}_implementation_internal`` in the config's ``__dict__``,
    behind a property and two ``__getattribute__`` overrides: microseconds a read, and a
    decoding step reads it every layer); through the property where it is kept elsewhere."""
    found = config.__dict__.get(_INTERNAL[kind], _INTERNAL)
    return getattr(config, f"_{kind}_implementation") if found is _INTERNAL else found


_INTERNAL = {kind: f"_{kind}_implementation_internal" for kind in ("attn", "experts")}


def paged_layers(paging: Paging) -> dict[int, _Layer]:
    """The paging state of each paged experts module, by layer."""
    return {layer: module.__dict__[_ATTR] for layer, module in paging.modules.items()}


def _torch_view(m: Any, dtype: str, like: torch.Tensor) -> torch.Tensor:
    """A torch tensor over an expert matrix's memory, no copy (read-only: never written)."""
    arr = np.asarray(m)
    return to_caller(arr, like, dtype) if dtype == "bfloat16" else torch.from_numpy(arr)


def paged_state(module: nn.Module, implementation: str) -> _Layer:
    """The paging state :func:`attach` gave ``module``, or a clear error."""
    state = module.__dict__.get(_ATTR)
    if state is None:
        raise RuntimeError(
            f"{type(module).__name__}: experts_implementation={implementation!r} runs the "
            "experts of a model loaded by colibri.integrations.transformers.from_pretrained "
            "(their weights are paged from the checkpoint); this module has none"
        )
    return state


def routed(
    state: _Layer, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """A layer's routing as its experts call gets it: ids and weights ``[T, k]``, and the ids
    as numpy with transformers' sentinels (ids out of range: no expert) as -1; the
    predictor told which experts the layer uses."""
    ids = top_k_index.reshape(top_k_index.shape[0], -1)
    weights = top_k_weights.reshape(ids.shape)
    ids_np = ids.detach().cpu().numpy()
    valid = (ids_np >= 0) & (ids_np < state.num_experts)
    if not valid.all():
        ids_np = np.where(valid, ids_np, -1)
    state.paging.predictor.observe(state.layer, np.unique(ids_np[valid]))
    return ids, weights, ids_np


def next_guess(state: _Layer, hidden_states: torch.Tensor) -> Callable | None:
    """The next paged layer's read-ahead guess from ``hidden_states`` (called by the engine
    when it has time), None when there is nothing to read ahead."""
    paging, nxt = state.paging, state.next
    if nxt is None or paging.read_ahead == "off" or paging.holds_all:
        return None
    return lambda: paging.predictor.guess(nxt, hidden_states)


def _spans(n: int) -> list[int]:
    """``n`` as powers of two, largest first (13: 8, 4, 1)."""
    return [1 << b for b in range(n.bit_length() - 1, -1, -1) if n >> b & 1]


def computation(module: nn.Module) -> tuple[int, Callable, str | None] | None:
    """How an experts module's experts are computed elsewhere (:mod:`colibri.distributed`):
    ``(E, torch path (weights, x [n, H]) -> [n, H], fused kernel's activation or None)``;
    None for a family paged its own way (:data:`OWN_PAGING`)."""
    if type(module).__name__ in OWN_PAGING:
        return None
    act = module.act_fn
    return int(module.gate_up_proj.shape[0]), partial(expert_rows, act), _kernel_activation(act)


def expert_rows(act_fn: Callable, w: ExpertWeights, x_e: torch.Tensor) -> torch.Tensor:
    """One expert on rows ``x_e [n, H]`` in torch: ``down(act_fn(gate x) * up x)``, ``[n, H]``
    in ``x_e``'s dtype, on zero-copy views of the pager's memory (a copy if the model runs in
    another dtype than stored); each linear in float32 where the CPU does not compute the
    half type natively (:func:`._linears.many`), rounded once as torch's own."""
    with warnings.catch_warnings():  # torch warns: the pager's arrays are read-only
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        gate, up, down = (_torch_view(m, w.dtype, x_e) for m in w)
    if gate.dtype != x_e.dtype:  # a model run in another dtype than stored: a copy
        gate, up, down = gate.to(x_e.dtype), up.to(x_e.dtype), down.to(x_e.dtype)
    h = x_e.new_empty(x_e.shape[0], down.shape[0])
    start = 0
    # Row counts in powers of two: oneDNN keeps a kernel per matmul shape it has run, and
    # every token count an expert gets would add one (+29 MiB of peak RSS over a run).
    for size in _spans(x_e.shape[0]):
        rows = slice(start, start + size)
        part = x_e[rows]
        h[rows] = many(act_fn(many(part, gate, None)) * many(part, up, None), down, None)
        start += size
    return h


def _holder(state: _Layer) -> HeldExperts | None:
    """``state.held``, made when the budget holds every expert (and the kernel computes the
    layer's experts); None otherwise."""
    paging = state.paging
    if (
        state.held is None
        and state.activation is not None
        and paging.remote is None
        and paging.holds_all
    ):
        state.held = HeldExperts(
            paging.open_pager(),
            state.layer,
            num_experts=state.num_experts,
            activation=state.activation,
            num_threads=paging.num_threads,
        )
    return state.held


def hold_all(paging: Paging) -> None:
    """Load and hold every expert of each layer when the budget holds them all, as a loader
    would (llama.cpp reads and repacks its weights at load): no token waits on a first
    read, or on the copy of a layout the kernel takes (Q4_0 rows interleaved by eight)."""
    for state in paged_layers(paging).values():
        holder = _holder(state)
        if holder is not None:
            holder.hold()


def _held_forward(
    state: _Layer,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor | None:
    """The experts of a budget that holds them all, kept between steps (no load a step:
    :class:`colibri.layer.HeldExperts`); None when this step needs :func:`run_experts`."""
    if state.held is None and _holder(state) is None:
        return None
    state.paging.open_pager()  # a clear error once closed
    x = hidden_states.detach()
    if not x.is_contiguous():
        x = x.contiguous()
    ids = top_k_index.detach().reshape(x.shape[0], -1)
    weights = top_k_weights.detach().reshape(ids.shape)
    weights = weights.contiguous() if weights.dtype == x.dtype else weights.float().contiguous()
    out = torch.empty_like(x)
    y = state.held(
        bits_of(x),
        ids.numpy(),
        bits_of(weights) if weights.dtype == x.dtype else weights.numpy(),
        dtype=HALF_NAMES[x.dtype],
        out=bits_of(out),
    )
    return None if y is None else out


def experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """transformers' experts call, ``[T, H], [T, k], [T, k] -> [T, H]``:
    ``y[t] = sum_j w[t, j] * down_e(act(gate_e x) * up_e x)`` over ``e = top_k_index[t, j]``,
    computed by colibri's engine on the experts the pager serves."""
    state = paged_state(self, IMPLEMENTATION)
    if torch.compiler.is_compiling():  # an opaque node of the graph
        return _ops.experts(state.handle, hidden_states, top_k_index, top_k_weights)
    _fresh(self, state)
    if state.activation is not None and hidden_states.dtype in _KERNEL_DTYPES:
        y = _held_forward(state, hidden_states, top_k_index, top_k_weights)
        if y is not None:
            return y
    ids, weights, ids_np = routed(state, top_k_index, top_k_weights)
    if state.paging.remote is not None:  # experts spread over ranks (colibri.distributed)
        guess = next_guess(state, hidden_states)
        return state.paging.remote(state.layer, hidden_states, ids_np, weights, guess)
    x = hidden_states.detach().float().numpy()  # no copy for float32
    out = None  # the fallback's sums, made by its first expert

    def fallback(e: int, w: ExpertWeights, tokens: np.ndarray, assignments: np.ndarray) -> None:
        nonlocal out
        if out is None:
            out = torch.zeros_like(hidden_states)
        token_t = torch.from_numpy(tokens)
        slot_t = torch.from_numpy(assignments % ids.shape[1])
        h = expert_rows(self.act_fn, w, hidden_states[token_t])
        out.index_add_(0, token_t, (h * weights[token_t, slot_t, None]).to(out.dtype))

    paging = state.paging
    sums = run_experts(
        paging.open_pager(),
        state.layer,
        x,
        ids_np,
        weights.detach().float().numpy(),
        num_experts=state.num_experts,
        activation=state.activation or "silu",
        num_threads=paging.num_threads,
        fallback=fallback,
        kernel=state.activation is not None and hidden_states.dtype in _KERNEL_DTYPES,
        read_ahead=paging.read_ahead != "off",
        next_layer=next_guess(state, hidden_states),
    )
    if sums is None:  # every expert ran in the fallback (or none was chosen)
        return torch.zeros_like(hidden_states) if out is None else out
    fused = torch.from_numpy(sums).to(hidden_states.dtype)  # summed in float32
    if out is None:
        return fused
    out += fused
    return out
