"""A GGUF model file as :func:`from_pretrained` loads it: the twin of :class:`Checkpoint`.

``GGUFCheckpoint(path)`` validates the file with colibri's own bounded walk first
(:func:`colibri.formats.gguf.gguf_tensors`: metadata, tensor table, every range), and only
then lets transformers read its config (``AutoConfig.from_pretrained(folder,
gguf_file=name)``, ``trust_remote_code=False``). The routed experts (``blk.N.ffn_{gate,up,
down}_exps``) stay in the file, block-quantized as stored, for the :class:`colibri.Pager`;
every other tensor is mapped to the model's name with transformers' own GGUF map and tensor
processor, read with a bounded read, dequantized to float32 by the ``gguf`` package and cast
to the compute dtype by the loader. A model split by ``gguf-split`` is read from all of its
parts. Nothing in the file's folder is written.
"""

from __future__ import annotations

import os
import re

import numpy as np
import torch
from torch import nn

from colibri._regular import check_regular
from colibri.formats import FormatError, TensorInfo, WeightSource
from colibri.formats.gguf import gguf_source, gguf_tensors
from colibri.integrations.transformers._checkpoint import (
    CheckpointError,
    TensorTable,
    check_fields,
    check_resident,
    read_bytes,
)
from colibri.integrations.transformers._experts import UnsupportedCheckpointError

__all__ = ["QUANTIZED_TYPES", "GGUFCheckpoint", "is_gguf", "split_parts"]

