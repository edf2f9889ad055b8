"""Validated expert layouts: which byte ranges of which files hold each expert's matrices.

A :class:`WeightSource` maps ``(layer, expert)`` to an :class:`ExpertLayout`, whose three
:class:`TensorRef` give the file, absolute byte offset, length, dtype and shape of the expert's
``gate [I, H]``, ``up [I, H]`` and ``down [H, I]`` matrices (torch ``nn.Linear`` ``[out, in]``
convention). Every range has been checked against the file before a source is returned: inside
the data section, no overlaps, and ``dtype x shape == length``. Nothing here maps a file.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from colibri._errors import FormatError
from colibri._json import INT32_MAX, MAX_BYTES

__all__ = [
    "ExpertLayout",
    "ExpertWeights",
    "FormatError",
    "TensorInfo",
    "TensorRef",
    "WeightSource",
    "assemble_experts",
    "expert_tensor",
    "check_extents",
    "fp8_scale",
    "is_fp8_scale",
    "numpy_dtype",
    "DTYPE_SIZES",
    "FP8_BLOCKED",
]

#: Largest JSON header or manifest colibri agrees to parse (safetensors uses the same bound).
MAX_HEADER_BYTES = MAX_BYTES
#: Largest layer or expert index a file may name (ids are int32).
MAX_INDEX = INT32_MAX

#: Element sizes in bytes of the dtypes a layout may name (safetensors spelling).
DTYPE_SIZES: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip

_NUMPY_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
    "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32, "U16": np.uint16,
    "U8": np.uint8, "BOOL": np.bool_,
}  # fmt: skip


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype that views a stored dtype.

    ``BF16`` and ``F8_*`` use ``ml_dtypes`` when it is installed (it comes with jax) and fall
    back to their raw bit patterns (``uint16`` / ``uint8``) otherwise. Block-quantized GGUF
    types (``Q4_K``, ...) are viewed as ``uint8`` rows of raw blocks.
    """
    if name in _NUMPY_DTYPES:
        return np.dtype(_NUMPY_DTYPES[name])
    if name in ("BF16", "F8_E4M3", "F8_E5M2"):
        try:
            import ml_dtypes
        except ImportError:
            return np.dtype(np.uint16 if name == "BF16" else np.uint8)
        attr = {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}[name]
        return np.dtype(getattr(ml_dtypes, attr))
    return np.dtype(np.uint8)


#: The compute name (numpy's spelling) of each stored float dtype an expert may have.
STORED_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
#: :class:`ExpertWeights`' dtype of float8 experts: e4m3fn bytes with one scale per 128 x 128
#: block (DeepSeek-V3 / Qwen3 FP8 checkpoints); their ``scales`` hold the block scales.
FP8_BLOCKED = "float8_e4m3_b128"
#: Rows and columns of one float8 scale block.
FP8_BLOCK = 128
#: What a float8 weight's block-scale tensor is named: the weight's name and this.
FP8_SCALE_SUFFIX = "_scale_inv"


