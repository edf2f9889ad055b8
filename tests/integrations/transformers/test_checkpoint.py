"""Checkpoints with colibri-paged experts (``from_pretrained``), against the resident model.

Each family's tiny random model is written with ``save_pretrained`` (sharded with a small
``max_shard_size``, and once as one file, and once with stacked ``[E, ...]`` expert tensors),
loaded paged under a budget smaller than one layer's experts, and compared with the same
model fully resident in transformers: float32 logits within 1e-5, the same greedy and
sampled generations, pager statistics that add up to what was routed. Broken checkpoints are
refused before anything runs, naming the file, the tensor and the fix.
"""

from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("safetensors")

from _support.hf_families import (  # noqa: E402
    FAMILIES,
    MORE_FAMILIES,
    build_model,
    logits,
    randomise_routers,
    token_ids,
)
from colibri.integrations.transformers import (  # noqa: E402
    CheckpointError,
    UnsupportedCheckpointError,
    from_pretrained,
    patch,
    unpatch,
)

UNSERVABLE = {"llama4_text": "transposed", "dbrx": r"one \[E\*I, H\]"}
PAGED = [f for f in FAMILIES if f not in UNSERVABLE]
MORE = list(MORE_FAMILIES)


def _expert_bytes(model) -> int:
    """Bytes of one routed expert (float32) of ``model``."""
    for module in model.modules():
        if hasattr(module, "gate_up_proj") and hasattr(module, "down_proj"):
            return (module.gate_up_proj[0].numel() + module.down_proj[0].numel()) * 4
    raise AssertionError("no experts")


