"""colibri routing inside transformers models, checked against transformers' own routing.

For every covered MoE family a tiny random model is built from a config (no
download), run once on transformers' routing and once patched onto colibri: the
routing decisions (ids and weights of every router call), the MoE block
outputs, the logits and a greedy generation must agree; ``unpatch`` must restore
the original computation bit for bit.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from _support.hf_families import FAMILIES, MORE_FAMILIES, build_model, randomise_routers  # noqa: E402
from colibri.integrations.transformers import (  # noqa: E402
    UnsupportedRouterError,
    patch,
    patched_routers,
    unpatch,
)

BIAS = "<correction_bias tensor>"

# model_type -> (router kind, colibri options patch() must derive from the config)
EXPECTED: dict[str, tuple[str, dict]] = {
    "mixtral": ("softmax_topk_renorm_fp32", {"normalize": True}),
    "qwen2_moe": ("softmax_topk_norm_topk_prob", {"normalize": False}),
    "qwen3_moe": ("softmax_topk_norm_topk_prob", {"normalize": True}),
    "olmoe": ("softmax_topk_norm_topk_prob", {"normalize": False}),
    "deepseek_v2": (
        "softmax_group_max_scale",
        {"normalize": False, "scale": 1.5, "num_groups": 4, "topk_groups": 2, "group_score": "max"},
    ),
    "deepseek_v3": (
        "sigmoid_bias_group_top2_scale",
        {"scoring": "sigmoid", "normalize": True, "scale": 2.5, "num_groups": 4,
         "topk_groups": 2, "group_score": "top2_sum", "correction_bias": BIAS,
         "normalize_eps": 1e-20},
    ),
    "glm4_moe": (
        "sigmoid_bias_group_top2_scale",
        {"scoring": "sigmoid", "normalize": True, "scale": 1.8, "correction_bias": BIAS,
         "normalize_eps": 1e-20},
    ),
    "gpt_oss": ("topk_logits_softmax_bias", {"normalize": True}),
    "llama4_text": ("topk_logits_sigmoid_dense", {"scoring": "sigmoid", "normalize": False}),
    "dbrx": ("softmax_topk_pnorm", {"normalize": True, "norm_p": 2.0}),
    "jamba": ("softmax_topk", {"normalize": False}),
    "granitemoe": ("topk_logits_softmax", {"normalize": True}),
    "gemma4_text": (
        "softmax_topk_renorm_expert_scale",
        {"normalize": True, "expert_scale": "<expert_scale tensor>"},
    ),
}  # fmt: skip

DENSE_KINDS = {"topk_logits_sigmoid_dense"}  # Llama4: [T, E] scores, zero where not chosen
EXPERTS_INPUT_KINDS = {"softmax_topk_pnorm"}  # DBRX: routing is a method of the FFN block


def _decisions(kind: str, first, second) -> tuple:
    """(ids in transformers' order [T, k] int64, weights [T, k] float32) of one router call."""
    if kind in DENSE_KINDS:
        dense = first.detach().float()
        k = int(dense.ne(0).sum(-1).max())
        weights, ids = dense.topk(k, dim=-1)
        return ids, weights
    return second.detach().long(), first.detach().float()


def _run(model, records, input_ids):
    """Routing decisions of every router call, every MoE block's output, and the logits."""
    modules = dict(model.named_modules())
    calls: list[tuple] = []
    blocks: list = []
    handles = []
    for record in records:
        module = modules[record.name]
        kind = record.kind
        if kind in EXPERTS_INPUT_KINDS:
            handles.append(
                module.experts.register_forward_pre_hook(
                    lambda m, args, kind=kind: calls.append(_decisions(kind, args[2], args[1]))
                )
            )
            block = module
        else:
            handles.append(
                module.register_forward_hook(
                    lambda m, args, out, kind=kind: calls.append(
                        _decisions(kind, out[0], None)
                        if kind in DENSE_KINDS
                        else _decisions(kind, out[1], out[2])
                    )
                )
            )
            block = modules[record.name.rsplit(".", 1)[0]]
        handles.append(
            block.register_forward_hook(
                lambda m, args, out: blocks.append(
                    (out[0] if isinstance(out, tuple) else out).detach().clone()
                )
            )
        )
    try:
        with torch.no_grad():
            logits = model(input_ids).logits
    finally:
        for handle in handles:
            handle.remove()
    return calls, blocks, logits


def _generate(model, input_ids):
    with torch.no_grad():
        return model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=5,
        )