@dataclass(frozen=True, slots=True)
class ExpertWeights:
    """One gated-FFN expert's matrices: ``y = down @ (act(gate @ x) * (up @ x))``.

    Attributes
    ----------
    gate, up : [I, H]
    down : [H, I]
        Arrays of one dtype (numpy, or any host DLPack tensor), in ``nn.Linear``'s ``[out,
        in]`` convention; from a :class:`colibri.Pager` they are read-only zero-copy views.
    dtype : str
        What the matrices store: ``"float32"``, ``"float64"``, ``"float16"`` or
        ``"bfloat16"`` (bfloat16 may arrive as raw ``uint16`` bits), or a block-quantized type
        (``"q4_k"``, ...: ``uint8 [rows, row_bytes]`` of blocks). Read from ``gate`` when
        not given.
    down_dtype : str
        ``down``'s, where it differs (GGUF files mix ``q4_k`` gate and up with ``q6_k``
        down); ``dtype`` when not given.
    scales : tuple or None
        Block-scaled float8 experts only (``dtype`` ``"float8_e4m3_b128"``, the matrices
        e4m3fn bytes: ``uint8`` or ml_dtypes' ``float8_e4m3fn``): ``(gate_scale, up_scale,
        down_scale)``, float32 (or bfloat16) ``[ceil(rows / 128), ceil(cols / 128)]`` of
        their matrix; the real weight is ``e4m3(w[i, j]) * scale[i // 128, j // 128]``.
        None for every other dtype. Iterating an expert still gives its three matrices.

    Examples
    --------
    >>> import numpy as np
    >>> from colibri import ExpertWeights
    >>> w = ExpertWeights(np.zeros((8, 4), np.float16), np.zeros((8, 4), np.float16),
    ...                   np.zeros((4, 8), np.float16))
    >>> w.dtype, w.nbytes
    ('float16', 192)
    """

    gate: Any
    up: Any
    down: Any
    dtype: str = ""
    down_dtype: str = ""
    scales: tuple | None = None

    def __post_init__(self) -> None:
        if not self.dtype:
            object.__setattr__(self, "dtype", _dtype_name(self.gate))
        if not self.down_dtype:
            object.__setattr__(self, "down_dtype", self.dtype)
        if (self.scales is not None) != (self.dtype == FP8_BLOCKED) or (
            self.scales is not None and len(self.scales) != 3
        ):
            raise ValueError(
                f"ExpertWeights(): {FP8_BLOCKED!r} experts need scales=(gate, up, down) block "
                f"scales and no other dtype takes any (got dtype {self.dtype!r}, "
                f"{'no' if self.scales is None else len(self.scales)} scales)"
            )

    @property
    def nbytes(self) -> int:
        """Bytes of the three matrices (and of their block scales)."""
        return sum(_nbytes(m) for m in (self.gate, self.up, self.down, *(self.scales or ())))

    def __iter__(self):
        """``gate, up, down = expert``."""
        return iter((self.gate, self.up, self.down))


def _dtype_name(m: Any) -> str:
    """numpy's name for the dtype of ``m`` (numpy, torch or any DLPack tensor)."""
    if isinstance(m, np.ndarray):
        return m.dtype.name  # "bfloat16" for ml_dtypes' type
    dtype = getattr(m, "dtype", None)
    if dtype is not None and type(dtype).__module__ == "torch":
        return str(dtype).removeprefix("torch.")
    from colibri._dlpack import import_host

    return import_host(m)[1]


def _nbytes(m: Any) -> int:
    nbytes = getattr(m, "nbytes", None)
    if nbytes is None:  # torch
        nbytes = m.numel() * m.element_size()
    return int(nbytes)


@dataclass(frozen=True)
class TensorInfo:
    """One whole tensor of a file, as its header describes it (offsets absolute)."""

    name: str
    path: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    #: Bytes per element block and elements per block (1, itemsize for plain dtypes).
    block: tuple[int, int] = (1, 0)

    def row_bytes(self) -> int:
        """Bytes of one row (last dimension) of the tensor."""
        elements, size = self.block
        if size == 0:
            return self.shape[-1] * DTYPE_SIZES[self.dtype]
        return self.shape[-1] // elements * size


@dataclass(frozen=True)
class TensorRef:
    """One expert matrix: ``nbytes`` bytes at absolute ``offset`` of ``path``.

    ``shape`` is the logical ``[rows, cols]``; ``dtype`` the stored dtype name (``F16``,
    ``BF16``, ``F32``, ... or a GGUF quantization such as ``Q4_K``).
    """

    name: str
    path: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]

    def view(self, buffer: np.ndarray) -> np.ndarray:
        """View ``buffer`` (``uint8``, ``nbytes`` long) as this matrix.

        Plain dtypes give ``shape``; quantized types give ``uint8 [rows, row_bytes]``.
        """
        dtype = numpy_dtype(self.dtype)
        if self.dtype in DTYPE_SIZES:
            return buffer.view(dtype).reshape(self.shape)
        return buffer.reshape(self.shape[0], -1)