def _two_experts(model, page: int = 4096) -> int:
    """A budget of two experts in 4 KiB pages: the mapped pager holds whole pages, and each
    of an expert's three matrices (not page-aligned in a safetensors file) touches at most
    ceil(bytes / page) + 1 of them."""
    for module in model.modules():
        if hasattr(module, "gate_up_proj") and hasattr(module, "down_proj"):
            half = module.gate_up_proj[0].numel() * 4 // 2
            down = module.down_proj[0].numel() * 4
            pages = 2 * (-(-half // page) + 1) + (-(-down // page) + 1)
            return 2 * pages * page
    raise AssertionError("no experts")


def _write(family: str, folder, *, shard: str | None = "20KB"):
    """A tiny random model of ``family`` (routers randomised) saved in ``folder``; returns the
    resident model, patched with colibri (the reference), and the budget: two experts, less
    than any layer's experts."""
    model = build_model(family)
    randomise_routers(model, [r.name for r in patch(model)])
    unpatch(model)
    if shard is None:
        model.save_pretrained(folder)
    else:
        model.save_pretrained(folder, max_shard_size=shard)
    patch(model)
    budget = _two_experts(model)
    layer = min(len(m.gate_up_proj) for m in model.modules() if hasattr(m, "gate_up_proj"))
    assert budget < layer * _expert_bytes(model), "the budget must not hold a layer's experts"
    return model, budget


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cache = {}

    def get(family):
        if family not in cache:
            folder = tmp_path_factory.mktemp(family)
            cache[family] = (folder, *_write(family, folder))
        return cache[family]

    return get


@pytest.mark.parametrize("family", PAGED)
def test_paged_matches_resident(saved, family):
    folder, ref, budget = saved(family)
    assert os.path.exists(folder / "model.safetensors.index.json")  # really sharded
    model = from_pretrained(folder, budget=budget, page_size_kb=4, read_ahead="gate")
    assert model.colibri.modules and not any(p.is_meta for p in model.parameters())
    assert model.colibri.pager.capacity < min(model.colibri.layers.values())
    ids = token_ids()
    torch.testing.assert_close(logits(model, ids), logits(ref, ids), rtol=0, atol=1e-5)
    greedy = dict(do_sample=False, max_new_tokens=6, pad_token_id=0)
    assert torch.equal(model.generate(ids, **greedy), ref.generate(ids, **greedy))
    stats = model.colibri.stats
    assert stats.misses > 0 and stats.resident_bytes <= budget
    model.colibri.close()


@pytest.mark.parametrize("family", MORE)
def test_more_families_logits(saved, family):
    folder, ref, budget = saved(family)
    model = from_pretrained(folder, budget=budget, page_size_kb=4)
    ids = token_ids(1)
    torch.testing.assert_close(logits(model, ids), logits(ref, ids), rtol=0, atol=1e-5)
    model.colibri.close()


def test_matches_transformers_own_routing(saved):
    """The resident reference is transformers' own model and routing, not colibri's."""
    folder, ref, budget = saved("qwen3_moe")
    unpatch(ref)
    try:
        model = from_pretrained(folder, budget=budget, page_size_kb=4)
        ids = token_ids(2)
        torch.testing.assert_close(logits(model, ids), logits(ref, ids), rtol=0, atol=1e-5)
    finally:
        patch(ref)


def test_single_file_and_sampling(tmp_path):
    ref, budget = _write("mixtral", tmp_path, shard=None)
    assert os.path.exists(tmp_path / "model.safetensors")
    assert not os.path.exists(tmp_path / "model.safetensors.index.json")
    model = from_pretrained(tmp_path, budget=budget, page_size_kb=4, read_ahead="previous")
    ids = token_ids(3, batch=3)
    sample = dict(do_sample=True, top_k=20, max_new_tokens=5, pad_token_id=0)
    torch.manual_seed(7)
    want = ref.generate(ids, **sample)
    torch.manual_seed(7)
    assert torch.equal(model.generate(ids, **sample), want)
    # no KV cache: the whole sequence every step, same tokens
    greedy = dict(do_sample=False, max_new_tokens=4, pad_token_id=0)
    assert torch.equal(model.generate(ids, use_cache=False, **greedy), ref.generate(ids, **greedy))


def test_stacked_layout(tmp_path):
    """Experts stored as the in-memory stacked tensors (experts.gate_up_proj [E, 2I, H])."""
    from safetensors.torch import save_file

    ref = build_model("qwen3_moe")
    randomise_routers(ref, [r.name for r in patch(ref)])
    ref.config.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = from_pretrained(tmp_path, budget=_two_experts(ref), page_size_kb=4)
    ids = token_ids(4)
    torch.testing.assert_close(logits(model, ids), logits(ref, ids), rtol=0, atol=1e-5)


def test_stats_add_up_to_the_routing(saved):
    """Without read-ahead every expert a call routes to is one demand access: hits + misses
    equal the unique experts routed per call, and every miss reads one expert."""
    folder, _, budget = saved("deepseek_v3")
    model = from_pretrained(folder, budget=budget, page_size_kb=4, read_ahead="off")
    routed: dict[int, int] = {}

    def counter(layer):
        def count(module, args):
            routed[layer] = routed.get(layer, 0) + len(torch.unique(args[1]))

        return count

    for layer, m in model.colibri.modules.items():
        m.register_forward_pre_hook(counter(layer))
    model.generate(token_ids(5), do_sample=False, max_new_tokens=4, pad_token_id=0)
    stats = model.colibri.stats
    assert stats.hits + stats.misses == sum(routed.values())
    for layer, n in routed.items():
        per = stats.per_layer[layer]
        assert per.hits + per.misses == n
    expert = model.colibri.pager.source.max_expert_nbytes
    assert stats.bytes_read == stats.misses * expert
    assert stats.prefetched == 0 and stats.advised == 0

    # a budget holding every expert: the load reads each once, every use after is a hit
    everything = model.colibri.expert_bytes + 64 * 4096 * 2
    model = from_pretrained(folder, budget=everything, page_size_kb=4, read_ahead="off")
    loaded = model.colibri.stats
    assert loaded.misses == sum(model.colibri.layers.values()) and loaded.evictions == 0
    assert loaded.bytes_read == loaded.misses * expert
    model.colibri.pager.reset_stats()
    routed.clear()
    for layer, m in model.colibri.modules.items():
        m.register_forward_pre_hook(counter(layer))
    model.generate(token_ids(5), do_sample=False, max_new_tokens=4, pad_token_id=0)
    stats = model.colibri.stats
    assert (stats.misses, stats.bytes_read, stats.evictions) == (0, 0, 0)
    assert stats.hits == sum(routed.values())


def test_prediction_recall_is_measured(saved):
    """The scores of both guesses equal a count made independently: at each call of layer l,
    layer l+1's router (called as a module) on layer l's input gives the gate guess, the
    experts layer l+1 used at its previous call the previous guess; both are scored against
    what layer l+1 then uses."""
    folder, _, budget = saved("qwen2_moe")
    model = from_pretrained(folder, budget=4 * budget, page_size_kb=4, read_ahead="gate")
    layers = sorted(model.colibri.modules)
    routers = {l: model.get_submodule(f"model.layers.{l}.mlp.gate") for l in layers}
    guesses, used_last, want = {}, {}, {"gate": [0, 0, 0], "previous": [0, 0, 0]}

    def recorder(layer):
        def record(module, args):
            used = set(torch.unique(args[1]).tolist())
            for mode in ("gate", "previous"):
                guess = guesses.pop((mode, layer), None)
                if guess is not None:
                    counts = want[mode]
                    counts[0] += len(used)
                    counts[1] += len(guess)
                    counts[2] += len(guess & used)
            nxt = layers.index(layer) + 1
            if nxt < len(layers):
                with torch.no_grad():
                    out = routers[layers[nxt]](args[0])
                ids = next(t for t in out if not t.is_floating_point())
                guesses[("gate", layers[nxt])] = set(torch.unique(ids).tolist())
                if layers[nxt] in used_last:
                    guesses[("previous", layers[nxt])] = used_last[layers[nxt]]
            used_last[layer] = used

        return record

    for layer, module in model.colibri.modules.items():
        module.register_forward_pre_hook(recorder(layer))
    model.generate(token_ids(6), do_sample=False, max_new_tokens=6, pad_token_id=0)
    for mode, (used, predicted, correct) in want.items():
        got = model.colibri.prediction[mode]
        assert (got.used, got.predicted, got.correct) == (used, predicted, correct), mode
        assert used > 0 and 0 < correct < used  # a real guess: right often, not always
    assert model.colibri.stats.advised > 0  # read ahead into the page cache, no slot taken


def test_no_prediction_when_the_budget_holds_every_expert(saved, monkeypatch):
    """With a budget that holds every expert nothing is ever evicted: each expert is read
    once and stays, so no layer is predicted; a smaller budget keeps predicting."""
    folder, _, budget = saved("qwen2_moe")
    model = from_pretrained(folder, budget="1GiB", page_size_kb=4, read_ahead="gate")
    assert model.colibri.pager.capacity >= sum(model.colibri.layers.values())
    model.generate(token_ids(6), do_sample=False, max_new_tokens=3, pad_token_id=0)
    assert model.colibri.prediction["gate"].predicted == 0
    assert model.colibri.stats.advised == 0 and model.colibri.stats.evictions == 0
    small = from_pretrained(folder, budget=budget, page_size_kb=4, read_ahead="gate")
    small.generate(token_ids(6), do_sample=False, max_new_tokens=3, pad_token_id=0)
    assert small.colibri.prediction["gate"].predicted > 0 and small.colibri.stats.advised > 0


def test_close_and_unpatch_in_any_order(saved):
    folder, ref, budget = saved("olmoe")
    ids = token_ids(7)
    model = from_pretrained(folder, budget=budget, page_size_kb=4)
    unpatch(model)  # transformers' routing over the paged experts
    unpatch(ref)
    try:
        torch.testing.assert_close(logits(model, ids), logits(ref, ids), rtol=0, atol=1e-5)
    finally:
        patch(ref)
    model.colibri.close()
    model.colibri.close()  # idempotent
    unpatch(model)
    with pytest.raises(ValueError, match="pager is closed"):
        logits(model, ids)
    other = from_pretrained(folder, budget=budget, page_size_kb=4)
    other.colibri.close()
    with pytest.raises(ValueError, match="pager is closed"):
        other.generate(ids, max_new_tokens=2)


def _expert_weight_pointers(monkeypatch) -> list[int]:
    """Record the data pointer of every weight torch's ``linear`` multiplies."""
    pointers = []
    real = torch.nn.functional.linear

    def linear(x, weight, *args, **kwargs):
        pointers.append(weight.data_ptr())
        return real(x, weight, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "linear", linear)
    return pointers


def _routed(paging) -> set[tuple[int, int]]:
    """``(layer, expert)`` of every expert the model's calls route to from now on."""
    seen: set[tuple[int, int]] = set()
    for layer, module in paging.modules.items():

        def record(module, args, layer=layer):
            seen.update((layer, int(e)) for e in torch.unique(args[1]))

        module.register_forward_pre_hook(record)
    return seen


def _gate_addresses(paging, experts) -> set[int]:
    """Where each of ``experts``' (``(layer, expert)``) gate matrix lives in the pager's
    memory."""
    found = set()
    for layer, expert in experts:
        with paging.pager.load(layer, [expert]) as batch:
            found.add(batch[expert].gate.ctypes.data)
    return found


def test_experts_run_on_the_pagers_memory(saved, monkeypatch):
    """torch multiplies the very bytes the pager mapped: every expert a float32 model ran
    reached ``linear`` as a view of the pager's memory, not a copy."""
    folder, _, _ = saved("qwen3_moe")
    model = from_pretrained(folder, budget="1GiB", page_size_kb=4, read_ahead="off")
    pointers, routed = _expert_weight_pointers(monkeypatch), _routed(model.colibri)
    logits(model, token_ids(8))
    gates = _gate_addresses(model.colibri, routed)
    assert gates and gates <= set(pointers)
    model.colibri.close()


def test_bfloat16_checkpoint(tmp_path):
    """A bf16 checkpoint runs in bf16 on the stored bytes. Its logits match the resident bf16
    model to bf16 rounding: gate and up are two products here and one fused product there,
    each rounded to bf16 (8 bits of mantissa), so 2**-7 relative on values of order 1."""
    ref = build_model("qwen3_moe").to(torch.bfloat16)
    randomise_routers(ref, [r.name for r in patch(ref)])
    unpatch(ref)
    ref.save_pretrained(tmp_path, max_shard_size="20KB")
    patch(ref)
    model = from_pretrained(tmp_path, budget=_two_experts(ref), page_size_kb=4)
    assert next(model.parameters()).dtype == torch.bfloat16
    ids = token_ids(9)
    got, want = logits(model, ids).float(), logits(ref, ids).float()
    torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7 * want.abs().max().item())
    for one in (token_ids(9, batch=1, length=1), token_ids(10, batch=3, length=1)):  # decoding
        got, want = logits(model, one).float(), logits(ref, one).float()
        torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7 * want.abs().max().item())
    # run in float32 on the same bytes: each expert converted on use, the float32 math of the
    # resident model with the same (bf16) values
    wide = from_pretrained(tmp_path, budget=_two_experts(ref), page_size_kb=4, dtype="float32")
    same = build_model("qwen3_moe")  # float32, its own float32 rotary tables
    same.load_state_dict(ref.state_dict())
    patch(same)
    torch.testing.assert_close(logits(wide, ids), logits(same, ids), rtol=0, atol=1e-5)


