"""``patch``/``unpatch``: colibri routing attached to the routers of a loaded model."""

from __future__ import annotations

import functools
import inspect
import itertools
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from colibri._validate import check_threads
from colibri.integrations.transformers import _ops
from colibri.integrations.transformers._families import _KINDS, UnsupportedRouterError, _Kind
from colibri.integrations.transformers._match import _classify, _family
from colibri.integrations.transformers._seen import scalars


@dataclass(frozen=True)
class PatchedRouter:
    """One router that ``patch`` replaced.

    Attributes
    ----------
    name : str
        The module's qualified name in the model (``model.layers.0.mlp.gate``).
    family : str
        The transformers model family the router class comes from (``mixtral``).
    router_class : str
        The router's class name.
    kind : str
        The routing implementation colibri recognised.
    num_experts, top_k : int
        Routed experts and experts per token.
    options : dict
        The colibri routing options, with ``correction_bias``/``expert_scale`` shown
        as the name of the tensor they are read from (re-read when it changes).
    """

    name: str
    family: str
    router_class: str
    kind: str
    num_experts: int
    top_k: int
    options: dict[str, Any] = field(hash=False)


# --------------------------------------------------------------------------------------
# Routing state attached to a patched module.


class _Routing:
    """A colibri context for one router, rebuilt when a tensor option changes.

    ``tensors`` maps a colibri option (``correction_bias``, ``expert_scale``) to a reader
    of the module's live parameter/buffer; the context is rebuilt when one of them is
    replaced or modified in place (``load_state_dict``, ``.to()``), tracked by identity
    and torch's version counter. ``handle`` names it to the ``colibri::route`` operator,
    which routes in compiled graphs.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        options: dict[str, Any],
        tensors: dict[str, Callable[[Any], torch.Tensor]],
        num_threads: int | None,
        module: Any = None,
    ) -> None:
        self.num_experts = num_experts
        self.top_k = top_k
        self.options = dict(options)
        self.tensors = tensors
        self.num_threads = num_threads
        self._ctx: Any = None
        self._key: tuple | None = None
        self.handle = _ops.handle(self)
        if module is not None:  # build now: colibri validates the options at patch time
            self._refresh({name: read(module) for name, read in tensors.items()})

    def __deepcopy__(self, memo: dict) -> _Routing:
        # a copied model gets its own context, built from its own tensors on first use
        return _Routing(self.num_experts, self.top_k, self.options, self.tensors, self.num_threads)

    def _refresh(self, live: dict[str, torch.Tensor]) -> None:
        key = tuple((name, id(t), t._version, t.dtype) for name, t in sorted(live.items()))
        if key == self._key:
            return
        import colibri

        options = dict(self.options)
        for name, tensor in live.items():
            options[name] = tensor.detach().to("cpu").float().numpy().copy()
        if self.num_threads is not None:
            options["routing_threads"] = self.num_threads
        self._ctx = colibri.init(self.num_experts, self.top_k, ids_dtype="int64", **options)
        self._key = key

    def context(self, live: dict[str, torch.Tensor]) -> Any:
        """The colibri context for the tensor options ``live`` (rebuilt if they changed)."""
        if live or self._ctx is None:
            self._refresh(live)
        return self._ctx

    def route(
        self, module: Any, logits: torch.Tensor, **given: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Route ``logits`` ``[T, E]``: ids ``[T, k]`` int64 and weights ``[T, k]`` float32.

        ``given`` holds tensor options the block passes at call time (MiniMax-M2's bias).
        """
        live = {name: read(module) for name, read in self.tensors.items()}
        live.update(given)
        if logits.requires_grad and module.training and torch.is_grad_enabled():
            raise RuntimeError(
                f"{type(module).__name__} is in training mode with gradients on, but colibri's "
                "routing weights carry no gradient back to the router: call model.eval() (or "
                "run under torch.no_grad()) for inference, or unpatch(model) to train"
            )
        if not logits.is_cpu:
            raise ValueError(
                f"colibri routes on the CPU, but the router logits are on {logits.device}; "
                "run the model on the CPU or unpatch it (colibri.integrations.transformers"
                ".unpatch(model))"
            )
        if logits.dim() != 2:
            logits = logits.reshape(-1, logits.shape[-1])
        if torch.compiler.is_compiling():  # an opaque node of the graph
            return _ops.route(self.handle, logits, live)
        return self.context(live).route(logits.detach())


