"""A transformers checkpoint directory, checked before anything is built or generated.

``Checkpoint(path)`` reads ``config.json`` and finds the safetensors files exactly as
transformers does (``config.json``'s ``transformers_weights``, else ``model.safetensors``, else
the shards named by ``model.safetensors.index.json``; anything else in the directory, a
colibri raw manifest included, is ignored), parses every shard's header with colibri's own
validating parser and sorts the tensors into routed experts (served by the
:class:`colibri.Pager`) and the rest (loaded resident). The directory is untrusted input: only
regular files (or symlinks to them) are opened, every read is bounded, expert counts are
checked against ``config.json`` before anything is built, and nothing in the directory is ever
written, renamed or deleted. Every problem is a :class:`CheckpointError` naming the file, the
tensor and the fix.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from colibri import _json
from colibri._regular import CheckpointError, check_regular, read_regular
from colibri.formats import (
    FP8_BLOCK,
    FormatError,
    TensorInfo,
    WeightSource,
    expert_tensor,
    fp8_scale,
    is_fp8_scale,
)
from colibri.formats.gpt_oss import gpt_oss_source
from colibri.formats.safetensors import QUANTIZED_BLOCKS, expert_source, read_header

__all__ = [
    "QUANTIZATION_CONFIG",
    "TORCH_DTYPES",
    "Checkpoint",
    "CheckpointError",
    "check_fields",
    "check_fp8_config",
    "dequantize_fp8",
    "is_expert_tensor",
    "layer_index",
    "read_bytes",
]

#: config.json's entry in a checkpoint ``colibri quantize`` wrote: ``{"type": "q4_k", ...}``
#: (each file's metadata names every quantized tensor's type).
QUANTIZATION_CONFIG = "colibri_quantization"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
#: Largest config.json (or generation_config.json) read; real ones are a few KiB.
CONFIG_BYTES = 16 << 20


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_index(name: str) -> int | None:
    """The layer index in a module or tensor name (``model.layers.3.mlp.experts`` -> 3)."""
    found = _LAYER.findall(name)
    return int(found[-1]) if found else None


# config.json fields that size the model colibri pages, by role; each is checked where present
# (a null means "the family's default" to transformers and is left to it).
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_TOP_K = ("num_experts_per_tok", "moe_topk", "moe_top_k", "moe_k", "top_k_experts")
_LAYERS = ("num_hidden_layers", "n_layers")
_SIZES = ("hidden_size", "intermediate_size", "moe_intermediate_size", "ffn_hidden_size",
          "intermediate_size_mlp")  # fmt: skip
# attention and embedding dimensions: a 0 divides by zero in the model's code
_DIMS = ("num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "kv_lora_rank",
         "qk_rope_head_dim", "v_head_dim")  # fmt: skip
_SHARED_SIZES = ("shared_expert_intermediate_size", "shared_intermediate_size")
_EVERY = ("decoder_sparse_step", "moe_layer_freq", "moe_layer_interval",
          "interleave_moe_layer_step", "expert_layer_period")  # fmt: skip
_FIRST = ("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index",
          "expert_layer_offset")  # fmt: skip
_LAYER_LISTS = ("mlp_only_layers", "moe_layers")
_DTYPES = ("float32", "float16", "bfloat16", "float64", "float", "half", "double")
MAX_EXPERTS = 1 << 16
MAX_LAYERS = 1 << 14
MAX_SIZE = 1 << 20


def check_config(path: str) -> dict:
    """Read ``config.json`` strictly (colibri's JSON reader) and check the fields colibri and
    the model code size things by, at the top level and in a ``text_config``.

    Raises
    ------
    FormatError
        Not JSON, duplicate keys, too large or deep, no ``model_type``, or a field of the wrong
        type or out of range; the message names the file, the key and what was expected.
    """
    try:
        return _checked_config(path)
    except CheckpointError:
        raise
    except FormatError as error:  # from the JSON reader: the same message, the loader's class
        raise CheckpointError(str(error)) from None


def read_json(path: str, what: str, limit: int = CONFIG_BYTES):
    """A JSON file of the checkpoint, read as a regular file of at most ``limit`` bytes and
    parsed strictly (colibri's JSON reader)."""
    return _json.parse(read_regular(path, what, limit), path, what=what)


def _checked_config(path: str) -> dict:
    return check_fields(read_json(path, "config.json"), path)


def check_fields(config, path: str) -> dict:
    """``config`` (a config dict read from ``path``) checked as :func:`check_config` checks
    ``config.json``; returns it.

    Raises
    ------
    CheckpointError
        As :func:`check_config`.
    """
    try:
        return _checked_fields(config, path)
    except CheckpointError:
        raise
    except FormatError as error:
        raise CheckpointError(str(error)) from None


def _checked_fields(config, path: str) -> dict:
    if not isinstance(config, dict) or "model_type" not in config:
        raise CheckpointError(f"{path}: has no 'model_type'; it is not a transformers config")
    model_type = _json.string(config["model_type"], path, "model_type")
    if not model_type:
        raise CheckpointError(f"{path}: 'model_type' must be a non-empty string (got '')")
    if config.get("transformers_weights") is not None:
        _json.string(config["transformers_weights"], path, "transformers_weights")
    _check_fields(config, path, "")
    if config.get("text_config") is not None:
        _check_fields(_json.mapping(config["text_config"], path, "text_config"), path,
                      "text_config.")  # fmt: skip
    return config


def _check_fields(config: dict, path: str, prefix: str) -> None:
    def ints(names, lo, hi) -> int | None:
        last = None
        for name in names:
            if config.get(name) is not None:
                last = _json.integer(config[name], path, prefix + name, lo=lo, hi=hi)
        return last

    ints(_DIMS, 1, MAX_SIZE)
    ints(("max_position_embeddings",), 1, _json.INT32_MAX)
    experts = ints(_EXPERTS, 1, MAX_EXPERTS)
    ints(_TOP_K, 1, experts or MAX_EXPERTS)  # a top-k never exceeds the expert count
    layers = ints(_LAYERS, 1, MAX_LAYERS)
    ints(_SIZES, 1, MAX_SIZE)
    ints(_SHARED_SIZES, 0, MAX_SIZE)
    ints(_EVERY, 1, max(layers or MAX_LAYERS, 1))
    ints(_FIRST, 0, layers or MAX_LAYERS)
    ints(("num_shared_experts", "n_shared_experts", "moe_num_shared_experts"), 0, MAX_EXPERTS)
    groups = ints(("n_group",), 1, experts or MAX_EXPERTS)
    ints(("topk_group",), 1, groups or MAX_EXPERTS)
    for name in _LAYER_LISTS:
        if config.get(name) is not None:
            _json.int_list(config[name], path, prefix + name, hi=(layers or MAX_LAYERS) - 1,
                           max_len=layers or MAX_LAYERS)  # fmt: skip
    for name in ("dtype", "torch_dtype"):
        value = config.get(name)
        if value is not None and value not in _DTYPES:
            raise CheckpointError(
                f"{path}: {prefix + name!r} must be null or one of {', '.join(_DTYPES)} "
                f"(got {_json.show(value)})"
            )


#: The torch dtype of each safetensors dtype.
TORCH_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U64": torch.uint64,
    "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


def read_bytes(f, info: TensorInfo) -> torch.Tensor:
    """The bytes of one tensor, read from the open file ``f`` into fresh ``uint8`` memory (no
    mapping: a file truncated later cannot take them away)."""
    data = torch.empty(info.nbytes, dtype=torch.uint8)
    view = memoryview(data.numpy())
    f.seek(info.offset)
    done = 0
    while done < info.nbytes:
        got = f.readinto(view[done:])
        if not got:
            raise CheckpointError(
                f"{info.path}: tensor {info.name!r} ends at byte {info.offset + info.nbytes} but "
                f"the file ends at {info.offset + done}: it was truncated while loading; fix: "
                "re-download the file and do not change it while colibri reads it"
            )
        done += got
    return data


def check_resident(
    checkpoint, name: str, target: str, want: torch.Tensor, floating: Callable[[str], bool]
) -> None:
    """Refuse checkpoint tensor ``name`` as the model's ``target`` (like ``want``) when it is
    no float where ``want`` is (``floating``: whether a stored dtype is) or its shape differs;
    axes of 1 are ignored, as a GGUF tensor's shape may differ from the model's by them."""
    info = checkpoint.tensors[name]
    if want.is_floating_point() and not floating(info.dtype):
        raise CheckpointError(
            f"{info.path}: tensor {name!r} is stored as {info.dtype}, but the model's "
            f"{target} holds floats ({str(want.dtype).removeprefix('torch.')}); fix: re-save "
            "the checkpoint with floating-point weights"
        )
    expected = list(want.shape)
    if [d for d in info.shape if d != 1] != [d for d in expected if d != 1]:
        raise CheckpointError(
            f"{info.path}: tensor {name!r} has shape {list(info.shape)} but "
            f"{checkpoint.config_name} gives the model's {target} the shape {expected}; "
            f"fix: {checkpoint.config_fix}"
        )


def is_expert_tensor(name: str) -> bool:
    """Whether ``name`` is a routed expert's matrix (the pager serves it, nothing loads it)."""
    return expert_tensor(name) is not None


class TensorTable:
    """What a checkpoint's tensor table tells (``tensors``: name -> TensorInfo): which are the
    routed experts', which are resident, and their bytes."""

    tensors: dict

    def expert_names(self) -> list[str]:
        """Names of the routed-expert tensors."""
        return [n for n in self.tensors if is_expert_tensor(n)]

    def resident_names(self) -> list[str]:
        """Names of every other tensor (attention, norms, embeddings, routers, shared experts;
        not the float8 experts' block scales, which are paged with them)."""
        return [n for n in self.tensors if not is_expert_tensor(n) and not is_fp8_scale(n)]

    def nbytes(self, names) -> int:
        """Bytes of the named tensors."""
        return sum(self.tensors[n].nbytes for n in names)


@dataclass
class Checkpoint(TensorTable):
    """A checkpoint directory: its config and every tensor of its safetensors files.

    Attributes
    ----------
    path : str
        The directory.
    config : dict
        ``config.json``.
    weights : str
        What the pager opens: the index JSON of a sharded checkpoint, else the single file.
    tensors : dict
        tensor name -> :class:`colibri.formats._base.TensorInfo` (file, offset, dtype, shape).
    """

    path: str
    config: dict
    weights: str
    tensors: dict[str, TensorInfo]

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.path.abspath(os.fspath(path))
        if not os.path.isdir(self.path):
            raise CheckpointError(
                f"from_pretrained(): {self.path!r} must be a checkpoint directory (with "
                "config.json and model.safetensors or model.safetensors.index.json)"
            )
        config_path = os.path.join(self.path, "config.json")
        if not os.path.lexists(config_path):
            raise CheckpointError(
                f"{config_path}: missing; a transformers checkpoint directory needs its "
                "config.json (save_pretrained writes one)"
            )
        self.config = check_config(config_path)
        check_fp8_config(self.config, config_path)
        self.weights, sharded = self._find_weights()
        shards = self._read_index(self.weights) if sharded else None
        files = [self.weights] if shards is None else sorted(set(shards.values()))
        headers = {}
        for file in files:
            try:
                headers[file] = read_header(file)
            except CheckpointError:
                raise
            except FormatError as exc:
                raise CheckpointError(
                    f"{exc}; fix: re-save or re-download {os.path.basename(file)}"
                ) from None
        if shards is None:
            self.tensors = headers[self.weights]
        else:
            self.tensors = {}
            for name, file in shards.items():
                info = headers[file].get(name)
                if info is None:
                    raise CheckpointError(
                        f"{self.weights}: tensor {name!r} is assigned to "
                        f"{os.path.basename(file)}, which does not hold it; fix: regenerate the "
                        "index (save_pretrained writes both) or re-download the shard"
                    )
                self.tensors[name] = info
            for file, header in headers.items():
                for name in header:
                    if name not in shards:
                        raise CheckpointError(
                            f"{self.weights}: tensor {name!r} of {os.path.basename(file)} is not "
                            "in the index's weight_map; fix: regenerate the index"
                        )
        self._check_expert_counts()
        self._check_experts_complete()
        self._check_quantization()

    def _find_weights(self) -> tuple[str, bool]:
        """The file transformers loads (and whether it is a shard index), in its order:
        config.json's ``transformers_weights``, ``model.safetensors``, the index. A name
        that exists but is no regular file is refused, not skipped (transformers would fall
        through to the next name and load other weights than the name says)."""
        explicit = self.config.get("transformers_weights")
        if explicit is not None:
            file = os.path.normpath(os.path.join(self.path, explicit))
            if not explicit.endswith((".safetensors", ".safetensors.index.json")) or (
                os.path.commonpath([self.path, file]) != self.path or file == self.path
            ):
                raise CheckpointError(
                    f"{self.path}/config.json: 'transformers_weights' must name a *.safetensors "
                    "or *.safetensors.index.json file inside the checkpoint directory, as "
                    f"transformers requires (got {_json.show(explicit)})"
                )
            check_regular(file, "the weights file config.json's 'transformers_weights' names")
            return file, explicit.endswith(".safetensors.index.json")
        for name, sharded in ((SINGLE, False), (INDEX, True)):
            file = os.path.join(self.path, name)
            if os.path.lexists(file):
                return str(check_regular(file, name)), sharded
        found = sorted(n for n in os.listdir(self.path) if n.endswith((".bin", ".pt", ".pth")))
        hint = (
            f" (found {', '.join(found)}: pickled torch weights; convert them once with "
            "transformers: AutoModelForCausalLM.from_pretrained(path).save_pretrained(path))"
            if found
            else ""
        )
        raise CheckpointError(
            f"{self.path}: neither {SINGLE} nor {INDEX}; colibri pages experts from "
            f"safetensors files{hint}"
        )

    def _read_index(self, index: str) -> dict[str, str]:
        try:
            data = read_json(index, "the shard index", _json.MAX_BYTES)
        except CheckpointError:
            raise
        except FormatError as error:
            raise CheckpointError(str(error)) from None
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: has no 'weight_map' object naming each tensor's shard")
        shards, checked = {}, set()
        for name, shard in weight_map.items():
            if not isinstance(shard, str) or os.path.basename(shard) != shard or shard in ("", "."):
                raise CheckpointError(
                    f"{index}: tensor {name!r} points to {_json.show(shard)}; shards must be "
                    "plain file names in the checkpoint directory"
                )
            file = os.path.join(self.path, shard)
            if shard not in checked:
                if not os.path.lexists(file):
                    raise CheckpointError(
                        f"{index}: names shard {shard!r} (for tensor {name!r}, among others), "
                        f"which is not in {self.path}; fix: copy the missing shard there, or "
                        "re-save the checkpoint so that the index matches its files"
                    )
                check_regular(file, f"shard {shard!r} (for tensor {name!r}, among others)")
                checked.add(shard)
            shards[name] = file
        return shards

    @property
    def num_experts(self) -> int | None:
        """The routed experts per layer config.json gives (the largest of its expert-count
        fields, in ``text_config`` too), or None when it names none."""
        found = [
            part[name]
            for part in (self.config, self.config.get("text_config") or {})
            for name in _EXPERTS
            if part.get(name) is not None
        ]
        return max(found) if found else None

    def _check_expert_counts(self) -> None:
        """No tensor stores more experts than config.json gives, read from the headers'
        names and shapes before anything per expert is built (a stacked tensor claiming a
        million experts costs only its header line)."""
        bound = self.num_experts
        for name, info in self.tensors.items():
            m = expert_tensor(name)
            if m is None:
                continue
            if m.expert is not None:
                count = int(m.expert) + 1 if len(m.expert) <= 10 else MAX_EXPERTS + 1
            else:
                count = info.shape[0] if info.shape else 0
            if count > (bound or MAX_EXPERTS):
                limit = (
                    f"config.json gives {bound} experts per layer"
                    if bound
                    else f"colibri serves at most {MAX_EXPERTS} experts per layer"
                )
                raise CheckpointError(
                    f"{info.path}: tensor {name!r} stores {count} experts but {limit}; fix: use "
                    "the config.json this checkpoint was saved with, or re-download the file"
                )

    def _check_quantization(self) -> None:
        """A checkpoint ``colibri quantize`` wrote says so in config.json
        (:data:`QUANTIZATION_CONFIG`: ``{"type": "q4_k", ...}``): then every routed-expert
        tensor must be block-quantized (its file's metadata says which type), never a float
        tensor of another checkpoint's files."""
        entry = self.config.get(QUANTIZATION_CONFIG)
        if entry is None:
            return
        where = f"{self.path}/config.json"
        entry = _json.mapping(entry, where, QUANTIZATION_CONFIG)
        qtype = entry.get("type")
        if qtype not in QUANTIZED_BLOCKS:
            raise CheckpointError(
                f"{where}: {QUANTIZATION_CONFIG + '.type'!r} must be one of "
                f"{', '.join(QUANTIZED_BLOCKS)} "
                f"(got {_json.show(qtype)}); fix: re-run colibri quantize"
            )
        for name in self.expert_names():
            info = self.tensors[name]
            if info.dtype in TORCH_DTYPES:
                raise CheckpointError(
                    f"{info.path}: config.json says the experts are quantized ({qtype}, by "
                    f"colibri quantize) but tensor {name!r} is stored as {info.dtype} with no "
                    "block type in its file's metadata; the directory mixes files of two "
                    "checkpoints; fix: re-run colibri quantize into a new directory"
                )

    def expert_source(self) -> WeightSource:
        """The routed experts as the :class:`colibri.Pager` serves them, from the headers
        already read and checked (no file is opened again)."""
        experts = {n: t for n, t in self.tensors.items() if is_expert_tensor(n) or is_fp8_scale(n)}
        try:
            if self.config.get("model_type") == "gpt_oss":  # fused, interleaved, maybe MXFP4
                return gpt_oss_source(self.weights, experts)
            return expert_source(self.weights, experts)
        except FormatError as exc:
            raise CheckpointError(f"{exc}; fix: re-save the checkpoint") from None

    def _check_experts_complete(self) -> None:
        """Per-expert layouts: every layer's experts 0..E-1 have the same three matrices."""
        per_layer: dict[str, set[str]] = {}
        experts: dict[str, set[int]] = {}
        for name in self.tensors:
            m = expert_tensor(name)
            if m is not None and m.expert is not None:
                per_layer.setdefault(m.prefix, set()).add(m.suffix)
                experts.setdefault(m.prefix, set()).add(int(m.expert))
        for prefix, suffixes in per_layer.items():
            count = max(experts[prefix]) + 1
            for e in range(count):
                for suffix in sorted(suffixes):
                    name = f"{prefix}{e}{suffix}"
                    if name not in self.tensors:
                        raise CheckpointError(
                            f"{self.weights}: tensor {name!r} is missing (its layer stores "
                            f"experts up to {count - 1}); fix: re-save the checkpoint, or "
                            "re-download the shard that should hold it"
                        )

    @property
    def config_path(self) -> str:
        """Where the config comes from: ``config.json``."""
        return os.path.join(self.path, "config.json")

    #: What the config is and how to mend one the weights contradict, for messages.
    config_name = "config.json"
    config_fix = "use the config.json this checkpoint was saved with, or re-save the checkpoint"

    @property
    def files(self) -> list[str]:
        """Every safetensors file of the checkpoint."""
        return sorted({t.path for t in self.tensors.values()})

    def read_tensor(self, f, name: str) -> torch.Tensor:
        """Tensor ``name`` read from its open file ``f`` into fresh memory, as stored."""
        info = self.tensors[name]
        return read_bytes(f, info).view(TORCH_DTYPES[info.dtype]).reshape(info.shape)


# -- float8 checkpoints (DeepSeek-V3, Qwen3 FP8: e4m3fn weights, 128 x 128 block scales) ------


def check_fp8_config(config: dict, path: str) -> None:
    """Refuse an ``"fp8"`` ``quantization_config`` colibri cannot compute exactly: ``fmt``
    other than ``"e4m3"``, ``activation_scheme`` other than ``"dynamic"`` (static activation
    scales), ``weight_block_size`` other than ``[128, 128]``. Other quantization methods are
    left to their own readers.

    Raises
    ------
    CheckpointError
        Naming the key, its value and what colibri reads.
    """
    qc = config.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != "fp8":
        return
    wanted = {"fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [FP8_BLOCK] * 2}
    for key, want in wanted.items():
        if key in qc and qc[key] != want and not (key == "fmt" and qc[key] is None):
            raise CheckpointError(
                f"{path}: 'quantization_config.{key}' is {_show(qc[key])}; colibri computes fp8 "
                f"checkpoints with {key} {_show(want)} only (e4m3fn weights, one scale per 128 x "
                "128 block, activations kept in the compute dtype)"
            )


def _show(value) -> str:
    """A config value for a message: short lists as written, anything else as _json shows it."""
    if isinstance(value, list) and len(value) <= 4 and all(isinstance(v, int) for v in value):
        return str(value)
    return _json.show(value)


def dequantize_fp8(checkpoint: TensorTable, name: str, weight: torch.Tensor, read) -> torch.Tensor:
    """A resident float8 tensor (``weight``, F8_E4M3 as stored) times its block scales, in
    float32; ``read(scale_name)`` reads the scale tensor.

    Raises
    ------
    CheckpointError
        The scale tensor is missing or misshapen (:func:`colibri.formats._base.fp8_scale`),
        or a value is not finite (a NaN byte 0x7F / 0xFF, a NaN or infinite scale).
    """
    info = checkpoint.tensors[name]
    try:
        scale_info = fp8_scale(info.path, checkpoint.tensors, name)
    except FormatError as exc:
        raise CheckpointError(f"{exc}; fix: re-download the checkpoint") from None
    scale = read(scale_info.name).float()
    rows, cols = weight.shape
    full = scale.repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[:, :cols]
    out = weight.float() * full
    if not torch.isfinite(out).all():
        bad = (~torch.isfinite(scale)).nonzero()
        nan = ((weight.view(torch.uint8) & 0x7F) == 0x7F).nonzero()
        if len(bad):
            i, j = (int(v) for v in bad[0])
            problem = f"its block scale {scale_info.name!r} [{i}, {j}] is {float(scale[i, j])}"
        elif len(nan):
            i, j = (int(v) for v in nan[0])
            problem = f"its e4m3 byte [{i}, {j}] is 0x7F or 0xFF, which e4m3fn reads as NaN"
        else:
            problem = "its values times their block scales overflow float32"
        raise CheckpointError(
            f"{info.path}: float8 tensor {name!r}: {problem}; the weight file is corrupt "
            "(re-download it)"
        )
    return out