@dataclass(frozen=True)
class ExpertLayout:
    """Where one expert's ``gate [I, H]``, ``up [I, H]`` and ``down [H, I]`` live."""

    layer: int
    expert: int
    gate: TensorRef
    up: TensorRef
    down: TensorRef
    #: float8 experts: the block scales of gate, up and down (paged with them), else None.
    scales: tuple[TensorRef, TensorRef, TensorRef] | None = None

    @property
    def matrices(self) -> tuple[TensorRef, ...]:
        """Every range the expert's bytes lie in: ``(gate, up, down)``, then for float8
        experts their three block-scale tensors (the pager holds all of them together)."""
        return (self.gate, self.up, self.down, *(self.scales or ()))

    @property
    def nbytes(self) -> int:
        """Total bytes of the matrices (and float8 block scales)."""
        return sum(ref.nbytes for ref in self.matrices)

    @property
    def dtype(self) -> str:
        """What the matrices store, in :class:`ExpertWeights`' spelling (``"bfloat16"``,
        ...; block-quantized GGUF types lower-cased: ``"q4_k"``; float8 with block scales:
        ``"float8_e4m3_b128"``)."""
        if self.scales is not None:
            return FP8_BLOCKED
        stored = self.gate.dtype
        return STORED_NAMES.get(stored, stored.lower())

    @property
    def down_dtype(self) -> str:
        """``down``'s, in the same spelling (GGUF files may store it in another type)."""
        if self.scales is not None:
            return FP8_BLOCKED
        stored = self.down.dtype
        return STORED_NAMES.get(stored, stored.lower())

    def weights(self, buffers) -> ExpertWeights:
        """The matrices over ``buffers`` (their bytes, ``uint8`` arrays in
        :attr:`matrices` order), no copy."""
        views = [ref.view(b) for ref, b in zip(self.matrices, buffers, strict=True)]
        scales = tuple(views[3:]) if self.scales is not None else None
        return ExpertWeights(*views[:3], self.dtype, self.down_dtype, scales)


@dataclass
class WeightSource:
    """Validated expert layouts of one checkpoint (one or several files).

    Attributes
    ----------
    format : str
        ``"safetensors"``, ``"gguf"`` or ``"colibri-raw"``.
    files : tuple of str
        Absolute paths of every file an expert lives in.
    experts : dict
        ``(layer, expert) -> ExpertLayout``.
    metadata : dict
        Format-specific extras (for a repacked raw file: its ``groups``).
    """

    format: str
    files: tuple[str, ...]
    experts: dict[tuple[int, int], ExpertLayout]
    metadata: dict = field(default_factory=dict)

    def __repr__(self) -> str:  # the expert table can hold thousands of entries
        layers = self.layers
        span = f"{layers[0]}..{layers[-1]}" if layers else "none"
        return (
            f"WeightSource(format={self.format!r}, files={len(self.files)}, "
            f"experts={len(self.experts)} in layers {span}, "
            f"metadata keys={sorted(self.metadata)})"
        )

    @property
    def layers(self) -> tuple[int, ...]:
        """Layer indices that hold experts, ascending."""
        return tuple(sorted({layer for layer, _ in self.experts}))

    def num_experts(self, layer: int) -> int:
        """Number of experts stored for ``layer``."""
        return sum(1 for key in self.experts if key[0] == layer)

    @property
    def max_expert_nbytes(self) -> int:
        """Bytes of the largest expert."""
        return max(layout.nbytes for layout in self.experts.values())

    @property
    def total_expert_nbytes(self) -> int:
        """Bytes of all experts together."""
        return sum(layout.nbytes for layout in self.experts.values())

    def layout(self, layer: int, expert: int) -> ExpertLayout:
        """The layout of one expert; ``KeyError`` naming the valid range when absent."""
        try:
            return self.experts[(layer, expert)]
        except KeyError:
            if layer not in self.layers:
                raise KeyError(
                    f"layer {layer} holds no experts in {self.files[0]!r} "
                    f"(layers with experts: {list(self.layers)})"
                ) from None
            raise KeyError(
                f"expert {expert} is not stored for layer {layer} in {self.files[0]!r} "
                f"(it has {self.num_experts(layer)} experts)"
            ) from None


