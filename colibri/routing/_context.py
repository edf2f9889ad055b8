"""The routing API: contexts, ``route_from_dlpack`` and a one-shot ``route``."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import numpy as np

from colibri._core import Router
from colibri._dlpack import host_tensor
from colibri._usage import UsageStats
from colibri._validate import check_threads
from colibri.routing._config import Config, check_options


class Context(Router):
    """A routing context: a fixed :class:`Config` and its compiled router.

    Create it with :func:`colibri.init`. ``ctx.route(logits, out=None)`` takes ``[T, E]`` or
    ``[E]`` logits (float32, float64, float16 or bfloat16, any strides) from any DLPack
    producer and returns ``(ids, weights)``, ``[T, k]`` int32 and float32 (``[k]`` for one
    token), in the caller's framework: each row by descending score, ties to the lower id.
    ``out=(ids, weights)`` fills caller-owned buffers instead of allocating. It raises
    ``TypeError`` for a non-float dtype, ``ValueError`` for a wrong shape, a NaN row or an
    all ``-inf`` row, and ``BufferError`` for memory it cannot read (a GPU tensor without a
    host copy). One context may be used from several threads at once.

    Examples
    --------
    >>> import numpy as np, colibri
    >>> ctx = colibri.init(4, 2)
    >>> ids, weights = ctx.route(np.array([[0.0, 3.0, 1.0, 2.0]], np.float32))
    >>> print(ids, weights.round(3))
    [[1 3]] [[0.731 0.269]]
    >>> out = ctx.buffers(1)
    >>> ctx.route(np.array([[5.0, 0.0, 0.0, 5.0]], np.float32), out=out)[0].tolist()
    [[0, 3]]
    """

    def __init__(self, config: Config):
        if not isinstance(config, Config):
            raise TypeError(f"Context() takes a colibri.Config (got {type(config).__name__})")
        if config.routing_threads is not None:
            check_threads(config.routing_threads, "routing_threads")
        self.config = config
        self._configure(config)

    @property
    def stats(self) -> UsageStats | None:
        """Usage statistics (:class:`colibri.UsageStats`) or None when not collecting."""
        if not self.collect_stats:
            return None
        counts, coactivation, tokens = self._usage_arrays()
        return UsageStats(counts=counts, coactivation=coactivation, tokens=int(tokens))

    def buffers(self, num_tokens: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Fresh ``(ids, weights)`` numpy buffers ``[num_tokens or batch_size, k]`` for ``out=``."""
        T = self.config.batch_size if num_tokens is None else int(num_tokens)
        return (
            np.empty((T, self.top_k), self.config.ids_dtype),
            np.empty((T, self.top_k), np.float32),
        )

    def __repr__(self) -> str:
        c = self.config
        extra = [f"scoring={c.scoring!r}"]
        if c.num_groups > 1:
            extra.append(f"num_groups={c.num_groups}, topk_groups={c.topk_groups}")
        return (
            f"colibri.Context(num_experts={c.num_experts}, top_k={c.top_k}, "
            f"{', '.join(extra)}, threads={self.routing_threads})"
        )


