"""Transformers checkpoints bigger than memory: :func:`from_pretrained`.

The model of a checkpoint directory is built without materialising its weights; every tensor
but the routed experts is loaded from the checkpoint's safetensors files; each experts module
becomes a colibri-paged one (its weights read on demand from the checkpoint's own files by a
:class:`colibri.Pager` under the budget, computed by colibri's expert engine) and every
router is colibri's, exactly as :func:`patch` makes it. ``model.generate()`` works unchanged,
with the checkpoint's ``generation_config.json`` as transformers reads it.

The directory is untrusted input (see :mod:`._checkpoint`): no code of it ever runs
(``trust_remote_code=False`` everywhere, ``auto_map`` refused), nothing reads stdin, and the
resident weights are copied out with plain bounded reads, so a file truncated later is an
error, never a ``SIGBUS``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from colibri import _json
from colibri._errors import FormatError
from colibri._regular import open_regular
from colibri._units import parse_size
from colibri._validate import check_choice, check_threads
from colibri.integrations.transformers import _attention, _decode, _gpt_oss, _norms, _threads
from colibri.integrations.transformers._budget import for_model
from colibri.integrations.transformers._checkpoint import (
    TORCH_DTYPES,
    Checkpoint,
    CheckpointError,
    check_resident,
    dequantize_fp8,
    layer_index,
    read_json,
)
from colibri.integrations.transformers._experts import (
    Paging,
    UnsupportedCheckpointError,
    computation,
    find_experts,
    hold_all,
    page,
    paged_layers,
)
from colibri.integrations.transformers._gguf import QUANTIZED_TYPES, GGUFCheckpoint, is_gguf
from colibri.integrations.transformers._linears import LINEAR_MODES, install
from colibri.integrations.transformers._patch import _STATE, patch
from colibri.integrations.transformers._predict import READ_AHEAD_MODES, link_layers
from colibri.layer import nonfinite_block

__all__ = ["from_pretrained"]


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    if attr in module._parameters:
        module._parameters[attr] = nn.Parameter(value, requires_grad=False)
    elif attr in module._buffers:
        module._buffers[attr] = value
    else:  # pragma: no cover - state_dict() named it
        raise KeyError(name)


def _plan_resident(model: nn.Module, checkpoint: Checkpoint) -> dict[str, list[tuple[str, str]]]:
    """Which checkpoint tensor fills which tensor of ``model`` (its experts already paged),
    by file: ``{path: [(checkpoint name, model name)]}``, every shape checked."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key

    transforms = get_model_conversion_mapping(model)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    wanted = model.state_dict(keep_vars=True)
    plan: dict[str, list[tuple[str, str]]] = {}
    for name in checkpoint.resident_names():
        info = checkpoint.tensors[name]
        target, converter = rename_source_key(
            name, renamings, converters, model.base_model_prefix, wanted
        )
        if converter is not None:
            raise UnsupportedCheckpointError(
                f"{info.path}: tensor {name!r} needs transformers' weight conversion "
                f"{converter!r}, which colibri applies to no tensor but routed experts; load "
                "this checkpoint with transformers' own from_pretrained"
            )
        if target not in wanted:
            continue  # not part of this model (transformers ignores it too)
        check_resident(checkpoint, name, target, wanted[target], _FLOATS.__contains__)
        plan.setdefault(info.path, []).append((name, target))
    return plan


