"""A framework-agnostic Mixture-of-Experts layer: gate → route → dispatch → experts → combine.

::

    hidden [T, H] ──gate [E, H]──► logits [T, E] ──route──► ids [T, k], weights [T, k]
          │                                                    │
          └──gather──► rows [N, H] in expert order ◄──dispatch─┘
                           │ per active expert e: y = down @ (act(gate @ x) * (up @ x))
                           ▼
               expert outputs [N, H] ──combine(weights)──► out [T, H]  (+ shared expert)

Expert weights come from an *expert weights provider*: anything with
``load(layer, expert_ids)`` returning a context manager that yields a mapping
``expert id -> object with .gate [I, H], .up [I, H], .down [H, I]`` (torch ``nn.Linear``'s
``[out, in]`` convention), the experts pinned until the block exits. An optional integer
attribute ``capacity`` (experts it can hold at once) makes the layer load a step's experts
in chunks of that size. ``colibri.Pager`` is one provider (weights paged from a file under
a memory budget); ``InMemoryExperts`` is another (stacked arrays).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np

from colibri._dlpack import dtype_name, import_host, to_caller
from colibri.layer import _ffn, _rows
from colibri.layer._dispatch import DispatchPlan, combine, dispatch, gather

__all__ = [
    "ExpertFFN",
    "ExpertStore",
    "InMemoryExperts",
    "MoELayer",
    "activation_function",
    "expert_ffn",
]


class ExpertFFN(NamedTuple):
    """One gated FFN expert: ``y = down @ (act(gate @ x) * (up @ x))``.

    gate, up : [I, H]; down : [H, I]; numpy arrays (float32, float64, float16 or bfloat16).
    """

    gate: Any
    up: Any
    down: Any


class ExpertStore(Protocol):
    """What ``MoELayer`` needs from a weight store (``colibri.Pager`` satisfies it)."""

    def load(
        self, layer: int, expert_ids: Sequence[int]
    ) -> contextlib.AbstractContextManager[Mapping[int, Any]]:
        """Make ``expert_ids`` of ``layer`` resident (pinned) for the ``with`` block."""
        ...


class InMemoryExperts:
    """Expert weights held in memory as stacked arrays.

    Parameters
    ----------
    gate, up : [E, I, H] or [L, E, I, H]
    down : [E, H, I] or [L, E, H, I]
        One layer (3-D, layer index 0) or ``L`` layers (4-D). Any array convertible with
        ``np.asarray`` (torch CPU tensors are viewed without a copy).
    """

    def __init__(self, gate: Any, up: Any, down: Any) -> None:
        arrays = [
            _host_array(a, name, keep_half=True)
            for a, name in ((gate, "gate"), (up, "up"), (down, "down"))
        ]
        if arrays[0].ndim == 3:
            arrays = [a[None] for a in arrays]
        g, u, d = arrays
        if g.ndim != 4 or u.shape != g.shape or d.shape != g.shape[:2] + g.shape[3:1:-1]:
            raise ValueError(
                "InMemoryExperts(): expected gate and up [E, I, H] and down [E, H, I] (or with "
                f"a leading layer axis); got gate {g.shape}, up {u.shape}, down {d.shape}"
            )
        self.gate, self.up, self.down = g, u, d
        self.num_layers, self.num_experts, self.intermediate_size, self.hidden_size = g.shape

    @contextlib.contextmanager
    def load(self, layer: int, expert_ids: Sequence[int]) -> Iterator[Mapping[int, ExpertFFN]]:
        """Yield ``{e: ExpertFFN}`` for the requested experts (views, no copies)."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range: the store holds {self.num_layers}")
        experts = {}
        for e in expert_ids:
            e = int(e)
            if not 0 <= e < self.num_experts:
                raise IndexError(
                    f"expert {e} out of range: layer {layer} has {self.num_experts} experts"
                )
            experts[e] = ExpertFFN(self.gate[layer, e], self.up[layer, e], self.down[layer, e])
        yield experts


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def _erf(x: np.ndarray) -> np.ndarray:
    try:
        from scipy.special import erf
    except ImportError:  # Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7), numpy only
        t = 1.0 / (1.0 + 0.3275911 * np.abs(x))
        poly = t * (
            0.254829592
            + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429)))
        )
        return np.sign(x) * (1.0 - poly * np.exp(-x * x))
    return erf(x)


