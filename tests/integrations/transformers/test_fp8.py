"""float8 checkpoints (DeepSeek-V3 / Qwen3 FP8 layout) through ``from_pretrained``.

A tiny random Qwen3-MoE is saved, then its routed experts (and one attention projection) are
quantized here with torch's float8_e4m3fn, one scale per 128 x 128 block (amax / 448, the
last blocks partial: hidden 160, expert intermediate 136), written as ``weight`` (F8_E4M3)
+ ``weight_scale_inv`` (F32) with config.json's ``quantization_config``. The reference is
transformers' own model loaded from the same weights dequantized to float32. Bounds: float32
(every expert dequantized exactly, as the reference) 1e-5 on the logits; the bfloat16
default (the float8 kernel on float32 rows, the rest of the model in bfloat16) 0.04 (the
reference run by transformers in bfloat16 is 0.006 off).
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")
safetensors_torch = pytest.importorskip("safetensors.torch")

from _support.hf_families import build_model, randomise_routers  # noqa: E402
from colibri import FormatError  # noqa: E402
from colibri.integrations.transformers import (  # noqa: E402
    CheckpointError,
    from_pretrained,
    patch,
    unpatch,
)

QC = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
      "activation_scheme": "dynamic"}  # fmt: skip
QUANTIZED = (".mlp.experts.", ".self_attn.q_proj.weight")


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [r, c]`` as e4m3fn with a float32 scale per 128 x 128 block (amax / 448)."""
    r, c = w.shape
    pad = torch.zeros(-(-r // 128) * 128, -(-c // 128) * 128)
    pad[:r, :c] = w
    blocks = pad.unflatten(0, (-1, 128)).unflatten(2, (-1, 128))  # [R, 128, C, 128]
    scale = blocks.abs().amax(dim=(1, 3)) / 448
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:r, :c]
    return (w / full).to(torch.float8_e4m3fn), scale


def _dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    r, c = q.shape
    return q.float() * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:r, :c]


def _write(folder, edit=None):
    """The float8 checkpoint in ``folder / "fp8"``, its float32 dequantization in ``folder /
    "ref"``; ``edit(tensors, config)`` breaks the float8 one."""
    model = build_model("qwen3_moe", hidden_size=160, moe_intermediate_size=136, head_dim=40)
    randomise_routers(model, [r.name for r in patch(model)])
    unpatch(model)
    model.save_pretrained(folder / "ref")  # per-expert names, as FP8 releases store them
    tensors = safetensors_torch.load_file(folder / "ref" / "model.safetensors")
    fp8, ref = {}, {}
    for name, t in tensors.items():
        if t.ndim == 2 and any(q in name for q in QUANTIZED):
            q, s = _quantize(t)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            ref[name] = _dequantize(q, s)
        else:
            fp8[name] = ref[name] = t
    assert sum(n.endswith("_scale_inv") for n in fp8) > 3 * 8
    config = json.loads((folder / "ref" / "config.json").read_text())
    config["quantization_config"] = dict(QC)
    if edit is not None:
        edit(fp8, config)
    (folder / "fp8").mkdir()
    safetensors_torch.save_file(fp8, folder / "fp8" / "model.safetensors", {"format": "pt"})
    (folder / "fp8" / "config.json").write_text(json.dumps(config))
    safetensors_torch.save_file(ref, folder / "ref" / "model.safetensors", {"format": "pt"})
    return folder / "fp8", folder / "ref"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("fp8"))


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


