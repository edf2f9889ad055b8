"""A ``from_pretrained`` model's one-token decoder-layer and model steps (``_decode``)
against the layers' and the model's own forwards bit for bit, and the calls that run their
own forwards."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("safetensors")

from _support.hf_families import save_bfloat16, token_ids  # noqa: E402
from colibri.integrations.transformers import _decode, from_pretrained  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_bfloat16(tmp_path_factory.mktemp("decode"))


@pytest.fixture(params=["colibri", "sdpa"])
def model(folder, request):
    """Every kernel colibri's (the step's two native calls), or torch's sdpa attention (the
    step calls the modules one by one)."""
    model = from_pretrained(folder, budget="64MiB", linears="colibri")
    if request.param == "sdpa":
        model.config._attn_implementation = "sdpa"
    return model


@pytest.fixture
def native(monkeypatch):
    """The native steps run: attention halves (``pre_attention`` calls, or ``AttentionStep``
    calls: ``planned``), those that computed the router's logits, steps that called the held
    experts themselves, routes the steps ran themselves (``plain``), AttentionSteps warmed
    (``warm``)."""
    ran = {"enter": 0, "routed": 0, "held": 0, "plain": 0, "planned": 0, "warm": 0}
    enter, leave, held = _decode.pre_attention, _decode.post_attention, _decode._experts.held
    plain, planned = _decode._patch.plain, _decode.AttentionStep

    class Planned:
        def __init__(self, *args):
            self.step = planned(*args)
            self.E = self.step.E

        def warm(self):
            self.step.warm()
            ran["warm"] += 1

        def __call__(self, *args):
            self.step(*args)
            ran["enter"] += 1
            ran["planned"] += 1
            ran["routed"] += args[-1] is not None

    def planning(module):
        given = plain(module)
        if given is None:
            return None

        class Counting:
            top_k = given[0].top_k

            def route(self, *args, **kwargs):
                ran["plain"] += 1
                return given[0].route(*args, **kwargs)

        return Counting(), given[1]

    def entering(*args):
        ran["enter"] += 1
        return enter(*args)

    def leaving(*args):
        out = leave(*args)
        ran["routed"] += out[2] is not None
        return out

    def holding(*args):
        out = held(*args)
        ran["held"] += out is not None
        return out

    monkeypatch.setattr(_decode, "pre_attention", entering)
    monkeypatch.setattr(_decode, "post_attention", leaving)
    monkeypatch.setattr(_decode._experts, "held", holding)
    monkeypatch.setattr(_decode._patch, "plain", planning)
    monkeypatch.setattr(_decode, "AttentionStep", Planned)
    return ran


@pytest.fixture
def steps(monkeypatch):
    """The steps run (a layer's native step, or its modules' calls), as ``(layer index,
    keys in the cache after it)``."""
    ran = []

    def counting(method):
        def count(self, *args):
            out = method(self, *args)
            if out is not None:  # a step that ran (calls always does)
                layer = self.attn.layer_idx
                ran.append((layer, args[2].get_seq_length(layer)))
            return out

        return count

    monkeypatch.setattr(_decode._Layer, "step", counting(_decode._Layer.step))
    monkeypatch.setattr(_decode._Layer, "calls", counting(_decode._Layer.calls))
    return ran


@pytest.fixture
def tokens(monkeypatch):
    """The model's steps run, as the number of layers each ran."""
    ran = []
    step = _decode._Model.step

    def counting(self, *args):
        out = step(self, *args)
        if out is not None:
            ran.append(len(self.layers))
        return out

    monkeypatch.setattr(_decode._Model, "step", counting)
    return ran


def _generate(model, ids, **kwargs):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=6, do_sample=False, output_scores=True,
                              return_dict_in_generate=True, **kwargs)  # fmt: skip


def _own_forward(model):
    for name in model.colibri.decode:
        model.get_submodule(name).__dict__.pop("forward")