def _assert_same_routing(reference, colibri, ordered: bool) -> None:
    assert len(reference) == len(colibri) > 0
    for (ref_ids, ref_w), (ids, w) in zip(reference, colibri, strict=True):
        assert ids.dtype == torch.int64
        assert ids.shape == ref_ids.shape
        ref_order, order = ref_ids.argsort(-1), ids.argsort(-1)
        torch.testing.assert_close(ids.gather(1, order), ref_ids.gather(1, ref_order))
        torch.testing.assert_close(
            w.gather(1, order), ref_w.gather(1, ref_order), atol=1e-6, rtol=0
        )
        if ordered:  # transformers' topk is sorted: colibri's rows are in the same order
            torch.testing.assert_close(ids, ref_ids)


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """Tiny models: torch's thread pool only adds contention (10x slower on 2 cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    """(model_type, model with randomised routers, the routers patch() finds)."""
    model_type = request.param
    model = build_model(model_type)
    records = patch(model)
    unpatch(model)
    randomise_routers(model, [r.name for r in records])
    return model_type, model, records


def test_patch_finds_every_moe_router(family):
    model_type, model, records = family
    kind, options = EXPECTED[model_type]
    assert records, model_type
    assert {r.kind for r in records} == {kind}
    for record in records:
        assert record.options == options
        assert record.family in model_type
    moe_blocks = {r.name.rsplit(".", 1)[0] for r in records}
    assert len(moe_blocks) == len(records) == 2  # one MoE block per layer, two layers


def _check_against_transformers(model, records, ordered: bool, **patch_options) -> None:
    input_ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(5))

    ref_calls, ref_blocks, ref_logits = _run(model, records, input_ids)
    ref_tokens = _generate(model, input_ids)

    patched = patch(model, **patch_options)
    try:
        assert [r.name for r in patched] == [r.name for r in records]
        assert patched_routers(model) == patched
        calls, blocks, logits = _run(model, records, input_ids)
        tokens = _generate(model, input_ids)
    finally:
        assert unpatch(model) == len(records)

    _assert_same_routing(ref_calls, calls, ordered)
    assert len(blocks) == len(ref_blocks)
    for block, ref_block in zip(blocks, ref_blocks, strict=True):
        torch.testing.assert_close(block, ref_block, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(tokens, ref_tokens, atol=0, rtol=0)

    # unpatch gives back transformers' own computation, bit for bit
    assert patched_routers(model) == []
    _, _, again_logits = _run(model, records, input_ids)
    torch.testing.assert_close(again_logits, ref_logits, atol=0, rtol=0)


def test_routing_blocks_logits_and_generation_match_transformers(family):
    model_type, model, records = family
    _check_against_transformers(model, records, ordered=FAMILIES[model_type][1])


@pytest.mark.parametrize("model_type", sorted(MORE_FAMILIES))
def test_more_families_match_transformers(model_type):
    _, ordered, kind = MORE_FAMILIES[model_type]
    model = build_model(model_type)
    records = patch(model)
    unpatch(model)
    assert records and {r.kind for r in records} == {kind}
    randomise_routers(model, [r.name for r in records])
    _check_against_transformers(model, records, ordered)


def test_skip_unsupported_leaves_hash_routed_layers_to_transformers():
    """DeepSeek-V4: hash-routed layers (experts from a token-id table) have no routing
    decision to make; skip_unsupported patches the learned routers only."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "deepseek_v4", vocab_size=96, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=24, mlp_layer_types=["hash_moe", "moe"],
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(UnsupportedRouterError, match=r"(?s)layers\.0.*family deepseek_v4.*hash"):
        patch(model)
    records = patch(model, skip_unsupported=True)
    unpatch(model)
    assert [r.router_class for r in records] == ["DeepseekV4TopKRouter"]
    assert records[0].options["scoring"] == "sqrtsoftplus"
    randomise_routers(model, [r.name for r in records])
    _check_against_transformers(model, records, ordered=False, skip_unsupported=True)


