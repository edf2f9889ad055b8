"""The non-expert linears of a model from :func:`from_pretrained` on colibri's kernel.

Every ``nn.Linear`` that is not inside a routed experts module (attention projections,
shared experts, dense MLPs, the LM head, ...) with bfloat16 or float16 weights on the CPU
runs colibri's linear kernel (``include/colibri/linear.h``: the expert kernel's dot products,
the weights read once at memory speed, float32 accumulation) when its input has few rows
(decoding), else torch's ``F.linear`` (in float32 on a CPU without native bfloat16, where
torch's half-precision GEMM is several times slower than converting the weight). torch's
half-precision GEMV is slow on CPUs without native bf16 and pays torch's per-op overhead; on
others torch may win, and its GEMM wins as rows grow, so ``linears="auto"`` times both once
per distinct weight shape at load: colibri's kernel where it wins at one row, up to the most
rows (of 2, 4, :data:`MAX_ROWS`) where it still wins (``model.colibri.linears`` records the
choice and the timings). A router's kernel, and the attention projections of a layer with a
decoding step, are timed alone, without the forward's conversions from and to torch's
tensors: a decoding step computes them inside one native call (``colibri.layer._step``),
which a single projection left to torch would cost every layer; so the projections take one
engine together, colibri's where its time summed over them wins.

The output equals torch's up to float32 summation order: both accumulate the exact products
in float32, add the bias in float32 and round once to the input's dtype.

A GGUF file's block-quantized linears (Q8_0, Q4_K, ...) are kept as stored when the model
computes in half precision: they never exist in bfloat16 (the module's ``weight`` stays on
the meta device) and every input runs colibri's quantized linear kernel
(``include/colibri/qlinear.h``: the input quantized to int8 blocks, as llama.cpp does), half
the bytes of bfloat16 for Q8_0, a quarter for Q4_0. Where colibri's x86 kernels are built,
Q4_0 weights are copied with their rows interleaved by eight (``colibri.layer.fast_layout``,
the same bits at 1.7-1.9x the speed), the file's pages left unread.
"""

from __future__ import annotations

import sys
import time
import types
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from colibri._validate import check_choice
from colibri.integrations.transformers._ops import HALF_NAMES, bits_of, compute, compute_quantized
from colibri.integrations.transformers._threads import DECODE_ROWS, one_thread
from colibri.layer import NATIVE_HALF, fast_layout, half_linear

__all__ = ["LINEAR_MODES", "MAX_ROWS", "LinearChoice", "install", "linear"]

LINEAR_MODES = ("auto", "colibri", "torch")
# Most input rows colibri's kernel takes (more: torch's GEMM; "auto" may choose fewer). The
# kernel reads the weights once whatever the rows, but its arithmetic grows with them (4 rows
# per pass over a weight row in L1) while a GEMM's barely does: decode sizes.
MAX_ROWS = DECODE_ROWS
_STEPS = (MAX_ROWS, 4, 2)  # the row counts "auto" tries, after one row
#: The weight dtypes colibri's linear kernel reads.
_HALVES = (torch.bfloat16, torch.float16)
_STATE = "_colibri_linear"
_REPEATS = 5  # timings per engine in "auto" (the minimum counts)


@dataclass
class LinearChoice:
    """The engine of one distinct linear shape (an entry of ``model.colibri.linears``).

    Attributes
    ----------
    engine : str
        ``"colibri"`` (inputs of up to ``rows`` rows on colibri's kernel) or ``"torch"``.
    rows : int
        Most input rows colibri's kernel takes (0 with ``engine="torch"``): ``MAX_ROWS``,
        or with ``linears="auto"`` the most of 1, 2, 4, ``MAX_ROWS`` at which it won (1 for
        an attention projection taken along by the others' summed time);
        ``sys.maxsize`` for block-quantized weights kept as stored (every input).
    modules : list of str
        The model's linears of this shape.
    colibri_s, torch_s : float or None
        With ``linears="auto"``: the best of a few timings of one input row, in seconds (a
        router's colibri_s: the kernel alone, as a decoding step calls it).
    by_rows : dict
        With ``linears="auto"``: ``{rows: (colibri_s, torch_s)}`` of every row count timed.
    """

    engine: str
    rows: int
    modules: list[str]
    colibri_s: float | None = None
    torch_s: float | None = None
    by_rows: dict[int, tuple[float, float]] = field(default_factory=dict)