# --------------------------------------------------------------------------------------
# Public API.

_STATE = "_colibri_routing"


@dataclass
class _State:
    kind: _Kind
    routing: _Routing
    record: PatchedRouter
    scalars: tuple  # the module's plain attributes its routing was configured from
    configured: frozenset  # the options its kind's configure gave (others were added since)


def _build(name: str, module: Any, kind: _Kind, config: tuple, num_threads: int | None,
           added: dict | None = None) -> _State:  # fmt: skip
    """The state of ``module`` routed by ``kind`` as ``kind.configure`` gave ``config``, with
    the options ``added`` since (a partition's).

    Raises
    ------
    UnsupportedRouterError
        colibri refuses the configuration.
    """
    num_experts, top_k, configured, tensors = config
    options = {**configured, **(added or {})}
    try:
        routing = _Routing(int(num_experts), int(top_k), options, tensors, num_threads, module)
    except (TypeError, ValueError) as err:
        raise UnsupportedRouterError(
            f"{name or '<model>'} ({type(module).__name__}, family "
            f"{_family(type(module))}): colibri refuses its configuration: {err}"
        ) from err
    shown = dict(options)
    shown.update({option: f"<{option} tensor>" for option in tensors})
    record = PatchedRouter(
        name=name,
        family=_family(type(module)),
        router_class=type(module).__name__,
        kind=kind.name,
        num_experts=int(num_experts),
        top_k=int(top_k),
        options=shown,
    )
    return _State(kind, routing, record, scalars(module), frozenset(configured))


def _state(module: Any) -> _State:
    """``module``'s state, configured again (a new state, keeping the options added since)
    when a plain attribute changed since it was made: a router's ``top_k`` set after
    patching routes to that many."""
    state = module.__dict__[_STATE]
    if torch.compiler.is_compiling():  # a graph keeps the settings it was traced with
        return state
    if scalars(module) != state.scalars:
        routing = state.routing
        added = {k: v for k, v in routing.options.items() if k not in state.configured}
        config = state.kind.configure(module)
        state = _build(state.record.name, module, state.kind, config, routing.num_threads,
                       added)  # fmt: skip
        module.__dict__[_STATE] = state
    return state


def _patched_call(self, *args, **kwargs):
    state = _state(self)
    return state.kind.forward(self, state.routing, *args, **kwargs)


def routed(module: Any) -> Callable | None:
    """``f(logits)``: what ``module``'s patched forward returns once its logits' linear
    ``linear(module, hidden)`` (:mod:`._linears`) gave ``logits`` ``[T, E]``, for a caller
    that computed them itself; None when its forward is not colibri's or has other steps."""
    if _STATE not in module.__dict__:
        return None
    state = _state(module)
    forward = module.__dict__.get(state.kind.method)
    rest = getattr(state.kind.forward, "routed", None)
    if rest is None or getattr(forward, "__func__", None) is not _patched_call:
        return None
    return functools.partial(rest, module, state.routing)


def plain(module: Any) -> tuple | None:
    """``(context, weights)`` for a caller that routes ``module``'s logits ``[T, E]`` itself,
    as its patched forward would: ``context.route(logits)`` gives ids and float32 weights,
    then rounded to the logits' dtype when ``weights`` is ``"logits"`` (else kept float32).
    None unless the forward is colibri's softmax routing with no tensor options."""
    if _STATE not in module.__dict__:
        return None
    state = _state(module)
    forward = module.__dict__.get(state.kind.method)
    weights = getattr(getattr(state.kind.forward, "routed", None), "weights", None)
    if (
        weights is None
        or state.routing.tensors
        or (getattr(forward, "__func__", None) is not _patched_call)
    ):
        return None
    return state.routing.context({}), weights


