"""Transformers checkpoints bigger than memory: :func:`from_pretrained`.

The model of a checkpoint directory is built without materialising its weights; every tensor
but the routed experts is loaded from the checkpoint's safetensors files; each experts module
becomes a colibri-paged one (its weights read on demand from the checkpoint's own files by a
:class:`colibri.Pager` under the budget, computed by colibri's expert engine) and every
router is colibri's, exactly as :func:`patch` makes it. ``model.generate()`` works unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from colibri._units import parse_size
from colibri._validate import check_int
from colibri.integrations.transformers._checkpoint import Checkpoint, CheckpointError, layer_index
from colibri.integrations.transformers._experts import (
    Paging,
    UnsupportedCheckpointError,
    find_experts,
    page,
    paged_layers,
)
from colibri.integrations.transformers._patch import _STATE, patch
from colibri.integrations.transformers._predict import READ_AHEAD_MODES, link_layers

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
        expected = tuple(wanted[target].shape)
        if tuple(info.shape) != expected:
            raise CheckpointError(
                f"{info.path}: tensor {name!r} has shape {list(info.shape)} but config.json "
                f"gives the model's {target} the shape {list(expected)}; fix: use the "
                "config.json this checkpoint was saved with"
            )
        plan.setdefault(info.path, []).append((name, target))
    return plan


def _load_resident(model: nn.Module, checkpoint: Checkpoint, plan: dict, dtype) -> int:
    """Load the tensors of ``plan`` into ``model``; returns their bytes."""
    from safetensors import safe_open

    wanted = model.state_dict(keep_vars=True)
    total = 0
    for path, names in plan.items():
        with safe_open(path, framework="pt") as f:
            for name, target in names:
                tensor = f.get_tensor(name)
                want = dtype or wanted[target].dtype
                if tensor.dtype != want and tensor.is_floating_point():
                    tensor = tensor.to(want)
                _set_tensor(model, target, tensor)
                total += checkpoint.tensors[name].nbytes
    if getattr(model.config, "tie_word_embeddings", False) or getattr(
        model.config.get_text_config(), "tie_word_embeddings", False
    ):
        model.tie_weights()
    missing = [n for n, t in model.state_dict(keep_vars=True).items() if t.is_meta]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        shown = ", ".join(missing[:5]) + more
        raise CheckpointError(
            f"{checkpoint.weights}: the model's tensors {shown} are in no file of the "
            "checkpoint; fix: re-save the checkpoint (save_pretrained) or re-download the "
            "missing shard"
        )
    return total


def _check_experts(modules: list[tuple[str, nn.Module]], source, checkpoint: Checkpoint) -> None:
    """Every expert the model has is in the checkpoint, shaped as config.json says."""
    servable = {"F32", "F16", "BF16"}
    for name, module in modules:
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
                    "gate_proj.weight'); fix: use the config.json this checkpoint was saved "
                    "with, or re-save the checkpoint"
                )
            for ref, shape in ((layout.gate, (inter, hidden)), (layout.up, (inter, hidden)),
                               (layout.down, (hidden, inter))):  # fmt: skip
                tensor = ref.name.split("[", 1)[0]
                if ref.dtype not in servable:
                    raise UnsupportedCheckpointError(
                        f"{ref.path}: expert tensor {tensor!r} is {ref.dtype}; the pager serves "
                        f"{', '.join(sorted(servable))} experts (quantized or FP8 checkpoints: "
                        "dequantize them to bf16 first)"
                    )
                if tuple(ref.shape) != shape:
                    raise CheckpointError(
                        f"{ref.path}: expert tensor {tensor!r} is {list(ref.shape)} per expert "
                        f"but config.json (hidden {hidden}, expert intermediate {inter}) needs "
                        f"{list(shape)}; fix: use the config.json this checkpoint was saved with"
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
    return {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}.get(
        stored, getattr(config, "dtype", None) or torch.float32
    )


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
) -> nn.Module:
    """Load a transformers MoE checkpoint with its routed experts paged under ``budget``.

    Parameters
    ----------
    path : path-like
        A checkpoint directory: ``config.json`` and ``model.safetensors`` or shards with
        ``model.safetensors.index.json`` (as ``save_pretrained`` writes them). Routed experts
        may be stored per expert (``...experts.{e}.gate_proj.weight``, Mixtral's
        ``...experts.{e}.w1.weight``) or stacked (``...experts.gate_up_proj [E, 2I, H]``).
    budget : int or str
        Most bytes of expert weights held in memory at once (``805306368``, ``"768MiB"``,
        ``"3GiB"``); everything else of the model is resident on top of it.
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
        Threads of colibri's routing and expert kernels (default: colibri's; torch's own:
        ``torch.set_num_threads``).
    dtype : torch.dtype or str, optional
        Compute dtype; default: the dtype the experts are stored in (then expert views are
        used as they are; another dtype converts each expert on use).
    partition : colibri.Partition, path or dict, optional
        Static expert partitioning: every router picks ``topk_groups`` groups of this
        partition, then its top-k inside them (changes the model's routing); a dict gives
        one partition per layer index.
    topk_groups : int
        Groups each token may use with ``partition``.
    record_trace : bool
        Record every expert load in ``model.colibri.pager.trace`` (for Belady's bound).

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
        A family or storage whose experts the pager cannot serve (says why and what works).
    """
    import colibri
    from colibri.formats import FormatError, open_weights

    if read_ahead not in READ_AHEAD_MODES:
        raise ValueError(
            f"from_pretrained(): read_ahead must be one of {READ_AHEAD_MODES} (got {read_ahead!r})"
        )
    budget_bytes = parse_size(budget, "from_pretrained(): budget")
    if num_threads is not None:
        check_int("from_pretrained(): num_threads", num_threads, 1)
    checkpoint = Checkpoint(path)
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
    try:
        source = open_weights(checkpoint.weights)
    except (FormatError, KeyError) as exc:
        raise CheckpointError(f"{exc}; fix: re-save the checkpoint") from None
    _check_experts(modules, source, checkpoint)
    plan = _plan_resident(model, checkpoint)  # every check before any weight is read
    pager = colibri.Pager(
        source,
        budget_bytes=budget_bytes,
        page_size_kb=page_size_kb,
        policy=policy,
        record_trace=record_trace,
    )
    paging = Paging(
        pager=pager,
        checkpoint=checkpoint,
        read_ahead=read_ahead,
        expert_bytes=source.total_expert_nbytes,
        num_threads=num_threads or 0,
    )
    try:
        for name, module in modules:
            page(name, module, paging)
        paging.resident_bytes = _load_resident(model, checkpoint, plan, torch_dtype)
        model.eval()
        patch(model, num_threads=num_threads)
        if partition is not None:
            _partition(model, partition, topk_groups)
        layers = paged_layers(paging)
        for here, nxt in link_layers(model, layers).items():
            layers[here].next = nxt
    except BaseException:
        pager.close()
        raise
    model.__dict__["colibri"] = paging
    return model


def _config(checkpoint: Checkpoint):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(checkpoint.path)
    except (ValueError, KeyError) as exc:
        import transformers

        raise UnsupportedCheckpointError(
            f"{checkpoint.path}/config.json: transformers {transformers.__version__} cannot "
            f"read it (model_type {checkpoint.config.get('model_type')!r}): {exc}"
        ) from None


def _empty_model(config: Any, checkpoint: Checkpoint, dtype: torch.dtype) -> nn.Module:
    """The causal LM of ``config`` with every parameter on the meta device (buffers real)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    try:
        with init_empty_weights(include_buffers=False):
            return AutoModelForCausalLM.from_config(config, dtype=dtype)
    except ValueError as exc:
        raise UnsupportedCheckpointError(
            f"{checkpoint.path}: model_type {checkpoint.config['model_type']!r} has no causal "
            f"LM class in transformers ({exc})"
        ) from None


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