def _silu(x: np.ndarray) -> np.ndarray:
    # x * sigmoid(x) without overflow warnings for large negative x
    return x * (0.5 * (1.0 + np.tanh(0.5 * x)))


_ACTIVATIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "silu": _silu,
    "swiglu": _silu,
    "gelu": lambda x: 0.5 * x * (1.0 + _erf(x / np.sqrt(2.0)).astype(x.dtype)),
    "gelu_tanh": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "geglu": _gelu_tanh,
    "relu": lambda x: np.maximum(x, 0),
}


# The activations the fused kernel computes itself (include/colibri/ffn.h), by name.
_KERNEL_ACTIVATIONS = {
    "silu": "silu",
    "swiglu": "silu",
    "gelu": "gelu",
    "gelu_tanh": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "geglu": "gelu_tanh",
    "relu": "relu",
}


def activation_function(activation: str | Callable) -> Callable[[np.ndarray], np.ndarray]:
    """The gate activation: "silu" (SwiGLU), "gelu" (exact, GeGLU), "gelu_tanh", "relu",
    or a callable on a float numpy array."""
    if callable(activation):
        return activation
    try:
        return _ACTIVATIONS[activation]
    except KeyError:
        raise ValueError(
            f"unknown activation {activation!r}; choose one of "
            f"{sorted(_ACTIVATIONS)} or pass a callable"
        ) from None


def _host_array(a: Any, what: str, keep_half: bool = False) -> np.ndarray:
    """Weights as numpy (float32 for bfloat16, unless ``keep_half`` and ml_dtypes gives numpy
    a bfloat16 dtype: the fused kernel reads it as stored); torch parameters are read
    without a copy."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(a, torch.Tensor):
        a = a.detach()  # weights are constants here: no autograd through the layer
    arr, name = import_host(a)
    if name == "bfloat16":
        if keep_half:
            try:
                import ml_dtypes
            except ImportError:
                pass
            else:
                return arr.view(ml_dtypes.bfloat16)
        return _bf16_to_float32(arr)
    if name not in ("float32", "float64", "float16"):
        raise ValueError(
            f"{what} weights must be float32, float64, float16 or bfloat16 (got {name})"
        )
    return arr


def _bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _float32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest even), returned as uint16 bits."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)
    return rounded


# Weight rows converted per block: about 256 KiB of float32, so the block stays in cache
# between its conversion and its GEMM (a whole converted matrix would go to DRAM and back).
_BLOCK_BYTES = 1 << 18
_HALF_KINDS = {"float16": 1, "bfloat16": 2}
# Read ahead (overlap reads with compute) only for experts at least this large by default.
_READ_AHEAD_MIN_BYTES = 1 << 20


def linear(x: np.ndarray, w: Any, dtype: np.dtype, name: str | None = None) -> np.ndarray:
    """``x @ w.T`` for rows ``x [n, in]`` and a weight ``w [out, in]``: ``[n, out]``.

    Computed as ``(w @ x.T).T`` (BLAS gemv for one row, several times faster than the
    row-vector form). float16/bfloat16 weights are converted to float32 block by block;
    ``name`` gives the dtype of uint16 bits ("float16" or "bfloat16").
    """
    arr = np.asarray(w)
    name = name or dtype_name(arr.dtype)
    if arr.ndim != 2 or arr.shape[1] != x.shape[1]:
        raise ValueError(
            f"expert weight of shape {arr.shape} does not match rows of width {x.shape[1]}"
        )
    if arr.dtype == dtype:
        return (arr @ x.T).T
    if name not in _HALF_KINDS or dtype != np.float32:
        if arr.dtype.kind != "f" and name != "bfloat16":
            raise ValueError(f"expert weights must be floating point (got {arr.dtype})")
        if name == "bfloat16":
            arr = _bf16_to_float32(arr.view(np.uint16))
        return (arr.astype(dtype, copy=False) @ x.T).T
    bits = np.ascontiguousarray(arr).view(np.uint16)
    rows, cols = bits.shape
    block = max(8, _BLOCK_BYTES // (4 * cols))
    buf = np.empty((min(block, rows), cols), np.float32)
    out = np.empty((rows, x.shape[0]), np.float32)
    xt = x.T
    for r in range(0, rows, block):
        b = buf[: min(block, rows - r)]
        _rows.to_float32(bits[r : r + len(b)], _HALF_KINDS[name], 1, b)
        np.matmul(b, xt, out=out[r : r + len(b)])
    return out.T


# Rows up to which the fused kernel runs; more rows go to block conversion + BLAS, which
# reuses each converted block across rows (crossover measured with bench/bench_kernels.py).
KERNEL_MAX_ROWS = 32


def _half_bits(w: Any) -> tuple[np.ndarray, str] | None:
    """float16/bfloat16 weights as their uint16 bits (a view) and the dtype name, else None."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(w, torch.Tensor):
        w = w.detach()
    arr, name = import_host(w) if not isinstance(w, np.ndarray) else (w, dtype_name(w.dtype))
    if name not in _HALF_KINDS:
        return None
    return arr.view(np.uint16), name