#: The block types colibri's expert engine computes (its kernel's, ``colibri.layer``'s
#: ``_quant.TYPES``; a test holds the two equal), in ggml's spelling.
QUANTIZED_TYPES = ("Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "MXFP4")

# Keys llama.cpp writes that transformers' GGUF config mapping (5.23) leaves out for these
# architectures, so that its config would keep the family's default instead.
_MISSED_KEYS = {
    "qwen3moe": {"expert_feed_forward_length": "moe_intermediate_size"},
    "qwen2moe": {
        "expert_feed_forward_length": "moe_intermediate_size",
        "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
    },
}
_PLAIN = {"F64": np.float64, "F32": np.float32, "F16": np.float16}
_INTS = {"I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64}


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether :func:`from_pretrained` reads ``path`` as a GGUF file (a ``*.gguf`` name)."""
    return os.fspath(path).endswith(".gguf") and not os.path.isdir(path)


# llama.cpp's gguf-split names: model-00001-of-00003.gguf (numbered from 1)
_SPLIT = re.compile(r"(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf")


def split_parts(path: str) -> list[str]:
    """Every part of the split GGUF model ``path`` is one of, in order (``[path]`` for a file
    not named as a part)."""
    folder, name = os.path.split(path)
    m = _SPLIT.fullmatch(name)
    if m is None:
        return [path]
    count = int(m["count"])
    if not 1 <= int(m["no"]) <= count:
        raise CheckpointError(
            f"{path}: names part {int(m['no'])} of {count}; a gguf-split part is numbered from "
            f"1 to its count"
        )
    return [os.path.join(folder, f"{m['stem']}-{i:05d}-of-{count:05d}.gguf")
            for i in range(1, count + 1)]  # fmt: skip


class GGUFCheckpoint(TensorTable):
    """A ``.gguf`` model file, with what :func:`from_pretrained` needs of a checkpoint.

    A model split by llama.cpp's ``gguf-split`` (``name-00001-of-00003.gguf``, ...: the
    first part holds the metadata, the tensors are spread over the parts) is read from all of
    its parts, whichever one ``path`` names.

    Attributes
    ----------
    path, weights : str
        The file (of a split model: its first part).
    parts : list of str
        Every file of the model.
    config : dict
        The transformers config transformers reads from the file's metadata.
    tensors : dict
        GGUF tensor name -> :class:`colibri.formats.TensorInfo` (offset, ggml type, shape).
    architecture : str
        ``general.architecture`` (``"qwen3moe"``, ...).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.parts = split_parts(os.path.abspath(os.fspath(path)))
        self.path = self.weights = self.parts[0]
        self.tensors = {}
        for no, part in enumerate(self.parts):
            self.tensors.update(self._read_part(no, part))
        self.architecture, metadata = self._metadata(self.path)
        if len(self.parts) > 1 and metadata.get("split.tensors.count") != len(self.tensors):
            raise CheckpointError(
                f"{self.path}: says its split model has {metadata.get('split.tensors.count')} "
                f"tensors, but its {len(self.parts)} parts hold {len(self.tensors)}; fix: "
                "download the parts of one model again"
            )
        self.config = self._read_config(metadata)
        try:
            self._source = gguf_source(self.parts, self.tensors)
        except FormatError as exc:
            raise CheckpointError(f"{exc}; fix: re-download the file") from None
        if not self._source.experts:
            raise UnsupportedCheckpointError(
                f"{self.path}: GGUF architecture {self.architecture!r} stores no routed experts "
                "(blk.N.ffn_gate_exps ...); colibri pages MoE models (qwen3moe, qwen2moe): load "
                "this one with transformers' own from_pretrained"
            )
        self._processor = None

    def _read_part(self, no: int, part: str) -> dict[str, TensorInfo]:
        """The tensors of one file (of part ``no`` of a split model), validated."""
        count = len(self.parts)
        what = "the GGUF file" if count == 1 else f"part {no + 1} of {count} of the split model"
        check_regular(part, what)
        try:
            tensors = gguf_tensors(part)
        except FormatError as exc:
            raise CheckpointError(f"{exc}; fix: re-download the file") from None
        if count > 1:
            found = _split_keys(part)
            if found != (no, count):
                raise CheckpointError(
                    f"{part}: its metadata says split.no {found[0]}, split.count {found[1]}; as "
                    f"part {no + 1} of {count} it needs {no}, {count}; fix: download the parts "
                    "of one model again"
                )
        twice = sorted(tensors.keys() & self.tensors.keys())
        if twice:
            raise CheckpointError(
                f"{part}: tensor {twice[0]!r} is in an earlier part too; fix: download the "
                "parts of one model again"
            )
        return tensors

    def _metadata(self, path: str) -> tuple[str, dict]:
        """``general.architecture`` and the metadata (the file already walked with bounds)."""
        metadata = _read_metadata(path)
        architecture = metadata.get("general.architecture")
        if not isinstance(architecture, str):
            raise CheckpointError(
                f"{self.path}: no 'general.architecture' string in its metadata; it is not a "
                "model file llama.cpp or transformers reads"
            )
        return architecture, metadata

    def _read_config(self, metadata: dict) -> dict:
        """The config dict transformers builds from the file, checked as config.json is."""
        import transformers
        from huggingface_hub.errors import StrictDataclassError
        from transformers import AutoConfig

        folder, name = os.path.split(self.path)
        try:
            config = AutoConfig.from_pretrained(folder, gguf_file=name, trust_remote_code=False)
        except (ValueError, KeyError, TypeError, OSError, StrictDataclassError) as exc:
            shown = " ".join(str(exc).split())
            raise UnsupportedCheckpointError(
                f"{self.path}: transformers {transformers.__version__} cannot read GGUF "
                f"architecture {self.architecture!r} ({shown})"
            ) from None
        data = config.to_dict()
        if len(self.parts) > 1:  # transformers looks for the output matrix in this part only
            data["tie_word_embeddings"] = "output.weight" not in self.tensors
        for key, field in _MISSED_KEYS.get(self.architecture, {}).items():
            value = metadata.get(f"{self.architecture}.{key}")
            if value is not None:
                data[field] = value
        check_fields(data, self.path)
        return data

    # -- what from_pretrained uses of a checkpoint -------------------------------------------

    def expert_source(self) -> WeightSource:
        """The routed experts, block-quantized as stored, for the :class:`colibri.Pager`."""
        return self._source

    @property
    def config_path(self) -> str:
        """Where the config comes from: the file's metadata."""
        return self.path

    #: What the config is and how to mend one the weights contradict, for messages.
    config_name = "the config transformers reads from its GGUF metadata"
    config_fix = (
        "the file's metadata contradicts its tensors (or transformers misreads them); "
        "re-convert the model to GGUF"
    )

    @property
    def files(self) -> list[str]:
        return list(self.parts)

    def plan_resident(self, model: nn.Module) -> dict[str, list[tuple[str, str]]]:
        """Which GGUF tensor fills which tensor of ``model``, by transformers' own GGUF name
        map: ``{path: [(GGUF name, model name)]}``, every shape checked."""
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            TensorProcessor,
            get_gguf_hf_weights_map,
        )

        self._processor = TENSOR_PROCESSORS.get(self.architecture, TensorProcessor)(
            config=self.config
        )
        names = get_gguf_hf_weights_map(model, self._processor)
        wanted = model.state_dict(keep_vars=True)
        plan: dict[str, list[tuple[str, str]]] = {}
        for name in self.resident_names():
            target = names.get(name)
            if target not in wanted:
                continue  # transformers' loader skips it too
            check_resident(self, name, target, wanted[target], lambda d: d not in _INTS)
            plan.setdefault(self.tensors[name].path, []).append((name, target))
        return plan

    def quantized_linears(self, model: nn.Module, plan: dict) -> dict[str, tuple[str, np.ndarray]]:
        """The linears of ``model`` whose weights colibri's quantized linear kernel computes
        as stored: ``{model tensor name: (GGUF name, row order)}``.

        A weight qualifies when it fills an ``nn.Linear`` (not an LM head tied to the
        embeddings) from a tensor of a type of :data:`QUANTIZED_TYPES` of the same
        ``[out, in]`` shape, and transformers' tensor processor at most reorders its rows
        (llama's q/k permutation): ``order`` (int64 ``[out]``) takes the stored rows to the
        model's, as the processor does (found by processing the rows' indices).
        """
        config = model.config.get_text_config()
        tied = getattr(config, "tie_word_embeddings", False)
        outputs = model.get_output_embeddings() if tied else None
        found = {}
        for names in plan.values():
            for name, target in names:
                info = self.tensors[name]
                owner, _, attr = target.rpartition(".")
                if info.dtype not in QUANTIZED_TYPES or attr != "weight":
                    continue
                module = model.get_submodule(owner)
                if not isinstance(module, nn.Linear) or module is outputs:
                    continue
                if tuple(info.shape) != (module.out_features, module.in_features):
                    continue
                order = self._row_order(name, module.out_features)
                if order is not None:
                    found[target] = (name, order)
        return found

    def _row_order(self, name: str, rows: int) -> np.ndarray | None:
        """Where transformers' processor takes each row of tensor ``name`` (``rows`` rows),
        or None when it does more than reorder them."""
        probe = np.arange(rows, dtype=np.float64)[:, None]
        try:
            done = self._processor.process(
                weights=probe, name=name, tensor_key_mapping={}, parsed_parameters={"tensors": {}}
            ).weights
        except (ValueError, TypeError, IndexError, KeyError):
            return None
        done = np.asarray(done)
        if done.shape != probe.shape:
            return None
        order = done[:, 0].astype(np.int64)
        if not np.array_equal(order, done[:, 0]) or not np.array_equal(np.sort(order), probe[:, 0]):
            return None
        return order

    def read_blocks(self, f, name: str, order: np.ndarray) -> tuple[str, np.ndarray]:
        """Tensor ``name`` as stored, read from the open file ``f``: its block type (colibri's
        name, ``"q8_0"`` ...) and its rows ``uint8 [out, row_bytes]`` in the model's
        ``order`` (:meth:`quantized_linears`)."""
        info = self.tensors[name]
        rows = read_bytes(f, info).numpy().reshape(info.shape[0], info.row_bytes())
        if not np.array_equal(order, np.arange(len(order))):
            rows = np.ascontiguousarray(rows[order])
        return info.dtype.lower(), rows

    def read_tensor(self, f, name: str) -> torch.Tensor:
        """Tensor ``name`` read from the open file ``f``: floats dequantized to float32 (F16,
        BF16 exactly) and transformed as transformers' tensor processor does (its shape then
        may differ by axes of 1), integers as stored."""
        info = self.tensors[name]
        raw = read_bytes(f, info)
        if info.dtype in _INTS:
            return raw.view(_INTS[info.dtype]).reshape(info.shape)
        if info.dtype == "BF16":
            values = raw.view(torch.bfloat16).float().numpy().reshape(info.shape)
        elif info.dtype in _PLAIN:
            values = raw.numpy().view(_PLAIN[info.dtype]).astype(np.float32).reshape(info.shape)
        else:
            values = _dequantize(info, raw.numpy())
        if self._processor is not None:
            values = self._processor.process(
                weights=values, name=name, tensor_key_mapping={}, parsed_parameters={"tensors": {}}
            ).weights
        return torch.from_numpy(np.ascontiguousarray(values, np.float32))


def _read_metadata(path: str) -> dict:
    """The metadata of a GGUF file (already walked with bounds), as transformers reads it."""
    from transformers.integrations.gguf import read_gguf_metadata

    try:
        return read_gguf_metadata(path)[0]
    except (ValueError, KeyError, IndexError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"{path}: transformers cannot read its metadata ({exc}); fix: re-download the file"
        ) from None


def _split_keys(path: str) -> tuple:
    """``split.no`` and ``split.count`` of a GGUF file (already walked with bounds)."""
    import gguf

    fields = gguf.GGUFReader(path, "r").fields
    return tuple(
        fields[key].contents() if key in fields else None for key in ("split.no", "split.count")
    )


def _dequantize(info: TensorInfo, raw: np.ndarray) -> np.ndarray:
    """A block-quantized tensor as float32 (the ``gguf`` package's dequantization)."""
    import gguf

    rows = raw.reshape(-1, info.row_bytes())
    values = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[info.dtype])
    return np.asarray(values, np.float32).reshape(info.shape)
