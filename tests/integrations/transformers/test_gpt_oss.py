"""gpt-oss checkpoints with paged experts, plain and MXFP4, against transformers' own model.

A tiny random gpt-oss (4 experts, top 2, sliding and full attention, sinks) is saved three
times: as ``save_pretrained`` writes it (plain float32, and bfloat16) and in the released
MXFP4 layout (``*_blocks`` / ``*_scales``, quantized here: an e8m0 scale per 32 values, the
nearest e2m1 value of each), with ``quantization_config: {"quant_method": "mxfp4"}``.
``from_pretrained`` under a budget of two experts (misses counted) gives transformers' logits
on the same weights (for MXFP4: transformers' own ``convert_moe_packed_tensors`` dequantizes
them into the reference) within 1e-5 (float32), bit for bit in bfloat16; MXFP4 experts of
decode size run colibri's fused kernel (q8 activations, bounded in
tests/layer/test_gpt_oss_kernel.py): within 5% of the logits' range and the same greedy
tokens, and within 1e-5 again with ``COLIBRI_EXPERT_KERNEL=0``. Broken checkpoints are one
``CheckpointError`` naming the tensor; an e8m0 scale byte 0xFF one ``FormatError`` naming it.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")
safetensors_torch = pytest.importorskip("safetensors.torch")

from _support.hf_families import logits, randomise_routers, token_ids  # noqa: E402
from colibri.formats.gpt_oss import dequantize_mxfp4  # noqa: E402
from colibri.integrations.transformers import (  # noqa: E402
    CheckpointError,
    from_pretrained,
    patch,
    unpatch,
)

HIDDEN, INTER, EXPERTS = 64, 64, 4
#: Bytes of one expert: plain float32 (two ranges), MXFP4 (4.25 bits a value, four ranges).
EXPERT_BYTES = {"plain": 3 * HIDDEN * INTER * 4, "bf16": 3 * HIDDEN * INTER * 2,
                "mxfp4": 3 * HIDDEN * INTER * 17 // 32}  # fmt: skip
#: Budgets of two experts in 4 KiB pages (each range touches at most one page more).
BUDGETS = {"plain": 2 * (EXPERT_BYTES["plain"] + 2 * 4096),
           "bf16": 2 * (EXPERT_BYTES["bf16"] + 2 * 4096),
           "mxfp4": 2 * 8 * 4096}  # fmt: skip
BUDGET = BUDGETS["plain"]
#: float32 models: to rounding; bfloat16: the same operations in the same order, the same bits;
#: MXFP4: the kernel's q8 activations, a fraction of the logits' range (KERNEL_RANGE).
ATOL = {"plain": 1e-5, "bf16": 0.0, "mxfp4": None}
KERNEL_RANGE = 0.05
FP4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


def _model():
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(
        vocab_size=96, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=EXPERTS,
        num_experts_per_tok=2, sliding_window=4, max_position_embeddings=64,
        layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = GptOssForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name:  # large enough that the SwiGLU's clamps at +-7 bite
                p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if "bias" in name else 0.3))
            elif "sinks" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
    randomise_routers(model, [r.name for r in patch(model)])
    unpatch(model)
    return model


def _quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``[..., rows, cols]`` float32 -> MXFP4 as gpt-oss stores it: blocks ``uint8 [..., rows,
    cols/32, 16]`` (low nibble first), e8m0 scales ``uint8 [..., rows, cols/32]``."""
    groups = w.reshape(*w.shape[:-1], -1, 32)
    amax = np.abs(groups).max(-1)
    exponent = np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)).astype(np.int32)
    scaled = groups / np.ldexp(np.float32(1), exponent)[..., None]
    codes = np.abs(np.abs(scaled)[..., None] - FP4).argmin(-1).astype(np.uint8)
    codes |= (scaled < 0).astype(np.uint8) << 3
    blocks = codes[..., 0::2] | codes[..., 1::2] << 4
    return blocks, (exponent + 127).astype(np.uint8)