def _fused(
    x32: np.ndarray,
    gate: np.ndarray,
    up: np.ndarray,
    down: np.ndarray,
    name: str,
    act: str,
    out: np.ndarray | None,
    num_threads: int | None,
    path: str | None = None,
) -> np.ndarray:
    """The fused kernel on float32 rows ``x32 [n, H]`` and uint16 weight bits."""
    if out is None:
        out = np.empty((x32.shape[0], down.shape[0]), np.float32)
    rows = []
    for w in (gate, up, down):
        rows.append(w if w.strides[1] == w.itemsize or w.shape[1] == 1 else np.ascontiguousarray(w))
    _ffn.ffn(
        x32,
        rows[0],
        rows[1],
        rows[2],
        _HALF_KINDS[name],
        _ffn.ACTIVATIONS[act],
        out,
        num_threads or 0,
        path,
    )
    return out


def gated_ffn(
    x: np.ndarray,
    expert: Any,
    act: Callable,
    dtype: np.dtype,
    kernel_act: str | None = None,
    num_threads: int | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """``down @ (act(gate @ x) * (up @ x))`` for rows ``x [n, H]``.

    float16/bfloat16 weights with up to ``KERNEL_MAX_ROWS`` float32 rows and a kernel
    activation (``kernel_act``) run the fused kernel, into ``out`` ([n, H] float32, rows
    contiguous) when given; otherwise three BLAS GEMMs (``out`` unused).
    """
    if kernel_act is not None and dtype == np.float32 and 0 < x.shape[0] <= KERNEL_MAX_ROWS:
        bits = [_half_bits(w) for w in (expert.gate, expert.up, expert.down)]
        if all(b is not None for b in bits) and len({b[1] for b in bits}) == 1:
            g, u, d = (b[0] for b in bits)
            _check_expert_shapes("gated_ffn", x.shape[1], g, u, d)
            return _fused(
                np.ascontiguousarray(x), g, u, d, bits[0][1], kernel_act, out, num_threads
            )
    h = act(linear(x, expert.gate, dtype))
    h *= linear(x, expert.up, dtype)
    return linear(np.ascontiguousarray(h), expert.down, dtype)


def _check_expert_shapes(func: str, H: int, g: Any, u: Any, d: Any) -> None:
    if g.ndim != 2 or g.shape[1] != H:
        raise ValueError(f"{func}(): gate must be [I, {H}] (got {tuple(g.shape)})")
    if tuple(u.shape) != tuple(g.shape):
        raise ValueError(
            f"{func}(): up must be [{g.shape[0]}, {H}] like gate (got {tuple(u.shape)})"
        )
    if tuple(d.shape) != (H, g.shape[0]):
        raise ValueError(f"{func}(): down must be [{H}, {g.shape[0]}] (got {tuple(d.shape)})")


def expert_ffn(
    x: Any,
    gate: Any,
    up: Any,
    down: Any,
    *,
    activation: str | Callable = "silu",
    out: Any = None,
    num_threads: int | None = None,
) -> Any:
    """One gated-FFN expert: ``y = down @ (act(gate @ x) * (up @ x))`` for each row of x.

    float16 and bfloat16 weights with up to ``KERNEL_MAX_ROWS`` rows run colibri's fused
    kernel (each weight read once in its stored dtype, float32 accumulation, the SIMD path
    of ``colibri.simd_path()``); more rows, float32/float64 weights or a callable activation
    run block conversion + BLAS.

    Parameters
    ----------
    x : [n, H] or [H]
        float32, float64, float16 or bfloat16; numpy or any host DLPack tensor (torch, jax).
    gate, up : [I, H]
    down : [H, I]
        The transformers convention (``nn.Linear`` weights, ``[out, in]``); all one dtype.
    activation : str or callable
        "silu" (SwiGLU), "gelu" (exact), "gelu_tanh", "relu", their aliases in
        ``activation_function``, or a callable on a float numpy array.
    out : like x, optional
        Written in place (same shape and dtype as x) and returned.
    num_threads : int or None
        Threads for the fused kernel (None: OpenMP's default).

    Returns
    -------
    y : same shape, dtype and framework as x (torch in, torch out, zero-copy)
    """
    arr, name = _float_host(x, "x")
    if arr.ndim not in (1, 2):
        raise ValueError(f"expert_ffn(): x must be [n, H] or [H] (got shape {tuple(arr.shape)})")
    rows2d = arr.reshape(1, -1) if arr.ndim == 1 else arr
    n, H = rows2d.shape
    if num_threads is not None and (
        not isinstance(num_threads, (int, np.integer)) or num_threads < 1
    ):
        raise ValueError(
            f"expert_ffn(): num_threads must be a positive int or None (got {num_threads!r})"
        )
    weights = [_weight_view(w, what) for w, what in ((gate, "gate"), (up, "up"), (down, "down"))]
    names = {wname for _, wname in weights}
    if len(names) != 1:
        raise ValueError(
            f"expert_ffn(): gate, up and down must share one dtype (got "
            f"{', '.join(w for _, w in weights)})"
        )
    (g, wname), (u, _), (d, _) = weights
    _check_expert_shapes("expert_ffn", H, g, u, d)
    kernel_act = _KERNEL_ACTIVATIONS.get(activation) if isinstance(activation, str) else None
    act = activation_function(activation)
    out_arr = None
    if out is not None:
        out_arr, out_name = import_host(out, writable=True)
        if out_name != name or tuple(out_arr.shape) != tuple(arr.shape):
            raise ValueError(
                f"expert_ffn(): out must be {name} of shape {tuple(arr.shape)} like x (got "
                f"{out_name} of shape {tuple(out_arr.shape)})"
            )
    compute = np.float64 if name == "float64" and wname == "float64" else np.float32
    x_c = _compute_input(rows2d, name).astype(compute, copy=False)
    if n == 0:
        y = np.empty((0, H), compute)
    elif wname in _HALF_KINDS and kernel_act is not None and n <= KERNEL_MAX_ROWS:
        x32 = np.ascontiguousarray(x_c, np.float32)
        direct = (
            out_arr is not None
            and name == "float32"
            and out_arr.ndim == 2
            and (out_arr.strides[1] == 4)
        )
        y = _fused(x32, g, u, d, wname, kernel_act, out_arr if direct else None, num_threads)
        if direct:
            return out
    else:
        h = act(linear(x_c, g, compute, wname))
        h *= linear(x_c, u, compute, wname)
        y = linear(np.ascontiguousarray(h), d, compute, wname)
    y = y.reshape(arr.shape)
    if out_arr is not None:
        out_arr[...] = _cast(y, name).reshape(out_arr.shape)
        return out
    return to_caller(_cast(y, name), x, name)


def _float_host(obj: Any, what: str) -> tuple[np.ndarray, str]:
    """``obj`` (numpy or any host DLPack tensor, detached) as numpy and its dtype name, no
    copy; refused unless float32, float64, float16 or bfloat16."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        obj = obj.detach()
    arr, name = import_host(obj)
    if name not in ("float32", "float64", "float16", "bfloat16"):
        raise ValueError(
            f"expert_ffn(): {what} must be float32, float64, float16 or bfloat16 (got {name})"
        )
    return arr, name


def _weight_view(w: Any, what: str) -> tuple[np.ndarray, str]:
    """An expert matrix as numpy (bfloat16 as uint16 bits) and its dtype name, no copy."""
    arr, name = _float_host(w, what)
    if name in _HALF_KINDS:
        arr = arr.view(np.uint16)
    return arr, name


_RouteFn = Callable[[np.ndarray], tuple[Any, Any]]


class MoELayer:
    """A sparse MoE block: gate → colibri routing → dispatch → gated-FFN experts → combine.

    Parameters
    ----------
    gate_weight : [E, H]
        Router weight (``logits = hidden @ gate_weight.T + gate_bias``).
    experts : ExpertStore or None
        Weight provider (``colibri.Pager``, ``InMemoryExperts``); may be None when
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
        ``expert_fn(expert_id, x, weights) -> y``: run one expert in your framework. ``x``
        is ``[n, H]`` in the input's framework (float32, or float64 for float64 input),
        ``weights`` the provider's entry (None without a provider); ``y`` is ``[n, H]``.
        Default: numpy (BLAS), three GEMMs per active expert.
    shared_expert : ExpertFFN or None
        An always-on expert added to every token.
    shared_expert_gate : [1, H] or [H] or None
        Scales the shared expert by ``sigmoid(hidden @ shared_expert_gate.T)`` (Qwen2-MoE).
    num_threads : int or None
        Threads for dispatch/gather/combine.
    read_ahead : bool or None
        With a provider that has ``prefetch`` (``Pager``): announce a step's experts, then
        load them one at a time so computing one overlaps reading the next. None (default):
        only when the provider's ``slot_bytes`` is at least 1 MiB (small experts read faster
        than the hand-off to the read-ahead thread costs).
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
        shared_expert: ExpertFFN | None = None,
        shared_expert_gate: Any = None,
        num_threads: int | None = None,
        read_ahead: bool | None = None,
        **route_options: Any,
    ) -> None:
        self.gate_weight = np.ascontiguousarray(_host_array(gate_weight, "gate"), np.float32)
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
        self.experts = experts
        self.layer = int(layer)
        self.gate_bias = None
        if gate_bias is not None:
            self.gate_bias = np.asarray(_host_array(gate_bias, "gate_bias"), np.float32)
            if self.gate_bias.shape != (self.num_experts,):
                raise ValueError(
                    f"MoELayer(): gate_bias must be [{self.num_experts}] "
                    f"(got {self.gate_bias.shape})"
                )
        self.activation = activation_function(activation)
        self._kernel_act = (
            _KERNEL_ACTIVATIONS.get(activation) if isinstance(activation, str) else None
        )
        self.expert_fn = expert_fn
        self.shared_expert = shared_expert
        self.shared_expert_gate = None
        if shared_expert_gate is not None:
            sg = np.asarray(_host_array(shared_expert_gate, "shared_expert_gate"), np.float32)
            self.shared_expert_gate = sg.reshape(1, -1)
            if self.shared_expert_gate.shape[1] != self.hidden_size:
                raise ValueError(
                    f"MoELayer(): shared_expert_gate must be [1, {self.hidden_size}]"
                    f" (got {sg.shape})"
                )
        self.num_threads = num_threads
        self.read_ahead = read_ahead
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
        x = _compute_input(*self._input(hidden))
        return self._route_rows(x.astype(np.float32, copy=False))

    def _route_rows(self, x32: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ids, weights = self._route(self.router_logits(x32))
        ids, _ = import_host(ids)
        weights, _ = import_host(weights)
        return ids, np.asarray(weights, np.float32)

    def _input(self, hidden: Any) -> tuple[np.ndarray, str]:
        arr, name = import_host(hidden)
        if name not in ("float32", "float64", "float16", "bfloat16"):
            raise ValueError(
                f"MoELayer: hidden states must be float32, float64, float16 or "
                f"bfloat16 (got {name})"
            )
        if arr.ndim != 2 or arr.shape[1] != self.hidden_size:
            raise ValueError(
                f"MoELayer: hidden states must be [T, {self.hidden_size}] "
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
        x = _compute_input(arr, name)
        compute = x.dtype
        x32 = x if compute == np.float32 else x.astype(np.float32)
        ids, weights = self._route_rows(x32)
        plan = dispatch(ids, self.num_experts, num_threads=self.num_threads)
        rows = gather(x, plan, num_threads=self.num_threads)
        expert_out = np.empty_like(rows)
        self._run_experts(plan, rows, expert_out, hidden, compute)
        if self.shared_expert is None:
            out = combine(expert_out, plan, weights, dtype=name, num_threads=self.num_threads)
            return to_caller(out, hidden, name)
        out = combine(expert_out, plan, weights, num_threads=self.num_threads)
        shared = gated_ffn(
            x, self.shared_expert, self.activation, compute, self._kernel_act, self.num_threads
        )
        if self.shared_expert_gate is not None:
            shared *= 0.5 * (1.0 + np.tanh(0.5 * (x @ self.shared_expert_gate.T)))  # sigmoid
        out += shared
        return to_caller(_cast(out, name), hidden, name)

    def _run_experts(
        self,
        plan: DispatchPlan,
        rows: np.ndarray,
        expert_out: np.ndarray,
        like: Any,
        compute: np.dtype,
    ) -> None:
        active = [int(e) for e in plan.active_experts]
        if self.experts is None:
            for e in active:
                self._run_expert(e, None, plan, rows, expert_out, like, compute)
            return
        # A provider with a fixed number of slots (Pager.capacity) gets the step's experts
        # in chunks it can hold; each chunk stays pinned while it runs. One that can read
        # ahead (Pager.prefetch) is asked for the rest of the step first and then loaded one
        # expert at a time, so computing an expert overlaps reading the next ones.
        chunk = getattr(self.experts, "capacity", None) or len(active) or 1
        prefetch = None if self.read_ahead is False else getattr(self.experts, "prefetch", None)
        if self.read_ahead is None and prefetch is not None:
            # small experts read faster than a hand-off to the read-ahead thread costs
            slot = getattr(self.experts, "slot_bytes", None)
            prefetch = prefetch if slot is None or slot >= _READ_AHEAD_MIN_BYTES else None
        if prefetch is not None and len(active) > 1:
            prefetch(self.layer, active[1:chunk])
            chunk = 1
        for lo in range(0, len(active), chunk):
            group = active[lo : lo + chunk]
            with self.experts.load(self.layer, group) as weights:
                for e in group:
                    self._run_expert(e, weights[e], plan, rows, expert_out, like, compute)

    def _run_expert(
        self,
        e: int,
        weights: Any,
        plan: DispatchPlan,
        rows: np.ndarray,
        expert_out: np.ndarray,
        like: Any,
        compute: np.dtype,
    ) -> None:
        sl = plan.expert_rows(e)
        if self.expert_fn is None:
            if sl.stop - sl.start <= KERNEL_MAX_ROWS and self._kernel_act is not None:
                # the fused kernel writes into expert_out directly when it runs
                y = gated_ffn(
                    rows[sl],
                    weights,
                    self.activation,
                    compute,
                    self._kernel_act,
                    self.num_threads,
                    out=expert_out[sl],
                )
                if y is not expert_out[sl]:
                    expert_out[sl] = y
                return
            expert_out[sl] = gated_ffn(rows[sl], weights, self.activation, compute)
            return
        y, _ = import_host(self.expert_fn(e, to_caller(rows[sl], like), weights))
        if y.shape != (sl.stop - sl.start, self.hidden_size):
            raise ValueError(
                f"expert_fn({e}) returned shape {tuple(y.shape)}; "
                f"expected [{sl.stop - sl.start}, {self.hidden_size}]"
            )
        expert_out[sl] = y


def _compute_input(arr: np.ndarray, name: str) -> np.ndarray:
    """Hidden states in the compute dtype: float64 stays, everything else float32."""
    if name == "bfloat16":
        return _bf16_to_float32(arr)
    return np.ascontiguousarray(arr, np.float64 if name == "float64" else np.float32)


def _cast(x: np.ndarray, name: str) -> np.ndarray:
    if name == "bfloat16":
        return _float32_to_bf16(x)
    return x.astype(name, copy=False)
