"""gpt-oss's routed experts: where one expert's fused gate/up and its down projection live.

gpt-oss stores its experts unlike every other family (transformers' ``GptOssExperts``), in
one of two forms per layer ``model.layers.N.mlp.experts.``:

- plain (``save_pretrained`` of a dequantized model): ``gate_up_proj [E, H, 2I]`` and
  ``down_proj [E, I, H]`` (F32, F16 or BF16), both transposed (``x @ W``), gate and up
  interleaved column by column (column ``2i`` is gate ``i``, ``2i + 1`` up ``i``);
- MXFP4 (the released checkpoints): ``gate_up_proj_blocks U8 [E, 2I, H/32, 16]``,
  ``gate_up_proj_scales U8 [E, 2I, H/32]``, ``down_proj_blocks U8 [E, H, I/32, 16]``,
  ``down_proj_scales U8 [E, H, I/32]``; rows are the output dimension (``W x``), gate and up
  interleaved by row; each byte holds two consecutive e2m1 values, low nibble first, each
  group of 32 values scaled by ``2 ** (scale - 127)`` (e8m0).

Either way one expert is a few contiguous byte ranges (``[e]`` of each tensor), paged as
stored: a :class:`GptOssLayout` lists them for the :class:`colibri.Pager`, and its
:meth:`GptOssLayout.weights` gives the views as :class:`GptOssWeights`. The biases
(``gate_up_proj_bias [E, 2I]``, ``down_proj_bias [E, H]``) are small and not paged: they are
loaded resident with the other non-expert tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from colibri.formats._base import (
    STORED_NAMES,
    FormatError,
    TensorInfo,
    TensorRef,
    WeightSource,
    _index,
    expert_tensor,
)

__all__ = [
    "MXFP4_OSS",
    "GptOssLayout",
    "GptOssWeights",
    "assemble_gpt_oss",
    "check_scales",
    "dequantize_mxfp4",
    "gpt_oss_source",
]

#: The dtype name of gpt-oss's MXFP4 experts as stored (not GGUF's ``mxfp4`` block layout).
MXFP4_OSS = "mxfp4_oss"
#: Values per MXFP4 block (one e8m0 scale) and bytes of its packed values.
BLOCK_VALUES, BLOCK_BYTES = 32, 16
_PLAIN = ("F32", "F16", "BF16")


@dataclass(frozen=True, slots=True)
class GptOssWeights:
    """One gpt-oss expert's weights, as the pager serves them (read-only views, no copy).

    Attributes
    ----------
    gate_up : array
        Plain: ``[H, 2I]`` (``x @ gate_up``, gate and up interleaved by column). MXFP4:
        ``uint8 [2I, H/32, 16]`` packed values (rows are outputs, interleaved by row).
    down : array
        Plain: ``[I, H]`` (``h @ down``). MXFP4: ``uint8 [H, I/32, 16]``.
    gate_up_scales, down_scales : array or None
        MXFP4: ``uint8 [2I, H/32]`` and ``[H, I/32]`` e8m0 exponents (bias 127); plain: None.
    dtype : str
        ``"mxfp4_oss"``, or the plain dtype (``"bfloat16"``, ``"float16"``, ``"float32"``).
    """

    gate_up: Any
    down: Any
    gate_up_scales: Any = None
    down_scales: Any = None
    dtype: str = MXFP4_OSS

    @property
    def nbytes(self) -> int:
        """Bytes of every array."""
        parts = (self.gate_up, self.down, self.gate_up_scales, self.down_scales)
        return sum(int(p.nbytes) for p in parts if p is not None)


@dataclass(frozen=True)
class GptOssLayout:
    """Where one gpt-oss expert lives (the :class:`colibri.Pager` reads :attr:`matrices`).

    ``gate_up`` and ``down`` are the expert's ``[e]`` of the plain tensors or of the MXFP4
    ``*_blocks``; ``gate_up_scales`` and ``down_scales`` its ``[e]`` of the ``*_scales``
    (MXFP4 only). Shapes are per expert, as stored.
    """

    layer: int
    expert: int
    gate_up: TensorRef
    down: TensorRef
    gate_up_scales: TensorRef | None = None
    down_scales: TensorRef | None = None

    @property
    def matrices(self) -> tuple[TensorRef, ...]:
        """Every byte range of the expert, in the order :meth:`weights` takes them."""
        refs = (self.gate_up, self.gate_up_scales, self.down, self.down_scales)
        return tuple(r for r in refs if r is not None)

    @property
    def nbytes(self) -> int:
        """Total bytes of the expert's ranges."""
        return sum(r.nbytes for r in self.matrices)

    @property
    def dtype(self) -> str:
        """``"mxfp4_oss"``, or the plain dtype in :class:`ExpertWeights`' spelling."""
        if self.gate_up_scales is not None:
            return MXFP4_OSS
        return STORED_NAMES[self.gate_up.dtype]

    down_dtype = dtype

    def weights(self, buffers) -> GptOssWeights:
        """The expert's arrays over ``buffers`` (``uint8``, in :attr:`matrices`' order)."""
        views = [ref.view(b) for ref, b in zip(self.matrices, buffers, strict=True)]
        if self.gate_up_scales is None:
            return GptOssWeights(views[0], views[1], dtype=self.dtype)
        return GptOssWeights(views[0], views[2], views[1], views[3])


