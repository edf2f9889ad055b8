"""The routing API: contexts, ``route_from_dlpack`` and a one-shot ``route``."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from colibri._core import Router, max_threads
from colibri._dlpack import host_tensor
from colibri.config import Config, check_options


class Context(Router):
    """A routing context: a fixed :class:`Config` and its compiled router.

    Create it with :func:`colibri.init`. ``ctx.route(logits)`` takes ``[T, E]`` or ``[E]``
    logits from any DLPack producer and returns ``(ids, weights)`` in the caller's framework.
    One context may be used from several threads at once.
    """

    def __init__(self, config: Config):
        if not isinstance(config, Config):
            raise TypeError(f"Context() takes a colibri.Config (got {type(config).__name__})")
        self.config = config
        groups = config.groups()
        sizes = [len(g) for g in groups]
        self._setup(
            num_experts=config.num_experts,
            top_k=config.top_k,
            scoring=config.scoring,
            normalize=config.normalize,
            norm_p=config.norm_p,
            norm_eps=config.normalize_eps,
            scale=config.scale,
            bias=config.correction_bias,
            bias_on=config.bias_on,
            expert_scale=config.expert_scale,
            group_start=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32),
            group_members=np.concatenate([np.asarray(g, np.int32) for g in groups]),
            topk_groups=config.topk_groups,
            group_score=config.group_score,
            routing_threads=config.routing_threads or max_threads(),
            ids_dtype=config.ids_dtype,
            collect_stats=config.collect_stats,
            use_avx512=config.use_avx512,
            use_avx2=config.use_avx2,
        )

    @property
    def stats(self):
        """Usage statistics (:class:`colibri.UsageStats`) or None when not collecting."""
        if not self.collect_stats:
            return None
        from colibri.stats import UsageStats

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

    ``init(26, 2)``, ``init(26, 2, num_groups=4)`` or ``init(config=Config(...))``; keyword
    options are the fields of :class:`Config` and override those of ``config``.
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


def route_from_dlpack(logits: Any, ctx: Context, *, out: Any = None):
    """Route ``logits`` (any DLPack producer or capsule) with ``ctx``: ``(ids, weights)``."""
    if not isinstance(ctx, Router):
        raise TypeError(
            f"route_from_dlpack(logits, ctx): ctx must be a colibri.Context "
            f"(got {type(ctx).__name__}); create one with colibri.init()"
        )
    return ctx.route(logits, out=out)


def route(logits: Any, top_k: int, **options: Any):
    """One-shot routing for scripts: ``route(logits, k, **options) -> (ids, weights)``.

    The number of experts is the last dimension of ``logits``. For repeated calls, build a
    context once with :func:`init`.
    """
    shape = getattr(logits, "shape", None)  # arrays of every framework: no import needed
    if shape is None:  # a raw capsule: import it here, once (it can be consumed only once)
        logits = host_tensor(logits)
        shape = logits.shape
    if len(shape) not in (1, 2):
        raise ValueError(f"route(): logits must be [E] or [T, E], got shape {tuple(shape)}")
    return init(shape[-1], top_k, **options).route(logits)
