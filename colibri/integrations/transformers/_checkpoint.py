"""A transformers checkpoint directory, checked before anything is built or generated.

``Checkpoint(path)`` reads ``config.json`` and finds the safetensors files (one
``model.safetensors``, or shards named by ``model.safetensors.index.json``), parses every
shard's header with colibri's own validating parser and sorts the tensors into routed experts
(served by the :class:`colibri.Pager`) and the rest (loaded resident). Every problem is a
:class:`CheckpointError` naming the file, the tensor and the fix.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from colibri import _json
from colibri.formats import FormatError, TensorInfo, expert_tensor
from colibri.formats.safetensors import read_header

__all__ = ["Checkpoint", "CheckpointError", "is_expert_tensor", "layer_index"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CheckpointError(FormatError):
    """A checkpoint directory that is incomplete, inconsistent or not servable (a
    :class:`colibri.FormatError`, so a ``ValueError`` too)."""


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


def _checked_config(path: str) -> dict:
    config = _json.load(path, what="config.json", max_bytes=16 << 20)
    if not isinstance(config, dict) or "model_type" not in config:
        raise CheckpointError(f"{path}: has no 'model_type'; it is not a transformers config")
    model_type = _json.string(config["model_type"], path, "model_type")
    if not model_type:
        raise CheckpointError(f"{path}: 'model_type' must be a non-empty string (got '')")
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


def is_expert_tensor(name: str) -> bool:
    """Whether ``name`` is a routed expert's matrix (the pager serves it, nothing loads it)."""
    return expert_tensor(name) is not None


@dataclass
class Checkpoint:
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
        if not os.path.exists(config_path):
            raise CheckpointError(
                f"{config_path}: missing; a transformers checkpoint directory needs its "
                "config.json (save_pretrained writes one)"
            )
        self.config = check_config(config_path)
        index = os.path.join(self.path, INDEX)
        single = os.path.join(self.path, SINGLE)
        if os.path.exists(index):
            self.weights = index
            shards = self._read_index(index)
        elif os.path.exists(single):
            self.weights = single
            shards = None
        else:
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
        self.tensors = {}
        files = [single] if shards is None else sorted(set(shards.values()))
        headers = {}
        for file in files:
            try:
                headers[file] = read_header(file)
            except FormatError as exc:
                raise CheckpointError(
                    f"{exc}; fix: re-save or re-download {os.path.basename(file)}"
                ) from None
        if shards is None:
            self.tensors = headers[single]
        else:
            for name, file in shards.items():
                info = headers[file].get(name)
                if info is None:
                    raise CheckpointError(
                        f"{index}: tensor {name!r} is assigned to {os.path.basename(file)}, "
                        "which does not hold it; fix: regenerate the index (save_pretrained "
                        "writes both) or re-download the shard"
                    )
                self.tensors[name] = info
            for file, header in headers.items():
                for name in header:
                    if name not in shards:
                        raise CheckpointError(
                            f"{index}: tensor {name!r} of {os.path.basename(file)} is not in "
                            "the index's weight_map; fix: regenerate the index"
                        )
        self._check_experts_complete()

    def _read_index(self, index: str) -> dict[str, str]:
        try:
            data = _json.load(index, what="the shard index")
        except FormatError as error:
            raise CheckpointError(str(error)) from None
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: has no 'weight_map' object naming each tensor's shard")
        shards = {}
        for name, shard in weight_map.items():
            if not isinstance(shard, str) or os.path.basename(shard) != shard or shard in ("", "."):
                raise CheckpointError(
                    f"{index}: tensor {name!r} points to {shard!r}; shards must be plain file "
                    "names in the checkpoint directory"
                )
            file = os.path.join(self.path, shard)
            if not os.path.exists(file):
                raise CheckpointError(
                    f"{index}: names shard {shard!r} (for tensor {name!r}, among others), "
                    f"which is not in {self.path}; fix: copy the missing shard there, or "
                    "re-save the checkpoint so that the index matches its files"
                )
            shards[name] = file
        return shards

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
    def files(self) -> list[str]:
        """Every safetensors file of the checkpoint."""
        return sorted({t.path for t in self.tensors.values()})

    def expert_names(self) -> list[str]:
        """Names of the routed-expert tensors."""
        return [n for n in self.tensors if is_expert_tensor(n)]

    def resident_names(self) -> list[str]:
        """Names of every other tensor (attention, norms, embeddings, routers, shared experts)."""
        return [n for n in self.tensors if not is_expert_tensor(n)]

    def nbytes(self, names) -> int:
        """Bytes of the named tensors."""
        return sum(self.tensors[n].nbytes for n in names)