def check_extents(
    path: str, file_size: int, data_start: int, tensors: Iterable[TensorInfo]
) -> None:
    """Raise :class:`FormatError` unless every tensor lies inside ``[data_start, file_size)``,
    its length equals ``dtype x shape``, and no two tensors overlap."""
    spans = []
    for t in tensors:
        if any((not isinstance(d, int)) or d < 0 for d in t.shape):
            raise FormatError(f"{path}: tensor {t.name!r} has an invalid shape {t.shape}")
        elements, size = t.block
        count = math.prod(t.shape)
        if size == 0:
            expected = count * DTYPE_SIZES[t.dtype]
        else:
            if t.shape and t.shape[-1] % elements:
                raise FormatError(
                    f"{path}: tensor {t.name!r} ({t.dtype}) has rows of {t.shape[-1]} elements, "
                    f"not a multiple of its block size {elements}"
                )
            expected = count // elements * size
        if t.nbytes != expected:
            raise FormatError(
                f"{path}: tensor {t.name!r} is {t.nbytes} bytes but {t.dtype} x {list(t.shape)} "
                f"needs {expected}; the header is corrupt"
            )
        if t.offset < data_start or t.offset + t.nbytes > file_size:
            raise FormatError(
                f"{path}: tensor {t.name!r} spans bytes [{t.offset}, {t.offset + t.nbytes}) "
                f"outside the data section [{data_start}, {file_size}); the file is truncated "
                "or its header is corrupt"
            )
        if t.nbytes:
            spans.append((t.offset, t.offset + t.nbytes, t.name))
    spans.sort()
    for (_, end, name), (begin, _, other) in zip(spans, spans[1:], strict=False):
        if begin < end:
            raise FormatError(
                f"{path}: tensors {name!r} and {other!r} overlap; the header is corrupt"
            )


# -- recognising expert tensors by name ---------------------------------------------------------

_PROJ = {
    "w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up",
    "down_proj": "down", "gate": "gate", "up": "up", "down": "down", "gate_up_proj": "gate_up",
    "gate_up": "gate_up", "input_linear": "gate_up", "output_linear": "down",
    "gate_up_proj_blocks": "gate_up_blocks", "gate_up_proj_scales": "gate_up_scales",
    "down_proj_blocks": "down_blocks", "down_proj_scales": "down_scales",
}  # fmt: skip
#: gpt-oss's MXFP4 parts (formats/gpt_oss.py reads them; nothing else can).
GPT_OSS_PARTS = ("gate_up_blocks", "gate_up_scales", "down_blocks", "down_scales")
_PER_EXPERT = re.compile(
    r"^(?P<prefix>(?:.*\.)?layers\.(?P<layer>\d+)\.(?:.*\.)?experts\.)(?P<expert>\d+)"
    r"(?P<suffix>\.(?P<proj>w1|w2|w3|gate_proj|up_proj|down_proj)\.weight)$"
)
_STACKED = (
    re.compile(  # transformers v5: experts.{gate_up_proj [E, 2I, H], gate_proj, up_proj, down_proj}
        r"^(?:.*\.)?layers\.(?P<layer>\d+)\.(?:.*\.)?experts\."
        r"(?P<proj>gate_up_proj|gate_proj|up_proj|down_proj)(?:\.weight)?$"
    ),
    re.compile(  # GraniteMoE: input_linear [E, 2I, H] (gate|up), output_linear [E, H, I]
        r"^(?:.*\.)?layers\.(?P<layer>\d+)\.block_sparse_moe\.(?P<proj>input_linear|output_linear)"
        r"\.weight$"
    ),
    re.compile(r"^blk\.(?P<layer>\d+)\.ffn_(?P<proj>gate_up|gate|up|down)_exps(?:\.weight)?$"),
    re.compile(  # gpt-oss MXFP4: experts.{gate_up,down}_proj_{blocks,scales} [E, rows, ...]
        r"^(?:.*\.)?layers\.(?P<layer>\d+)\.(?:.*\.)?experts\."
        r"(?P<proj>(?:gate_up|down)_proj_(?:blocks|scales))$"
    ),
)


class ExpertTensorName(NamedTuple):
    """What a tensor name says about a routed expert's matrix (see :func:`expert_tensor`)."""

    layer: str
    expert: str | None  # None: stacked, every expert of the layer ([E, ...])
    proj: str  # "gate", "up", "down", "gate_up" (gate and up stacked, in that order) or
    # one of GPT_OSS_PARTS
    prefix: str  # per expert: the name before the expert index, else ""
    suffix: str  # per expert: the name after the expert index, else ""