class _Linear:
    """One linear's colibri state: its weight's bits (refreshed when the weight moves)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, num_threads: int,
                 rows: int) -> None:  # fmt: skip
        self.num_threads = num_threads
        self.rows = rows
        self.refresh(weight, bias)

    def refresh(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.key = _key(weight, bias)
        usable = weight.dtype in _HALVES and weight.device.type == "cpu" and weight.is_contiguous()
        self.bits = bits_of(weight) if usable else None  # a view: follows in-place changes
        self.bias32 = None if bias is None else bias.detach().to(torch.float32).numpy()

    def current(self, weight: torch.Tensor, bias: torch.Tensor | None) -> np.ndarray | None:
        """The weight's bits, read again if it moved (``.to()``, a copy) or the bias is new;
        None when colibri's kernel cannot read it."""
        if _key(weight, bias) != self.key:
            self.refresh(weight, bias)
        return self.bits


class _Quantized:
    """One linear's weight as stored in a GGUF file (rows of blocks) and its float32 bias;
    Q4_0 rows interleaved by eight (a copy) where that layout has its kernel."""

    def __init__(self, module: nn.Linear, qtype: str, blocks, num_threads: int) -> None:
        self.stored = qtype  # the file's type
        blocks, self.qtype = fast_layout(blocks, qtype)
        self.blocks = torch.from_numpy(blocks)  # uint8 [out, row_bytes]
        self.array = blocks  # the same memory as numpy, for direct() callers
        self.num_threads = num_threads
        self.refresh(module)

    def refresh(self, module: nn.Linear) -> None:
        bias = module.bias
        self.key = None if bias is None else (bias.data_ptr(), bias._version)
        self.bias32 = None if bias is None else bias.detach().to(torch.float32).numpy()

    def current(self, module: nn.Linear) -> _Quantized:
        """This state, its bias read again if ``module``'s moved or changed in place."""
        bias = module.bias
        if (None if bias is None else (bias.data_ptr(), bias._version)) != self.key:
            self.refresh(module)
        return self


def _quantized_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    state: _Quantized = self.__dict__[_STATE]
    if torch.compiler.is_compiling():  # an opaque node of the graph
        return torch.ops.colibri.quant_linear(
            x, state.blocks, state.qtype, self.bias, state.num_threads
        )
    if x.device.type != "cpu":
        raise ValueError(
            f"a {state.stored} linear of a GGUF model computes on the CPU, its input is on "
            f"{x.device}; move the input to the CPU"
        )
    if torch.is_grad_enabled() and x.requires_grad:
        raise RuntimeError(
            f"a {state.stored} linear kept as stored has no gradient; run under "
            "torch.no_grad(), or load with linears='torch' (bfloat16 weights, dequantized)"
        )
    state.current(self)
    return compute_quantized(x, state.blocks, state.qtype, state.bias32, state.num_threads)


def direct(module: nn.Module, router: bool = False) -> tuple | None:
    """``(weight, code, bias32, num_threads)``: the arguments of the kernel call ``module``'s
    forward makes for one input row (its state refreshed as the forward refreshes it), for a
    caller that makes the call itself (``colibri.layer._step``): ``code`` the quantized type
    of rows of blocks, or ``"bfloat16"`` / ``"float16"`` for a half-precision weight's bits.
    None when the forward would not call colibri's kernel. ``router``: ``module`` is a router
    whose forward computes its logits with :func:`linear` (no bias)."""
    forward = module.__dict__.get("forward")
    state = module.__dict__.get(_STATE)
    if getattr(forward, "__func__", None) is _quantized_forward:
        state = state.current(module)
        return state.array, state.qtype, state.bias32, state.num_threads
    if not isinstance(state, _Linear) or (
        not router and getattr(forward, "__func__", None) is not _forward
    ):
        return None
    weight = module.weight
    bias = None if router else module.bias
    if (
        state.rows < 1
        or weight.device.type != "cpu"
        or (torch.is_grad_enabled() and weight.requires_grad)
    ):
        return None
    bits = state.current(weight, bias)
    if bits is None:
        return None
    return bits, HALF_NAMES[weight.dtype], state.bias32, state.num_threads