def _write_mxfp4(model, folder) -> None:
    """``model`` saved as the released checkpoints are: experts in MXFP4, the rest as is;
    then ``model``'s experts replaced by transformers' dequantization of what was written."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model.save_pretrained(folder)
    tensors = safetensors_torch.load_file(folder / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        stored = tensors.pop(name).transpose(1, 2).contiguous().numpy()  # rows: outputs
        blocks, scales = _quantize(stored)
        tensors[name + "_blocks"] = torch.from_numpy(blocks)
        tensors[name + "_scales"] = torch.from_numpy(scales)
        back = convert_moe_packed_tensors(tensors[name + "_blocks"], tensors[name + "_scales"],
                                          dtype=torch.float32)  # fmt: skip
        model.get_parameter(name).data.copy_(back)
    safetensors_torch.save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    keep = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head"]  # fmt: skip
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": keep}
    (folder / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``{form: (folder, reference)}``: plain float32, plain bfloat16 and MXFP4 (float32
    elsewhere) checkpoints and the transformers models holding the same weights."""
    out = {}
    plain = tmp_path_factory.mktemp("gpt_oss_plain")
    model = _model()
    model.save_pretrained(plain)
    out["plain"] = (plain, model)
    bf16 = tmp_path_factory.mktemp("gpt_oss_bf16")
    model = _model().to(torch.bfloat16)
    model.save_pretrained(bf16)
    out["bf16"] = (bf16, model)
    mxfp4 = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    model = _model()
    _write_mxfp4(model, mxfp4)
    out["mxfp4"] = (mxfp4, model)
    return out


def _assert_close(got, want, form):
    atol = ATOL[form] if ATOL[form] is not None else KERNEL_RANGE * want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=0, atol=atol)


@pytest.mark.parametrize("form", ["plain", "bf16", "mxfp4"])
def test_paged_logits_match_transformers(saved, form):
    folder, ref = saved[form]
    model = from_pretrained(folder, budget=BUDGETS[form], page_size_kb=4)
    assert 2 <= model.colibri.pager.capacity < EXPERTS
    ids = token_ids(0, batch=2, length=9)
    assert model.dtype == ref.dtype
    _assert_close(logits(model, ids), logits(ref, ids), form)
    stats = model.colibri.stats
    assert stats.misses > 0 and stats.resident_bytes <= BUDGETS[form]
    greedy = dict(do_sample=False, max_new_tokens=4, pad_token_id=0)
    assert torch.equal(model.generate(ids, **greedy), ref.generate(ids, **greedy))
    # paged as stored: one MXFP4 expert is its blocks and scales, no more
    assert model.colibri.pager.source.max_expert_nbytes == EXPERT_BYTES[form]
    model.colibri.close()


@pytest.mark.parametrize("io", ["read", "view"])
def test_io_backends(saved, io):
    """Each backend places an MXFP4 expert's four ranges (read: one after another in a slot)."""
    folder, ref = saved["mxfp4"]
    model = from_pretrained(folder, budget=BUDGETS["mxfp4"], page_size_kb=4, io=io)
    ids = token_ids(1)
    _assert_close(logits(model, ids), logits(ref, ids), "mxfp4")
    model.colibri.close()


def test_mxfp4_kernel_runs_and_torch_path_stays_exact(saved, monkeypatch):
    """Decode-size MXFP4 experts take the kernel (q8: not transformers' float bits); with
    ``COLIBRI_EXPERT_KERNEL=0`` every expert goes through torch, to rounding."""
    folder, ref = saved["mxfp4"]
    ids = token_ids(1)
    want = logits(ref, ids)
    model = from_pretrained(folder, budget=BUDGETS["mxfp4"], page_size_kb=4)
    kernel = logits(model, ids)
    monkeypatch.setenv("COLIBRI_EXPERT_KERNEL", "0")
    torch_path = logits(model, ids)
    model.colibri.close()
    torch.testing.assert_close(torch_path, want, rtol=0, atol=1e-5)
    assert (kernel - want).abs().max() > 1e-4
    _assert_close(kernel, want, "mxfp4")