# --------------------------------------------------------------------------------------
# Tensors read at call time: biases and scales loaded or changed after patch().


@pytest.mark.parametrize("model_type", ["deepseek_v3", "gemma4_text"])
def test_changed_bias_or_scale_after_patch_is_followed(model_type):
    model = build_model(model_type)
    records = patch(model)
    randomise_routers(model, [r.name for r in records], seed=7)  # in place, after patch
    input_ids = torch.randint(3, 96, (1, 11), generator=torch.Generator().manual_seed(2))
    calls, _, logits = _run(model, records, input_ids)
    unpatch(model)
    ref_calls, _, ref_logits = _run(model, records, input_ids)
    _assert_same_routing(ref_calls, calls, ordered=False)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("model_type", "attribute", "value"),
    [("qwen3_moe", "top_k", 1), ("qwen3_moe", "norm_topk_prob", False),
     ("deepseek_v3", "routed_scaling_factor", 0.5), ("deepseek_v3", "topk_group", 1)],
)  # fmt: skip
def test_changed_router_settings_after_patch_are_followed(model_type, attribute, value):
    """A router's plain setting changed after ``patch`` (its ``top_k``, normalization,
    scaling, groups) routes as transformers' own routing does with it; an option added to
    the routing since (as a partition adds its own) is kept."""
    model = build_model(model_type)
    records = patch(model)
    randomise_routers(model, [r.name for r in records], seed=7)
    input_ids = torch.randint(3, 96, (1, 11), generator=torch.Generator().manual_seed(2))
    _run(model, records, input_ids)  # routed once with the settings patched
    router = model.get_submodule(records[0].name)
    state = router.__dict__["_colibri_routing"]
    state.routing.options["collect_stats"] = True  # added, as _load adds a partition
    for record in records:
        setattr(model.get_submodule(record.name), attribute, value)
    calls, _, logits = _run(model, records, input_ids)
    assert router.__dict__["_colibri_routing"] is not state  # configured again
    assert router.__dict__["_colibri_routing"].routing.options["collect_stats"] is True
    unpatch(model)
    ref_calls, _, ref_logits = _run(model, records, input_ids)
    _assert_same_routing(ref_calls, calls, ordered=False)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)


def test_state_dict_is_untouched_by_patch():
    model = build_model("mixtral")
    keys = list(model.state_dict())
    patch(model)
    assert list(model.state_dict()) == keys
    unpatch(model)


def test_patch_twice_replaces_and_unpatch_is_idempotent():
    model = build_model("qwen3_moe")
    first = patch(model)
    second = patch(model)
    assert [r.name for r in second] == [r.name for r in first]
    assert len(patched_routers(model)) == len(first)
    assert unpatch(model) == len(first)
    assert unpatch(model) == 0