def _load_resident(
    model: nn.Module, checkpoint: Checkpoint, plan: dict, dtype, kept: dict, blocks: dict
) -> int:
    """Load the tensors of ``plan`` into ``model``, those of ``kept`` (a GGUF file's
    :meth:`~GGUFCheckpoint.quantized_linears`) as stored into ``blocks`` (``{module name:
    (qtype, rows)}``, their weights left on the meta device); returns their bytes."""
    wanted = model.state_dict(keep_vars=True)
    total = 0
    for path, names in plan.items():
        with open_regular(path, "the weights file") as f:
            for name, target in names:
                if target in kept:
                    qtype, rows = checkpoint.read_blocks(f, name, kept[target][1])
                    bad = nonfinite_block(qtype, rows)
                    if bad >= 0:
                        raise CheckpointError(
                            f"{checkpoint.tensors[name].path}: tensor {name!r} holds a "
                            f"non-finite {qtype} block scale (row {bad // rows.shape[1]}): the "
                            "file is corrupt; fix: re-download or re-convert it"
                        )
                    blocks[target.removesuffix(".weight")] = qtype, rows
                    total += checkpoint.tensors[name].nbytes
                    continue
                # a GGUF tensor's shape may differ from the model's by axes of 1
                tensor = checkpoint.read_tensor(f, name)
                if checkpoint.tensors[name].dtype == "F8_E4M3":  # times its block scales
                    tensor = dequantize_fp8(checkpoint, name, tensor,
                                            lambda n: _read_one(checkpoint, n))  # fmt: skip
                tensor = tensor.reshape(wanted[target].shape)
                want = dtype or wanted[target].dtype
                if tensor.dtype != want and tensor.is_floating_point():
                    tensor = tensor.to(want)
                _set_tensor(model, target, tensor)
                total += checkpoint.tensors[name].nbytes
    if getattr(model.config, "tie_word_embeddings", False) or getattr(
        model.config.get_text_config(), "tie_word_embeddings", False
    ):
        model.tie_weights()
    tensors = model.state_dict(keep_vars=True).items()
    missing = [n for n, t in tensors if t.is_meta and n not in kept]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        shown = ", ".join(missing[:5]) + more
        raise CheckpointError(
            f"{checkpoint.weights}: the model's tensors {shown} are in no file of the "
            "checkpoint; fix: re-save the checkpoint (save_pretrained) or re-download the "
            "missing shard"
        )
    return total


_FLOATS = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")


def _read_one(checkpoint: Checkpoint, name: str) -> torch.Tensor:
    """Tensor ``name`` of ``checkpoint``, read from its own file (a float8 weight's block
    scales may lie in another shard than the weight)."""
    with open_regular(checkpoint.tensors[name].path, "the weights file") as f:
        return checkpoint.read_tensor(f, name)


def _check_experts(modules: list[tuple[str, nn.Module]], source, checkpoint: Checkpoint) -> None:
    """Every expert the model has is in the checkpoint, shaped as config.json says, its gate
    and up of one dtype and its down of the same (block-quantized: of any such type)."""
    servable = {"F32", "F16", "BF16", "F8_E4M3", *QUANTIZED_TYPES}
    for name, module in modules:
        if type(module).__name__ == _gpt_oss.GPT_OSS:  # its own layouts
            _gpt_oss.check_experts(name, module, source, checkpoint)
            continue
        layer = layer_index(name)
        num, rows2, hidden = module.gate_up_proj.shape
        inter = rows2 // 2
        for e in range(num):
            layout = source.experts.get((layer, e))
            if layout is None:
                stored = source.num_experts(layer)
                raise CheckpointError(
                    f"{checkpoint.weights}: no tensors for layer {layer} expert {e} (the model "
                    f"{name} has {num} experts, the checkpoint stores {stored} for that "
                    f"layer; expected e.g. '{name.rsplit('.experts', 1)[0]}.experts.{e}."
                    f"gate_proj.weight'); fix: {checkpoint.config_fix}"
                )
            matrices = (layout.gate, layout.up, layout.down)  # not float8 block scales
            stored = {ref.dtype for ref in matrices}
            plain = any(d in TORCH_DTYPES for d in stored)
            if layout.gate.dtype != layout.up.dtype or len(stored) > 1 and plain:
                shown = ", ".join(f"{ref.name.split('[', 1)[0]!r} {ref.dtype}" for ref in matrices)
                raise CheckpointError(
                    f"{layout.gate.path}: layer {layer} expert {e} mixes dtypes ({shown}); an "
                    "expert's gate and up must share one dtype, and its down that one too unless "
                    "all three are block-quantized; fix: re-save the checkpoint in one dtype"
                )
            for ref, shape in ((layout.gate, (inter, hidden)), (layout.up, (inter, hidden)),
                               (layout.down, (hidden, inter))):  # fmt: skip
                tensor = ref.name.split("[", 1)[0]
                if ref.dtype not in servable:
                    raise UnsupportedCheckpointError(
                        f"{ref.path}: expert tensor {tensor!r} is {ref.dtype}; the pager serves "
                        f"{', '.join(sorted(servable))} experts (other quantized or float8 "
                        "checkpoints: dequantize them to bf16 first)"
                    )
                if tuple(ref.shape) != shape:
                    raise CheckpointError(
                        f"{ref.path}: expert tensor {tensor!r} is {list(ref.shape)} per expert "
                        f"but {checkpoint.config_name} (hidden {hidden}, expert intermediate "
                        f"{inter}) needs {list(shape)}; fix: {checkpoint.config_fix}"
                    )