def supported_routers() -> dict[str, str]:
    """The routing implementations colibri maps, by kind, with the transformers router
    classes (importable in this environment) that use each.

    Returns
    -------
    dict
        ``{kind: "Class1 Class2 ..."}``. Walks ``transformers.models``: slow (seconds).
    """
    import importlib
    import pkgutil

    import transformers.models

    found: dict[str, list[str]] = {kind.name: [] for kind in _KINDS}
    for info in pkgutil.iter_modules(transformers.models.__path__):
        try:
            module = importlib.import_module(
                f"transformers.models.{info.name}.modeling_{info.name}"
            )
        except Exception:  # a family whose optional dependencies are missing: not listed
            continue
        for obj in vars(module).values():
            if inspect.isclass(obj) and obj.__module__ == module.__name__:
                kind, _ = _classify(obj)
                if kind is not None:
                    found[kind.name].append(obj.__name__)
    return {name: " ".join(classes) for name, classes in found.items()}


def patch(
    model: torch.nn.Module,
    *,
    num_threads: int | None = None,
    skip_unsupported: bool = False,
) -> list[PatchedRouter]:
    """Route every MoE block of ``model`` with colibri.

    Parameters
    ----------
    model : torch.nn.Module
        A loaded transformers model (any head: ``AutoModelForCausalLM``, base model,
        vision-language model...), on the CPU.
    num_threads : int, optional
        Threads for colibri's routing (default: colibri's default).
    skip_unsupported : bool
        Leave routers colibri cannot reproduce (e.g. PhiMoE's sparsemixer) on
        transformers' own code instead of raising; they are not in the result.

    Returns
    -------
    list of PatchedRouter
        One entry per patched router, in module order (also ``patched_routers(model)``).

    Raises
    ------
    UnsupportedRouterError
        A router (or its configuration) colibri cannot reproduce exactly; the message
        names the module, the family and the reason. Nothing is patched then.
    ValueError
        The model has no MoE router colibri knows, or lives off the CPU.
    """
    if num_threads is not None:
        check_threads(num_threads, "patch(): num_threads")
    plan: list[tuple[str, Any, _Kind, tuple]] = []
    problems: list[str] = []
    for name, module in model.named_modules():
        kind, reason = _classify(type(module))
        label = f"{name or '<model>'} ({type(module).__name__}, family {_family(type(module))})"
        if kind is None:
            if reason is not None and not skip_unsupported:
                problems.append(f"{label}: {reason}")
            continue
        try:
            config = kind.configure(module)
        except UnsupportedRouterError as err:
            if not skip_unsupported:
                problems.append(f"{label}: {err}")
            continue
        plan.append((name, module, kind, config))
    if problems:
        raise UnsupportedRouterError(
            "colibri cannot route these MoE routers exactly:\n  "
            + "\n  ".join(problems)
            + "\nPass skip_unsupported=True to leave them on transformers' own routing."
        )
    if not plan:
        raise ValueError(
            f"no MoE router colibri knows in {type(model).__name__}; supported kinds: "
            + ", ".join(kind.name for kind in _KINDS)
        )
    for name, module, _, _ in plan:
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            if tensor.device.type != "cpu":
                raise ValueError(
                    f"{name or '<model>'}: tensors on {tensor.device}; colibri routes on the "
                    "CPU (move the model with model.to('cpu') first)"
                )

    # Every context first (colibri validates the options), then install: all or nothing.
    states = [_build(name, module, kind, config, num_threads)
              for name, module, kind, config in plan]  # fmt: skip
    patched = []
    for (_, module, kind, _), state in zip(plan, states, strict=True):
        _remove(module)
        # Plain instance attributes: the state dict, hooks and the class stay untouched;
        # a bound method (not a closure) so that copy.deepcopy rebinds it to the copy.
        module.__dict__[_STATE] = state
        module.__dict__[kind.method] = types.MethodType(_patched_call, module)
        patched.append(state.record)
    return patched


def patched_routers(model: torch.nn.Module) -> list[PatchedRouter]:
    """The routers of ``model`` currently routed by colibri, in module order."""
    return [
        module.__dict__[_STATE].record
        for _, module in model.named_modules()
        if _STATE in module.__dict__
    ]


def unpatch(model: torch.nn.Module) -> int:
    """Give every patched router back its transformers routing; returns how many."""
    return sum(_remove(module) for _, module in model.named_modules())


def _remove(module: Any) -> bool:
    state = module.__dict__.pop(_STATE, None)
    if state is None:
        return False
    module.__dict__.pop(state.kind.method, None)
    return True
