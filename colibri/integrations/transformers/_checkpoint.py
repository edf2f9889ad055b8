"""A transformers checkpoint directory, checked before anything is built or generated.

``Checkpoint(path)`` reads ``config.json`` and finds the safetensors files (one
``model.safetensors``, or shards named by ``model.safetensors.index.json``), parses every
shard's header with colibri's own validating parser and sorts the tensors into routed experts
(served by the :class:`colibri.Pager`) and the rest (loaded resident). Every problem is a
:class:`CheckpointError` naming the file, the tensor and the fix.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from colibri.formats import FormatError
from colibri.formats._base import TensorInfo
from colibri.formats.safetensors import read_header

__all__ = ["Checkpoint", "CheckpointError", "is_expert_tensor"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CheckpointError(FormatError):
    """A checkpoint directory that is incomplete, inconsistent or not servable (a
    :class:`colibri.FormatError`, so a ``ValueError`` too)."""


# The names colibri.formats recognises as routed-expert tensors (per expert, or stacked [E, ...]).
_PER_EXPERT = re.compile(
    r"^(?P<prefix>(?:.*\.)?layers\.(?P<layer>\d+)\.(?:.*\.)?experts\.)(?P<expert>\d+)"
    r"(?P<suffix>\.(?:w1|w2|w3|gate_proj|up_proj|down_proj)\.weight)$"
)
_STACKED = re.compile(
    r"^(?:.*\.)?layers\.(?P<layer>\d+)\.(?:.*\.)?experts\."
    r"(?:gate_up_proj|gate_proj|up_proj|down_proj)(?:\.weight)?$"
    r"|^(?:.*\.)?layers\.(?P<granite>\d+)\.block_sparse_moe\.(?:input|output)_linear\.weight$"
)


def is_expert_tensor(name: str) -> bool:
    """Whether ``name`` is a routed expert's matrix (the pager serves it, nothing loads it)."""
    return bool(_PER_EXPERT.match(name) or _STACKED.match(name))


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
        try:
            with open(config_path, encoding="utf-8") as f:
                self.config = json.load(f)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{config_path}: not valid JSON ({exc})") from None
        if not isinstance(self.config, dict) or "model_type" not in self.config:
            raise CheckpointError(
                f"{config_path}: has no 'model_type'; it is not a transformers config"
            )
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
            with open(index, encoding="utf-8") as f:
                data = json.load(f)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{index}: not valid JSON ({exc})") from None
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
            m = _PER_EXPERT.match(name)
            if m:
                per_layer.setdefault(m["prefix"], set()).add(m["suffix"])
                experts.setdefault(m["prefix"], set()).add(int(m["expert"]))
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
