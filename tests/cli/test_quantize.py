"""``colibri quantize SRC DST --type ...`` end to end on a tiny Qwen3-MoE checkpoint.

The source is written by ``save_pretrained`` (float32, hidden 256 and expert intermediate 256
so that every type's blocks fit, sharded, with a tokenizer). The reference for DST is the
transformers model itself with each expert's weights replaced by DST's blocks as the
``gguf`` package dequantizes them, read with the ``safetensors`` package (not colibri's
reader).
"""

from __future__ import annotations

import copy
import json
import os
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")
gguf = pytest.importorskip("gguf")
safetensors = pytest.importorskip("safetensors")

from _support.hf_families import build_model, save_patched  # noqa: E402
from colibri.__main__ import main  # noqa: E402
from colibri.formats import FormatError  # noqa: E402
from colibri.formats.safetensors import read_header  # noqa: E402
from colibri.integrations.transformers import (  # noqa: E402
    CheckpointError,
    from_pretrained,
    patch,
    unpatch,
)
from colibri.integrations.transformers import _quantize as quantizing  # noqa: E402
from colibri.layer import _quant  # noqa: E402

SIZES = dict(hidden_size=256, moe_intermediate_size=256, num_experts=4, num_experts_per_tok=2)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """``(folder, model)``: the float32 checkpoint and its model, patched (routing as colibri
    routes: the reference's router is the loaded model's)."""
    folder = tmp_path_factory.mktemp("quantize") / "src"
    return folder, save_patched(build_model("qwen3_moe", **SIZES), folder, "400KB")


def _snapshot(folder) -> dict:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def quantized(source, tmp_path_factory):
    """``get(qtype) -> DST``: SRC quantized once per type (SRC checked unchanged after)."""
    folder, _ = source
    done = {}

    def get(qtype):
        if qtype not in done:
            before = _snapshot(folder)
            dst = tmp_path_factory.mktemp("out") / qtype
            assert main(["quantize", str(folder), str(dst), "--type", qtype]) == 0
            assert _snapshot(folder) == before  # SRC: same files, bytes and mtimes
            done[qtype] = dst
        return done[qtype]

    return get


def _dequantized_reference(model, dst, qtype):
    """``model`` with every expert's weights DST's blocks dequantized by gguf-py."""
    from safetensors import safe_open

    ref = copy.deepcopy(model)
    state = ref.state_dict()
    kind = getattr(gguf.GGMLQuantizationType, qtype.upper())
    seen = 0
    for shard in sorted(dst.glob("*.safetensors")):
        with safe_open(shard, "np") as f:
            types = json.loads(f.metadata()["colibri_quantization"])
            for name, stored in types.items():
                assert stored == qtype
                w = torch.from_numpy(gguf.quants.dequantize(f.get_tensor(name), kind))
                prefix, expert, proj = name.rsplit(".", 3)[:3]  # ...experts, E, x_proj
                e, inter = int(expert), w.shape[0] if proj != "down_proj" else w.shape[1]
                with torch.no_grad():
                    if proj == "down_proj":
                        state[f"{prefix}.down_proj"][e].copy_(w)
                    else:
                        rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
                        state[f"{prefix}.gate_up_proj"][e, rows].copy_(w)
                seen += 1
    assert seen == 2 * SIZES["num_experts"] * 3
    return ref


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


@pytest.mark.parametrize("qtype", ["q8_0", "q4_k"])
def test_loads_and_matches_the_dequantized_model(source, quantized, qtype, monkeypatch):
    """float32 (the source's dtype): experts dequantized on use, the reference's logits to
    float32 rounding; bfloat16: decode-size experts in the quantized kernel (activations as
    int8 blocks), the logits of at least 5 of 6 positions within 3% of their span of the
    reference run in bfloat16 (at a near-tie of the router, bfloat16 rounding may pick
    another expert for one token), and generate() runs."""
    folder, model = source
    dst = quantized(qtype)
    ref = _dequantized_reference(model, dst, qtype)
    ids = torch.randint(4, 70, (2, 6), generator=torch.Generator().manual_seed(0))
    loaded = from_pretrained(dst, budget="1MiB", page_size_kb=4)
    try:
        assert loaded.dtype == torch.float32  # the non-expert tensors' dtype
        source_view = loaded.colibri.pager.source
        assert {lay.dtype for lay in source_view.experts.values()} == {qtype}
        per = 256 // _quant.BLOCK[qtype] * _quant.BLOCK_BYTES[qtype] * 256 * 3
        assert loaded.colibri.expert_bytes == 2 * SIZES["num_experts"] * per
        want = _logits(ref, ids)
        torch.testing.assert_close(_logits(loaded, ids), want, rtol=1e-4,
                                   atol=1e-4 * want.abs().max().item())  # fmt: skip
        assert loaded.colibri.stats.misses > 0
    finally:
        loaded.colibri.close()
    kernel_calls = []  # the types the quantized kernel ran: per call, or per held expert
    fused = _quant.ffn_sum
    monkeypatch.setattr(
        _quant, "ffn_sum", lambda *a, **k: kernel_calls.append(a[2]) or fused(*a, **k)
    )

    class Held(_quant.Held):  # the budget holds every expert: their steps run natively
        def hold(self, e, mats, qtype, down_type):
            kernel_calls.append(qtype)
            return super().hold(e, mats, qtype, down_type)

    monkeypatch.setattr(_quant, "Held", Held)
    loaded = from_pretrained(dst, budget="1MiB", page_size_kb=4, dtype=torch.bfloat16)
    try:
        one = ids[:1]
        want, got = _logits(ref.to(torch.bfloat16), one), _logits(loaded, one)
        assert set(kernel_calls) == {qtype}
        per_position = (got - want).abs().amax(-1).flatten()
        assert (per_position < 0.03 * (want.max() - want.min())).sum().item() >= 5
        assert loaded.generate(one, max_new_tokens=3, do_sample=False).shape == (1, 9)
    finally:
        loaded.colibri.close()


