"""The routing API: contexts, ``route_from_dlpack`` and a one-shot ``route``."""

from __future__ import annotations

import dataclasses
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
    return ctx.route(logits, out=out)


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
    Each call builds a context; for repeated calls build one with :func:`init`.

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
    return init(shape[-1], top_k, **options).route(logits)