_FORMS = {
    ("down", "gate_up"): "plain",
    ("down_blocks", "down_scales", "gate_up_blocks", "gate_up_scales"): "mxfp4",
}


def assemble_gpt_oss(
    path: str, tensors: Mapping[str, TensorInfo]
) -> dict[tuple[int, int], GptOssLayout]:
    """gpt-oss's routed experts among ``tensors`` (the whole checkpoint's), per expert.

    Raises
    ------
    FormatError
        A layer mixes the two forms, lacks a tensor of its form, or a tensor's dtype or shape
        disagrees with its layer's others (naming ``path`` and the tensor).
    """
    layers: dict[int, dict[str, TensorInfo]] = {}
    for name, t in tensors.items():
        found = expert_tensor(name)
        if found is None:
            continue
        if found.expert is not None:
            raise FormatError(
                f"{path}: tensor {name!r} stores one expert's matrix; gpt-oss stores each "
                "layer's experts stacked (experts.gate_up_proj [E, H, 2I], experts.down_proj "
                "[E, I, H], or their MXFP4 *_blocks and *_scales)"
            )
        layer = layers.setdefault(_index(path, name, found.layer), {})
        layer[found.proj] = t
    experts: dict[tuple[int, int], GptOssLayout] = {}
    for layer, parts in sorted(layers.items()):
        experts.update(_layer(path, layer, parts))
    return experts


def gpt_oss_source(path: str, tensors: Mapping[str, TensorInfo]) -> WeightSource:
    """The routed experts of a gpt-oss checkpoint (headers read and checked; ``path``: its
    index or single file) as a :class:`WeightSource` of :class:`GptOssLayout`.

    Raises
    ------
    FormatError
        As :func:`assemble_gpt_oss`.
    """
    experts = assemble_gpt_oss(path, tensors)
    files = tuple(sorted({ref.path for layout in experts.values() for ref in layout.matrices}))
    return WeightSource("safetensors", files, experts)  # type: ignore[arg-type]