def test_deepcopy_of_a_patched_model_routes_with_its_own_weights():
    import copy

    model = build_model("deepseek_v3")
    records = patch(model)
    randomise_routers(model, [r.name for r in records], seed=3)
    input_ids = torch.randint(3, 96, (1, 8), generator=torch.Generator().manual_seed(4))
    twin = copy.deepcopy(model)
    assert patched_routers(twin) == records
    _, _, expected = _run(twin, records, input_ids)
    randomise_routers(model, [r.name for r in records], seed=11)  # the original moves on
    _, _, logits = _run(twin, records, input_ids)
    torch.testing.assert_close(logits, expected, atol=0, rtol=0)
    unpatch(twin)
    _, _, reference = _run(twin, records, input_ids)
    torch.testing.assert_close(logits, reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("threads", ["one", "more than the default"])
def test_num_threads_is_passed_to_colibri(monkeypatch, threads):
    """Every router's colibri context is built with ``patch(num_threads=n)``'s n, read
    back from the contexts (the default is max_threads(), so "more" is never it), and the
    routing is transformers' whatever n is; 0 is refused at patch time."""
    import colibri

    n = 1 if threads == "one" else colibri.max_threads() + 1
    contexts = []
    init = colibri.init

    def recording_init(*args, **options):
        contexts.append(init(*args, **options))
        return contexts[-1]

    monkeypatch.setattr(colibri, "init", recording_init)  # public: what patch() builds with
    model = build_model("olmoe")
    records = patch(model, num_threads=n)
    randomise_routers(model, [r.name for r in records])
    input_ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(5))
    calls, _, _ = _run(model, records, input_ids)
    assert len(contexts) >= len(records) > 0
    assert [(c.routing_threads, c.config.routing_threads) for c in contexts] == [(n, n)] * len(
        contexts
    )
    unpatch(model)
    ref_calls, _, _ = _run(model, records, input_ids)
    _assert_same_routing(ref_calls, calls, ordered=True)
    with pytest.raises(ValueError, match=r"patch\(\): num_threads must be >= 1 \(got 0\)"):
        patch(model, num_threads=0)
    assert patched_routers(model) == []


# --------------------------------------------------------------------------------------
# Refusals: never route differently in silence.


def test_unsupported_family_is_refused_by_name():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "phimoe", vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(UnsupportedRouterError, match=r"(?s)family phimoe.*sparsemixer"):
        patch(model)
    assert patched_routers(model) == []
    with pytest.raises(ValueError, match="no MoE router"):
        patch(model, skip_unsupported=True)


def test_unsupported_config_option_is_refused_by_name():
    model = build_model("deepseek_v2", topk_method="greedy")
    records = patch(model)
    assert "num_groups" not in records[0].options
    unpatch(model)
    for _, module in model.named_modules():
        if type(module).__name__ == "DeepseekV2TopkRouter":
            module.topk_method = "noaux_tc"
    with pytest.raises(UnsupportedRouterError, match=r"(?s)deepseek_v2.*topk_method='noaux_tc'"):
        patch(model)
    assert patched_routers(model) == []  # all or nothing


def test_configuration_colibri_refuses_is_reported_by_name():
    # 4 groups of 4 experts, a token keeps 1 group: top-5 cannot be reached
    model = build_model("deepseek_v3", num_experts_per_tok=5, topk_group=1)
    with pytest.raises(UnsupportedRouterError, match=r"(?s)family deepseek_v3.*top_k"):
        patch(model)
    assert patched_routers(model) == []


def test_model_off_the_cpu_is_refused():
    model = build_model("mixtral").to("meta")
    with pytest.raises(ValueError, match="meta"):
        patch(model)
    assert patched_routers(model) == []


def test_training_with_gradients_is_refused():
    """The routing weights come from colibri without a gradient: training through a
    patched router would silently leave the router untrained."""
    model = build_model("qwen3_moe")
    patch(model)
    input_ids = torch.randint(3, 96, (1, 5))
    model.train()
    with pytest.raises(RuntimeError, match="no gradient"):
        model(input_ids)
    with torch.no_grad():
        model(input_ids)  # training mode without gradients (e.g. a no_grad evaluation) is fine
    model.eval()
    model(input_ids)  # eval mode: inference, gradients or not
    unpatch(model)