def _torch_dtype(config: Any, checkpoint: Checkpoint, dtype: Any) -> torch.dtype:
    if dtype is not None:
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(
                f"from_pretrained(): dtype must be a floating torch dtype or its name (got "
                f"{dtype!r})"
            )
        return dtype
    names = checkpoint.expert_names()
    stored = checkpoint.tensors[names[0]].dtype if names else None
    if stored == "F8_E4M3":
        return torch.bfloat16  # the float8 kernel's experts; float32: dequantized GEMMs
    if stored is not None and stored not in TORCH_DTYPES:  # block-quantized
        if not isinstance(checkpoint, GGUFCheckpoint):  # colibri quantize: as the rest is
            stored = _resident_dtype(checkpoint)
        else:
            return torch.bfloat16  # the quantized kernel's experts; float32: dequantized GEMMs
    return {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}.get(
        stored, getattr(config, "dtype", None) or torch.float32
    )


def _resident_dtype(checkpoint: Checkpoint) -> str | None:
    """The float dtype (``F32``, ``F16`` or ``BF16``) holding most of the non-expert bytes."""
    held: dict[str, int] = {}
    for name in checkpoint.resident_names():
        info = checkpoint.tensors[name]
        if info.dtype in ("F32", "F16", "BF16"):
            held[info.dtype] = held.get(info.dtype, 0) + info.nbytes
    return max(held, key=held.__getitem__) if held else None