def init(
    num_experts: int | None = None,
    top_k: int | None = None,
    *,
    config: Config | None = None,
    **options: Any,
) -> Context:
    """Create a routing context.

    Parameters
    ----------
    num_experts, top_k : int, optional
        E experts, k chosen per token; fixed for the context's life. Required unless
        ``config`` is given (and then, if given, they must agree with it).
    config : colibri.Config, optional
        A complete configuration.
    **options
        Any field of :class:`Config` (``scoring``, ``normalize``, ``correction_bias``,
        ``num_groups``, ``partition``, ``routing_threads``, ...); overrides ``config``'s.

    Returns
    -------
    Context
        The routing context; ``ctx.route(logits)`` routes ``[T, E]`` or ``[E]`` logits.

    Raises
    ------
    TypeError
        An unknown option (with the closest known name), or an option of the wrong type.
    ValueError
        An option out of range (``top_k`` above the experts reachable, ``num_groups`` above
        ``num_experts``, a bias of the wrong shape or with NaN, ...).

    Examples
    --------
    >>> import colibri
    >>> colibri.init(26, 2)
    colibri.Context(num_experts=26, top_k=2, scoring='softmax', threads=...)
    >>> colibri.init(256, 8, scoring="sigmoid", num_groups=8, topk_groups=4).config.num_groups
    8
    >>> colibri.init(26, 2, topk=3)
    Traceback (most recent call last):
    TypeError: unknown routing option 'topk'; did you mean 'top_k'? ...
    """
    check_options(options)
    if config is None:
        if num_experts is None or top_k is None:
            raise TypeError("init() needs num_experts and top_k, or config=colibri.Config(...)")
        config = Config(num_experts=num_experts, top_k=top_k, **options)
    else:
        if not isinstance(config, Config):
            raise TypeError(
                f"init(config=...) takes a colibri.Config (got {type(config).__name__})"
            )
        for name, value in (("num_experts", num_experts), ("top_k", top_k)):
            if value is not None and value != getattr(config, name):
                raise ValueError(
                    f"init(): {name}={value} contradicts config.{name}="
                    f"{getattr(config, name)}; pass one or the other"
                )
        if options:
            config = dataclasses.replace(config, **options)
    return Context(config)


def route_from_dlpack(logits: Any, ctx: Context, *, out: Any = None) -> tuple[Any, Any]:
    """Route ``logits`` with ``ctx``, from any framework.

    Parameters
    ----------
    logits : DLPack producer or capsule, ``[T, E]`` or ``[E]``
        torch, jax, numpy, cupy... tensors, or a raw ``"dltensor"`` /
        ``"dltensor_versioned"`` capsule; float32, float64, float16 or bfloat16, any strides.
    ctx : Context
        From :func:`colibri.init`; ``E`` must be its ``num_experts``.
    out : (ids, weights), optional
        Writable ``[T, k]`` (``[k]``) buffers, int32 and float32, of any framework.

    Returns
    -------
    ids : ``[T, k]`` int32
    weights : ``[T, k]`` float32
        In ``logits``' framework (a capsule gives numpy), zero-copy.

    Notes
    -----
    Inside ``jax.jit`` or ``jax.vmap`` (``logits`` a jax tracer, ``[..., T, E]`` under
    vmap) the routing runs on the host through ``jax.pure_callback``, batched rows merged
    into one call: the results equal eager routing's exactly (bfloat16 logits are widened to
    float32 first, which is exact). ``out=`` is refused there (traced arrays are immutable),
    and ``ids_dtype="int64"`` needs ``jax_enable_x64``. ``ctx.route`` itself takes no tracers:
    it is the compiled fast path.

    Raises
    ------
    TypeError
        ``ctx`` is not a Context, or ``logits`` is not floating point.
    ValueError
        Wrong shape, or a row with NaN or all ``-inf``.
    BufferError
        Memory colibri cannot read on the host (a GPU tensor), or an ``out`` it cannot write.

    Examples
    --------
    >>> import numpy as np, colibri
    >>> ctx = colibri.init(3, 1)
    >>> colibri.route_from_dlpack(np.array([[1.0, 2.0, 0.0]], np.float32), ctx)[0].tolist()
    [[1]]
    """
    if not isinstance(ctx, Router):
        raise TypeError(
            f"route_from_dlpack(logits, ctx): ctx must be a colibri.Context "
            f"(got {type(ctx).__name__}); create one with colibri.init()"
        )
    if _traced(logits):
        return _route_traced(ctx, logits, out)
    return ctx.route(logits, out=out)


_FLOATS = ("float32", "float64", "float16", "bfloat16")