def _key(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    """What a :class:`_Linear` was made from: the weight's memory and dtype, the bias's
    memory and version (its float32 copy is stale after an in-place change)."""
    if bias is None:
        return weight.data_ptr(), weight.dtype
    return weight.data_ptr(), weight.dtype, bias.data_ptr(), bias._version


def _needs_grad(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)


def _run(state: _Linear, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """``F.linear(x, weight, bias)``, on colibri's kernel for few rows on the CPU."""
    few = 0 < x.numel() <= state.rows * weight.shape[1]
    if torch.compiler.is_compiling():  # an opaque node of the graph
        if few and weight.dtype in _HALVES and not _needs_grad(x, weight):
            return torch.ops.colibri.linear(x, weight, bias, state.num_threads)
        return F.linear(x, weight, bias)
    if x.device.type != "cpu" or _needs_grad(x, weight):
        return F.linear(x, weight, bias)
    if not few:
        return many(x, weight, bias)
    bits = state.current(weight, bias)
    if bits is None:
        return F.linear(x, weight, bias)
    return compute(x, weight, bias, state.num_threads, bits, state.bias32)


def many(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` for more rows than the kernel takes (a prompt's): in float32, rounded
    once to ``x``'s dtype, where the CPU does not compute that half type natively
    (``NATIVE_HALF``) and torch's GEMM of it is several times slower than converting the
    weight and running its float32 GEMM; the same sums (float32 accumulation, the bias added,
    one rounding) up to their order. torch's own ``F.linear`` otherwise."""
    if x.dtype not in _HALVES or weight.dtype != x.dtype or HALF_NAMES[x.dtype] in NATIVE_HALF:
        return F.linear(x, weight, bias)
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return _run(self.__dict__[_STATE], x, self.weight, self.bias)


def linear(module: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A router's logits ``F.linear(x, module.weight, bias)``: on colibri's kernel where
    :func:`install` chose it for the router's weight shape (decoding rows), else torch's."""
    state = module.__dict__.get(_STATE)
    if state is None:
        return F.linear(x, module.weight, bias)
    return _run(state, x, module.weight, bias)


def _usable(weight: object) -> bool:
    """A weight colibri's linear kernel reads: ``[out, in]`` half precision, contiguous,
    in CPU memory."""
    return (
        isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and weight.device.type == "cpu"
        and weight.dtype in _HALVES
        and weight.is_contiguous()
    )


def _candidates(
    model: nn.Module, skip: list[str], routers: list[str]
) -> list[tuple[str, nn.Module]]:
    """The modules whose linear colibri's kernel may run: ``nn.Linear`` with half-precision
    contiguous weights on the CPU, outside the ``skip`` modules (the routed experts), not
    already given another forward; and the patched ``routers`` (their logits' linear)."""
    prefixes = tuple(f"{name}." for name in skip)
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or name.startswith(prefixes) or name in skip:
            continue
        if _usable(module.weight) and "forward" not in module.__dict__:
            found.append((name, module))
    for name in routers:
        module = model.get_submodule(name)
        if _usable(getattr(module, "weight", None)):
            found.append((name, module))
    return found


def _bias(module: nn.Module) -> torch.Tensor | None:
    return module.bias if isinstance(module, nn.Linear) else None


def _best(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _measure(
    module: nn.Linear, num_threads: int, rows: int, alone: bool = False
) -> tuple[float, float]:
    """The best of a few timings of ``rows`` input rows: colibri's kernel, then ``F.linear``
    on one torch thread, as a decoding step runs it (:mod:`._threads`). colibri's through
    its forward (:func:`compute`: torch's tensors converted in and out), or ``alone`` the
    kernel alone: a decoding step computes a router's logits and its layer's attention
    projections inside its native call (:func:`direct`), where the conversions cost 7 times
    a router's kernel (25 µs against 3.5 µs for a [26, 1024] router on a Zen 3 core) and
    would hand every router, and some projections (a [256, 1024] float16 one: 47 µs either
    way through the forward on a Zen 3), to torch."""
    weight, bias = module.weight, _bias(module)
    x = torch.randn(rows, weight.shape[1]).to(weight.dtype)
    bits = bits_of(weight)
    bias32 = None if bias is None else bias.detach().to(torch.float32).numpy()
    dtype, x32 = HALF_NAMES[weight.dtype], x.to(torch.float32).numpy()
    with torch.no_grad():
        if alone:
            ours = _best(lambda: half_linear(x32, bits, dtype, bias32, num_threads), _REPEATS)
        else:
            ours = _best(lambda: compute(x, weight, bias, num_threads, bits, bias32), _REPEATS)
        with one_thread():
            theirs = _best(lambda: F.linear(x, weight, bias), _REPEATS)
    return ours, theirs


def _choose(
    module: nn.Linear, num_threads: int, names: list[str], alone: bool = False
) -> LinearChoice:
    """``"auto"``: colibri's kernel if it beats ``F.linear`` at one row, up to the most rows
    of :data:`_STEPS` at which it still does (tried from the most); ``alone``: timed as a
    decoding step calls it (:func:`_measure`)."""
    timed = {1: _measure(module, num_threads, 1, alone)}
    choice = LinearChoice("torch", 0, names, *timed[1], by_rows=timed)
    if timed[1][0] >= timed[1][1]:
        return choice
    choice.engine, choice.rows = "colibri", 1
    for rows in _STEPS:
        timed[rows] = _measure(module, num_threads, rows, alone)
        if timed[rows][0] < timed[rows][1]:
            choice.rows = rows
            break
    return choice


def _together(group: list[LinearChoice]) -> None:
    """One engine for the linears a decoding step computes in one native call (the attention
    projections): colibri's where its time summed over them (one row each) beats torch's.
    Left to torch, any one of them takes its layers off the step (every module then called
    one by one: a token took twice as long), and a single timing of a small shape is close
    (a [256, 1024] float16 projection on a Zen 4: 8-15 µs against torch's 16): noise must not
    decide it."""
    if not group:
        return
    ours = sum(c.colibri_s * len(c.modules) for c in group)
    theirs = sum(c.torch_s * len(c.modules) for c in group)
    for c in group:
        if ours < theirs and c.engine == "torch":
            c.engine, c.rows = "colibri", 1
        elif ours >= theirs and c.engine == "colibri":
            c.engine, c.rows = "torch", 0


def install(
    model: nn.Module,
    mode: str,
    num_threads: int = 0,
    skip: list[str] = (),
    quantized: dict | None = None,
    routers: list[str] = (),
    stepped: list[str] = (),
) -> dict[tuple[int, int, str], LinearChoice]:
    """Run the non-expert linears of ``model`` on colibri's kernel as ``mode`` says.

    Parameters
    ----------
    model : nn.Module
        A model with its weights loaded (ties made).
    mode : str
        ``"auto"`` (per distinct ``(out, in, dtype)``: colibri's kernel where a timed row
        beats ``F.linear``, for as many rows as it still wins at), ``"colibri"`` (everywhere,
        up to :data:`MAX_ROWS` rows) or ``"torch"`` (nowhere).
    num_threads : int
        colibri's threads (0: colibri's default).
    skip : list of str
        Names of modules whose linears stay torch's (the routed experts).
    quantized : dict, optional
        ``{module name: (qtype, blocks)}``: linears whose weights stay block-quantized as
        stored (``blocks`` ``uint8 [out, row_bytes]``; the module's weight on the meta
        device), run on colibri's quantized kernel whatever ``mode`` says.
    routers : list of str
        Names of the patched routers: their logits' linear (``linear``) is chosen as the
        others are, timed alone.
    stepped : list of str
        Names of the linears a decoding step computes inside its native call (the attention
        projections of :mod:`._decode`'s layers): timed alone.

    Returns
    -------
    dict
        ``{(out, in, dtype name): LinearChoice}`` for every candidate linear's shape (the
        block type's name, ``"q8_0"`` ..., for the quantized ones).
    """
    check_choice("from_pretrained(): linears", mode, LINEAR_MODES)
    by_shape: dict[tuple[int, int, str], list[tuple[str, nn.Linear]]] = {}
    routers, alone = set(routers), set(routers) | set(stepped)
    for name, module in _candidates(model, list(skip), sorted(routers)):
        out, inp = module.weight.shape
        key = (int(out), int(inp), str(module.weight.dtype).removeprefix("torch."))
        by_shape.setdefault(key, []).append((name, module))
    choices = {}
    for key, members in by_shape.items():
        names = [name for name, _ in members]
        choice = LinearChoice("torch", 0, names)
        if mode == "colibri":
            choice = LinearChoice("colibri", MAX_ROWS, names)
        elif mode == "auto":
            choice = _choose(members[0][1], num_threads, names, alone.issuperset(names))
        choices[key] = choice
    if mode == "auto":
        _together([c for c in choices.values() if set(stepped).issuperset(c.modules)])
    for key, members in by_shape.items():
        if choices[key].engine == "colibri":
            for name, module in members:
                # plain instance attributes, as patch() does for routers
                state = _Linear(module.weight, _bias(module), num_threads, choices[key].rows)
                module.__dict__[_STATE] = state
                if name not in routers:  # a router's own forward calls linear()
                    module.__dict__["forward"] = types.MethodType(_forward, module)
    for name, (qtype, blocks) in (quantized or {}).items():
        module = model.get_submodule(name)
        key = (module.out_features, module.in_features, qtype)
        choices.setdefault(key, LinearChoice("colibri", sys.maxsize, [])).modules.append(name)
        module.__dict__[_STATE] = _Quantized(module, qtype, blocks, num_threads)
        module.__dict__["forward"] = types.MethodType(_quantized_forward, module)
    return choices