def from_pretrained(
    path,
    *,
    budget: int | str,
    policy: str = "adaptive",
    page_size_kb: int = 64,
    read_ahead: str = "gate",
    num_threads: int | None = None,
    dtype: Any = None,
    partition: Any = None,
    topk_groups: int = 1,
    record_trace: bool = False,
    io: str | None = None,
    linears: str = "auto",
    expert_parallel: Any = None,
) -> nn.Module | None:
    """Load a transformers MoE checkpoint with its routed experts paged under ``budget``.

    Parameters
    ----------
    path : path-like
        A checkpoint directory: ``config.json`` and ``model.safetensors`` or shards with
        ``model.safetensors.index.json`` (as ``save_pretrained`` writes them). Routed experts
        may be stored per expert (``...experts.{e}.gate_proj.weight``, Mixtral's
        ``...experts.{e}.w1.weight``) or stacked (``...experts.gate_up_proj [E, 2I, H]``).
        float8 checkpoints (DeepSeek-V3, Qwen3 FP8: ``quantization_config`` ``"fp8"``,
        e4m3fn, 128 x 128 ``weight_scale_inv`` blocks, dynamic activations) have their
        experts paged as stored, with their block scales, and computed by colibri's float8
        kernel; every other float8 tensor is dequantized once at load.
        Or a ``*.gguf`` model file of an MoE architecture transformers reads (``qwen3moe``,
        ``qwen2moe``), or any part of one split by gguf-split (``name-00001-of-00003.gguf``):
        its experts paged block-quantized as stored (Q4_K, Q6_K, Q8_0, ... as
        :mod:`colibri.layer` computes them), every other tensor dequantized. A directory
        ``colibri quantize`` wrote (:func:`quantize_checkpoint`) pages its experts as stored
        too.
    budget : int or str
        Most bytes of expert weights held in memory at once (``805306368``, ``"768MiB"``,
        ``"3GiB"``); everything else of the model is resident on top of it. ``"auto"``: what
        the memory this process may use leaves (the cgroup limit or MemAvailable, less the
        process, the resident weights and a margin: ``model.colibri.auto_budget`` says). A
        budget that holds every expert has them read and held here, as a loader would (and
        repacked where the kernel takes a layout of its own): no token waits on a first read.
    policy : str
        The pager's cache policy (``"adaptive"``, the pager's default, ``"lru"``, ``"fifo"``,
        ``"lrfu"``, ...).
    page_size_kb : int
        The pager's page size (a power of two >= 4).
    read_ahead : str
        ``"gate"`` (default): while layer l runs, have the OS read ahead the experts that
        layer l+1's router picks for layer l's input (:meth:`colibri.Pager.advise`: into the
        page cache, not into the budget); ``"previous"``: those layer l+1 used at the
        previous step; ``"off"``. A budget that holds every expert predicts nothing (each
        expert is read once and stays; a guess would cost more than it hides).
    num_threads : int, optional
        Threads of colibri's routing, expert and linear kernels (default: torch's thread
        count when the model is loaded, ``torch.set_num_threads``). A step of at most 8
        tokens (decoding) runs torch's operations on one thread, colibri's pool doing the
        parallel work, and gives torch its threads back after the step.
    dtype : torch.dtype or str, optional
        Compute dtype; default: the dtype the experts are stored in (then expert views are
        used as they are; another dtype converts each expert on use); for block-quantized
        experts of a GGUF file or float8 experts bfloat16 (of a ``colibri quantize``
        directory: the dtype of its other tensors), with which decode-size experts run in the
        quantized (float8) kernel (float32: every expert dequantized to float32 on use, exact
        but slower).
    partition : colibri.Partition, path or dict, optional
        Static expert partitioning: every router picks ``topk_groups`` groups of this
        partition, then its top-k inside them (changes the model's routing); a dict gives
        one partition per layer index.
    topk_groups : int
        Groups each token may use with ``partition``.
    record_trace : bool
        Record every expert load in ``model.colibri.pager.trace`` (for Belady's bound).
    io : str, optional
        The pager's backend (:class:`colibri.Pager`'s ``io``: ``"mmap"``, ``"view"`` or
        ``"read"``; default: the pager's). ``"read"`` suits files that may change while in use.
    linears : str
        Where the other linears (attention, shared experts, dense MLPs, LM head; bfloat16 or
        float16 weights on the CPU) run for inputs of a few rows: ``"auto"`` (default) times
        colibri's kernel against torch's ``F.linear`` once per weight shape at load and keeps
        the faster, ``"colibri"`` or ``"torch"`` force one (``model.colibri.linears``
        records each shape's engine and timings). A GGUF file's block-quantized linears
        (Q8_0, Q4_K, ...) stay as stored and run colibri's quantized kernel for every input
        when the model computes in half precision, unless ``"torch"`` (then: dequantized).
        Unless ``"torch"``, the model's RMSNorms run colibri's kernel at decode sizes too
        (``model.colibri.norms`` names them), and so does the attention of decoding steps
        where the model's is transformers' ``"sdpa"`` (``model.colibri.attention``).
    expert_parallel : bool, dict or colibri.distributed.ExpertParallel, optional
        Spread the routed experts over the ranks of a torch.distributed (gloo) group: call
        on every rank; rank 0 gets the model, every other rank serves its share of the
        experts until rank 0's ``model.colibri.close()``, then gets None
        (``docs/distributed.md``).

    Returns
    -------
    transformers.PreTrainedModel
        The causal LM in eval mode; ``model.colibri`` is its :class:`Paging` (pager, stats,
        prediction recall, ``close()``).

    Raises
    ------
    CheckpointError
        The directory is incomplete or contradicts its config.json (names file, tensor, fix).
    UnsupportedCheckpointError
        A family or storage whose experts the pager cannot serve (says why and what works),
        or a config.json that asks to run the checkpoint's own code (``auto_map``).
    ImportError
        ``accelerate`` is missing (``pip install "colibri-moe[transformers]"``).
    """
    import colibri
    from colibri.pager import IO_BACKENDS

    _need_accelerate()

    if read_ahead not in READ_AHEAD_MODES:
        raise ValueError(
            f"from_pretrained(): read_ahead must be one of {READ_AHEAD_MODES} (got {read_ahead!r})"
        )
    auto = isinstance(budget, str) and budget.strip().lower() == "auto"
    budget_bytes = None if auto else parse_size(budget, "from_pretrained(): budget")
    if num_threads is not None:
        check_threads(num_threads, "from_pretrained(): num_threads")
    else:  # fixed now: a decoding step sets torch's (OpenMP's) count, colibri's default, to 1
        num_threads = torch.get_num_threads()
    if io is not None:
        check_choice("from_pretrained(): io", io, IO_BACKENDS)
    check_choice("from_pretrained(): linears", linears, LINEAR_MODES)
    checkpoint = GGUFCheckpoint(path) if is_gguf(path) else Checkpoint(path)
    config = _config(checkpoint)
    torch_dtype = _torch_dtype(config, checkpoint, dtype)
    model = _empty_model(config, checkpoint, torch_dtype)
    modules = find_experts(model)
    if not modules:
        raise UnsupportedCheckpointError(
            f"{checkpoint.path}: {type(model).__name__} (model_type "
            f"{checkpoint.config['model_type']!r}) has no routed experts to page; load it with "
            "transformers' own from_pretrained"
        )
    source = checkpoint.expert_source()  # never opens a stray manifest or another file
    _check_experts(modules, source, checkpoint)
    # every check before any weight is read
    kept = {}  # a GGUF file's quantized linears, computed as stored in half precision
    if isinstance(checkpoint, GGUFCheckpoint):
        plan = checkpoint.plan_resident(model)
        if linears != "torch" and torch_dtype in (torch.bfloat16, torch.float16):
            kept = checkpoint.quantized_linears(model, plan)
    else:
        plan = _plan_resident(model, checkpoint)
    chosen = None
    if auto:  # what the memory this process may use leaves (_budget.py)
        chosen = for_model(model, checkpoint, plan, source, page_size_kb, torch_dtype, kept)
        budget_bytes = chosen.nbytes
    pager = colibri.Pager(
        source,
        budget_bytes=budget_bytes,
        page_size_kb=page_size_kb,
        policy=policy,
        record_trace=record_trace,
        io=io,
    )
    paging = Paging(
        pager=pager,
        checkpoint=checkpoint,
        read_ahead=read_ahead,
        expert_bytes=source.total_expert_nbytes,
        num_threads=num_threads,
        auto_budget=chosen,
    )
    try:
        if expert_parallel is not None and expert_parallel is not False:
            from colibri.distributed import start

            paging.remote = start(expert_parallel, pager,
                                  {layer_index(n): computation(m) for n, m in modules}, source,
                                  num_threads=num_threads, read_ahead=read_ahead)  # fmt: skip
            if paging.remote is None:  # a serving rank, served until rank 0 closed
                pager.close()
                return None
        for name, module in modules:
            page(name, module, paging)
        blocks = {}
        paging.resident_bytes = _load_resident(model, checkpoint, plan, torch_dtype, kept, blocks)
        _generation_config(model, checkpoint)
        model.eval()
        routers = [router.name for router in patch(model, num_threads=num_threads)]
        stepped = _decode.stepped(model) if linears == "auto" else ()
        paging.linears = install(model, linears, num_threads, [n for n, _ in modules],
                                 blocks, routers, stepped)  # fmt: skip
        if linears != "torch":
            paging.norms = _norms.install(model)
            paging.attention = _attention.NAME if _attention.install(model) else None
            paging.decode = _decode.install(model)
        _threads.install(model)
        if partition is not None:
            _partition(model, partition, topk_groups)
        layers = paged_layers(paging)
        for here, nxt in link_layers(model, layers).items():
            layers[here].next = nxt
        hold_all(paging)
    except BaseException:
        paging.close()
        raise
    model.__dict__["colibri"] = paging
    return model