def test_fp8_matches_dequantized_transformers(saved):
    from transformers import AutoModelForCausalLM

    fp8, ref_dir = saved
    ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    ids = torch.randint(3, 90, (2, 6), generator=torch.Generator().manual_seed(0))
    want = _logits(ref, ids)
    expert = 3 * 160 * 136 + 3 * 4 * 2 * 2  # bytes + three float32 [2, 2] scale tables
    model = from_pretrained(fp8, budget=3 * expert + 16384, page_size_kb=4, dtype="float32")
    torch.testing.assert_close(_logits(model, ids), want, rtol=0, atol=1e-5)
    greedy = dict(do_sample=False, max_new_tokens=5, pad_token_id=0)
    assert torch.equal(model.generate(ids, **greedy), ref.generate(ids, **greedy))
    source = model.colibri.pager.source
    assert source.max_expert_nbytes == expert and model.colibri.stats.misses > 0
    model.colibri.close()
    # the default: bfloat16, decode-size experts in the float8 kernel
    model = from_pretrained(fp8, budget=3 * expert + 16384, page_size_kb=4)
    assert model.dtype == torch.bfloat16
    torch.testing.assert_close(_logits(model, ids), want, rtol=0, atol=0.04)
    model.colibri.close()


def _scale(name):
    return f"model.layers.1.mlp.experts.2.{name}.weight_scale_inv"


HOSTILE = {
    "missing scale": (lambda t, c: t.pop(_scale("up_proj")),
                      r"'model.layers.1.mlp.experts.2.up_proj.weight' has no block-scale tensor"),
    "scale shape": (lambda t, c: t.__setitem__(_scale("down_proj"), torch.ones(1, 2)),
                    r"down_proj.weight_scale_inv' is F32 \[1, 2\] but .* needs F32 or BF16 "
                    r"\[2, 2\]"),
    "e5m2": (lambda t, c: t.__setitem__(
        "model.layers.0.mlp.experts.0.gate_proj.weight",
        t["model.layers.0.mlp.experts.0.gate_proj.weight"].float().to(torch.float8_e5m2)),
        r"is F8_E5M2; colibri computes float8 weights stored as F8_E4M3"),
    "static activations": (lambda t, c: c["quantization_config"].update(
        activation_scheme="static"), r"'quantization_config.activation_scheme' is 'static'"),
    "fmt": (lambda t, c: c["quantization_config"].update(fmt="e5m2"),
            r"'quantization_config.fmt' is 'e5m2'"),
    "block size": (lambda t, c: c["quantization_config"].update(weight_block_size=[64, 64]),
                   r"'quantization_config.weight_block_size' is \[64, 64\]"),
    "resident scale missing": (lambda t, c: t.pop(
        "model.layers.0.self_attn.q_proj.weight_scale_inv"),
        r"'model.layers.0.self_attn.q_proj.weight' has no block-scale tensor"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_checkpoints_refused(tmp_path, case):
    edit, match = HOSTILE[case]
    fp8, _ = _write(tmp_path, edit)
    with pytest.raises(CheckpointError, match=match):
        from_pretrained(fp8, budget="1MiB")


def _corrupt(kind):
    def edit(tensors, config):
        if kind == "nan scale":
            tensors[_scale("gate_proj")][0, 1] = float("nan")
        elif kind == "inf scale":
            tensors[_scale("up_proj")][1, 1] = float("inf")
        else:
            w = tensors["model.layers.1.mlp.experts.2.down_proj.weight"].view(torch.uint8)
            w[5, 7] = 0x7F if kind == "nan byte" else 0xFF

    return edit


@pytest.mark.parametrize(
    "kind, match",
    [("nan scale", r"gate_proj.weight: its block scale .* \[0, 1\] is nan"),
     ("inf scale", r"up_proj.weight: its block scale .* \[1, 1\] is inf"),
     ("nan byte", r"down_proj.weight: its e4m3 byte \[5, 7\] is 0x7F"),
     ("negative nan byte", r"down_proj.weight: its e4m3 byte \[5, 7\] is 0xFF")],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [None, "float32"])
def test_corrupt_expert_values_named(tmp_path, kind, match, dtype):
    """Found when the expert runs (scanning every expert at load would read the whole
    checkpoint): the kernel (bfloat16) and the dequantized path (float32) both name it."""
    fp8, _ = _write(tmp_path, _corrupt(kind))
    model = from_pretrained(fp8, budget="1MiB", dtype=dtype)
    with pytest.raises(FormatError, match="layer 1 expert 2: " + match):
        for token in range(3, 90):  # one row at a time (bfloat16: the kernel) until expert 2
            _logits(model, torch.tensor([[token]]))
    model.colibri.close()