def test_generate_command(quantized, capsys):
    dst = quantized("q4_k")
    code = main(["generate", str(dst), "--budget", "1MiB", "--prompt", "abc",
                 "--max-new-tokens", "3", "--page-size-kb", "4", "--no-stream"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.out.splitlines()[1].startswith("abc")


def test_stacked_layout(source, tmp_path):
    """Experts stored stacked (``experts.gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``):
    quantized in place as ``[E, 2I, row_bytes]``; the loaded model matches the reference
    with each stacked tensor dequantized by gguf-py."""
    from safetensors import safe_open

    _, model = source
    ref = unpatched(model)
    _single_file(tmp_path / "src", ref, lambda state: None)
    dst = tmp_path / "out"
    cli = quantizing.quantize_checkpoint(tmp_path / "src", dst, "q6_k")
    assert cli["experts"] == 4 and cli["max_error"] < 0.04
    state = ref.state_dict()
    with safe_open(dst / "model.safetensors", "np") as f:
        for name in json.loads(f.metadata()["colibri_quantization"]):
            blocks = f.get_tensor(name)
            assert blocks.shape[:2] == tuple(state[name].shape[:2])
            w = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q6_K)
            with torch.no_grad():
                state[name].copy_(torch.from_numpy(w))
    patch(ref)
    loaded = from_pretrained(dst, budget="1MiB", page_size_kb=4)
    try:
        ids = torch.randint(4, 70, (1, 5), generator=torch.Generator().manual_seed(1))
        want = _logits(ref, ids)
        torch.testing.assert_close(_logits(loaded, ids), want, rtol=1e-4,
                                   atol=1e-4 * want.abs().max().item())  # fmt: skip
    finally:
        loaded.colibri.close()


def test_the_written_files(source, quantized):
    """Shards valid for the safetensors package, experts U8 blocks of their source's rows,
    every other tensor and file as in SRC, the type in config.json and the index kept."""
    from safetensors import safe_open

    folder, _ = source
    dst = quantized("q8_0")
    assert sorted(p.name for p in dst.iterdir()) == sorted(p.name for p in folder.iterdir())
    for name in ("tokenizer.json", "generation_config.json"):
        assert (dst / name).read_bytes() == (folder / name).read_bytes()
    config = json.loads((dst / "config.json").read_text())
    assert config.pop("colibri_quantization")["type"] == "q8_0"
    assert config == json.loads((folder / "config.json").read_text())
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert (
        index["weight_map"]
        == json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    )
    assert index["metadata"]["total_size"] == sum(
        os.path.getsize(dst / s) - 8 - len(read_raw_header(dst / s))
        for s in set(index["weight_map"].values())
    )
    experts = 0
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(shard, "np") as before, safe_open(dst / shard.name, "np") as after:
            types = json.loads(after.metadata()["colibri_quantization"])
            assert sorted(before.keys()) == sorted(after.keys())
            for name in before.keys():  # noqa: SIM118 (safe_open is no dict)
                x = before.get_tensor(name)
                if name in types:
                    want = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)
                    np.testing.assert_array_equal(after.get_tensor(name), want)
                    experts += 1
                else:
                    np.testing.assert_array_equal(after.get_tensor(name), x)
    assert experts == 24
    # the formats' own opener and the pager serve the blocks as they are stored
    from colibri import Pager
    from colibri.formats import open_weights

    source_view = open_weights(dst / "model.safetensors.index.json")
    assert {layout.dtype for layout in source_view.experts.values()} == {"q8_0"}
    with Pager(source_view, budget_bytes=1 << 20) as pager:
        w = pager.load(1, [3])[3]
        assert (w.dtype, w.gate.dtype, w.gate.shape) == ("q8_0", np.uint8, (256, 8 * 34))
        with safe_open(dst / source_view.layout(1, 3).gate.path, "np") as f:
            np.testing.assert_array_equal(
                w.gate, f.get_tensor("model.layers.1.mlp.experts.3.gate_proj.weight")
            )