def test_colibri_generate(saved, capsys):
    """``colibri generate`` runs the released (MXFP4) form and writes transformers' text."""
    from transformers import AutoTokenizer

    from _support.hf_families import save_tokenizer
    from colibri.__main__ import main

    folder, ref = saved["mxfp4"]
    save_tokenizer(folder)
    code = main(["generate", str(folder), "--budget", str(BUDGETS["mxfp4"]), "--prompt",
                 "hello", "--max-new-tokens", "5", "--page-size-kb", "4"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    tokenizer = AutoTokenizer.from_pretrained(folder)
    out = ref.generate(**tokenizer(["hello"], return_tensors="pt"), do_sample=False,
                       max_new_tokens=5, pad_token_id=0)  # fmt: skip
    assert captured.out.splitlines()[1] == tokenizer.decode(out[0], skip_special_tokens=True)


def test_clamps_are_exercised(saved):
    """The reference's SwiGLU inputs reach past the limit: a wrong clamp would show."""
    _, ref = saved["plain"]
    experts = ref.model.layers[0].mlp.experts
    seen = []
    hook = experts.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    logits(ref, token_ids(0, batch=2, length=9))
    hook.remove()
    with torch.no_grad():
        h = seen[0] @ experts.gate_up_proj[0] + experts.gate_up_proj_bias[0]
    assert (h[:, ::2] > experts.limit).any() and (h[:, 1::2].abs() > experts.limit).any()


def test_dequantize_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = np.random.default_rng(0)
    blocks = gen.integers(0, 256, (3, 8, 2, 16), dtype=np.uint8)
    scales = gen.integers(110, 140, (3, 8, 2), dtype=np.uint8)
    ref = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                     dtype=torch.float32).transpose(1, 2)  # fmt: skip
    for e in range(3):
        got = dequantize_mxfp4(blocks[e], scales[e])
        np.testing.assert_array_equal(got, ref[e].numpy())


def _rewrite(folder, change) -> None:
    tensors = safetensors_torch.load_file(folder / "model.safetensors")
    change(tensors)
    safetensors_torch.save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture
def broken(saved, tmp_path):
    def copy(form):
        folder = tmp_path / form
        shutil.copytree(saved[form][0], folder)
        return folder

    return copy


SCALES = "model.layers.1.mlp.experts.down_proj_scales"


def test_scales_of_the_wrong_shape(broken):
    folder = broken("mxfp4")
    _rewrite(folder, lambda t: t.update({SCALES: t[SCALES][:, :, :1].contiguous()}))
    with pytest.raises(CheckpointError, match=f"{SCALES}.* has shape \\[4, 64, 1\\]"):
        from_pretrained(folder, budget=BUDGET, page_size_kb=4)


def test_missing_scales(broken):
    folder = broken("mxfp4")
    _rewrite(folder, lambda t: t.pop(SCALES))
    with pytest.raises(CheckpointError, match="layer 1 stores gpt-oss experts as .*_blocks"):
        from_pretrained(folder, budget=BUDGET, page_size_kb=4)


def test_scales_of_another_dtype(broken):
    folder = broken("mxfp4")
    _rewrite(folder, lambda t: t.update({SCALES: t[SCALES].float()}))
    with pytest.raises(CheckpointError, match=f"{SCALES}' is F32 .* must be U8"):
        from_pretrained(folder, budget=BUDGET, page_size_kb=4)


@pytest.mark.parametrize("kernel", ["1", "0"])
def test_a_nan_scale_byte_is_an_error_naming_the_expert(broken, monkeypatch, kernel):
    """e8m0's NaN (0xFF) in a scale: the kernel's NaN sums, or torch's dequantization, are
    one FormatError naming the layer, the expert, the tensor, the row and the block."""
    from colibri.formats import FormatError

    folder = broken("mxfp4")

    def nan_scale(t):
        t[SCALES][:, 5, 1] = 0xFF

    _rewrite(folder, nan_scale)
    monkeypatch.setenv("COLIBRI_EXPERT_KERNEL", kernel)
    model = from_pretrained(folder, budget=BUDGETS["mxfp4"], page_size_kb=4)
    match = r"layer 1 expert \d down_proj_scales: the e8m0 scale of row 5, block 1 is 0xFF"
    with pytest.raises(FormatError, match=match):
        logits(model, token_ids(1))
    model.colibri.close()


@pytest.mark.parametrize("form", ["plain", "mxfp4"])
def test_bias_of_the_wrong_shape(broken, form):
    folder = broken(form)
    bias = "model.layers.0.mlp.experts.gate_up_proj_bias"
    _rewrite(folder, lambda t: t.update({bias: t[bias][:, :-2].contiguous()}))
    with pytest.raises(CheckpointError, match=f"{bias}' has shape \\[4, 126\\]"):
        from_pretrained(folder, budget=BUDGET, page_size_kb=4)


def test_blocks_contradicting_config(broken):
    folder = broken("mxfp4")
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 2 * INTER
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"proj_blocks' is \[128, 2, 16\] per expert"):
        from_pretrained(folder, budget=BUDGET, page_size_kb=4)


def test_plain_reader_refuses_mxfp4(saved):
    from colibri.formats import FormatError, open_weights

    with pytest.raises(FormatError, match="holds gpt-oss MXFP4 experts"):
        open_weights(saved["mxfp4"][0] / "model.safetensors")


def test_colibri_quantize_refuses_gpt_oss(saved, tmp_path, capsys):
    """gpt-oss's experts are no gate/up/down matrices: quantize says so before writing."""
    from colibri.__main__ import main

    folder, _ = saved["bf16"]
    code = main(["quantize", str(folder), str(tmp_path / "out"), "--type", "q8_0"])
    err = capsys.readouterr().err
    assert code == 2 and "gpt-oss checkpoint" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()