def _need_accelerate() -> None:
    try:
        import accelerate  # noqa: F401
    except ImportError:
        raise ImportError(
            "from_pretrained() builds the model with accelerate's empty weights, and accelerate "
            'is not installed: pip install "colibri-moe[transformers]"'
        ) from None


def _config(checkpoint: Checkpoint):
    """The transformers config of ``checkpoint.config`` (the bytes already read and checked,
    not the file again), refused before transformers could ask to run the checkpoint's code."""
    import transformers
    from transformers import CONFIG_MAPPING

    where = checkpoint.config_path
    model_type = checkpoint.config["model_type"]
    if "auto_map" in checkpoint.config:
        raise UnsupportedCheckpointError(
            f"{where}: 'auto_map' asks to run Python code shipped with the checkpoint; colibri "
            "never runs a checkpoint's code: use a model_type transformers itself implements"
        )
    if model_type not in CONFIG_MAPPING:
        raise UnsupportedCheckpointError(
            f"{where}: model_type {model_type!r} is not one transformers "
            f"{transformers.__version__} implements; colibri runs no code but transformers' own"
        )
    from huggingface_hub.errors import StrictDataclassError  # a field of the wrong type

    try:
        return CONFIG_MAPPING[model_type].from_dict(dict(checkpoint.config))
    except (ValueError, KeyError, TypeError, StrictDataclassError) as exc:
        raise UnsupportedCheckpointError(
            f"{where}: transformers {transformers.__version__} cannot read it (model_type "
            f"{model_type!r}): {exc}"
        ) from None