def test_expert_kernel_switch(tmp_path, monkeypatch):
    """A bf16 model decodes its experts with the fused kernel (torch's ``linear`` never sees
    an expert's weights); COLIBRI_EXPERT_KERNEL=0 sends every expert to torch's ``linear``
    on the pager's views; both agree to bf16 rounding; anything but 0 or 1 is refused."""
    ref = build_model("qwen3_moe").to(torch.bfloat16)
    randomise_routers(ref, [r.name for r in patch(ref)])
    unpatch(ref)
    ref.save_pretrained(tmp_path, max_shard_size="20KB")
    model = from_pretrained(tmp_path, budget="1GiB", page_size_kb=4, read_ahead="off")
    one = token_ids(1, batch=1, length=1)  # decoding: one row per expert
    outputs, routed = {}, _routed(model.colibri)
    for value in ("1", "0"):
        monkeypatch.setenv("COLIBRI_EXPERT_KERNEL", value)
        pointers = _expert_weight_pointers(monkeypatch)
        outputs[value] = logits(model, one).float()
        gates = _gate_addresses(model.colibri, routed)
        assert gates and (gates.isdisjoint(pointers) if value == "1" else gates <= set(pointers))
        monkeypatch.undo()
    torch.testing.assert_close(outputs["1"], outputs["0"], rtol=2**-6, atol=2**-6)
    assert not torch.equal(outputs["1"], outputs["0"])  # float32 sums against bf16 ones
    monkeypatch.setenv("COLIBRI_EXPERT_KERNEL", "off")
    with pytest.raises(ValueError, match=r"COLIBRI_EXPERT_KERNEL must be \"0\" or \"1\""):
        logits(model, one)