def test_changed_router_code_is_refused(monkeypatch):
    from transformers.models.mixtral import modeling_mixtral

    original = modeling_mixtral.MixtralTopKRouter.forward

    def forward(self, hidden_states):  # a "future transformers" router: sigmoid scores
        logits, _, _ = original(self, hidden_states)
        weights, ids = torch.topk(logits.sigmoid(), self.top_k, dim=-1)
        return logits, weights, ids

    monkeypatch.setattr(modeling_mixtral.MixtralTopKRouter, "forward", forward)
    model = build_model("mixtral")
    with pytest.raises(UnsupportedRouterError, match=r"(?s)family mixtral.*not one colibri"):
        patch(model)


def test_model_without_moe_is_refused():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama", vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    with pytest.raises(ValueError, match="no MoE router"):
        patch(AutoModelForCausalLM.from_config(config))


# --------------------------------------------------------------------------------------
# Documented differences (colibri.integrations.transformers.DIFFERENCES), shown exactly.


def _route_one(model, record, logits_row: list[float]):
    """Drive one router with a hidden state whose logits are ``logits_row``."""
    module = dict(model.named_modules())[record.name]
    weight = module.weight
    hidden = torch.zeros(1, weight.shape[1])
    hidden[0, 0] = 1.0
    with torch.no_grad():
        weight.zero_()
        weight[:, 0] = torch.tensor(logits_row)
        if getattr(module, "bias", None) is not None:
            module.bias.zero_()
        return module(hidden)


def test_difference_softmax_underflow_ties():
    """Mixtral takes the top-k of softmax probabilities; exp(-150) and exp(-200) both
    underflow to 0 in float32 and tie, so torch.topk may return either. colibri
    selects on the logits and returns expert 2 (logit -150). Weight 0 either way."""
    model = build_model("mixtral")
    record = patch(model)[0]
    logits_row = [0.0, -200.0, -150.0, -300.0, -400.0, -500.0, -600.0, -700.0]
    _, weights, ids = _route_one(model, record, logits_row)
    unpatch(model)
    _, ref_weights, ref_ids = _route_one(model, record, logits_row)
    assert ids.tolist() == [[0, 2]]
    assert ref_ids[0, 0] == 0
    torch.testing.assert_close(weights, ref_weights, atol=0, rtol=0)
    assert weights.tolist() == [[1.0, 0.0]]


def test_selection_on_logits_survives_sigmoid_saturation():
    """Llama4 takes the top-k of the logits; sigmoid(20) == sigmoid(21) == 1.0 in
    float32, yet colibri (selecting on logits) picks 21 as transformers does."""
    model = build_model("llama4_text")
    record = patch(model)[0]
    logits_row = [20.0, 21.0, -1.0, 0.5]
    scores, _ = _route_one(model, record, logits_row)
    unpatch(model)
    ref_scores, _ = _route_one(model, record, logits_row)
    assert ref_scores.tolist() == scores.tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_difference_ties_go_to_the_lower_id():
    """DIFFERENCES["ties"]: equal keys go to the lower expert id (torch.topk leaves it
    open). Four experts tie on the best logit: colibri takes the two lowest, half each."""
    from colibri.integrations.transformers import DIFFERENCES

    assert "ties" in DIFFERENCES
    model = build_model("mixtral")
    record = patch(model)[0]
    _, weights, ids = _route_one(model, record, [0.0, 2.0, -1.0, 2.0, 2.0, -3.0, 2.0, -5.0])
    assert ids.tolist() == [[1, 3]]
    assert weights.tolist() == [[0.5, 0.5]]