def test_steps_equal_the_layers_own_forward(model, steps, native, tokens):
    layers = model.config.num_hidden_layers
    assert model.colibri.decode == [*(f"model.layers.{i}" for i in range(layers)), "model"]
    ids = token_ids(seed=5, batch=1, length=7)
    ours = _generate(model, ids)
    # five steps after the prompt, each through every layer, the cache one key longer each
    assert steps == [(i, 8 + s) for s in range(5) for i in range(layers)]
    assert tokens == [layers] * 5  # each the model's step
    on_colibri = model.config._attn_implementation != "sdpa"
    # every step's experts held after the prompt's (a budget that holds them all), every
    # attention half one call with the cache update
    counts = ("enter", "routed", "held", "plain", "planned")
    # each layer's weights warmed before its step, from the second step on (the first
    # makes each layer's AttentionStep)
    assert native == {**dict.fromkeys(counts, 5 * layers * on_colibri),
                      "warm": 4 * layers * on_colibri}  # fmt: skip
    _own_forward(model)
    theirs = _generate(model, ids)
    assert torch.equal(ours.sequences, theirs.sequences)
    assert all(torch.equal(a, b) for a, b in zip(ours.scores, theirs.scores, strict=True))


def test_a_cache_of_another_kind_is_updated_between_two_calls(model, native):
    """A cache colibri's buffers do not stand in for (here a subclass of ``DynamicCache``):
    its own ``update`` between ``pre_attention`` and ``post_attention``; the same tokens
    and logits as the layers' own forward."""
    from transformers import DynamicCache

    class Cache(DynamicCache):
        pass

    layers = model.config.num_hidden_layers
    ids = token_ids(seed=8, batch=1, length=7)
    ours = _generate(model, ids, past_key_values=Cache(config=model.config))
    on_colibri = model.config._attn_implementation != "sdpa"
    assert native["enter"] == 5 * layers * on_colibri and native["planned"] == 0
    _own_forward(model)
    theirs = _generate(model, ids, past_key_values=Cache(config=model.config))
    assert all(torch.equal(a, b) for a, b in zip(ours.scores, theirs.scores, strict=True))


def test_a_step_is_the_layer_forward_on_any_inputs(model):
    """One layer's step against its forward on the same random state (a cache of 9 keys,
    a hidden state far from the model's usual scale)."""
    from transformers import DynamicCache

    layer = model.model.layers[1]
    rotary = model.model.rotary_emb
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(1, 1, model.config.hidden_size, generator=g) * 30).bfloat16()
    position = torch.tensor([[9]])
    cos, sin = rotary(hidden, position)
    caches = []
    for _ in range(2):
        cache = DynamicCache(config=model.config)
        for i in range(model.config.num_hidden_layers):
            shape = (1, model.config.num_key_value_heads, 9, layer.self_attn.head_dim)
            keys = torch.randn(shape, generator=torch.Generator().manual_seed(i)).bfloat16()
            cache.update(keys, keys.flip(-1), i)
        caches.append(cache)
    with torch.no_grad():
        ours = layer(hidden, None, position, caches[0], True, (cos, sin))
        theirs = type(layer).forward(layer, hidden, None, position, caches[1], True, (cos, sin))
    assert torch.equal(ours, theirs)
    assert torch.equal(caches[0].layers[1].keys, caches[1].layers[1].keys)
    assert torch.equal(caches[0].layers[1].values, caches[1].layers[1].values)


