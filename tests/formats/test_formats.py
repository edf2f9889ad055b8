"""Expert weight formats: layouts against reference writers, and adversarial headers."""

import json
import os
import struct

import numpy as np
import pytest

from colibri.formats import FormatError, open_weights
from colibri.formats.raw import write_experts
from colibri.pager import Pager

safetensors_numpy = pytest.importorskip("safetensors.numpy")
gguf = pytest.importorskip("gguf")

L, E, I, H = 2, 4, 8, 6
RNG = np.random.default_rng(7)
GATE = RNG.standard_normal((L, E, I, H)).astype(np.float16)
UP = RNG.standard_normal((L, E, I, H)).astype(np.float16)
DOWN = RNG.standard_normal((L, E, H, I)).astype(np.float16)


def read_all(source):
    """Every expert's matrices through a Pager big enough to hold one expert at a time."""
    out = {}
    with Pager(source, budget_bytes=1 << 20, page_size_kb=4) as pager:
        for layer, e in sorted(pager.source.experts):
            with pager.load(layer, [e]) as batch:
                w = batch[e]
                out[(layer, e)] = (w.gate.copy(), w.up.copy(), w.down.copy())
    return out


def assert_matches_reference(got):
    assert sorted(got) == [(lay, e) for lay in range(L) for e in range(E)]
    for (lay, e), (g, u, d) in got.items():
        np.testing.assert_array_equal(g, GATE[lay, e])
        np.testing.assert_array_equal(u, UP[lay, e])
        np.testing.assert_array_equal(d, DOWN[lay, e])


def test_safetensors_per_expert_mixtral_names(tmp_path):
    tensors = {"model.embed_tokens.weight": np.zeros((3, H), np.float16)}
    for lay in range(L):
        for e in range(E):
            p = f"model.layers.{lay}.block_sparse_moe.experts.{e}"
            tensors[f"{p}.w1.weight"] = GATE[lay, e]
            tensors[f"{p}.w3.weight"] = UP[lay, e]
            tensors[f"{p}.w2.weight"] = DOWN[lay, e]
        tensors[f"model.layers.{lay}.block_sparse_moe.gate.weight"] = np.zeros((E, H), np.float16)
    path = tmp_path / "m.safetensors"
    safetensors_numpy.save_file(tensors, str(path))
    src = open_weights(path)
    assert src.format == "safetensors" and src.layers == (0, 1) and src.num_experts(0) == E
    assert_matches_reference(read_all(src))


def test_safetensors_stacked_transformers_v5(tmp_path):
    torch = pytest.importorskip("torch")
    tensors = {}
    for lay in range(L):
        p = f"model.layers.{lay}.mlp.experts"
        tensors[f"{p}.gate_up_proj"] = np.concatenate([GATE[lay], UP[lay]], axis=1)  # [E, 2I, H]
        tensors[f"{p}.down_proj"] = DOWN[lay]  # [E, H, I]
        tensors[f"model.layers.{lay}.mlp.shared_expert.gate_proj.weight"] = GATE[lay, 0]
    path = tmp_path / "v5.safetensors"
    safetensors_numpy.save_file(tensors, str(path))
    got = read_all(path)
    assert_matches_reference(got)
    # Reference: transformers v5 splits the fused projection with .chunk(2, dim=-1).
    x = torch.randn(3, H, dtype=torch.float32)
    gu = torch.from_numpy(tensors["model.layers.1.mlp.experts.gate_up_proj"][2]).float()
    gate_ref, up_ref = torch.nn.functional.linear(x, gu).chunk(2, dim=-1)
    g, u, _ = got[(1, 2)]
    np.testing.assert_allclose(x.numpy() @ g.astype(np.float32).T, gate_ref.numpy(), rtol=1e-5)
    np.testing.assert_allclose(x.numpy() @ u.astype(np.float32).T, up_ref.numpy(), rtol=1e-5)