def expert_tensor(name: str) -> ExpertTensorName | None:
    """Which routed expert's matrix the tensor ``name`` holds, or None.

    Recognised: per-expert ``...layers.N....experts.M.{w1,w2,w3,gate_proj,up_proj,down_proj}
    .weight`` (Mixtral, Qwen, DeepSeek); stacked ``...layers.N....experts.{gate_up_proj,
    gate_proj, up_proj, down_proj}`` (transformers v5), GraniteMoE's
    ``block_sparse_moe.{input,output}_linear.weight``, GGUF's ``blk.N.ffn_{gate,up,gate_up,
    down}_exps``, gpt-oss's MXFP4 ``...experts.{gate_up,down}_proj_{blocks,scales}``.
    Shared experts (``shared_expert(s)``, ``_shexp``) are not routed experts.
    The one home of these patterns: the pager's formats and the checkpoint loader both ask
    here.
    """
    m = _PER_EXPERT.match(name)
    if m:
        return ExpertTensorName(m["layer"], m["expert"], _PROJ[m["proj"]], m["prefix"],
                                m["suffix"])  # fmt: skip
    for pattern in _STACKED:
        m = pattern.match(name)
        if m:
            return ExpertTensorName(m["layer"], None, _PROJ[m["proj"]], "", "")
    return None


def _index(path: str, name: str, value: int | str) -> int:
    """A layer or expert index read from a tensor name, bounded by :data:`MAX_INDEX`."""
    if isinstance(value, str) and len(value) > 10 or int(value) > MAX_INDEX:
        raise FormatError(
            f"{path}: tensor {name!r} names index {str(value)[:20]}, more than the "
            f"{MAX_INDEX} allowed"
        )
    return int(value)


def _ref(t: TensorInfo, name: str, offset: int, nbytes: int, shape) -> TensorRef:
    return TensorRef(name, t.path, offset, nbytes, t.dtype, tuple(int(d) for d in shape))


def is_fp8_scale(name: str) -> bool:
    """Whether ``name`` is a routed expert's float8 block scales
    (``...experts.3.gate_proj.weight_scale_inv``: paged with the expert, never resident)."""
    return name.endswith(FP8_SCALE_SUFFIX) and (
        expert_tensor(name.removesuffix(FP8_SCALE_SUFFIX)) is not None
    )