def test_difference_softmax_over_k_is_within_a_few_ulps():
    """DIFFERENCES["softmax over k"]: colibri's renormalised softmax over the k chosen
    logits is within a few float32 ulps of Mixtral's softmax-over-all-then-renormalise, on
    the same choices: 4 ulps of 1.0 (the weights sum to 1; 2 were seen), where the
    agreement the other tests ask is 1e-6, 8 of them."""
    from colibri.integrations.transformers import DIFFERENCES

    assert "softmax over k" in DIFFERENCES
    model = build_model("mixtral")
    records = patch(model)
    randomise_routers(model, [r.name for r in records], seed=7)
    input_ids = torch.randint(3, 96, (4, 16), generator=torch.Generator().manual_seed(8))
    calls, _, _ = _run(model, records, input_ids)
    unpatch(model)
    ref_calls, _, _ = _run(model, records, input_ids)
    for (ref_ids, ref_w), (ids, w) in zip(ref_calls, calls, strict=True):
        torch.testing.assert_close(ids, ref_ids, atol=0, rtol=0)
        torch.testing.assert_close(w, ref_w, atol=4 * torch.finfo(torch.float32).eps, rtol=0)


# --------------------------------------------------------------------------------------
# Routers whose models are too heavy to build here: checked module by module.


def _mistral4_router():
    from transformers.models.mistral4 import configuration_mistral4, modeling_mistral4

    config = configuration_mistral4.Mistral4Config(
        hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=1.3,
    )  # fmt: skip
    return modeling_mistral4.Mistral4TopkRouter(config)


def _longcat_router():
    from transformers.models.longcat_flash import (
        configuration_longcat_flash,
        modeling_longcat_flash,
    )

    config = configuration_longcat_flash.LongcatFlashConfig(
        hidden_size=32, n_routed_experts=8, zero_expert_num=2, num_experts_per_tok=3,
        routed_scaling_factor=1.3,
    )  # fmt: skip
    return modeling_longcat_flash.LongcatFlashTopkRouter(config)


def _deepseek_v4_router(scoring_func):
    from transformers.models.deepseek_v4 import configuration_deepseek_v4, modeling_deepseek_v4

    config = configuration_deepseek_v4.DeepseekV4Config(
        hidden_size=32, n_routed_experts=12, num_experts_per_tok=3, routed_scaling_factor=1.5,
        scoring_func=scoring_func,
    )  # fmt: skip
    return modeling_deepseek_v4.DeepseekV4TopKRouter(config)


def _router(family: str, config_class: str, router_class: str, **config):
    """A router module built straight from its family's config class."""
    import importlib

    configuration = importlib.import_module(f"transformers.models.{family}.configuration_{family}")
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    return getattr(modeling, router_class)(getattr(configuration, config_class)(**config))


ROUTERS = {
    "aria": (
        lambda: _router(
            "aria",
            "AriaTextConfig",
            "AriaTextTopKRouter",
            hidden_size=32,
            moe_num_experts=8,
            moe_topk=3,
        ),
        "topk_logits_softmax_aria",
    ),
    "mistral_large4": (
        lambda: _router(
            "mistral_large4",
            "MistralLarge4TextConfig",
            "MistralLarge4TextTopkRouter",
            hidden_size=32,
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.3,
        ),
        "softmax_fp32_group_top2_renorm_scale",
    ),
    "minimax_m3_vl": (
        lambda: _router(
            "minimax_m3_vl",
            "MiniMaxM3VLTextConfig",
            "MiniMaxM3VLTopKRouter",
            hidden_size=32,
            num_local_experts=8,
            num_experts_per_tok=2,
        ),
        "sigmoid_bias_renorm",
    ),
    "step3p7": (
        lambda: _router(
            "step3p7",
            "Step3p7TextConfig",
            "Step3p7TopKRouter",
            hidden_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
        ),
        "sigmoid_bias_renorm",
    ),
    "beam": (
        lambda: _router(
            "beam",
            "BeamConfig",
            "BeamTopKRouter",
            hidden_size=32,
            num_experts=16,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
        ),
        "sigmoid_bias_group_top2",
    ),
    "flint": (
        lambda: _router(
            "flint",
            "FlintConfig",
            "FlintTopKRouter",
            hidden_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
        ),
        "sigmoid_topk_norm_topk_prob",
    ),
    "mistral4": (_mistral4_router, "softmax_group_top2_scale"),
    "longcat_flash": (_longcat_router, "softmax_bias_scale"),
    "deepseek_v4_sqrtsoftplus": (
        lambda: _deepseek_v4_router("sqrtsoftplus"),
        "score_fn_bias_renorm_scale",
    ),
    "deepseek_v4_sigmoid": (lambda: _deepseek_v4_router("sigmoid"), "score_fn_bias_renorm_scale"),
}