@pytest.mark.parametrize(
    "change", ["norm", "epsilon", "projection", "router", "projection in place",
               "router in place", "norm in place"]
)  # fmt: skip
def test_modules_changed_between_steps_are_read_again(model, steps, change):
    """What a step reads of its modules, kept between steps, is read again when a module
    changes: a weight's memory replaced (``.data``, a new parameter), a norm's epsilon; a
    weight changed in place is read in place; the steps stay the layers' own forward."""
    ids = token_ids(seed=6, batch=1, length=5)
    before = _generate(model, ids)
    g = torch.Generator().manual_seed(1)
    layer = model.model.layers[0]
    norm, attn, gate = layer.input_layernorm, layer.self_attn, layer.mlp.gate
    with torch.no_grad():
        if change == "norm":
            norm.weight.data = (torch.rand(norm.weight.shape, generator=g) + 0.5).bfloat16()
        elif change == "epsilon":
            attn.k_norm.variance_epsilon = 0.5
        elif change == "projection":
            attn.q_proj.weight = torch.nn.Parameter(attn.q_proj.weight.flip(0).contiguous())
        elif change == "projection in place":
            attn.q_proj.weight.mul_(-1.5)
        elif change == "router in place":
            gate.weight.mul_(-1.5)
        elif change == "norm in place":
            norm.weight.add_(0.5)
        else:
            gate.weight.data = gate.weight.data.flip(0).contiguous()
    ours = _generate(model, ids)
    assert len(steps) == 2 * 5 * model.config.num_hidden_layers
    _own_forward(model)
    theirs = _generate(model, ids)
    assert not all(torch.equal(a, b) for a, b in zip(before.scores, theirs.scores, strict=True))
    assert torch.equal(ours.sequences, theirs.sequences)
    assert all(torch.equal(a, b) for a, b in zip(ours.scores, theirs.scores, strict=True))


@pytest.mark.parametrize("replaced", ["q_proj", "input_layernorm", "self_attn", "gate"])
def test_modules_replaced_between_steps_are_the_ones_run(model, replaced):
    """A module of a layer replaced by another after loading (a new linear, a changed copy of
    a norm, of the attention, of the router) is the one that runs: the tokens and logits of
    the layers' own forward with the new module, not the old one's."""
    import copy

    ids = token_ids(seed=6, batch=1, length=5)
    before = _generate(model, ids)
    layer = model.model.layers[0]
    attn = layer.self_attn
    with torch.no_grad():
        if replaced == "q_proj":
            new = torch.nn.Linear(attn.q_proj.in_features, attn.q_proj.out_features,
                                  bias=False).bfloat16()  # fmt: skip
            new.weight.copy_(attn.q_proj.weight.flip(0))
            attn.q_proj = new
        elif replaced == "input_layernorm":
            new = copy.deepcopy(layer.input_layernorm)
            new.weight.mul_(3)
            layer.input_layernorm = new
        elif replaced == "self_attn":
            new = copy.deepcopy(attn)
            new.o_proj.weight.data = new.o_proj.weight.data.flip(1).contiguous()
            layer.self_attn = new
        else:
            new = copy.deepcopy(layer.mlp.gate)
            new.weight.data = new.weight.data.flip(0).contiguous()
            layer.mlp.gate = new
    ours = _generate(model, ids)
    _own_forward(model)
    theirs = _generate(model, ids)
    assert not all(torch.equal(a, b) for a, b in zip(before.scores, theirs.scores, strict=True))
    assert torch.equal(ours.sequences, theirs.sequences)
    assert all(torch.equal(a, b) for a, b in zip(ours.scores, theirs.scores, strict=True))