def _traced(logits: Any) -> bool:
    """Whether ``logits`` is a jax tracer (inside ``jax.jit``, ``jax.vmap``...)."""
    jax = sys.modules.get("jax")  # never imported here: a tracer means jax is loaded
    return jax is not None and isinstance(logits, jax.core.Tracer)


def _route_traced(ctx: Router, logits: Any, out: Any) -> tuple[Any, Any]:
    """Route a jax tracer ``[..., E]`` through ``jax.pure_callback``: ``[..., k]`` ids (the
    context's ids dtype) and float32 weights, computed by ``ctx.route`` on the host."""
    import jax

    if out is not None:
        raise ValueError(
            "route(out=...) cannot fill buffers inside jax.jit/vmap (traced arrays are "
            "immutable); drop out= and use the returned arrays"
        )
    shape, dtype = tuple(logits.shape), str(logits.dtype)
    if dtype not in _FLOATS:
        raise TypeError(
            f"route(logits): logits must be floating point (float32, float64, float16 or "
            f"bfloat16), got {dtype}"
        )
    E, k = ctx.num_experts, ctx.top_k
    if len(shape) not in (1, 2) or shape[-1] != E:
        raise ValueError(
            f"route(logits): traced logits must be [E] or [T, E] with E={E} (the context's "
            f"num_experts), got shape {shape}; reshape to (-1, {E})"
        )
    ids_dtype = np.dtype(ctx.config.ids_dtype)
    if ids_dtype.itemsize == 8 and not jax.config.read("jax_enable_x64"):
        raise TypeError(
            "route(): this context returns int64 ids, which jax holds only with "
            "jax_enable_x64; init() the context with ids_dtype='int32' (the default) or "
            "enable x64 (jax.config.update('jax_enable_x64', True))"
        )

    def host(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x = np.asarray(x)
        if x.dtype.name == "bfloat16":  # ml_dtypes' numpy bfloat16 has no DLPack export
            x = x.astype(np.float32)
        lead = x.shape[:-1]  # [T] or [], with vmap's batch dimensions in front
        ids, weights = Router.route(ctx, x.reshape(-1, E))
        return ids.reshape(*lead, k), weights.reshape(*lead, k)

    result = (
        jax.ShapeDtypeStruct((*shape[:-1], k), ids_dtype),
        jax.ShapeDtypeStruct((*shape[:-1], k), np.float32),
    )
    return jax.pure_callback(host, result, logits, vmap_method="expand_dims")


def route(logits: Any, top_k: int, **options: Any) -> tuple[Any, Any]:
    """One-shot routing for scripts.

    Parameters
    ----------
    logits : DLPack producer or capsule, ``[T, E]`` or ``[E]``
        E, the number of experts, is the last dimension.
    top_k : int
        Experts chosen per token.
    **options
        Any field of :class:`Config`.

    Returns
    -------
    ids : ``[T, k]`` int32
    weights : ``[T, k]`` float32
        In ``logits``' framework.

    Raises
    ------
    TypeError, ValueError
        As :func:`init` and :func:`route_from_dlpack`.

    Notes
    -----
    Each call builds a context; for repeated calls build one with :func:`init`. Inside
    ``jax.jit`` or ``jax.vmap`` it routes as :func:`route_from_dlpack` does (the context is
    built when tracing).

    Examples
    --------
    >>> import numpy as np, colibri
    >>> ids, w = colibri.route(np.array([0.5, 0.1, 0.9], np.float32), 2, normalize=False)
    >>> print(ids, w.round(3))
    [2 0] [0.472 0.316]
    """
    shape = getattr(logits, "shape", None)  # arrays of every framework: no import needed
    if shape is None:  # a raw capsule: import it here, once (it can be consumed only once)
        logits = host_tensor(logits)
        shape = logits.shape
    if len(shape) not in (1, 2):
        raise ValueError(f"route(): logits must be [E] or [T, E], got shape {tuple(shape)}")
    return route_from_dlpack(logits, init(shape[-1], top_k, **options))