# Real model shapes: each config class's defaults are a released model's (hidden sizes of
# thousands, up to 256 experts in 8 groups); DeepSeek-V2 and Qwen2-MoE given explicitly.
REAL_ROUTERS = {
    "DeepSeek-V3-671B": (
        lambda: _router("deepseek_v3", "DeepseekV3Config", "DeepseekV3TopkRouter"),
        "sigmoid_bias_group_top2_scale",
    ),
    "DeepSeek-V2-236B": (
        lambda: _router(
            "deepseek_v2", "DeepseekV2Config", "DeepseekV2TopkRouter", hidden_size=5120,
            n_routed_experts=160, num_experts_per_tok=6, n_group=8, topk_group=3,
            topk_method="group_limited_greedy", routed_scaling_factor=16.0,
        ),
        "softmax_group_max_scale",
    ),
    "GLM-4.5-Air": (
        lambda: _router("glm4_moe", "Glm4MoeConfig", "Glm4MoeTopkRouter"),
        "sigmoid_bias_group_top2_scale",
    ),
    "Qwen3-30B-A3B": (
        lambda: _router("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeTopKRouter", norm_topk_prob=True),
        "softmax_topk_norm_topk_prob",
    ),
    "Qwen2-57B-A14B": (
        lambda: _router("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeTopKRouter"),
        "softmax_topk_norm_topk_prob",
    ),
    "Mixtral-8x7B": (
        lambda: _router("mixtral", "MixtralConfig", "MixtralTopKRouter"),
        "softmax_topk_renorm_fp32",
    ),
    "gpt-oss-120b": (
        lambda: _router("gpt_oss", "GptOssConfig", "GptOssTopKRouter"),
        "topk_logits_softmax_bias",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(ROUTERS) + sorted(REAL_ROUTERS))
def test_router_modules_match_transformers(name):
    make, kind = ROUTERS[name] if name in ROUTERS else REAL_ROUTERS[name]
    torch.manual_seed(0)
    router = make().eval()
    records = patch(router)
    unpatch(router)
    assert [r.kind for r in records] == [kind]
    randomise_routers(router, [""])
    hidden_size = next(p for p in router.parameters() if p.dim() == 2).shape[1]
    hidden = torch.randn(64, hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = router(hidden)
        patch(router)
        got = router(hidden)
        unpatch(router)
    torch.testing.assert_close(got[0], ref[0], atol=0, rtol=0)  # the logits, untouched
    _assert_same_routing([(ref[2], ref[1].float())], [(got[2], got[1].float())], ordered=False)
    assert got[1].dtype == ref[1].dtype


def test_bfloat16_router_routes_like_transformers():
    """bfloat16 logits go to colibri as they are (DLPack); Qwen3-MoE computes its
    softmax in float32 as colibri does, so ids and weights match, except that equal
    bfloat16 logits (frequent: 8 bits of mantissa) tie, and at the k-th place
    colibri's tie rule (lower id) decides where torch.topk's choice is unspecified."""
    model = build_model("qwen3_moe").to(torch.bfloat16)
    records = patch(model)
    unpatch(model)
    randomise_routers(model, [r.name for r in records])
    router = dict(model.named_modules())[records[0].name]
    hidden = torch.randn(256, 32, generator=torch.Generator().manual_seed(5)).bfloat16()
    with torch.no_grad():
        ref_logits, ref_w, ref_ids = router(hidden)
        patch(router)
        logits, w, ids = router(hidden)
        unpatch(router)
    k = records[0].top_k
    assert w.dtype == torch.bfloat16 and ids.dtype == torch.int64
    torch.testing.assert_close(logits, ref_logits, atol=0, rtol=0)
    top = logits.float().topk(k + 1, dim=-1).values
    boundary_tie = top[:, k - 1] == top[:, k]
    assert boundary_tie.any()  # the case this test is about does occur
    free = ~boundary_tie
    torch.testing.assert_close(ids[free].sort(-1).values, ref_ids[free].sort(-1).values)
    torch.testing.assert_close(
        w[free].float().sort(-1).values,
        ref_w[free].float().sort(-1).values,
        atol=1e-6,
        rtol=2**-8,  # one bfloat16 ulp: colibri's float32 exp may differ from torch's by an ulp
    )
    for row in boundary_tie.nonzero().flatten().tolist():  # the lower ids win the tie
        tied = (logits[row] == top[row, k - 1]).nonzero().flatten().tolist()
        kept = [e for e in ids[row].tolist() if e in tied]
        assert kept == sorted(tied)[: len(kept)]


@pytest.mark.slow
def test_supported_routers_lists_the_covered_families():
    from colibri.integrations.transformers import supported_routers

    listed = " ".join(supported_routers().values()).split()
    for cls in [
        "MixtralTopKRouter",
        "Qwen2MoeTopKRouter",
        "Qwen3MoeTopKRouter",
        "OlmoeTopKRouter",
        "DeepseekV2TopkRouter",
        "DeepseekV3TopkRouter",
        "Glm4MoeTopkRouter",
        "GptOssTopKRouter",
        "Llama4Router",
        "DbrxFFN",
        "JambaTopKRouter",
        "GraniteMoeTopKRouter",
        "Gemma4TextRouter",
    ]:
        assert cls in listed


# --------------------------------------------------------------------------------------
# Routers that needed core options: LFM2-MoE (normalize_eps) and Kolibri1 (bias_on).


@pytest.mark.parametrize("use_expert_bias", [True, False])
def test_lfm2_moe_renormalisation_epsilon(use_expert_bias):
    """LFM2-MoE: w = sigmoid(x)[ids]; w / (sum(w) + 1e-6) * routed_scaling_factor; the
    epsilon moves the weights by ~1e-6/sum, above float32 rounding."""
    router = _router(
        "lfm2_moe", "Lfm2MoeConfig", "Lfm2MoeTopKRouter", hidden_size=32, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, use_expert_bias=use_expert_bias,
        routed_scaling_factor=1.5,
    )  # fmt: skip
    randomise_routers(router, [""])
    bias = torch.randn(8, generator=torch.Generator().manual_seed(1)) * 0.3
    hidden = torch.randn(64, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, ref_w, ref_ids = router(hidden, bias if use_expert_bias else None)
        (info,) = patch(router)
        _, w, ids = router(hidden, bias if use_expert_bias else None)
    assert info.options["normalize_eps"] == 1e-6
    _assert_same_routing([(ref_ids, ref_w)], [(ids, w)], ordered=True)
    unpatch(router)


def test_kolibri1_bias_on_logits():
    """Kolibri1: ids = top-k(logits + bias); w = sigmoid(logits)[ids], renormalised."""
    router = _router(
        "kolibri1", "Kolibri1Config", "Kolibri1TopKRouter", hidden_size=32, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True,
    )  # fmt: skip
    randomise_routers(router, [""])
    with torch.no_grad():
        router.e_score_correction_bias.copy_(
            torch.randn(8, generator=torch.Generator().manual_seed(3)) * 2.0
        )
    hidden = torch.randn(64, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, ref_w, ref_ids = router(hidden)
        (info,) = patch(router)
        _, w, ids = router(hidden)
    assert info.options["bias_on"] == "logits"
    _assert_same_routing([(ref_ids, ref_w)], [(ids, w)], ordered=True)