def test_a_routers_top_k_set_between_tokens_is_the_one_routed(model, steps):
    """A router's ``top_k`` set between two decoding steps (here by a logits processor, so
    that no prompt runs the router's forward in between) routes the next steps to that
    many experts, as the layers' own forward does."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class Fewer(LogitsProcessor):
        def __init__(self) -> None:
            self.calls = 0

        def __call__(self, input_ids, scores):
            self.calls += 1
            if self.calls == 3:
                for layer in model.model.layers:
                    layer.mlp.gate.top_k = 1
            return scores

    def run():
        for layer in model.model.layers:
            layer.mlp.gate.top_k = top_k
        return _generate(model, ids, logits_processor=LogitsProcessorList([Fewer()]))

    ids = token_ids(seed=6, batch=1, length=5)
    top_k = model.model.layers[0].mlp.gate.top_k
    before = _generate(model, ids)
    ours = run()
    assert len(steps) == 2 * 5 * model.config.num_hidden_layers  # the steps ran
    _own_forward(model)
    theirs = run()
    assert not all(torch.equal(a, b) for a, b in zip(before.scores, theirs.scores, strict=True))
    assert torch.equal(ours.sequences, theirs.sequences)
    assert all(torch.equal(a, b) for a, b in zip(ours.scores, theirs.scores, strict=True))


def test_other_calls_run_the_layers_forward(model, steps, tokens):
    ids = token_ids(seed=5, batch=2, length=7)
    _generate(model, ids, attention_mask=torch.ones_like(ids))  # a batch
    assert steps == [] and tokens == []
    with torch.enable_grad():  # gradients: torch's graph, the layers' own code
        out = model(ids[:1, :3], use_cache=True)
        model(ids[:1, 3:4], past_key_values=out.past_key_values)
    assert steps == []
    # a hook on a module the step would skip: that layer runs its forward, the hook fires
    fired = []
    model.model.layers[0].mlp.gate.register_forward_hook(lambda *a: fired.append(1))
    _generate(model, ids[:1])
    assert len(fired) == 6 and 0 not in {layer for layer, _ in steps}
    assert {layer for layer, _ in steps} == set(range(1, model.config.num_hidden_layers))
    steps.clear()
    model.model.layers[1].self_attn.train()  # its dropout: the layer's own forward
    _generate(model, ids[:1])
    assert steps == []  # layer 0 hooked, layer 1 training


def test_a_hook_added_between_tokens_runs_from_the_next_token(model, steps):
    """A hook registered on a module the step skips between two tokens (a logits
    processor's), then removed: that layer runs its forward, the hook fires, for the tokens
    in between only; the text stays the model's."""
    from transformers import LogitsProcessor, LogitsProcessorList

    ids, fired, handles = token_ids(seed=9, batch=1, length=5), [], []
    before = _generate(model, ids)
    projection = model.model.layers[1].self_attn.q_proj

    class Hooking(LogitsProcessor):
        def __call__(self, input_ids, scores):
            new = input_ids.shape[1] - ids.shape[1]
            if new == 2:
                handles.append(projection.register_forward_hook(lambda *a: fired.append(1)))
            elif new == 4:
                handles.pop().remove()
            return scores

    steps.clear()
    ours = _generate(model, ids, logits_processor=LogitsProcessorList([Hooking()]))
    assert len(fired) == 2  # the third and fourth of the five steps
    assert [layer for layer, _ in steps].count(1) == 3
    assert [layer for layer, _ in steps].count(0) == 5
    assert torch.equal(ours.sequences, before.sequences)
    assert all(torch.equal(a, b) for a, b in zip(ours.scores, before.scores, strict=True))


def test_a_copied_layer_step_looks_at_its_modules_hooks_anew(model):
    """A copy of a layer's step does not take its original's word that the modules have no
    hooks: hooks that came with copied modules were put in place with no handle made."""
    import copy

    state = model.model.layers[0].__dict__[_decode._STATE]
    assert state.ready()  # its modules seen without hooks
    twin = copy.copy(state)
    hooks = state.q_norm._forward_hooks
    hooks[-1] = lambda *a: None  # as a copied or unpickled module's hooks arrive
    try:
        assert not twin.ready()
    finally:
        del hooks[-1]
    assert twin.ready()


def test_other_model_calls_run_the_models_forward(model, steps, tokens):
    """What the model's step leaves to the model's forward: a hook on a module it calls
    itself, a layer replaced, a tuple asked for, outputs recorded by its decorators. The
    results stay the same."""
    layers = model.config.num_hidden_layers
    ids = token_ids(seed=7, batch=1, length=6)
    plain = _generate(model, ids)
    assert tokens == [layers] * 5
    tokens.clear()
    fired = []
    handle = model.model.norm.register_forward_hook(lambda *a: fired.append(1))
    hooked = _generate(model, ids)
    handle.remove()
    assert tokens == [] and len(fired) == 6  # the prompt's and each step's
    assert all(torch.equal(a, b) for a, b in zip(plain.scores, hooked.scores, strict=True))
    layer = model.model.layers[1]

    class Wrapped(torch.nn.Module):  # another module in the layer's place
        def forward(self, *args, **kwargs):
            return layer(*args, **kwargs)

    model.model.layers[1] = Wrapped()
    wrapped = _generate(model, ids)
    model.model.layers[1] = layer
    assert tokens == []
    assert all(torch.equal(a, b) for a, b in zip(plain.scores, wrapped.scores, strict=True))
    with torch.no_grad():
        out = model.model(ids, use_cache=True)
        step = model.model(ids[:, :1], past_key_values=out.past_key_values, return_dict=False)
    assert isinstance(step, tuple) and tokens == []
    steps.clear()
    # hidden states recorded: transformers hooks the layers (from then on: they run their
    # own forward, called by the model's step)
    recorded = _generate(model, ids, output_hidden_states=True)
    assert tokens == [] and steps == []
    assert all(len(h) == layers + 1 for h in recorded.hidden_states)
    assert all(torch.equal(a, b) for a, b in zip(plain.scores, recorded.scores, strict=True))
    again = _generate(model, ids)
    assert tokens == [layers] * 5 and steps == []
    assert all(torch.equal(a, b) for a, b in zip(plain.scores, again.scores, strict=True))


def test_forwards_replaced_after_loading_run(model, steps, monkeypatch):
    """A module's forward replaced on the instance, or its class's code changed after
    loading: the layer runs its own forward, which calls them."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe as m

    calls = []
    mlp = model.model.layers[1].mlp
    real = mlp.forward
    monkeypatch.setattr(mlp, "forward", lambda h: calls.append(1) or real(h))
    ids = token_ids(seed=5, batch=1, length=7)
    _generate(model, ids)
    assert len(calls) == 6 and 1 not in {layer for layer, _ in steps}
    steps.clear()
    attention = m.Qwen3MoeAttention.forward
    monkeypatch.setattr(m.Qwen3MoeAttention, "forward", lambda *a, **k: attention(*a, **k))
    _generate(model, ids)
    assert steps == []


def test_a_final_norm_replaced_runs(model, tokens, monkeypatch):
    """The final norm's forward replaced on the instance: the model's step calls it where
    it would call the norm's kernel, as the model's own forward does."""
    norm = model.model.norm
    real = norm.forward
    calls = []
    monkeypatch.setattr(norm, "forward", lambda h: calls.append(1) or real(h) * 2)
    ids = token_ids(seed=5, batch=1, length=7)
    ours = _generate(model, ids)
    assert len(calls) == 6 and tokens == [model.config.num_hidden_layers] * 5
    _own_forward(model)
    theirs = _generate(model, ids)
    assert all(torch.equal(a, b) for a, b in zip(ours.scores, theirs.scores, strict=True))


def test_router_logits_asked_for_are_recorded(model, steps):
    """transformers' output recorders hook the routers: the layers run their forward."""
    ids = token_ids(seed=5, batch=1, length=7)
    with torch.no_grad():
        out = model.model(ids, use_cache=True)
        step = model(ids[:, :1] + 1, past_key_values=out.past_key_values,
                     output_router_logits=True)  # fmt: skip
    layers = model.config.num_hidden_layers
    assert len(step.router_logits) == layers and steps == []


def test_unknown_code_gets_no_step(folder, monkeypatch):
    from transformers.models.qwen3_moe import modeling_qwen3_moe as m

    forward = m.Qwen3MoeAttention.forward

    def changed(self, *args, **kwargs):  # any other code: another fingerprint
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(m.Qwen3MoeAttention, "forward", changed)
    model = from_pretrained(folder, budget="64MiB")
    assert model.colibri.decode == []
    assert "forward" not in model.model.__dict__  # no model step without its layers'
    torch_only = from_pretrained(folder, budget="64MiB", linears="torch")
    assert torch_only.colibri.decode == []


def _greedy(model, cache, ids, n):
    """``n`` greedy tokens after ``ids`` (a prompt, or the last token) on ``cache``: their
    logits, and the last token."""
    logits = []
    with torch.no_grad():
        for _ in range(n):
            logits.append(model(ids, past_key_values=cache, use_cache=True).logits[:, -1])
            ids = logits[-1].argmax(-1, keepdim=True)
    return logits, ids


def test_the_cache_grows_in_place_and_others_changes_are_taken(folder):
    """A step appends to buffers with room to grow that the cache's layers show (their
    keys' memory stays put from step to step, past a doubling), and takes the layers as
    others leave them: cropped, deep-copied. Logits and cache bit for bit the layers' own
    forward's."""
    import copy

    from transformers import DynamicCache

    ids = token_ids(seed=6, batch=1, length=7)
    runs = []
    for own in (False, True):
        model = from_pretrained(folder, budget="64MiB", linears="colibri")
        if own:
            _own_forward(model)
        cache = DynamicCache(config=model.config)
        logits, last = _greedy(model, cache, ids, 3)  # the prompt, then 2 steps
        where = cache.layers[0].keys.untyped_storage().data_ptr()
        more, last = _greedy(model, cache, last, 50)  # 59 rows: one buffer of 64 holds them
        assert (cache.layers[0].keys.untyped_storage().data_ptr() == where) != own
        logits += more
        copied = copy.deepcopy(cache)
        more, last = _greedy(model, cache, last, 10)  # past 64 rows: the buffers double
        logits += more
        cache.crop(-4)
        more, _ = _greedy(model, cache, last, 3)
        logits += more
        more, _ = _greedy(model, copied, last, 3)  # the copy, where the cache was
        logits += more
        runs.append((logits, cache, copied))
    (ours, cache, copied), (theirs, own_cache, own_copied) = runs
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    assert _decode._ROOM in cache.layers[0].__dict__  # the steps ran on their own buffers
    for a, b in ((cache, own_cache), (copied, own_copied)):
        assert a.get_seq_length() == b.get_seq_length()
        for x, y in zip(a.layers, b.layers, strict=True):
            assert torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)


