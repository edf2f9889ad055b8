"""Transformers checkpoints bigger than memory: routed experts paged by colibri.

``from_pretrained(path, budget=...)`` builds the model of a checkpoint directory without
materialising its weights, loads every tensor but the routed experts from the checkpoint's
safetensors files, replaces each MoE block's experts module with :class:`PagedExperts` (its
weights read on demand from the checkpoint's own files by a :class:`colibri.Pager` under the
budget, computed in torch on zero-copy views of the pager's memory), and routes every block
with colibri exactly as :func:`patch` does. ``model.generate()`` works unchanged.
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from colibri.integrations.transformers._checkpoint import Checkpoint, CheckpointError
from colibri.integrations.transformers._families import _fingerprint
from colibri.integrations.transformers._patch import _STATE, patch, patched_routers
from colibri.layer import _ffn
from colibri.layer._moe import _half_bits

__all__ = [
    "PagedExperts",
    "Paging",
    "PredictionStats",
    "UnsupportedCheckpointError",
    "from_pretrained",
    "parse_size",
]

PREFETCH_MODES = ("gate", "previous", "off")


def _kernel_rows() -> int:
    """Rows per expert up to which the fused kernel runs (decoding; torch's GEMMs win beyond,
    on CPUs with AMX or AVX512_BF16 from about 4 rows: bench/README.md, Kernels).
    ``COLIBRI_EXPERT_KERNEL=0`` turns it off (torch's ``linear`` for every expert), to compare
    or to rule the kernel out in a bug report."""
    value = os.environ.get("COLIBRI_EXPERT_KERNEL", "1")
    if value not in ("0", "1"):
        raise ValueError(f'COLIBRI_EXPERT_KERNEL must be "0" or "1" (got {value!r})')
    return 2 if value == "1" else 0


_KERNEL_ROWS = _kernel_rows()
_KERNEL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_SILU = _ffn.ACTIVATIONS["silu"]


def _kernel_weights(w: Any, dtype: torch.dtype) -> tuple[np.ndarray, ...] | None:
    """An expert's (gate, up, down) as uint16 bits for the fused kernel, None unless all three
    are stored in ``dtype`` (float16 or bfloat16)."""
    bits = [_half_bits(m) for m in (w.gate, w.up, w.down)]
    if any(b is None or b[1] != _KERNEL_DTYPES.get(dtype) for b in bits):
        return None
    return tuple(b[0] for b in bits)


def _fused_expert(
    x32: np.ndarray, w: Any, dtype: torch.dtype, threads: int = 0
) -> torch.Tensor | None:
    """``down @ (silu(gate @ x) * (up @ x))`` for float32 rows ``x32 [n, H]`` through
    colibri's fused kernel, straight on the pager's arrays, as a ``dtype`` tensor ``[n, H]``;
    None unless the weights are stored in ``dtype`` (float16 or bfloat16)."""
    bits = _kernel_weights(w, dtype)
    if bits is None:
        return None
    g, u, d = bits
    y = np.empty((x32.shape[0], d.shape[0]), np.float32)
    _ffn.ffn(x32, g, u, d, _ffn.WEIGHT_KINDS[_KERNEL_DTYPES[dtype]], _SILU, y, threads)
    return torch.from_numpy(y).to(dtype)  # nearest even, as torch rounds its own products


def _is_silu(act: Any) -> bool:
    """Whether an experts module's ``act_fn`` is SiLU (torch's or transformers' own class)."""
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


class UnsupportedCheckpointError(CheckpointError):
    """A checkpoint whose routed experts colibri cannot page (the message says why)."""


# --------------------------------------------------------------------------------------
# Sizes.

_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
    "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
    "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}  # fmt: skip


def parse_size(value: int | str, what: str = "budget") -> int:
    """Bytes from an int or a string with a unit: ``805306368``, ``"768MiB"``, ``"3GiB"``,
    ``"3GB"`` (10**9), ``"512M"`` (binary, as ``M``/``G`` are commonly meant)."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"from_pretrained(): {what} must be a positive size (got {value!r})")
        return int(value)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if m and m[2].lower() in _UNITS:
            size = int(float(m[1]) * _UNITS[m[2].lower()])
            if size > 0:
                return size
    raise ValueError(
        f"from_pretrained(): {what} must be a positive size in bytes or with a unit, e.g. "
        f"805306368, '768MiB', '3GiB' (got {value!r})"
    )


# --------------------------------------------------------------------------------------
# Which experts modules can be paged.

# Fingerprints (``_families._fingerprint`` of the original forward) of
# transformers 5.23's experts implementations: the one colibri computes, and those it cannot.
_STANDARD = frozenset({"40b5d4608822"})
_UNSERVABLE: dict[str, str] = {
    "b932d708aef2": (
        "gpt-oss stores its experts as MXFP4 blocks in the released checkpoints and, in every "
        "form, as one transposed [E, H, 2I] tensor with gate and up interleaved column by "
        "column, biases and a clamped SwiGLU; the pager serves plain row-major gate [I, H], "
        "up [I, H] and down [H, I] matrices. What works instead: transformers' own "
        "from_pretrained (experts resident) and colibri routing through patch(model)"
    ),
    "0a2f85e9b9bc": (
        "Llama4 stores its experts as transposed [E, H, 2I] / [E, I, H] tensors, so one "
        "expert's gate is not a contiguous byte range the pager can read. What works "
        "instead: transformers' own from_pretrained and patch(model)"
    ),
    "b7cfe9750199": (
        "DBRX stores all experts of a layer as one [E*I, H] matrix per projection with its "
        "own routing inside the FFN block. What works instead: transformers' own "
        "from_pretrained and patch(model)"
    ),
}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _experts_fingerprint(cls: type) -> str | None:

    forward = getattr(cls, "forward", None)
    forward = getattr(forward, "__wrapped__", forward)
    try:
        return _fingerprint(forward)
    except (OSError, TypeError):
        return None


def _servable(module: nn.Module) -> str | None:
    """None if colibri computes ``module`` (a transformers experts module) exactly, else why."""
    from transformers.integrations.moe import _default_apply_gate

    fp = _experts_fingerprint(type(module))
    if fp in _UNSERVABLE:
        return _UNSERVABLE[fp]
    if fp not in _STANDARD:
        return (
            f"its experts code ({type(module).__name__}.forward) is not one colibri was "
            "checked against (transformers 5.23's gated experts)"
        )
    flags = {
        "has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
        "has_post_expert_norm": False,
    }  # fmt: skip
    for flag, want in flags.items():
        if getattr(module, flag, want) != want:
            return f"{type(module).__name__}.{flag} is {getattr(module, flag)!r}"
    if getattr(type(module), "_apply_gate", _default_apply_gate) is not _default_apply_gate:
        return f"{type(module).__name__} has its own gating (_apply_gate)"
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)):
        return f"{type(module).__name__} has no gate_up_proj/down_proj parameters"
    return None


def _find_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every routed-experts module of ``model``: ``(qualified name, module)``."""
    found, problems = [], []
    for name, module in model.named_modules():
        cls = type(module)
        if not cls.__name__.endswith("Experts") or not cls.__module__.startswith("transformers."):
            continue
        reason = _servable(module)
        if reason is None:
            if _LAYER.search(name) is None:
                problems.append(f"{name}: no layer index in its name")
            found.append((name, module))
        else:
            problems.append(f"{name} ({cls.__name__}): {reason}")
    if problems:
        raise UnsupportedCheckpointError(
            "from_pretrained(): colibri cannot page these experts:\n  " + "\n  ".join(problems)
        )
    return found


# --------------------------------------------------------------------------------------
# Zero-copy torch views of the pager's numpy arrays.

_TORCH_DTYPES = {
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float16): torch.float16,
    np.dtype(np.float64): torch.float64,
}


