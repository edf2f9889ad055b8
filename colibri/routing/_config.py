"""Routing configuration: every option validated once, with errors that name the fix."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

import numpy as np

from colibri import _core, _groups
from colibri._validate import check_choice, check_float, check_int, check_page_size_kb

SCORINGS = tuple(_core.SCORINGS)  # the names route.h has codes for
GROUP_SCORES = tuple(_core.GROUP_SCORES)
IDS_DTYPES = ("int32", "int64")
BIAS_ON = ("scores", "logits")


def _expert_vector(name: str, value: Any, num_experts: int) -> np.ndarray | None:
    """A read-only float32 [E] copy of a per-expert vector from numpy, torch, jax, lists..."""
    if value is None:
        return None
    if hasattr(value, "__dlpack__") and not isinstance(value, np.ndarray):
        from colibri._dlpack import bf16_to_float32, import_host

        if getattr(value, "requires_grad", False):
            value = value.detach()
        array, dtype = import_host(value)
        if dtype == "bfloat16":
            array = bf16_to_float32(array)
    else:
        array = np.asarray(value)
    if array.dtype.kind != "f":
        raise TypeError(
            f"{name} must be a floating-point [E] vector (got dtype "
            f"{array.dtype}); convert it with .astype(np.float32)"
        )
    if array.shape != (num_experts,):
        raise ValueError(
            f"{name} must have shape ({num_experts},) for {num_experts} experts (got {array.shape})"
        )
    array = np.array(array, dtype=np.float32)
    if not np.isfinite(array).all():
        raise ValueError(
            f"{name} must be finite; expert {int(np.argmin(np.isfinite(array)))} is NaN or inf"
        )
    array.setflags(write=False)
    return array


@dataclasses.dataclass(frozen=True)
class Config:
    """What a routing context does; fixed for the context's life.

    Parameters
    ----------
    num_experts, top_k : int
        E experts, k chosen per token (1 <= k <= the experts reachable through the groups).
    batch_size : int
        Tokens per call the context preallocates result buffers for (``ctx.buffers()``).
    page_size_kb : int
        Expert-weight page size (KiB, a power of two >= 4) for a pager built with this
        configuration: ``Pager(path, budget_bytes=..., page_size_kb=ctx.config.page_size_kb)``.
    routing_threads : int or None
        OpenMP threads for batched routing; None: all cores (OMP_NUM_THREADS).
    scoring : {"softmax", "sigmoid", "sqrtsoftplus"}
        Score function (sqrtsoftplus: DeepSeek-V4's sqrt(softplus(x))).
    normalize : bool
        Renormalise the k chosen weights to unit ``norm_p``-norm (transformers' norm_topk_prob).
    norm_p : float
        The norm's p: 1 divides by the sum; DBRX uses moe_normalize_expert_weights.
    normalize_eps : float
        Added to the norm before dividing (0: exact; LFM2-MoE uses 1e-6).
    correction_bias : [E] float array or None
        Added for selection only (DeepSeek-V3's e_score_correction_bias).
    bias_on : {"scores", "logits"}
        What the bias is added to: the scores (DeepSeek-V3) or the raw logits (Kolibri).
    scale : float
        Multiplies the final weights (routed_scaling_factor).
    expert_scale : [E] float array or None
        Per-expert factor applied after renormalisation (Gemma 4's per_expert_scale).
    num_groups, topk_groups : int
        Group-limited routing: keep the topk_groups best of num_groups contiguous groups.
    group_score : {"max", "top2_sum"}
        A group's score: its best key, or the sum of its best two.
    partition : colibri.Partition, list of lists of expert ids, or None
        Explicit groups of any membership (Static Expert Partitioning); overrides num_groups.
        Kept as the groups, a tuple of tuples of ascending ids (``Partition.groups``).
    ids_dtype : {"int32", "int64"}
    collect_stats : bool
        Count expert selections and co-activations while routing (``ctx.stats``).
    use_avx512 : bool or None
        The AVX-512F kernels (score pass, top two): None uses them where the CPU has them,
        True requires them (an error where they cannot run), False keeps to SSE2. Every
        path gives the same bits.
    use_avx2 : bool or None
        The AVX2 kernels (score passes, top two, top-k bound), where the AVX-512F ones do
        not apply; the same choices and the same bits. ``COLIBRI_SIMD`` (scalar, sse2, avx2,
        avx512) caps what None picks.
    """

    num_experts: int
    top_k: int
    batch_size: int = 1
    page_size_kb: int = 64
    routing_threads: int | None = None
    scoring: str = "softmax"
    normalize: bool = True
    norm_p: float = 1.0
    normalize_eps: float = 0.0
    correction_bias: Any = None
    bias_on: str = "scores"
    scale: float = 1.0
    expert_scale: Any = None
    num_groups: int = 1
    topk_groups: int = 1
    group_score: str = "max"
    partition: Any = None
    ids_dtype: str = "int32"
    collect_stats: bool = False
    use_avx512: bool | None = None
    use_avx2: bool | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__.__get__(self)  # frozen: store the normalised values
        E = check_int("num_experts", self.num_experts, 1)
        set_("num_experts", E)
        set_("batch_size", check_int("batch_size", self.batch_size, 1))
        set_("page_size_kb", check_page_size_kb(self.page_size_kb))
        if self.routing_threads is not None:
            set_("routing_threads", check_int("routing_threads", self.routing_threads, 1))
        check_choice("scoring", self.scoring, SCORINGS)
        check_choice("group_score", self.group_score, GROUP_SCORES)
        check_choice("ids_dtype", self.ids_dtype, IDS_DTYPES)
        for flag in ("normalize", "collect_stats"):
            if not isinstance(getattr(self, flag), (bool, np.bool_)):
                raise TypeError(f"{flag} must be True or False (got {getattr(self, flag)!r})")
            set_(flag, bool(getattr(self, flag)))
        for flag in ("use_avx512", "use_avx2"):
            value = getattr(self, flag)
            if value is not None:
                if not isinstance(value, (bool, np.bool_)):
                    raise TypeError(f"{flag} must be None, True or False (got {value!r})")
                set_(flag, bool(value))
        set_("norm_p", check_float("norm_p", self.norm_p, positive=True))
        set_("normalize_eps", check_float("normalize_eps", self.normalize_eps))
        if self.normalize_eps < 0:
            raise ValueError(f"normalize_eps must be >= 0 (got {self.normalize_eps})")
        check_choice("bias_on", self.bias_on, BIAS_ON)
        set_("scale", check_float("scale", self.scale))
        set_("correction_bias", _expert_vector("correction_bias", self.correction_bias, E))
        set_("expert_scale", _expert_vector("expert_scale", self.expert_scale, E))

        if self.partition is not None:  # a colibri.Partition, or its groups
            groups = _groups.check(getattr(self.partition, "groups", self.partition))
            covered = sum(len(g) for g in groups)
            if covered != E:
                raise ValueError(f"partition covers {covered} experts but num_experts={E}")
            set_("partition", groups)
            set_("num_groups", len(groups))
        else:
            set_(
                "num_groups",
                check_int("num_groups", self.num_groups, 1, E, " (groups partition the experts)"),
            )
        G = self.num_groups
        kg = check_int("topk_groups", self.topk_groups, 1, G, f" ({G} group(s) exist)")
        set_("topk_groups", kg)
        sizes = sorted(len(g) for g in self.groups())
        reachable = sum(sizes[:kg]) if G > 1 else E  # whichever groups a token keeps
        check_int(
            "top_k",
            self.top_k,
            1,
            reachable,
            ""
            if G == 1
            else f": a token that keeps the {kg} smallest group(s) can reach "
            f"only {reachable} experts; raise topk_groups or lower top_k",
        )
        set_("top_k", int(self.top_k))
        if G > 1 and self.group_score == "top2_sum" and sizes[0] < 2:
            raise ValueError(
                "group_score='top2_sum' needs at least 2 experts in every group, "
                "but a group has 1; use group_score='max' or larger groups"
            )

    def groups(self) -> tuple[tuple[int, ...], ...]:
        """The expert groups routing is limited by (one group of all experts when ungrouped)."""
        if self.partition is not None:
            return self.partition
        return _groups.contiguous(self.num_experts, self.num_groups)

    @classmethod
    def options(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))


def check_options(options: dict[str, Any]) -> None:
    """Raise a TypeError naming any option Config does not know, with the closest match."""
    known = Config.options()
    for name in options:
        if name not in known:
            hint = difflib.get_close_matches(name, known, n=1)
            suggestion = f"; did you mean {hint[0]!r}?" if hint else ""
            raise TypeError(
                f"unknown routing option {name!r}{suggestion} (options: {', '.join(known)})"
            )