def fp8_scale(path: str, tensors: Mapping[str, TensorInfo], name: str) -> TensorInfo:
    """The block scales of the float8 weight ``tensors[name]`` (``name + "_scale_inv"``):
    F32 or BF16 ``[ceil(rows / 128), ceil(cols / 128)]``, the last block of a row or column
    possibly partial (DeepSeek-V3's files have such). A :class:`FormatError` naming both
    tensors otherwise; other float8 formats (E5M2) are refused here too."""
    t = tensors[name]
    if t.dtype != "F8_E4M3":
        raise FormatError(
            f"{path}: tensor {name!r} is {t.dtype}; colibri computes float8 weights stored as "
            "F8_E4M3 (e4m3fn, the 'fmt': 'e4m3' of FP8 checkpoints) only"
        )
    scale = tensors.get(name + FP8_SCALE_SUFFIX)
    if scale is None:
        raise FormatError(
            f"{path}: float8 tensor {name!r} has no block-scale tensor "
            f"{name + FP8_SCALE_SUFFIX!r}; without it its values are unknown: the checkpoint "
            "is incomplete (re-download it)"
        )
    want = tuple(-(-d // FP8_BLOCK) for d in t.shape)
    if len(t.shape) != 2 or tuple(scale.shape) != want or scale.dtype not in ("F32", "BF16"):
        raise FormatError(
            f"{path}: block-scale tensor {scale.name!r} is {scale.dtype} {list(scale.shape)} but "
            f"{name!r} {list(t.shape)} in {FP8_BLOCK} x {FP8_BLOCK} blocks needs F32 or BF16 "
            f"{list(want)} (colibri reads 'weight_block_size': [128, 128] only)"
        )
    return scale


def assemble_experts(
    path: str, tensors: Mapping[str, TensorInfo]
) -> dict[tuple[int, int], ExpertLayout]:
    """Find the routed experts among ``tensors`` (names as :func:`expert_tensor` reads them)
    and split stacked ``[E, ...]`` tensors into per-expert ranges. A float8 expert's
    matrices take their block scales (:func:`fp8_scale`) along; float8 experts are read
    stored per expert (DeepSeek-V3, Qwen3 FP8), not stacked."""
    parts: dict[tuple[int, int], dict[str, TensorRef]] = {}

    def put(layer: int | str, expert: int | str, proj: str, ref: TensorRef) -> None:
        layer, expert = (_index(path, ref.name, v) for v in (layer, expert))
        slot = parts.setdefault((layer, expert), {})
        if proj in slot:
            raise FormatError(
                f"{path}: layer {layer} expert {expert} has two {proj} matrices "
                f"({slot[proj].name!r} and {ref.name!r})"
            )
        slot[proj] = ref

    for name, t in tensors.items():
        found = expert_tensor(name)
        if found is None:
            continue
        if found.expert is not None:
            if len(t.shape) != 2 or 0 in t.shape:
                raise FormatError(
                    f"{path}: expert tensor {name!r} must be 2-D and not empty (got {t.shape})"
                )
            put(found.layer, found.expert, found.proj, _ref(t, name, t.offset, t.nbytes, t.shape))
            if t.dtype.startswith("F8_"):
                sc = fp8_scale(path, tensors, name)
                ref = _ref(sc, sc.name, sc.offset, sc.nbytes, sc.shape)
                put(found.layer, found.expert, found.proj + FP8_SCALE_SUFFIX, ref)
            continue
        if found.proj in GPT_OSS_PARTS:
            raise FormatError(
                f"{path}: tensor {name!r} holds gpt-oss MXFP4 experts, which only a gpt-oss "
                "checkpoint directory reads (colibri.from_pretrained); they are no gate/up/down "
                "matrices"
            )
        if t.dtype.startswith("F8_"):
            raise FormatError(
                f"{path}: stacked expert tensor {name!r} is {t.dtype}; colibri reads float8 "
                "experts stored per expert ('...experts.0.gate_proj.weight' with its "
                "'weight_scale_inv'), as DeepSeek-V3 and Qwen3 FP8 checkpoints store them"
            )
        if len(t.shape) != 3 or 0 in t.shape:
            raise FormatError(
                f"{path}: stacked expert tensor {name!r} must be 3-D [E, rows, cols] and not "
                f"empty (got {list(t.shape)})"
            )
        num, rows, _ = t.shape
        stride = t.row_bytes() * rows
        proj = found.proj
        if proj == "gate_up" and rows % 2:
            raise FormatError(f"{path}: fused tensor {name!r} has an odd row count {rows}")
        for e in range(num):
            base = t.offset + e * stride
            if proj == "gate_up":
                half = stride // 2
                shape = (rows // 2, t.shape[2])
                put(found.layer, e, "gate", _ref(t, f"{name}[{e}][:I]", base, half, shape))
                put(found.layer, e, "up", _ref(t, f"{name}[{e}][I:]", base + half, half, shape))
            else:
                put(found.layer, e, proj, _ref(t, f"{name}[{e}]", base, stride, t.shape[1:]))

    experts = {}
    for (layer, expert), slot in sorted(parts.items()):
        missing = [p for p in ("gate", "up", "down") if p not in slot]
        if missing:
            raise FormatError(
                f"{path}: layer {layer} expert {expert} lacks its {', '.join(missing)} matrix "
                f"(found {sorted(slot)})"
            )
        gate, up, down = slot["gate"], slot["up"], slot["down"]
        rows, cols = gate.shape
        if up.shape != gate.shape or down.shape != (cols, rows):
            raise FormatError(
                f"{path}: layer {layer} expert {expert} has inconsistent shapes: gate "
                f"{list(gate.shape)}, up {list(up.shape)}, down {list(down.shape)} (expected "
                "gate [I, H], up [I, H], down [H, I])"
            )
        names = [p + FP8_SCALE_SUFFIX for p in ("gate", "up", "down")]
        scales = tuple(slot[n] for n in names if n in slot) or None
        if scales is not None and len(scales) != 3:
            raise FormatError(
                f"{path}: layer {layer} expert {expert} mixes float8 and other matrices "
                f"({gate.name!r} {gate.dtype}, {up.name!r} {up.dtype}, {down.name!r} "
                f"{down.dtype}); re-save the checkpoint in one dtype"
            )
        experts[(layer, expert)] = ExpertLayout(layer, expert, gate, up, down, scales)
    return experts


def file_size(path: str) -> int:
    """Size of ``path`` in bytes, with a clear error when it is missing."""
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        raise FileNotFoundError(f"weight file {path!r} does not exist") from None