def _empty_model(config: Any, checkpoint: Checkpoint, dtype: torch.dtype) -> nn.Module:
    """The causal LM of ``config`` with every parameter on the meta device (buffers real)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    try:
        with init_empty_weights(include_buffers=False):
            return AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
    except ValueError as exc:
        raise UnsupportedCheckpointError(
            f"{checkpoint.path}: model_type {checkpoint.config['model_type']!r} has no causal "
            f"LM class in transformers ({exc})"
        ) from None


def _generation_config(model: nn.Module, checkpoint: Checkpoint) -> None:
    """``generation_config.json``, as transformers' ``from_pretrained`` reads it (its eos,
    sampling defaults); without one, the model keeps the one its config gives."""
    from transformers import GenerationConfig

    path = f"{checkpoint.path}/generation_config.json"
    if not model.can_generate() or not os.path.lexists(path):
        return
    try:
        data = _json.mapping(read_json(path, "generation_config.json"), path, "the document")
    except CheckpointError:
        raise
    except FormatError as exc:
        raise CheckpointError(str(exc)) from None
    try:
        config = GenerationConfig.from_dict(data)
    except (ValueError, TypeError) as exc:
        raise CheckpointError(
            f"{path}: transformers refuses it ({exc}); fix: correct or remove it"
        ) from None
    config._original_object_hash = hash(config)  # what transformers' from_pretrained records
    model.generation_config = config


def _partition(model: nn.Module, partition: Any, topk_groups: int) -> None:
    """Give every router ``partition`` (one for all layers, or ``{layer: Partition}``)."""
    from colibri.partition import Partition

    if isinstance(partition, dict):
        by_layer = {int(k): v for k, v in partition.items()}
    else:
        if not isinstance(partition, Partition):
            partition = Partition.load(partition)
        by_layer = None
    for name, module in model.named_modules():
        state = module.__dict__.get(_STATE)
        if state is None:
            continue
        here = partition
        if by_layer is not None:
            found = layer_index(name)
            here = by_layer.get(found) if found is not None else None
            if here is None:
                continue
        routing = state.routing
        if "num_groups" in routing.options:
            raise UnsupportedCheckpointError(
                f"{name}: this router already limits routing to its own groups "
                f"(n_group={routing.options['num_groups']}); a partition cannot be added"
            )
        if here.num_experts != routing.num_experts:
            raise ValueError(
                f"from_pretrained(): partition covers {here.num_experts} experts but "
                f"{name} routes {routing.num_experts}"
            )
        routing.options["partition"] = here
        routing.options["topk_groups"] = int(topk_groups)
        routing._key = None
        routing._refresh({n: read(module) for n, read in routing.tensors.items()})