def test_sharded_safetensors_with_index(tmp_path):
    weight_map = {}
    for lay in range(L):
        shard = f"model-{lay + 1:05d}-of-00002.safetensors"
        tensors = {}
        for e in range(E):
            p = f"model.layers.{lay}.mlp.experts.{e}"
            tensors.update(
                {f"{p}.gate_proj.weight": GATE[lay, e], f"{p}.up_proj.weight": UP[lay, e],
                 f"{p}.down_proj.weight": DOWN[lay, e]}
            )  # fmt: skip
        safetensors_numpy.save_file(tensors, str(tmp_path / shard))
        weight_map.update(dict.fromkeys(tensors, shard))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    src = open_weights(index)
    assert len(src.files) == 2
    assert_matches_reference(read_all(src))

    weight_map[next(iter(weight_map))] = "../escape.safetensors"
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(FormatError, match="must be a plain file name"):
        open_weights(index)


def write_gguf(path, fused=False, quantize=None):
    w = gguf.GGUFWriter(str(path), "llama")
    for lay in range(L):
        if fused:
            w.add_tensor(
                f"blk.{lay}.ffn_gate_up_exps.weight", np.concatenate([GATE[lay], UP[lay]], 1)
            )
        else:
            w.add_tensor(f"blk.{lay}.ffn_gate_exps.weight", GATE[lay])
            w.add_tensor(f"blk.{lay}.ffn_up_exps.weight", UP[lay])
        w.add_tensor(f"blk.{lay}.ffn_down_exps.weight", DOWN[lay])
        w.add_tensor(f"blk.{lay}.ffn_gate_inp.weight", np.zeros((E, H), np.float32))
    if quantize is not None:
        q = gguf.quants.quantize(quantize, gguf.GGMLQuantizationType.Q8_0)
        w.add_tensor("blk.9.ffn_gate_exps.weight", q, raw_shape=quantize.shape,
                     raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # fmt: skip
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("fused", [False, True])
def test_gguf_stacked_experts(tmp_path, fused):
    path = tmp_path / "m.gguf"
    write_gguf(path, fused=fused)
    src = open_weights(path)
    assert src.format == "gguf"
    assert_matches_reference(read_all(src))


def test_gguf_quantized_experts_are_raw_blocks(tmp_path):
    stacked = RNG.standard_normal((E, 32, 64)).astype(np.float32)
    path = tmp_path / "q.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    qtype = gguf.GGMLQuantizationType.Q8_0
    down = RNG.standard_normal((E, 64, 32)).astype(np.float32)
    for name, arr in (("gate", stacked), ("up", stacked), ("down", down)):
        w.add_tensor(f"blk.0.ffn_{name}_exps.weight", gguf.quants.quantize(arr, qtype),
                     raw_dtype=qtype)  # fmt: skip
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    src = open_weights(path)
    layout = src.layout(0, 3)
    assert layout.gate.dtype == "Q8_0" and layout.gate.shape == (32, 64)
    assert layout.down.shape == (64, 32)
    with Pager(src, budget_bytes=1 << 20, page_size_kb=4) as pager, pager.load(0, [3]) as b:
        expected = gguf.quants.quantize(stacked[3], qtype)  # uint8 [I, row_bytes]
        np.testing.assert_array_equal(b[3].gate, expected)
        np.testing.assert_allclose(gguf.quants.dequantize(b[3].up, qtype), stacked[3], atol=0.05)


def test_raw_round_trip_and_refuses_overwrite(tmp_path):
    experts = {
        (lay, e): (GATE[lay, e], UP[lay, e], DOWN[lay, e]) for lay in range(L) for e in range(E)
    }
    path = write_experts(tmp_path / "x.colibri", experts, metadata={"note": "hi"})
    src = open_weights(path)
    assert src.format == "colibri-raw" and src.metadata == {"note": "hi"}
    assert all(lay.gate.offset % 4096 == 0 for lay in src.experts.values())
    assert open_weights(path + ".json").experts == src.experts
    assert_matches_reference(read_all(path))
    with pytest.raises(FileExistsError, match="overwrite=True"):
        write_experts(tmp_path / "x.colibri", experts)
    write_experts(tmp_path / "x.colibri", experts, overwrite=True)


def test_raw_overwrite_alternates_data_names_and_open_sweeps_the_stale_one(tmp_path):
    experts = {
        (lay, e): (GATE[lay, e], UP[lay, e], DOWN[lay, e]) for lay in range(L) for e in range(E)
    }
    names = lambda: sorted(p.name for p in tmp_path.iterdir())  # noqa: E731
    path = write_experts(tmp_path / "x.colibri", experts)
    assert names() == ["x.colibri", "x.colibri.json"]
    write_experts(path, experts, overwrite=True)  # the previous data stays until the commit
    assert names() == ["x.colibri.alt", "x.colibri.json"]
    assert open_weights(path).files == (path + ".alt",)
    assert_matches_reference(read_all(path))
    write_experts(path, experts, overwrite=True)
    assert names() == ["x.colibri", "x.colibri.json"]
    (tmp_path / "x.colibri.alt").write_bytes(b"left by a write killed before its commit")
    assert open_weights(path).files == (path,)
    assert names() == ["x.colibri", "x.colibri.json"]  # the open removed the unnamed data
    manifest = json.loads((tmp_path / "x.colibri.json").read_text())
    os.rename(path, tmp_path / "other.bin")
    (tmp_path / "x.colibri").write_bytes(b"a user's own file")
    manifest["data"] = "other.bin"  # a manifest RawWriter did not write: nothing is removed
    (tmp_path / "x.colibri.json").write_text(json.dumps(manifest))
    assert open_weights(path + ".json").files == (str(tmp_path / "other.bin"),)
    assert names() == ["other.bin", "x.colibri", "x.colibri.json"]


def test_raw_writer_never_clobbers_a_manifest_that_appears_while_writing(tmp_path):
    from colibri.formats.raw import RawWriter

    writer = RawWriter(tmp_path / "y.colibri")
    writer.add(0, 0, [("F32", (2, 2), np.ones((2, 2), np.float32))] * 3)
    (tmp_path / "y.colibri.json").write_text("someone else's")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        writer.commit()
    assert (tmp_path / "y.colibri.json").read_text() == "someone else's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["y.colibri.json"]  # no data, no temps


# -- adversarial files -------------------------------------------------------------------------


def raw_safetensors(path, header, data=b"", length=None):
    blob = json.dumps(header).encode() if not isinstance(header, bytes) else header
    n = len(blob) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + blob + data)
    return path