def test_output_does_not_depend_on_the_budget(tmp_path):
    """Chunking a step under a small budget changes no bit of the result: each expert's
    share is added in ascending expert order whatever the chunks (bf16: kernel and torch)."""
    ref = build_model("mixtral").to(torch.bfloat16)
    randomise_routers(ref, [r.name for r in patch(ref)])
    unpatch(ref)
    ref.save_pretrained(tmp_path, max_shard_size="20KB")
    ids = token_ids(11, batch=2, length=7)
    wide = from_pretrained(tmp_path, budget="1GiB", page_size_kb=4)
    narrow = from_pretrained(tmp_path, budget=_two_experts(ref), page_size_kb=4)
    assert narrow.colibri.pager.capacity < min(narrow.colibri.layers.values())
    assert torch.equal(logits(wide, ids), logits(narrow, ids))
    greedy = dict(do_sample=False, max_new_tokens=5, pad_token_id=0)
    assert torch.equal(wide.generate(ids, **greedy), narrow.generate(ids, **greedy))


# --------------------------------------------------------------------------------------
# Broken checkpoints: refused before anything runs, naming the file, the tensor, the fix.


@pytest.fixture
def copy(saved, tmp_path):
    """A fresh copy of the sharded qwen3_moe checkpoint to break."""
    import shutil

    folder, _, budget = saved("qwen3_moe")
    target = tmp_path / "ckpt"
    shutil.copytree(folder, target)
    return target, budget