def torch_view(array: np.ndarray) -> torch.Tensor:
    """A torch tensor over ``array``'s memory (no copy); bfloat16 arrays (ml_dtypes or raw
    uint16 bits) become ``torch.bfloat16``. Read-only memory: never write to the result."""
    if array.dtype in _TORCH_DTYPES:
        return torch.from_numpy(array)
    if array.dtype.itemsize == 2:  # bfloat16 (ml_dtypes) or its raw bits
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    raise TypeError(f"torch_view(): expert dtype {array.dtype} has no torch equivalent")


# --------------------------------------------------------------------------------------
# Prediction of the next layer's experts.


@dataclass
class PredictionStats:
    """How well a strategy predicted the next MoE layer's experts.

    ``recall`` = predicted experts that were then used / experts used, over every step
    (one step: one forward of one layer; sets of unique experts).
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


@dataclass
class Paging:
    """The paging state of a model from :func:`from_pretrained` (``model.colibri``).

    Attributes
    ----------
    pager : colibri.Pager
        Serves the routed experts from the checkpoint's files.
    checkpoint : Checkpoint
        The directory, its config and tensor table.
    prefetch : str
        ``"gate"`` (layer l+1's router applied to layer l's input), ``"previous"`` (layer
        l+1's experts of the previous step) or ``"off"``.
    resident_bytes : int
        Bytes of the tensors loaded resident (everything but the routed experts).
    expert_bytes : int
        Bytes of the routed experts in the checkpoint.
    threads : int
        Threads of the expert kernels (0: OpenMP's default).
    prediction : dict
        ``{"gate": PredictionStats, "previous": PredictionStats}``: both are measured
        (``gate`` only when ``prefetch="gate"``), whichever one prefetches.
    """

    pager: Any
    checkpoint: Checkpoint
    prefetch: str
    resident_bytes: int
    expert_bytes: int
    layers: list[PagedExperts] = field(default_factory=list, repr=False)
    prediction: dict[str, PredictionStats] = field(default_factory=dict)
    _last: dict[int, np.ndarray] = field(default_factory=dict, repr=False)
    _guess: dict[tuple[str, int], np.ndarray] = field(default_factory=dict, repr=False)
    _chunk: int = 0
    _holds_all: bool = False  # the budget holds every expert: nothing is ever evicted
    threads: int = 0

    def __post_init__(self) -> None:
        self.prediction = {"gate": PredictionStats(), "previous": PredictionStats()}
        capacity = getattr(self.pager, "capacity", None)
        if capacity is None:
            slot = -(-self.pager.source.max_expert_nbytes // self.pager.page_size)
            capacity = self.pager.budget_bytes // (slot * self.pager.page_size)
        self._chunk = max(1, int(capacity))
        self._holds_all = capacity >= sum(layer.num_experts for layer in self.layers)

    @property
    def stats(self):
        """The pager's counters (:class:`colibri.PagerStats`)."""
        return self.pager.stats

    @property
    def closed(self) -> bool:
        return bool(self.pager.closed)

    def reset_stats(self) -> None:
        """Zero the pager's and the predictions' counters."""
        self.pager.reset_stats()
        self.prediction = {"gate": PredictionStats(), "previous": PredictionStats()}

    def close(self) -> None:
        """Release the pager (idempotent, safe in any order with :func:`unpatch`); the model
        raises a clear error if run afterwards."""
        self.pager.close()

    # -- used by PagedExperts -----------------------------------------------------------------

    def _open_pager(self):
        if self.pager.closed:
            raise ValueError(
                "this model's expert pager is closed (model.colibri.close() was called); "
                "load the checkpoint again with from_pretrained()"
            )
        return self.pager

    def _observe(self, layer: int, used: np.ndarray) -> None:
        """Score the predictions made for ``layer`` against the experts it used."""
        for mode in ("gate", "previous"):
            guess = self._guess.pop((mode, layer), None)
            if guess is None:
                continue
            stats = self.prediction[mode]
            stats.used += len(used)
            stats.predicted += len(guess)
            stats.correct += len(np.intersect1d(guess, used, assume_unique=True))

    def _load(self, layer: int, ids: np.ndarray):
        """``pager.load`` of at most ``self._chunk`` experts; halves the chunk when views kept
        elsewhere (or prefetches in flight) leave fewer slots."""
        from colibri.pager import BudgetError

        try:
            return self._open_pager().load(layer, ids)
        except BudgetError:
            if len(ids) <= 1:
                raise
            self._chunk = max(1, len(ids) // 2)
            raise _Retry from None


class _Rows:
    """A layer call's rows as float32 numpy (``x [T, H]``) for the fused kernel, the dtype
    they came in, and the float32 sums of the experts run in one call (``sums``)."""

    def __init__(self, hidden_states: torch.Tensor, threads: int) -> None:
        self.x = hidden_states.detach().float().numpy()
        self.threads = threads  # 0: OpenMP's default
        self.dtype = hidden_states.dtype
        self.sums: np.ndarray | None = None


class _Retry(Exception):
    """The chunk size shrank: PagedExperts restarts the layer's loop with smaller chunks."""


# --------------------------------------------------------------------------------------
# The experts module.


class PagedExperts(nn.Module):
    """A transformers experts module whose weights live in a :class:`colibri.Pager`.

    Same call as the module it replaces: ``forward(hidden_states [T, H], top_k_index [T, k],
    top_k_weights [T, k]) -> [T, H]``, with ``y[t] = sum_j w[t, j] * down_e(act(gate_e x) *
    up_e x)`` over the chosen experts ``e = top_k_index[t, j]``, experts in ascending order as
    transformers adds them. The experts of a call are loaded in chunks the budget holds, so a
    budget smaller than one layer's experts works (at the cost of reads).
    """

    def __init__(self, original: nn.Module, name: str) -> None:
        super().__init__()
        self.num_experts = int(original.gate_up_proj.shape[0])
        self.intermediate_dim = int(original.down_proj.shape[2])
        self.hidden_dim = int(original.down_proj.shape[1])
        self.act_fn = original.act_fn
        self.__dict__["_silu"] = _is_silu(original.act_fn)  # the fused kernel's activation
        self.layer = int(_LAYER.findall(name)[-1])
        self.name = name
        self.__dict__["_paging"] = None  # plain attributes: not submodules, not state
        self.__dict__["_next"] = None  # (layer, router module) of the next MoE block

    def extra_repr(self) -> str:
        return (
            f"layer={self.layer}, num_experts={self.num_experts}, hidden={self.hidden_dim}, "
            f"intermediate={self.intermediate_dim}, paged"
        )

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        paging: Paging = self.__dict__["_paging"]
        paging._open_pager()
        ids = top_k_index.reshape(hidden_states.shape[0], -1)
        weights = top_k_weights.reshape(ids.shape)
        ids_np = ids.detach().cpu().numpy()
        used = np.unique(ids_np[(ids_np >= 0) & (ids_np < self.num_experts)])
        paging._observe(self.layer, used)
        with warnings.catch_warnings():  # torch warns once: the pager's arrays are read-only
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            out = self._run(paging, hidden_states, ids_np, weights, used)
        paging._last[self.layer] = used
        return out

    def _run(self, paging, hidden_states, ids_np, weights, used) -> torch.Tensor:
        predicted = False
        # float32 rows for the fused kernel, converted once for the layer's experts
        rows32 = None
        if _KERNEL_ROWS and self.__dict__["_silu"] and hidden_states.dtype in _KERNEL_DTYPES:
            rows32 = _Rows(hidden_states, paging.threads)
        while True:
            out = torch.zeros_like(hidden_states)
            if rows32 is not None:  # a retry starts the sums over
                rows32.sums = None
            try:
                for start in range(0, len(used), paging._chunk):
                    part = used[start : start + paging._chunk]
                    with paging._load(self.layer, part) as batch:
                        if not predicted:  # after this layer's own misses were asked for
                            self._predict(hidden_states)
                            predicted = True
                        if rows32 is not None and self._sum(batch, part, rows32, ids_np, weights):
                            continue
                        for e in part:
                            e = int(e)
                            self._expert(batch[e], e, hidden_states, rows32, ids_np, weights, out)
                break
            except _Retry:
                continue
        if rows32 is not None and rows32.sums is not None:
            out += torch.from_numpy(rows32.sums).to(out.dtype)
        return out

    def _sum(self, batch, part, rows32, ids_np, weights) -> bool:
        """Decoding: every expert of ``part`` has at most ``_KERNEL_ROWS`` rows, so the chunk
        runs as one kernel call (both passes of all its experts on the pool at once, float32
        sums into ``rows32.sums``); False, having done nothing, otherwise."""
        flat = ids_np.reshape(-1)
        order = np.argsort(flat, kind="stable")
        ranked = flat[order]
        lo = np.searchsorted(ranked, part, "left")
        hi = np.searchsorted(ranked, part, "right")
        if (hi - lo).max() > _KERNEL_ROWS:
            return False
        experts = []
        for e in part:
            bits = _kernel_weights(batch[int(e)], rows32.dtype)
            if bits is None:
                return False
            experts.append(bits)
        pick = np.concatenate([order[a:b] for a, b in zip(lo, hi)])  # noqa: B905
        scale = weights.reshape(-1).detach().float().numpy()[pick]
        if rows32.sums is None:
            rows32.sums = np.zeros_like(rows32.x)
        bounds = np.concatenate([[0], np.cumsum(hi - lo)]).astype(np.int64)
        kind = _ffn.WEIGHT_KINDS[_KERNEL_DTYPES[rows32.dtype]]
        _ffn.ffn_sum(rows32.x, experts, kind, _SILU, bounds,
                     (pick // ids_np.shape[1]).astype(np.int64), scale, rows32.sums,
                     rows32.threads)  # fmt: skip
        return True

    def _expert(self, w, e, hidden_states, rows32, ids_np, weights, out) -> None:
        token, slot = np.nonzero(ids_np == e)
        h = None
        if rows32 is not None and len(token) <= _KERNEL_ROWS:
            # few rows of half-precision weights (decoding): colibri's fused kernel reads
            # each weight once, in place, at memory speed; torch's GEMMs win on more rows
            h = _fused_expert(rows32.x[token], w, hidden_states.dtype, rows32.threads)
        token_t, slot_t = torch.from_numpy(token), torch.from_numpy(slot)
        if h is None:
            x = hidden_states[token_t]
            gate, up, down = (torch_view(m) for m in (w.gate, w.up, w.down))
            if gate.dtype != x.dtype:  # a model run in another dtype than stored: a copy
                gate, up, down = gate.to(x.dtype), up.to(x.dtype), down.to(x.dtype)
            h = F.linear(self.act_fn(F.linear(x, gate)) * F.linear(x, up), down)
        y = h * weights[token_t, slot_t, None]
        out.index_add_(0, token_t, y.to(out.dtype))

    def _predict(self, hidden_states: torch.Tensor) -> None:
        """Guess the next MoE layer's experts and prefetch them (mode ``paging.prefetch``)."""
        paging: Paging = self.__dict__["_paging"]
        nxt = self.__dict__["_next"]
        if nxt is None:
            return
        layer, router, block = nxt
        if paging._holds_all:  # each expert is read once and stays: a guess saves nothing
            return
        guesses = {}
        last = paging._last.get(layer)
        if last is not None:
            guesses["previous"] = last
        if paging.prefetch == "gate":
            ids = _route_only(router, block, hidden_states)
            if ids is not None:
                flat = ids.reshape(-1).numpy()
                flat = flat[(flat >= 0) & (flat < 1 << 30)]
                experts, votes = np.unique(flat, return_counts=True)
                guesses["gate"] = experts[np.argsort(-votes, kind="stable")]
        for mode, guess in guesses.items():
            paging._guess[(mode, layer)] = np.sort(guess)
        guess = guesses.get(paging.prefetch)
        if guess is not None:
            # read ahead into the page cache, not into the budget: a slot prefetch evicts
            # experts still in use and spends a core mapping pages (bench/README.md)
            paging.pager.advise(layer, np.asarray(guess, dtype=np.int64))


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


def _route_only(router: nn.Module, block: nn.Module, hidden_states: torch.Tensor):
    """The expert ids ``[T, k]`` colibri would choose at ``router`` for ``hidden_states``,
    through the patched routing (no hooks run, nothing recorded). Arguments the block
    passes to its router (MiniMax-M2's, AFMoE's selection bias) are read from ``block``."""
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


# --------------------------------------------------------------------------------------
# Loading.


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    if attr in module._parameters:
        module._parameters[attr] = nn.Parameter(value, requires_grad=False)
    elif attr in module._buffers:
        module._buffers[attr] = value
    else:  # pragma: no cover - state_dict() named it
        raise KeyError(name)


def _plan_resident(model: nn.Module, checkpoint: Checkpoint) -> dict[str, list[tuple[str, str]]]:
    """Which checkpoint tensor fills which tensor of ``model`` (its experts already paged),
    by file: ``{path: [(checkpoint name, model name)]}``, every shape checked."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key

    transforms = get_model_conversion_mapping(model)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    wanted = model.state_dict(keep_vars=True)
    plan: dict[str, list[tuple[str, str]]] = {}
    for name in checkpoint.resident_names():
        info = checkpoint.tensors[name]
        target, converter = rename_source_key(
            name, renamings, converters, model.base_model_prefix, wanted
        )
        if converter is not None:
            raise UnsupportedCheckpointError(
                f"{info.path}: tensor {name!r} needs transformers' weight conversion "
                f"{converter!r}, which colibri applies to no tensor but routed experts; load "
                "this checkpoint with transformers' own from_pretrained"
            )
        if target not in wanted:
            continue  # not part of this model (transformers ignores it too)
        expected = tuple(wanted[target].shape)
        if tuple(info.shape) != expected:
            raise CheckpointError(
                f"{info.path}: tensor {name!r} has shape {list(info.shape)} but config.json "
                f"gives the model's {target} the shape {list(expected)}; fix: use the "
                "config.json this checkpoint was saved with"
            )
        plan.setdefault(info.path, []).append((name, target))
    return plan


def _load_resident(model: nn.Module, checkpoint: Checkpoint, plan: dict, dtype) -> int:
    """Load the tensors of ``plan`` into ``model``; returns their bytes."""
    from safetensors import safe_open

    wanted = model.state_dict(keep_vars=True)
    total = 0
    for path, names in plan.items():
        with safe_open(path, framework="pt") as f:
            for name, target in names:
                tensor = f.get_tensor(name)
                want = dtype or wanted[target].dtype
                if tensor.dtype != want and tensor.is_floating_point():
                    tensor = tensor.to(want)
                _set_tensor(model, target, tensor)
                total += checkpoint.tensors[name].nbytes
    if getattr(model.config, "tie_word_embeddings", False) or getattr(
        model.config.get_text_config(), "tie_word_embeddings", False
    ):
        model.tie_weights()
    missing = [n for n, t in model.state_dict(keep_vars=True).items() if t.is_meta]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        shown = ", ".join(missing[:5]) + more
        raise CheckpointError(
            f"{checkpoint.weights}: the model's tensors {shown} are in no file of the "
            "checkpoint; fix: re-save the checkpoint (save_pretrained) or re-download the "
            "missing shard"
        )
    return total


def _check_experts(modules: list[tuple[str, nn.Module]], source, checkpoint: Checkpoint) -> None:
    """Every expert the model has is in the checkpoint, shaped as config.json says."""
    servable = {"F32", "F16", "BF16"}
    for name, module in modules:
        layer = int(_LAYER.findall(name)[-1])
        num, rows2, hidden = module.gate_up_proj.shape
        inter = rows2 // 2
        for e in range(num):
            layout = source.experts.get((layer, e))
            if layout is None:
                stored = source.num_experts(layer)
                raise CheckpointError(
                    f"{checkpoint.weights}: no tensors for layer {layer} expert {e} (the model "
                    f"{name} has {num} experts, the checkpoint stores {stored} for that "
                    f"layer; expected e.g. '{name.rsplit('.experts', 1)[0]}.experts.{e}."
                    "gate_proj.weight'); fix: use the config.json this checkpoint was saved "
                    "with, or re-save the checkpoint"
                )
            for ref, shape in ((layout.gate, (inter, hidden)), (layout.up, (inter, hidden)),
                               (layout.down, (hidden, inter))):  # fmt: skip
                tensor = ref.name.split("[", 1)[0]
                if ref.dtype not in servable:
                    raise UnsupportedCheckpointError(
                        f"{ref.path}: expert tensor {tensor!r} is {ref.dtype}; the pager serves "
                        f"{', '.join(sorted(servable))} experts (quantized or FP8 checkpoints: "
                        "dequantize them to bf16 first)"
                    )
                if tuple(ref.shape) != shape:
                    raise CheckpointError(
                        f"{ref.path}: expert tensor {tensor!r} is {list(ref.shape)} per expert "
                        f"but config.json (hidden {hidden}, expert intermediate {inter}) needs "
                        f"{list(shape)}; fix: use the config.json this checkpoint was saved with"
                    )


def _torch_dtype(config: Any, checkpoint: Checkpoint, dtype: Any) -> torch.dtype:
    if dtype is not None:
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(
                f"from_pretrained(): dtype must be a floating torch dtype or its name (got "
                f"{dtype!r})"
            )
        return dtype
    names = checkpoint.expert_names()
    stored = checkpoint.tensors[names[0]].dtype if names else None
    return {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}.get(
        stored, getattr(config, "dtype", None) or torch.float32
    )


def from_pretrained(
    path,
    *,
    budget: int | str,
    policy: str = "adaptive",
    page_size_kb: int = 64,
    prefetch: str = "gate",
    num_threads: int | None = None,
    dtype: Any = None,
    partition: Any = None,
    topk_groups: int = 1,
    record_trace: bool = False,
) -> nn.Module:
    """Load a transformers MoE checkpoint with its routed experts paged under ``budget``.

    Parameters
    ----------
    path : path-like
        A checkpoint directory: ``config.json`` and ``model.safetensors`` or shards with
        ``model.safetensors.index.json`` (as ``save_pretrained`` writes them). Routed experts
        may be stored per expert (``...experts.{e}.gate_proj.weight``, Mixtral's
        ``...experts.{e}.w1.weight``) or stacked (``...experts.gate_up_proj [E, 2I, H]``).
    budget : int or str
        Most bytes of expert weights held in memory at once (``805306368``, ``"768MiB"``,
        ``"3GiB"``); everything else of the model is resident on top of it.
    policy : str
        The pager's cache policy (``"adaptive"``, the pager's default, ``"lru"``, ``"fifo"``,
        ``"lrfu"``, ...).
    page_size_kb : int
        The pager's page size (a power of two >= 4).
    prefetch : str
        ``"gate"`` (default): while layer l runs, have the OS read ahead the experts that
        layer l+1's router picks for layer l's input (:meth:`colibri.Pager.advise`: into the
        page cache, not into the budget); ``"previous"``: those layer l+1 used at the
        previous step; ``"off"``. A budget that holds every expert predicts nothing (each
        expert is read once and stays; a guess would cost more than it hides).
    num_threads : int, optional
        Threads of colibri's routing and expert kernels (default: OpenMP's; torch's own:
        ``torch.set_num_threads``).
    dtype : torch.dtype or str, optional
        Compute dtype; default: the dtype the experts are stored in (then expert views are
        used as they are; another dtype converts each expert on use).
    partition : colibri.Partition, path or dict, optional
        Static expert partitioning: every router picks ``topk_groups`` groups of this
        partition, then its top-k inside them (changes the model's routing); a dict gives
        one partition per layer index.
    topk_groups : int
        Groups each token may use with ``partition``.
    record_trace : bool
        Record every expert load in ``model.colibri.pager.trace`` (for Belady's bound).

    Returns
    -------
    transformers.PreTrainedModel
        The causal LM in eval mode; ``model.colibri`` is its :class:`Paging` (pager, stats,
        prediction recall, ``close()``).

    Raises
    ------
    CheckpointError
        The directory is incomplete or contradicts its config.json (names file, tensor, fix).
    UnsupportedCheckpointError
        A family or storage whose experts the pager cannot serve (says why and what works).
    """
    import colibri
    from colibri.formats import FormatError, open_weights

    if prefetch not in PREFETCH_MODES:
        raise ValueError(
            f"from_pretrained(): prefetch must be one of {PREFETCH_MODES} (got {prefetch!r})"
        )
    budget_bytes = parse_size(budget)
    checkpoint = Checkpoint(path)
    config = _config(checkpoint)
    torch_dtype = _torch_dtype(config, checkpoint, dtype)
    model = _empty_model(config, checkpoint, torch_dtype)
    modules = _find_experts(model)
    if not modules:
        raise UnsupportedCheckpointError(
            f"{checkpoint.path}: {type(model).__name__} (model_type "
            f"{checkpoint.config['model_type']!r}) has no routed experts to page; load it with "
            "transformers' own from_pretrained"
        )
    try:
        source = open_weights(checkpoint.weights)
    except (FormatError, KeyError) as exc:
        raise CheckpointError(f"{exc}; fix: re-save the checkpoint") from None
    _check_experts(modules, source, checkpoint)
    paged = []
    for name, module in modules:
        owner, _, attr = name.rpartition(".")
        paged.append(PagedExperts(module, name))
        setattr(model.get_submodule(owner), attr, paged[-1])
    plan = _plan_resident(model, checkpoint)  # every check before any weight is read
    pager = colibri.Pager(
        source,
        budget_bytes=budget_bytes,
        page_size_kb=page_size_kb,
        policy=policy,
        record_trace=record_trace,
    )
    paging = Paging(
        pager=pager,
        checkpoint=checkpoint,
        prefetch=prefetch,
        resident_bytes=0,
        expert_bytes=source.total_expert_nbytes,
        layers=paged,
        threads=num_threads or 0,
    )
    try:
        for module in paged:
            module.__dict__["_paging"] = paging
        paging.resident_bytes = _load_resident(model, checkpoint, plan, torch_dtype)
        model.eval()
        patch(model, routing_threads=num_threads)
        if partition is not None:
            _partition(model, partition, topk_groups)
        _link(model, paging)
    except BaseException:
        pager.close()
        raise
    model.__dict__["colibri"] = paging
    return model


def _config(checkpoint: Checkpoint):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(checkpoint.path)
    except (ValueError, KeyError) as exc:
        import transformers

        raise UnsupportedCheckpointError(
            f"{checkpoint.path}/config.json: transformers {transformers.__version__} cannot "
            f"read it (model_type {checkpoint.config.get('model_type')!r}): {exc}"
        ) from None


def _empty_model(config: Any, checkpoint: Checkpoint, dtype: torch.dtype) -> nn.Module:
    """The causal LM of ``config`` with every parameter on the meta device (buffers real)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    try:
        with init_empty_weights(include_buffers=False):
            return AutoModelForCausalLM.from_config(config, dtype=dtype)
    except ValueError as exc:
        raise UnsupportedCheckpointError(
            f"{checkpoint.path}: model_type {checkpoint.config['model_type']!r} has no causal "
            f"LM class in transformers ({exc})"
        ) from None


def _link(model: nn.Module, paging: Paging) -> None:
    """Tell each paged layer which router comes next (for prefetching across layers)."""

    routers = {}
    modules = dict(model.named_modules())
    for record in patched_routers(model):
        m = _LAYER.findall(record.name)
        if m:
            owner = record.name.rpartition(".")[0]
            routers[int(m[-1])] = (modules[record.name], modules[owner] if owner else model)
    layers = sorted(paging.layers, key=lambda p: p.layer)
    for here, there in zip(layers, layers[1:], strict=False):
        if there.layer in routers:
            here.__dict__["_next"] = (there.layer, *routers[there.layer])


def _partition(model: nn.Module, partition: Any, topk_groups: int) -> None:
    """Give every router ``partition`` (one for all layers, or ``{layer: Partition}``)."""
    from colibri.partition import Partition

    if isinstance(partition, dict):
        by_layer = {int(k): v for k, v in partition.items()}
    else:
        if not isinstance(partition, Partition):
            partition = Partition.load(partition)
        by_layer = None
    for name, module in model.named_modules():
        state = module.__dict__.get(_STATE)
        if state is None:
            continue
        here = partition
        if by_layer is not None:
            found = _LAYER.findall(name)
            here = by_layer.get(int(found[-1])) if found else None
            if here is None:
                continue
        routing = state.routing
        if "num_groups" in routing.options:
            raise UnsupportedCheckpointError(
                f"{name}: this router already limits routing to its own groups "
                f"(n_group={routing.options['num_groups']}); a partition cannot be added"
            )
        if here.num_experts != routing.num_experts:
            raise ValueError(
                f"from_pretrained(): partition covers {here.num_experts} experts but "
                f"{name} routes {routing.num_experts}"
            )
        routing.options["partition"] = here
        routing.options["topk_groups"] = int(topk_groups)
        routing._key = None
        routing._refresh({n: read(module) for n, read in routing.tensors.items()})