def entry(offsets, shape=(2, 2), dtype="F16"):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def good_header():
    return {
        "model.layers.0.mlp.experts.0.gate_proj.weight": entry([0, 8]),
        "model.layers.0.mlp.experts.0.up_proj.weight": entry([8, 16]),
        "model.layers.0.mlp.experts.0.down_proj.weight": entry([16, 24]),
    }


def test_handcrafted_safetensors_is_valid(tmp_path):
    src = open_weights(raw_safetensors(tmp_path / "ok.safetensors", good_header(), bytes(24)))
    assert src.layout(0, 0).nbytes == 24


@pytest.mark.parametrize(
    ("mutate", "data", "match"),
    [
        (lambda h: h, bytes(10), "inside the data section"),  # truncated data
        (lambda h: h["model.layers.0.mlp.experts.0.up_proj.weight"].update(data_offsets=[4, 12]),
         bytes(24), "overlap"),
        (lambda h: h["model.layers.0.mlp.experts.0.down_proj.weight"].update(
            data_offsets=[1 << 40, (1 << 40) + 8]), bytes(24), "inside the data section"),
        (lambda h: h["model.layers.0.mlp.experts.0.gate_proj.weight"].update(dtype="F32"),
         bytes(24), "needs 16"),
        (lambda h: h["model.layers.0.mlp.experts.0.gate_proj.weight"].update(dtype="Q9"),
         bytes(24), "dtype' must be one of F64"),
        (lambda h: h["model.layers.0.mlp.experts.0.gate_proj.weight"].update(shape=[-2, 2]),
         bytes(24), r"shape\[0\]' must be an integer >= 0"),
        (lambda h: h["model.layers.0.mlp.experts.0.gate_proj.weight"].update(
            data_offsets=[8, 0]), bytes(24), "begin <= end"),
        (lambda h: h.pop("model.layers.0.mlp.experts.0.down_proj.weight"), bytes(16),
         "lacks its down"),
        (lambda h: h, bytes(25), "without holes"),  # a byte after the last tensor
    ],
)  # fmt: skip
def test_corrupt_safetensors_headers(tmp_path, mutate, data, match):
    header = good_header()
    mutate(header)
    path = raw_safetensors(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(FormatError, match=match) as info:
        open_weights(path)
    assert str(path) in str(info.value)


def test_corrupt_header_names_the_tensor(tmp_path):
    header = good_header()
    header["model.layers.0.mlp.experts.0.up_proj.weight"]["dtype"] = "F64"
    path = raw_safetensors(tmp_path / "bad.safetensors", header, bytes(24))
    with pytest.raises(FormatError, match=r"experts\.0\.up_proj\.weight"):
        open_weights(path)


def test_header_length_past_eof(tmp_path):
    path = raw_safetensors(tmp_path / "a.safetensors", good_header(), bytes(24), length=10_000)
    with pytest.raises(FormatError, match="truncated"):
        open_weights(path)


def test_huge_header_is_refused_before_reading(tmp_path):
    path = raw_safetensors(tmp_path / "a.safetensors", good_header(), bytes(24), length=1 << 62)
    with pytest.raises(FormatError, match="more than the"):
        open_weights(path)


@pytest.mark.parametrize("blob", [b"\xff\xfe not json", b"[1, 2, 3]", b'{"a": 1'])
def test_non_json_header(tmp_path, blob):
    path = raw_safetensors(tmp_path / "a.safetensors", blob, bytes(8))
    with pytest.raises(FormatError, match="JSON|must be an object"):
        open_weights(path)


def test_too_short_file(tmp_path):
    (tmp_path / "a.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(FormatError, match="too short"):
        open_weights(tmp_path / "a.safetensors")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_weights(tmp_path / "missing.safetensors")


def test_truncated_gguf(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path)
    data = path.read_bytes()
    for cut in (30, len(data) // 3, len(data) - 5):
        (tmp_path / "t.gguf").write_bytes(data[:cut])
        with pytest.raises(FormatError, match="t.gguf"):
            open_weights(tmp_path / "t.gguf")


def test_gguf_absurd_counts(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1 << 60, 0) + bytes(64))
    with pytest.raises(FormatError, match="more than"):
        open_weights(path)


def test_raw_manifest_attacks(tmp_path):
    experts = {(0, e): (GATE[0, e], UP[0, e], DOWN[0, e]) for e in range(E)}
    path = write_experts(tmp_path / "x.colibri", experts)
    with open(path, "r+b") as f:  # truncated data file
        f.truncate(os.path.getsize(path) - 1)
    with pytest.raises(FormatError, match="truncated"):
        open_weights(path)
    write_experts(tmp_path / "x.colibri", experts, overwrite=True)  # its data: x.colibri.alt
    with open(path + ".json") as f:
        manifest = json.load(f)

    def attempt(m, match):
        (tmp_path / "x.colibri.json").write_text(json.dumps(m))
        with pytest.raises(FormatError, match=match):
            open_weights(path)

    bad = json.loads(json.dumps(manifest))
    bad["experts"][1]["matrices"]["gate"]["offset"] = 0
    attempt(bad, "overlap")
    bad = json.loads(json.dumps(manifest))
    bad["experts"][0]["matrices"]["up"]["nbytes"] += 2
    attempt(bad, "needs")
    bad = json.loads(json.dumps(manifest))
    bad["data"] = "../../etc/passwd"
    attempt(bad, "file name next to the manifest")
    bad = json.loads(json.dumps(manifest))
    bad["experts"][0]["matrices"]["down"]["offset"] = -5
    attempt(bad, r"'experts\[0\]\.matrices\.down\.offset' must be an integer >= 0")
    (tmp_path / "x.colibri.json").write_bytes(b"\x00garbage")
    with pytest.raises(FormatError, match="not valid JSON"):
        open_weights(path)