def _index(folder):
    with open(folder / "model.safetensors.index.json") as f:
        return json.load(f)["weight_map"]


def test_missing_expert_tensor(copy):
    from safetensors.torch import load_file, save_file

    folder, budget = copy
    name = "model.layers.1.mlp.experts.5.up_proj.weight"
    shard = folder / _index(folder)[name]
    tensors = load_file(shard)
    del tensors[name]
    save_file(tensors, shard, metadata={"format": "pt"})
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    del index["weight_map"][name]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' is missing.*fix: re-save"):
        from_pretrained(folder, budget=budget)


def test_shape_contradicting_config(copy):
    folder, budget = copy
    config = json.loads((folder / "config.json").read_text())
    config["moe_intermediate_size"] = 20
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        CheckpointError,
        match=r"model-000\d+-of-\d+\.safetensors: expert tensor "
        r"'model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight' is \[24, 32\].*"
        r"config\.json .*needs \[20, 32\]; fix: use the config\.json",
    ):
        from_pretrained(folder, budget=budget)


def test_shape_contradicting_config_resident_tensor(copy):
    folder, budget = copy
    config = json.loads((folder / "config.json").read_text())
    config["vocab_size"] = 100
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        CheckpointError,
        match=r"safetensors: tensor '(lm_head|model\.embed_tokens)\.weight' has shape "
        r"\[96, 32\] but config\.json",
    ):
        from_pretrained(folder, budget=budget)


def test_truncated_shard(copy):
    folder, budget = copy
    shard = folder / _index(folder)["model.layers.1.mlp.experts.7.down_proj.weight"]
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:
        f.truncate(size - 100)
    tensor = r"'model\.layers\.1\.mlp\.experts\.7\.down_proj\.weight\.data_offsets'"
    with pytest.raises(
        CheckpointError, match=rf"{shard.name}: {tensor}.* truncated.*fix: re-save or re-download"
    ):
        from_pretrained(folder, budget=budget)


def test_index_naming_a_missing_file(copy):
    folder, budget = copy
    shard = _index(folder)["model.layers.0.mlp.experts.3.gate_proj.weight"]
    os.remove(folder / shard)
    with pytest.raises(
        CheckpointError, match=rf"names shard '{shard}' .*not in .*fix: copy the missing shard"
    ):
        from_pretrained(folder, budget=budget)


@pytest.mark.parametrize("family", sorted(UNSERVABLE))
def test_unsupported_family(tmp_path, family):
    model = build_model(family)
    model.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedCheckpointError, match=UNSERVABLE[family]) as err:
        from_pretrained(tmp_path, budget="1MiB")
    assert "What works instead" in str(err.value)