def test_the_experts_function_is_read_every_token(model):
    """Which experts function transformers dispatches to is read once a token: another one
    registered and set between two tokens (a logits processor's change) runs from the next
    token on, in every layer; the text stays the model's."""
    from transformers import LogitsProcessor, LogitsProcessorList
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    from colibri.integrations.transformers import _experts

    config, ids, calls = model.config, token_ids(seed=7, batch=1, length=5), []
    before, setting = _generate(model, ids), _experts.implementation(config, "experts")

    def counting(*args, **kwargs):
        calls.append(1)
        return _experts.experts_forward(*args, **kwargs)

    class Switch(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if input_ids.shape[1] == ids.shape[1] + 2:  # after the second new token
                config._experts_implementation = "counting"
            return scores

    ALL_EXPERTS_FUNCTIONS["counting"] = counting
    try:
        ours = _generate(model, ids, logits_processor=LogitsProcessorList([Switch()]))
    finally:
        config._experts_implementation = setting
        del ALL_EXPERTS_FUNCTIONS["counting"]
    layers = config.num_hidden_layers
    assert len(calls) == 3 * layers  # the last three of the six tokens
    assert torch.equal(ours.sequences, before.sequences)
    assert all(torch.equal(a, b) for a, b in zip(ours.scores, before.scores, strict=True))


def test_implementation_settings_are_the_configs_own():
    """The step reads ``config._attn_implementation`` / ``_experts_implementation`` from
    where transformers keeps them: the value the property gives after each change, and the
    property itself on a config that keeps them elsewhere."""
    from transformers import Qwen3MoeConfig

    from colibri.integrations.transformers import _experts

    config = Qwen3MoeConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=2)
    for value in ("sdpa", "eager"):
        config._attn_implementation = value
        assert _experts.implementation(config, "attn") == config._attn_implementation == value
    config._experts_implementation = "eager"
    assert _experts.implementation(config, "experts") == "eager"

    class Elsewhere:
        _attn_implementation = "kept apart"

    assert _experts.implementation(Elsewhere(), "attn") == "kept apart"
