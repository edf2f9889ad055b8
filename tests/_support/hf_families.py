"""Tiny random models of the MoE families the transformers integration covers.

Shared by the transformers integration tests: no download, hidden size 32, two
layers, a handful of experts, router weights and selection biases randomised so
that ties are improbable and the biases change which experts win.
"""

from __future__ import annotations

import torch

COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

_MLA = dict(
    kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, num_key_value_heads=4
)

# model_type -> (config overrides, transformers' top-k is sorted (ids comparable in order))
FAMILIES: dict[str, tuple[dict, bool]] = {
    "mixtral": (dict(num_local_experts=8, num_experts_per_tok=2), True),
    "qwen2_moe": (
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            norm_topk_prob=False,
        ),
        True,
    ),
    "qwen3_moe": (
        dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, norm_topk_prob=True),
        True,
    ),
    "olmoe": (dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=False), True),
    "deepseek_v2": (
        dict(
            n_routed_experts=12,
            num_experts_per_tok=3,
            moe_intermediate_size=24,
            n_shared_experts=1,
            first_k_dense_replace=0,
            n_group=4,
            topk_group=2,
            topk_method="group_limited_greedy",
            routed_scaling_factor=1.5,
            q_lora_rank=None,
            **_MLA,
        ),
        False,
    ),
    "deepseek_v3": (
        dict(
            n_routed_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=24,
            n_shared_experts=1,
            first_k_dense_replace=0,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            q_lora_rank=24,
            **_MLA,
        ),
        False,
    ),
    "glm4_moe": (
        dict(
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            n_shared_experts=1,
            first_k_dense_replace=0,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=1.8,
            norm_topk_prob=True,
            partial_rotary_factor=0.5,
        ),
        False,
    ),
    "gpt_oss": (
        dict(
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"],
        ),
        True,
    ),
    "llama4_text": (
        dict(
            num_local_experts=4,
            num_experts_per_tok=1,
            intermediate_size_mlp=48,
            interleave_moe_layer_step=1,
            no_rope_layers=[1, 1],
            attention_chunk_size=16,
        ),
        True,
    ),
    "dbrx": (
        dict(
            d_model=32,
            n_heads=4,
            n_layers=2,
            max_seq_len=64,
            vocab_size=96,
            attn_config=dict(kv_n_heads=2, clip_qkv=8.0),
            ffn_config=dict(
                ffn_hidden_size=48, moe_num_experts=8, moe_top_k=2, moe_normalize_expert_weights=2.0
            ),
        ),
        True,
    ),
    "jamba": (
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            expert_layer_period=1,
            expert_layer_offset=0,
            attn_layer_period=2,
            attn_layer_offset=1,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_dt_rank=4,
        ),
        True,
    ),
    "granitemoe": (dict(num_local_experts=8, num_experts_per_tok=2), True),
    "gemma4_text": (
        dict(
            enable_moe_block=True,
            num_experts=8,
            top_k_experts=2,
            moe_intermediate_size=24,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=16,
            hidden_size_per_layer_input=0,
            global_head_dim=8,
        ),
        True,
    ),
}

_LINEAR_ATTENTION = dict(
    layer_types=["linear_attention", "full_attention"],
    linear_num_value_heads=2,
    linear_num_key_heads=2,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
)

# Further families (mostly sharing a router implementation with the ones above):
# model_type -> (config overrides, transformers' top-k is sorted, router kind).
MORE_FAMILIES: dict[str, tuple[dict, bool, str]] = {
    "qwen3_next": (
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
             shared_expert_intermediate_size=24, norm_topk_prob=True, **_LINEAR_ATTENTION),
        True, "softmax_topk_norm_topk_prob",
    ),
    "qwen3_5_moe_text": (
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
             shared_expert_intermediate_size=24, **_LINEAR_ATTENTION),
        True, "softmax_topk_renorm",
    ),
    "flex_olmo": (
        dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
        True, "softmax_topk_norm_topk_prob",
    ),
    "minimax": (
        dict(num_local_experts=8, num_experts_per_tok=2), True, "softmax_topk_renorm_fp32"
    ),
    "hunyuan_v1_moe": (
        dict(num_experts=8, num_local_experts=8, moe_topk=2), True, "softmax_topk_renorm_hunyuan"
    ),
    "ernie4_5_moe": (
        dict(num_experts=8, num_experts_per_tok=2, moe_k=2, moe_intermediate_size=24,
             moe_num_shared_experts=1),
        True, "softmax_bias_renorm",
    ),
    "granitemoeshared": (
        dict(num_local_experts=8, num_experts_per_tok=2), True, "topk_logits_softmax"
    ),
    "cohere2_moe": (
        dict(num_experts=8, num_experts_per_tok=2, expert_selection_fn="sigmoid",
             norm_topk_prob=False),
        True, "topk_logits_softmax_or_sigmoid",
    ),
    "dots1": (
        dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
             n_shared_experts=1, n_group=2, topk_group=1, norm_topk_prob=True,
             routed_scaling_factor=2.0),
        False, "sigmoid_bias_group_top2_scale",
    ),
    "exaone_moe": (
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, n_group=2,
             topk_group=1),
        False, "sigmoid_bias_group_top2_scale",
    ),
    "deepseek_v32": (
        dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
             n_shared_experts=1, first_k_dense_replace=0, n_group=2, topk_group=1,
             q_lora_rank=24, **_MLA),
        False, "sigmoid_bias_group_top2_scale",
    ),
    "glm4_moe_lite": (
        dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
             n_shared_experts=1, first_k_dense_replace=0, q_lora_rank=24, **_MLA),
        False, "sigmoid_bias_group_top2_scale",
    ),
    "minimax_m2": (
        dict(num_local_experts=8, num_experts_per_tok=2), False, "sigmoid_block_bias_renorm"
    ),
    "hy_v3": (
        dict(num_experts=8, num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=24),
        False, "sigmoid_block_bias_renorm_scale",
    ),
    "afmoe": (
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, route_scale=1.7,
             num_dense_layers=0),
        True, "sigmoid_block_bias_renorm_route_scale",
    ),
    "laguna": (
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
             moe_router_logit_softcapping=3.0),
        True, "softcap_sigmoid_bias_renorm",
    ),
}  # fmt: skip