def _layer(path: str, layer: int, parts: dict[str, TensorInfo]) -> dict:
    form = _FORMS.get(tuple(sorted(parts)))
    if form is None:
        names = ", ".join(sorted(t.name for t in parts.values()))
        raise FormatError(
            f"{path}: layer {layer} stores gpt-oss experts as {names}; expected "
            "experts.gate_up_proj and experts.down_proj (plain), or experts.gate_up_proj_blocks, "
            "gate_up_proj_scales, down_proj_blocks and down_proj_scales (MXFP4)"
        )
    if form == "plain":
        gate_up, down = parts["gate_up"], parts["down"]
        _check(path, gate_up, _PLAIN, 3)
        _check(path, down, (gate_up.dtype,), 3)
        num, hidden, inter2 = gate_up.shape
        _expect(path, down, (num, inter2 // 2, hidden), inter2 % 2 == 0)
        return {(layer, e): GptOssLayout(layer, e, _at(gate_up, e), _at(down, e))
                for e in range(num)}  # fmt: skip
    blocks, scales = parts["gate_up_blocks"], parts["gate_up_scales"]
    down, down_scales = parts["down_blocks"], parts["down_scales"]
    for t in parts.values():
        _check(path, t, ("U8",), 3 if t.name.endswith("_scales") else 4)
    num, inter2, groups, size = blocks.shape
    _expect(path, blocks, (num, inter2, groups, BLOCK_BYTES), inter2 % 2 == 0)
    _expect(path, scales, (num, inter2, groups))
    hidden = groups * BLOCK_VALUES
    inter = inter2 // 2
    _expect(path, down, (num, hidden, inter // BLOCK_VALUES, BLOCK_BYTES),
            inter % BLOCK_VALUES == 0)  # fmt: skip
    _expect(path, down_scales, (num, hidden, inter // BLOCK_VALUES))
    return {
        (layer, e): GptOssLayout(
            layer, e, _at(blocks, e), _at(down, e), _at(scales, e), _at(down_scales, e)
        )
        for e in range(num)
    }


def _check(path: str, t: TensorInfo, dtypes: tuple[str, ...], ndim: int) -> None:
    if t.dtype not in dtypes or len(t.shape) != ndim or 0 in t.shape:
        raise FormatError(
            f"{path}: gpt-oss expert tensor {t.name!r} is {t.dtype} {list(t.shape)}; it must be "
            f"{' or '.join(dtypes)} with {ndim} non-empty dimensions"
        )


def _expect(path: str, t: TensorInfo, shape: tuple[int, ...], ok: bool = True) -> None:
    if not ok or tuple(t.shape) != shape:
        raise FormatError(
            f"{path}: gpt-oss expert tensor {t.name!r} has shape {list(t.shape)}, but its "
            f"layer's other expert tensors give it {list(shape)}"
            + ("" if ok else " (with an even 2I, and I a multiple of 32 for MXFP4)")
        )


def _at(t: TensorInfo, e: int) -> TensorRef:
    """Expert ``e`` of the stacked tensor ``t``: a contiguous byte range."""
    stride = t.nbytes // t.shape[0]
    return TensorRef(f"{t.name}[{e}]", t.path, t.offset + e * stride, stride, t.dtype,
                     tuple(t.shape[1:]))  # fmt: skip


def check_scales(scales: np.ndarray, what: str) -> None:
    """Raise :class:`FormatError` if an e8m0 scale byte of ``scales`` (uint8 ``[R, G]``) is
    0xFF, e8m0's NaN, naming ``what``, the row and the block."""
    bad = np.flatnonzero(np.asarray(scales).reshape(-1) == 0xFF)
    if bad.size:
        row, block = divmod(int(bad[0]), scales.shape[-1])
        raise FormatError(
            f"{what}: the e8m0 scale of row {row}, block {block} is 0xFF, which MXFP4 reads "
            "as NaN (no weight has it): the weight file is corrupt"
        )


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray, what: str = "scales") -> np.ndarray:
    """MXFP4 as gpt-oss stores it, to float32 (exact: every value is representable).

    Parameters
    ----------
    blocks : uint8 [R, G, 16]
        Packed e2m1 values, two a byte, low nibble first.
    scales : uint8 [R, G]
        e8m0 exponents (bias 127) of each group of 32 values.
    what : str
        The scales' name in errors.

    Returns
    -------
    float32 [R, G * 32]

    Raises
    ------
    FormatError
        A scale byte is 0xFF (NaN).
    """
    check_scales(scales, what)
    rows, groups = scales.shape
    blocks = np.asarray(blocks).reshape(rows, groups, BLOCK_BYTES)
    values = np.empty((rows, groups, BLOCK_VALUES), np.float32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    exponents = np.asarray(scales, np.int32) - 127
    return np.ldexp(values, exponents[..., None]).reshape(rows, groups * BLOCK_VALUES)


#: The 16 e2m1 values by their 4-bit code (sign bit 3).
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)  # fmt: skip