def test_unknown_and_dense_models(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path / "dense")
    with pytest.raises(UnsupportedCheckpointError, match="has no routed experts to page"):
        from_pretrained(tmp_path / "dense", budget="1MiB")
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text(json.dumps({"model_type": "no_such_model"}))
    with pytest.raises(CheckpointError, match="neither model.safetensors"):
        from_pretrained(tmp_path / "odd", budget="1MiB")
    (tmp_path / "odd" / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(UnsupportedCheckpointError, match="'no_such_model'"):
        from_pretrained(tmp_path / "odd", budget="1MiB")
    with pytest.raises(CheckpointError, match="must be a checkpoint directory"):
        from_pretrained(tmp_path / "nowhere", budget="1MiB")
    with pytest.raises(ValueError, match="read_ahead must be one of"):
        from_pretrained(tmp_path / "dense", budget="1MiB", read_ahead="always")


# --------------------------------------------------------------------------------------
# The memory bound, in a fresh process.

_PROBE = r"""
import json, sys
def status():
    found = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                found[key] = int(value.split()[0]) * 1024
    return found
import torch
import transformers.models.qwen3_moe.modeling_qwen3_moe  # the family's code, as after imports
from colibri.integrations.transformers import from_pretrained
torch.set_num_threads(1)
warm = from_pretrained(sys.argv[3], budget="1MiB")  # torch's one-time allocations: not counted
with torch.no_grad():
    warm.generate(torch.zeros((1, 4), dtype=torch.long), do_sample=False, max_new_tokens=2)
warm.colibri.close()
del warm
import gc; gc.collect()
base = status()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM restarts from the current RSS
budget = int(sys.argv[2])
model = from_pretrained(sys.argv[1], budget=budget)
ids = torch.randint(0, 1000, (1, 16), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    model.generate(ids, do_sample=False, max_new_tokens=16)
end = status()
stats = model.colibri.stats
print(json.dumps(dict(base=base, end=end, resident=model.colibri.resident_bytes,
                      experts=model.colibri.expert_bytes, read=stats.bytes_read)))
"""

# What a run adds beyond the process after its imports and a tiny warm-up run (torch's
# one-time allocations), the resident weights and the budget: torch's kernels for the model's
# shapes (oneDNN keeps one per bf16 matmul shape; the experts' fallback runs its rows in
# power-of-two spans so that a run adds a few, not one per token count), generate()'s working
# memory, activations and the KV cache. Measured 15.5-16.9 MiB alone (27-28 MiB with a
# kernel per row count; 36.7-37.5 MiB with a pager that holds twice its budget, which this
# bound must catch); it does not grow with the checkpoint (the experts enter the process
# only through the pager).
OVERHEAD = 32 << 20


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_peak_rss_is_bounded(tmp_path):
    import subprocess
    import sys

    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3_moe", vocab_size=1024, hidden_size=256, intermediate_size=512,
        moe_intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, num_experts=32, num_experts_per_tok=4,
        max_position_embeddings=128, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.2)
    model.save_pretrained(tmp_path, max_shard_size="60MB")
    del model
    warm = AutoConfig.for_model(
        "qwen3_moe", vocab_size=128, hidden_size=64, intermediate_size=64,
        moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(warm).to(torch.bfloat16).save_pretrained(tmp_path / "warm")
    budget = 24 << 20
    # Two fresh processes, the better counted: torch's code pages (file-backed, mapped on first
    # use) come in page-cache folios whose size depends on what else the machine does. A
    # pager that held more than its budget fails both runs.
    runs = []
    for _ in range(2):
        result = subprocess.run(
            [sys.executable, "-c", _PROBE, str(tmp_path), str(budget), str(tmp_path / "warm")],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        got = json.loads(result.stdout.splitlines()[-1])
        assert got["experts"] >= 8 * budget
        assert got["read"] > 2 * budget  # the experts were streamed through the budget
        runs.append(got)
        if got["end"]["VmHWM"] <= got["base"]["VmRSS"] + got["resident"] + budget + OVERHEAD:
            break
    got = min(runs, key=lambda g: g["end"]["VmHWM"] - g["base"]["VmRSS"])
    bound = got["base"]["VmRSS"] + got["resident"] + budget + OVERHEAD
    assert got["end"]["VmHWM"] <= bound, runs


def test_fallback_rows_run_in_power_of_two_spans(saved, monkeypatch):
    """The experts' torch path multiplies row counts that are powers of two only (oneDNN
    keeps a kernel per shape it has run); the sums are the resident model's."""
    from colibri.integrations.transformers import _experts

    folder, ref, budget = saved("qwen3_moe")
    model = from_pretrained(folder, budget=budget, page_size_kb=4)  # float32: torch path only
    rows = []

    def linear(x, w, b):
        rows.append(x.shape[0])
        return torch.nn.functional.linear(x, w, b)

    monkeypatch.setattr(_experts, "many", linear)
    ids = token_ids(3, batch=3, length=9)
    torch.testing.assert_close(logits(model, ids), logits(ref, ids), rtol=0, atol=1e-5)
    assert rows and all(n & (n - 1) == 0 for n in rows), sorted(set(rows))
    assert len(rows) > 3 * len(model.colibri.layers)  # 27 tokens x top-2 over 8 experts


def test_partition_keeps_each_token_in_one_group(saved, tmp_path):
    """With a partition of 2 groups and topk_groups=1, a token's experts share a group
    (without it, the random routers mix groups)."""
    from colibri import Partition

    folder, _, budget = saved("qwen3_moe")
    groups = Partition([[0, 2, 4, 6], [1, 3, 5, 7]])
    path = tmp_path / "groups.json"
    groups.save(path)

    def groups_per_token(model):
        seen = []

        def record(module, args):
            seen.append(torch.tensor(groups.group_of.tolist())[args[1]])

        for m in model.colibri.modules.values():
            m.register_forward_pre_hook(record)
        logits(model, token_ids(10))
        return torch.cat([g.reshape(-1, g.shape[-1]) for g in seen])

    free = groups_per_token(from_pretrained(folder, budget=budget, page_size_kb=4))
    assert (free.min(-1).values != free.max(-1).values).any()
    for partition in (groups, str(path), {0: groups, 1: groups}):
        model = from_pretrained(folder, budget=budget, page_size_kb=4, partition=partition)
        held = groups_per_token(model)
        assert (held.min(-1).values == held.max(-1).values).all()
    with pytest.raises(ValueError, match="partition covers 6 experts"):
        from_pretrained(
            folder, budget=budget, page_size_kb=4, partition=Partition([[0, 1, 2], [3, 4, 5]])
        )


def _block_output(model, ids) -> torch.Tensor:
    """The first MoE block's output on ``ids``, float32."""
    out = []
    block = model.model.layers[0].mlp
    handle = block.register_forward_hook(
        lambda m, args, y: out.append((y[0] if isinstance(y, tuple) else y).float())
    )
    try:
        logits(model, ids)
    finally:
        handle.remove()
    return out[0]


@pytest.mark.parametrize("budget", ["1GiB", "128KiB"])  # every expert held; two a layer
@pytest.mark.parametrize("act", ["relu", "another silu"])
def test_an_activation_replaced_after_loading_is_the_one_computed(tmp_path, budget, act):
    """A bfloat16 experts module's ``act_fn`` replaced after loading computes the experts,
    held or paged, as the resident model with the same replacement does (the fused kernel
    only where it is SiLU, another SiLU module included): an MoE block's output to
    bfloat16 rounding, and the decoding steps' greedy tokens."""
    ref = build_model("qwen3_moe").to(torch.bfloat16)
    randomise_routers(ref, [r.name for r in patch(ref)])
    unpatch(ref)
    ref.save_pretrained(tmp_path, max_shard_size="20KB")
    model = from_pretrained(tmp_path, budget=budget, page_size_kb=4, read_ahead="off")
    ids = token_ids(1, batch=1, length=4)
    greedy = dict(do_sample=False, max_new_tokens=8, pad_token_id=0)
    model.generate(ids, **greedy)  # the kernel's activation in use (its experts held)
    before = _block_output(ref, ids)
    for m in (model, ref):
        for layer in m.model.layers:
            layer.mlp.experts.act_fn = torch.nn.ReLU() if act == "relu" else torch.nn.SiLU()
    want, scale = _block_output(ref, ids), before.abs().max().item()
    assert act != "relu" or (want - before).abs().max().item() > scale / 4
    torch.testing.assert_close(_block_output(model, ids), want, rtol=2**-6, atol=2**-6 * scale)
    assert torch.equal(model.generate(ids, **greedy), ref.generate(ids, **greedy))
    model.colibri.close()
