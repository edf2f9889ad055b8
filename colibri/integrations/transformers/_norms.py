"""The RMSNorms of a model from :func:`from_pretrained` on colibri's kernel at decode sizes.

A decoding token runs every layer's norms (four a layer in Qwen3: input, post-attention,
query and key), each a handful of eager torch ops on one row: ~17 us a norm, ~1 ms a token
on the demo's shape, and more once a layer's weight stream has flushed the caches. colibri's
kernel (:func:`colibri.layer.rms_norm`) computes the same formula in one call.

A module is taken only if its class computes that formula: at install a copy of it, given a
random weight, runs its own ``forward`` and colibri's on random rows, which must agree to one
unit in the last place (Gemma's ``1 + weight`` and other variants fail and keep their own
forward). Inputs of more than :data:`MAX_VALUES` values, another dtype than the weight's,
gradients and other devices run the module's own forward; in a compiled graph the kernel is
the ``colibri::rms_norm`` operator (eager mode's bits).
"""

from __future__ import annotations

import copy
import types

import numpy as np
import torch
from torch import nn

from colibri.integrations.transformers._ops import values_of
from colibri.layer import rms_norm

__all__ = ["MAX_VALUES", "install"]

#: Most values of an input colibri's kernel takes (one thread; more: the module's own
#: forward, on torch's threads): a decoding step's rows, or their heads' (q/k norms).
MAX_VALUES = 1 << 16
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


_STATE = "_colibri_norm"  # (weight, its values: a view, follows in-place changes, address)


def _eps(module: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def compute(
    x: torch.Tensor, weight: torch.Tensor, eps: float, values: np.ndarray | None = None
) -> torch.Tensor:
    """colibri's RMSNorm of ``x [..., n]`` with ``weight [n]`` (same dtype, on the CPU;
    ``values``: the weight as ``values_of`` gives it, when the caller holds it)."""
    rows = values_of(x).reshape(-1, x.shape[-1])
    out = np.empty(rows.shape, rows.dtype)
    rms_norm(rows, values_of(weight) if values is None else values, eps, _DTYPES[x.dtype], out)
    return torch.from_numpy(out).view(x.dtype).reshape(x.shape)


@torch.library.custom_op("colibri::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """colibri's RMSNorm (:func:`compute`) as an opaque node of a compiled graph."""
    return compute(x, weight, eps)


@_rms_norm_op.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


def _forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    weight = self.weight
    if (
        x.dtype != weight.dtype
        or x.device.type != "cpu"
        or weight.device.type != "cpu"
        or not 0 < x.numel() <= MAX_VALUES
        or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    ):
        return type(self).forward(self, x)
    if torch.compiler.is_compiling():  # the same bits as eager mode
        return torch.ops.colibri.rms_norm(x, weight, _eps(self))
    state = self.__dict__.get(_STATE)
    if state is None or state[0] is not weight or state[2] != weight.data_ptr():
        state = self.__dict__[_STATE] = (weight, values_of(weight), weight.data_ptr())  # new
    return compute(x, weight, _eps(self), state[1])


def direct(module: nn.Module, dtype: torch.dtype, size: int) -> tuple[np.ndarray, float] | None:
    """``(weight values, eps)`` for a caller that runs ``module``'s kernel call itself on a
    ``dtype`` input of ``size`` values (no gradient): when its forward is colibri's and would
    call the kernel; None otherwise (call its forward)."""
    forward = module.__dict__.get("forward")
    weight = module.weight
    if (
        getattr(forward, "__func__", None) is not _forward
        or weight.dtype != dtype
        or weight.device.type != "cpu"
        or not 0 < size <= MAX_VALUES
        or (torch.is_grad_enabled() and weight.requires_grad)
    ):
        return None
    return values_of(weight), _eps(module)


def _agrees(module: nn.Module, eps: float) -> bool:
    """Whether ``module``'s class computes colibri's formula: its forward and the kernel on a
    copy with a random weight, over random rows, equal to one unit in the last place."""
    probe = copy.deepcopy(module)
    generator = torch.Generator().manual_seed(0)
    n = probe.weight.shape[0]
    dtype = probe.weight.dtype
    with torch.no_grad():
        probe.weight.copy_(torch.rand(n, generator=generator) * 2 - 0.5)
        x = (torch.randn(4, n, generator=generator) * 3).to(dtype)
        try:
            theirs = type(probe).forward(probe, x)
        except Exception:  # noqa: BLE001 (a forward that needs more arguments: not ours)
            return False
        if not isinstance(theirs, torch.Tensor) or theirs.shape != x.shape:
            return False
        if theirs.dtype != dtype:
            return False
        ours = compute(x, probe.weight, eps)
    rounding = 1 if dtype != torch.float32 else 4  # float32: two roundings (x r, w h)
    ulp = rounding * torch.finfo(dtype).eps * theirs.float().abs()
    return bool(((ours.float() - theirs.float()).abs() <= ulp).all())


def install(model: nn.Module) -> list[str]:
    """Put every ``*RMSNorm`` module of ``model`` that computes colibri's formula on
    colibri's kernel for decode-size inputs; returns their names."""
    taken = []
    for name, module in model.named_modules():
        if not type(module).__name__.endswith("RMSNorm"):
            continue
        weight, eps = getattr(module, "weight", None), _eps(module)
        if (
            eps is None
            or not isinstance(weight, nn.Parameter)
            or weight.ndim != 1
            or weight.dtype not in _DTYPES
            or weight.device.type != "cpu"
            or not _agrees(module, eps)
        ):
            continue
        module.__dict__["forward"] = types.MethodType(_forward, module)
        taken.append(name)
    return taken