def read_raw_header(path) -> bytes:
    data = path.read_bytes()
    return data[8 : 8 + int.from_bytes(data[:8], "little")]


def test_existing_destination(source, quantized, tmp_path, capsys):
    folder, _ = source
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep").write_text("mine")
    assert main(["quantize", str(folder), str(dst), "--type", "q4_0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("colibri: error: ") and "already exists" in err and "--force" in err
    assert (dst / "keep").read_text() == "mine"
    assert main(["quantize", str(folder), str(dst), "--type", "q4_0", "--force"]) == 0
    assert not (dst / "keep").exists() and (dst / "config.json").exists()
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no temporary left beside it
    inside = folder / "q"
    assert main(["quantize", str(folder), str(inside), "--type", "q8_0"]) == 2
    assert "overlap" in capsys.readouterr().err and not inside.exists()


def test_a_crash_leaves_no_destination(source, tmp_path, monkeypatch):
    folder, _ = source
    real = quantizing._write_safetensors
    calls = []

    def failing(*args):
        calls.append(args[0])
        if len(calls) == 3:
            raise OSError("disk full")
        return real(*args)

    monkeypatch.setattr(quantizing, "_write_safetensors", failing)
    with pytest.raises(OSError, match="disk full"):
        quantizing.quantize_checkpoint(folder, tmp_path / "out", "q4_k")
    assert os.listdir(tmp_path) == []


def _single_file(folder, model, edit):
    """``model`` saved as one file after ``edit(state)``."""
    from safetensors.torch import save_file

    model.config.save_pretrained(folder)
    state = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
    edit(state)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})


def test_non_finite_source(source, tmp_path, capsys):
    """NaN in one expert: one line naming the tensor, no DST; the stacked layout too."""
    _, model = source
    src = tmp_path / "src"

    def poison(state):
        state["model.layers.1.mlp.experts.gate_up_proj"][2, 5, 7] = float("nan")

    _single_file(src, unpatched(model), poison)
    assert main(["quantize", str(src), str(tmp_path / "out"), "--type", "q8_0"]) == 2
    err = capsys.readouterr().err
    assert "'model.layers.1.mlp.experts.gate_up_proj'" in err and "NaN or inf" in err
    assert err.count("\n") == 1
    assert sorted(os.listdir(tmp_path)) == ["src"]


def unpatched(model):
    ref = copy.deepcopy(model)
    unpatch(ref)
    return ref


def test_row_length_the_type_cannot_split(tmp_path, capsys):
    model = build_model("qwen3_moe", moe_intermediate_size=32)  # hidden 32
    model.save_pretrained(tmp_path / "src")
    assert main(["quantize", str(tmp_path / "src"), str(tmp_path / "out"), "--type",
                 "q4_k"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "q4_k quantizes rows in blocks of 256 values" in err and "experts" in err
    assert "hold 32" in err and "32-value blocks (q8_0, q4_0, mxfp4)" in err
    assert not (tmp_path / "out").exists()


def test_reader_refuses_bad_quantization_metadata(tmp_path):
    from safetensors.numpy import save_file

    name = "model.layers.0.mlp.experts.0.gate_proj.weight"
    path = tmp_path / "x.safetensors"

    def write(tensors, types):
        save_file(tensors, path, metadata={"colibri_quantization": json.dumps(types)})

    write({name: np.zeros((4, 34), np.uint8)}, {name: "q8_0"})
    info = read_header(str(path))[name]
    assert (info.dtype, info.shape, info.block) == ("Q8_0", (4, 32), (32, 34))
    write({name: np.zeros((4, 35), np.uint8)}, {name: "q8_0"})
    with pytest.raises(FormatError, match="row_bytes a positive multiple of 34"):
        read_header(str(path))
    write({name: np.zeros((4, 34), np.float32)}, {name: "q8_0"})
    with pytest.raises(FormatError, match="must be U8"):
        read_header(str(path))
    write({name: np.zeros((4, 34), np.uint8)}, {name: "q3_k"})
    with pytest.raises(FormatError, match="colibri computes q8_0"):
        read_header(str(path))
    write({name: np.zeros((4, 34), np.uint8)}, {"other": "q8_0"})
    with pytest.raises(FormatError, match="names tensor 'other', which the file lacks"):
        read_header(str(path))


def test_config_says_quantized_but_a_shard_is_not(source, quantized, tmp_path):
    folder, _ = source
    dst = tmp_path / "mixed"
    shutil.copytree(quantized("q8_0"), dst)
    shard = sorted(dst.glob("*.safetensors"))[1]
    shutil.copy(folder / shard.name, shard)
    with pytest.raises(CheckpointError, match="mixes files of two checkpoints"):
        from_pretrained(dst, budget="1MiB")