def build_model(model_type: str, **overrides) -> torch.nn.Module:
    """A tiny random ``AutoModelForCausalLM`` of ``model_type``, float32, eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    options = FAMILIES[model_type][0] if model_type in FAMILIES else MORE_FAMILIES[model_type][0]
    if model_type == "dbrx":
        config = AutoConfig.for_model("dbrx", **{**options, **overrides})
        config.attn_config.rope_theta = 10000.0  # transformers 5.23 reads it, never sets it
    else:
        config = AutoConfig.for_model(model_type, **{**COMMON, **options, **overrides})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def randomise_routers(model: torch.nn.Module, router_names: list[str], seed: int = 1) -> None:
    """Give the routers spread-out logits, negative and positive selection biases and
    per-expert scales away from 1 (transformers initialises them to zeros/ones)."""
    gen = torch.Generator().manual_seed(seed)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name in router_names:
            scopes = [modules[name]]
            if name and "." in name:  # block-level biases (MiniMax-M2, AFMoE, HY-V3)
                scopes.append(modules[name.rsplit(".", 1)[0]])
            for scope, recurse in zip(scopes, (True, False), strict=False):
                tensors = list(scope.named_parameters(recurse=recurse))
                tensors += list(scope.named_buffers(recurse=recurse))
                for tname, tensor in tensors:
                    if "experts" in tname or "shared" in tname:
                        continue
                    if "per_expert_scale" in tname:
                        tensor.copy_(torch.rand(tensor.shape, generator=gen) * 1.5 + 0.5)
                    elif "bias" in tname and tensor.numel() < 64:
                        tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.3)
                    elif tensor.dim() == 2 and tensor.shape[0] < tensor.shape[1]:
                        fan_in = tensor.shape[1]
                        tensor.copy_(torch.randn(tensor.shape, generator=gen) * 2 / fan_in**0.5)


CHARACTERS = " abcdefghijklmnopqrstuvwxyz.,!?'0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def save_tokenizer(folder) -> None:
    """A character-level tokenizer (ids 0-3 special, then :data:`CHARACTERS`, 73 in all) that
    ``AutoTokenizer.from_pretrained(folder)`` loads: text for the tiny models' vocabularies."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + list(CHARACTERS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
        unk_token="<unk>",
    ).save_pretrained(folder)  # fmt: skip


def token_ids(seed: int = 0, batch: int = 2, length: int = 6, low: int = 3, high: int = 90):
    """``[batch, length]`` random token ids in ``[low, high)``, the same for a seed."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, (batch, length), generator=gen)


def logits(model: torch.nn.Module, ids) -> torch.Tensor:
    """``model(ids).logits`` as float32, without autograd."""
    with torch.no_grad():
        return model(ids).logits.float()


def compiled_logits(model: torch.nn.Module, ids) -> tuple[torch.Tensor, list]:
    """:func:`logits` of ``torch.compile(model, fullgraph=True)``, and the FX graphs dynamo
    handed its backend (run as they are: no inductor), dynamo reset before and after."""
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    try:
        return logits(torch.compile(model, fullgraph=True, backend=backend), ids), graphs
    finally:
        torch._dynamo.reset()


def save_bfloat16(folder, model_type: str = "qwen3_moe"):
    """Save a random ``model_type`` model in bfloat16 to ``folder``, its routers randomised
    (no routing ties); returns ``folder``."""
    from colibri.integrations.transformers import patch, unpatch

    model = build_model(model_type).to(torch.bfloat16)
    randomise_routers(model, [r.name for r in patch(model)])
    unpatch(model)
    model.save_pretrained(folder)
    return folder


def save_patched(model: torch.nn.Module, folder, max_shard_size: str) -> torch.nn.Module:
    """Save ``model`` to ``folder`` as a checkpoint with a tokenizer, its routers randomised
    first (so that routing is not a tie), and return it patched with colibri: the reference
    for what ``from_pretrained(folder)`` computes."""
    from colibri.integrations.transformers import patch, unpatch

    randomise_routers(model, [r.name for r in patch(model)])
    unpatch(model)
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    save_tokenizer(folder)
    patch(model)
    return model
