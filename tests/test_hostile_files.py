"""Hand-made hostile files for every loader: each is refused with a FormatError (a ColibriError
and a ValueError) naming the file and the key, never a crash, a hang or a silent wrong answer."""

import json
import os
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest

import colibri
from colibri import ColibriError, FormatError, Partition, UsageStats
from colibri.formats import open_weights
from colibri.formats.raw import write_experts
from colibri.pager import Trace

safetensors_numpy = pytest.importorskip("safetensors.numpy")

DEEP = b"[" * 100_000 + b"]" * 100_000
GATE = "model.layers.0.mlp.experts.0.gate_proj.weight"
UP = "model.layers.0.mlp.experts.0.up_proj.weight"
DOWN = "model.layers.0.mlp.experts.0.down_proj.weight"


def entry(begin, end, shape=(2, 2), dtype="F16"):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}


def header_text(pairs):
    """A JSON object from ``(key, raw JSON value)`` pairs, repeated keys kept."""
    return "{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in pairs) + "}"


def good_pairs():
    return [(n, json.dumps(entry(8 * i, 8 * i + 8))) for i, n in enumerate((GATE, UP, DOWN))]


def safetensors_file(path, header, data=bytes(24)):
    blob = header.encode() if isinstance(header, str) else header
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    return path


def refused(call, path, match):
    with pytest.raises(FormatError, match=match) as info:
        call(path)
    assert isinstance(info.value, ColibriError) and isinstance(info.value, ValueError)
    assert os.fspath(path) in str(info.value)
    return info.value


# -- the faults the issue found by hand --------------------------------------------------------


def test_duplicate_tensor_name_is_refused_as_safetensors_does(tmp_path):
    pairs = good_pairs()
    pairs.append((GATE, json.dumps(entry(16, 24))))  # GATE again; json kept the last one
    path = safetensors_file(tmp_path / "dup.safetensors", header_text(pairs))
    with pytest.raises(Exception, match="(?i)duplicate|invalid"):  # the reference refuses too
        safetensors_numpy.load_file(str(path))
    refused(open_weights, path, f"names the key '{GATE}' twice")


def test_dtype_that_is_a_list(tmp_path):
    pairs = good_pairs()
    pairs[0] = (GATE, json.dumps({"dtype": ["F16"], "shape": [2, 2], "data_offsets": [0, 8]}))
    path = safetensors_file(tmp_path / "d.safetensors", header_text(pairs))
    refused(open_weights, path, rf"'{GATE}\.dtype' must be a string \(got a list of 1 items\)")


def _write_deep(kind, tmp_path):
    """A deeply nested document in the place each loader reads JSON from."""
    if kind == "safetensors":
        return open_weights, safetensors_file(tmp_path / "m.safetensors", DEEP)
    if kind == "index":
        (tmp_path / "m.safetensors.index.json").write_bytes(b'{"weight_map": ' + DEEP + b"}")
        return open_weights, tmp_path / "m.safetensors.index.json"
    if kind == "manifest":
        path = write_experts(tmp_path / "x.colibri", {(0, 0): [np.ones((2, 2))] * 3})
        (tmp_path / "x.colibri.json").write_bytes(DEEP)
        return open_weights, path + ".json"
    path = tmp_path / f"{kind}.json"
    path.write_bytes(b'{"format": ' + DEEP + b"}")
    load = {"partition": Partition.load, "stats": UsageStats.load, "trace": Trace.load}[kind]
    return load, path


@pytest.mark.parametrize(
    "kind", ["safetensors", "index", "manifest", "partition", "stats", "trace"]
)
def test_deep_nesting_is_refused_before_parsing(tmp_path, kind):
    load, path = _write_deep(kind, tmp_path)
    refused(load, path, "nests deeper than 32 levels")


# -- every loader: duplicate keys, NaN, size, types ---------------------------------------------


def _good_files(tmp_path):
    """One valid file per loader, as ``(load, path)``."""
    experts = {(0, e): [np.full((2, 3), e, np.float32)] * 2 + [np.ones((3, 2), np.float32)]
               for e in range(2)}  # fmt: skip
    raw = write_experts(tmp_path / "x.colibri", experts)
    safetensors_numpy.save_file(
        {GATE: np.ones((2, 2), np.float16), UP: np.ones((2, 2), np.float16),
         DOWN: np.ones((2, 2), np.float16)}, str(tmp_path / "s.safetensors"),
    )  # fmt: skip
    index = tmp_path / "m.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": dict.fromkeys((GATE, UP, DOWN), "s.safetensors")}))
    Partition([[0, 2], [1]]).save(tmp_path / "p.json")
    UsageStats.from_ids([[0, 1], [1, 2]], 3).save(tmp_path / "u.json")
    Trace([(0, [1, 2]), (1, [0])]).save(tmp_path / "t.json")
    return {
        "manifest": (open_weights, raw + ".json"),
        "index": (open_weights, index),
        "partition": (Partition.load, tmp_path / "p.json"),
        "stats": (UsageStats.load, tmp_path / "u.json"),
        "trace": (Trace.load, tmp_path / "t.json"),
    }


KINDS = ["manifest", "index", "partition", "stats", "trace"]


@pytest.mark.parametrize("kind", KINDS)
def test_good_files_load(tmp_path, kind):
    load, path = _good_files(tmp_path)[kind]
    load(path)


@pytest.mark.parametrize("kind", KINDS)
def test_repeated_top_level_key(tmp_path, kind):
    load, path = _good_files(tmp_path)[kind]
    text = Path(path).read_text().strip()
    key = next(iter(json.loads(text)))
    value = json.dumps(json.loads(text)[key])
    with open(path, "w") as f:  # the same key again, first: json.loads would keep the last
        f.write("{" + json.dumps(key) + ": " + value + ", " + text[1:])
    refused(load, path, f"names the key '{key}' twice")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_non_json_constants(tmp_path, kind, constant):
    load, path = _good_files(tmp_path)[kind]
    text = Path(path).read_text().strip()
    with open(path, "w") as f:
        f.write('{"x": ' + constant + ", " + text[1:])
    refused(load, path, f"not valid JSON .*{constant}")


@pytest.mark.parametrize("kind", KINDS)
def test_oversized_file_is_refused_before_reading(tmp_path, kind):
    load, path = _good_files(tmp_path)[kind]
    with open(path, "r+b") as f:  # sparse: nothing is written, nothing may be read
        f.truncate(colibri._json.MAX_BYTES + 1)
    refused(load, path, "more than the 104857600 allowed")


@pytest.mark.parametrize("kind", KINDS)
def test_huge_number(tmp_path, kind):
    load, path = _good_files(tmp_path)[kind]
    text = Path(path).read_text().strip()
    with open(path, "w") as f:
        f.write('{"x": 1' + "0" * 5000 + ", " + text[1:])
    refused(load, path, "not valid JSON")


# -- types and ranges, each naming its key --------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ([0, 1 << 64], r"data_offsets\[1\]' must be an integer >= 0 that fits in int64"),
        ([0, 8.0], r"data_offsets\[1\]' must be an integer"),
        ([True, 8], r"data_offsets\[0\]' must be an integer"),
        ([0, 8, 16], r"data_offsets' must be a list of exactly 2 items"),
        ("0-8", r"data_offsets' must be a list"),
    ],
)
def test_safetensors_offsets(tmp_path, value, match):
    pairs = good_pairs()
    pairs[0] = (GATE, json.dumps({"dtype": "F16", "shape": [2, 2], "data_offsets": value}))
    refused(open_weights, safetensors_file(tmp_path / "o.safetensors", header_text(pairs)), match)


def test_safetensors_metadata_must_map_strings(tmp_path):
    pairs = [*good_pairs(), ("__metadata__", '{"format": 3}')]
    path = safetensors_file(tmp_path / "m.safetensors", header_text(pairs))
    with pytest.raises(Exception):  # noqa: B017 - the reference refuses it as well
        safetensors_numpy.load_file(str(path))
    refused(open_weights, path, r"'__metadata__\.format' must be a string")


def test_empty_stacked_tensor_does_not_loop(tmp_path):
    """[2**40, 0, 4] holds 0 bytes, so its length checks out; splitting it was 2**40 steps."""
    name = "model.layers.0.mlp.experts.gate_up_proj"
    header = header_text([(name, json.dumps(entry(0, 0, shape=(1 << 40, 0, 4))))])
    path = safetensors_file(tmp_path / "e.safetensors", header, b"")
    refused(open_weights, path, "must be 3-D .* and not empty")


def test_absurd_layer_index_in_a_tensor_name(tmp_path):
    name = "model.layers." + "9" * 5000 + ".mlp.experts.0.gate_proj.weight"
    pairs = good_pairs()
    pairs[0] = (name, pairs[0][1])
    refused(open_weights, safetensors_file(tmp_path / "n.safetensors", header_text(pairs)),
            "more than the 2147483647 allowed")  # fmt: skip


@pytest.mark.parametrize("shard", ["", ".", "..", "a\x00b", "sub/s.safetensors", "/etc/passwd", 3])
def test_index_shard_names(tmp_path, shard):
    path = tmp_path / "m.safetensors.index.json"
    path.write_text(json.dumps({"weight_map": {GATE: shard}}))
    refused(open_weights, path, "must be a plain file name in the index's folder")


def test_trace_steps_must_be_integers(tmp_path):
    path = tmp_path / "t.json"
    for steps, match in [
        ([[1.7, [0]]], r"'steps\[0\]\[0\]' must be an integer"),  # int(1.7) read layer 1
        ([["3", [0]]], r"'steps\[0\]\[0\]' must be an integer"),
        ([[0, [True]]], r"'steps\[0\]\[1\]\[0\]' must be an integer"),
        ([[0, [-1]]], r"'steps\[0\]\[1\]\[0\]' must be an integer in \[0, 2147483647\]"),
        ([[0, [0], 5]], r"'steps\[0\]' must be a list of exactly 2 items"),
    ]:
        path.write_text(json.dumps({"steps": steps}))
        refused(Trace.load, path, match)


def test_partition_num_experts_is_checked_before_allocating(tmp_path):
    path = tmp_path / "p.json"
    document = {"format": "colibri.Partition", "version": 1, "num_experts": 10**12}
    path.write_text(json.dumps({**document, "groups": [[0], [1]]}))
    refused(Partition.load, path, "'num_experts' is 1000000000000 but the groups list 2")


def test_manifest_field_types(tmp_path):
    path = write_experts(tmp_path / "x.colibri", {(0, 0): [np.ones((2, 2))] * 3})
    manifest = json.loads(Path(path + ".json").read_text())
    cases = [
        (("experts", 0, "layer"), "0", r"'experts\[0\]\.layer' must be an integer"),
        (("experts", 0, "expert"), 1 << 40, r"'experts\[0\]\.expert' must be an integer in"),
        (("experts", 0, "matrices", "up", "shape"), [2, 2, 1], r"up\.shape' must be a list of"),
        (("experts", 0, "matrices", "up", "dtype"), "q4;rm", r"up\.dtype' must be a"),
        (("data_bytes",), 1.5e3, r"'data_bytes' must be an integer"),
        (("experts",), {}, r"'experts' must be a list"),
    ]
    for keys, value, match in cases:
        bad = json.loads(json.dumps(manifest))
        node = bad
        for key in keys[:-1]:
            node = node[key]
        node[keys[-1]] = value
        with open(path + ".json", "w") as f:
            json.dump(bad, f)
        refused(open_weights, path + ".json", match)


def test_npz_member_claiming_more_than_it_holds(tmp_path):
    """An .npy header of int64 [2**40] over 8 bytes: np.load would allocate 8 TiB first."""
    good = tmp_path / "good.npz"
    UsageStats.from_ids([[0, 1]], 2).save(good)
    header = {"descr": "<i8", "fortran_order": False, "shape": (1 << 40,)}
    bad = tmp_path / "bad.npz"
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(bad, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename == "counts.npy":
                with dst.open("counts.npy", "w") as member:
                    np.lib.format.write_array_header_1_0(member, header)
                    member.write(bytes(8))
                continue
            dst.writestr(info, data)
    refused(UsageStats.load, bad, "declares int64 .1099511627776.")


def test_npz_with_objects_is_refused(tmp_path):
    bad = tmp_path / "o.npz"
    np.savez(bad, counts=np.array([1, None], dtype=object))
    refused(UsageStats.load, bad, "objects")


# -- a transformers checkpoint's config.json -------------------------------------------------

# a qwen3_moe-like config with the layer-frequency fields of qwen (decoder_sparse_step,
# mlp_only_layers) and deepseek (first_k_dense_replace, n_group, topk_group)
CONFIG = {
    "model_type": "qwen3_moe", "num_hidden_layers": 4, "hidden_size": 32,
    "intermediate_size": 48, "moe_intermediate_size": 24, "num_experts": 8,
    "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [0],
    "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "dtype": "bfloat16",
    "text_config": None,
}  # fmt: skip


def _checkpoint_dir(tmp_path, config_text):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(config_text)
    return folder


def _open_checkpoint(config_path):
    """Open the checkpoint directory that holds ``config_path``."""
    from colibri.integrations.transformers._checkpoint import Checkpoint

    return Checkpoint(config_path.parent)


def test_a_good_config_passes_to_the_weights(tmp_path):
    folder = _checkpoint_dir(tmp_path, json.dumps(CONFIG))
    with pytest.raises(FormatError, match="neither model.safetensors"):  # next check: weights
        _open_checkpoint(folder / "config.json")


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"num_experts": "8"}, r"'num_experts' must be an integer in \[1, 65536\].*got '8'"),
        ({"num_experts": 0}, r"'num_experts' must be an integer in \[1, 65536\]"),
        ({"num_experts": True}, r"'num_experts' must be an integer.*got True"),
        ({"num_experts_per_tok": 9}, r"'num_experts_per_tok' must be an integer in \[1, 8\]"),
        ({"num_experts_per_tok": 2.0}, r"'num_experts_per_tok' must be an integer"),
        ({"hidden_size": -32}, r"'hidden_size' must be an integer in \[1, 1048576\]"),
        ({"moe_intermediate_size": 1 << 40}, r"'moe_intermediate_size' must be an integer in"),
        ({"num_hidden_layers": 10**30}, r"'num_hidden_layers' must be an integer in \[1, 16384\]"),
        ({"decoder_sparse_step": 0}, r"'decoder_sparse_step' must be an integer in \[1, 4\]"),
        ({"mlp_only_layers": [4]}, r"'mlp_only_layers\[0\]' must be an integer in \[0, 3\]"),
        ({"mlp_only_layers": "0"}, r"'mlp_only_layers' must be a list"),
        ({"first_k_dense_replace": 5}, r"'first_k_dense_replace' must be an integer in \[0, 4\]"),
        ({"topk_group": 3}, r"'topk_group' must be an integer in \[1, 2\]"),
        ({"n_group": 9}, r"'n_group' must be an integer in \[1, 8\]"),
        ({"dtype": "float128"}, r"'dtype' must be null or one of float32, .*got 'float128'"),
        ({"torch_dtype": ["bfloat16"]}, r"'torch_dtype' must be null or one of"),
        ({"model_type": 7}, r"'model_type' must be a string"),
        ({"text_config": {"num_experts": -1}}, r"'text_config\.num_experts' must be an integer"),
        ({"text_config": [1]}, r"'text_config' must be an object"),
    ],
    ids=lambda v: json.dumps(v)[:40] if isinstance(v, dict) else None,
)
def test_config_fields_are_checked_before_use(tmp_path, change, match):
    folder = _checkpoint_dir(tmp_path, json.dumps({**CONFIG, **change}))
    refused(_open_checkpoint, folder / "config.json", match)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('{"model_type": "qwen3_moe", "num_experts": 8, "num_experts": 64}',
         "names the key 'num_experts' twice"),
        ('{"model_type": "qwen3_moe", "rope_scaling": ' + "[" * 40 + "]" * 40 + "}",
         "nests deeper than"),
        ('{"model_type": "qwen3_moe", "hidden_size": NaN}', "not valid JSON"),
        ('{"model_type": "qwen3_moe", "hidden_size": 1' + "0" * 5000 + "}", "not valid JSON"),
        ("\xff", "not UTF-8|not valid JSON"),
        ('{"hidden_size": 32}', "has no 'model_type'"),
    ],
    ids=["duplicate-key", "deep", "nan", "huge-int", "not-utf8", "no-model-type"],
)  # fmt: skip
def test_config_json_is_read_strictly(tmp_path, text, match):
    folder = _checkpoint_dir(tmp_path, text)
    refused(_open_checkpoint, folder / "config.json", match)


def test_config_json_size_is_bounded(tmp_path):
    folder = _checkpoint_dir(tmp_path, json.dumps(CONFIG))
    with open(folder / "config.json", "ab") as f:
        f.truncate((16 << 20) + 1)
    refused(_open_checkpoint, folder / "config.json", "more than")


def test_every_families_saved_config_passes(tmp_path):
    """No false alarm: the config.json transformers saves for each tested family is accepted."""
    pytest.importorskip("transformers")
    from _support.hf_families import FAMILIES, MORE_FAMILIES, build_model
    from colibri.integrations.transformers._checkpoint import check_config

    for family in [*FAMILIES, *MORE_FAMILIES]:
        folder = tmp_path / family
        build_model(family).config.save_pretrained(folder)
        config = check_config(str(folder / "config.json"))
        assert (
            config["model_type"] == json.loads((folder / "config.json").read_text())["model_type"]
        )


def test_checkpoint_index_with_a_repeated_tensor_is_refused(tmp_path):
    folder = _checkpoint_dir(tmp_path, json.dumps(CONFIG))
    (folder / "a.safetensors").write_bytes(b"")
    index = folder / "model.safetensors.index.json"
    shards = header_text([(GATE, '"a.safetensors"'), (GATE, '"b.safetensors"')])
    index.write_text(header_text([("weight_map", shards)]))  # json kept b, which is missing
    refused(lambda p: _open_checkpoint(p.parent / "config.json"), index, "names the key .* twice")


def test_npz_member_marked_encrypted(tmp_path):
    """A flipped flag bit in the central directory: zipfile asks for a password with a
    RuntimeError (found by test_stats_load_long, 1 run in 13)."""
    path = tmp_path / "u.npz"
    UsageStats.from_ids([[0, 1], [1, 2]], 3).save(path)
    data = bytearray(path.read_bytes())
    entry = data.rindex(b"PK\x01\x02", 0, data.rindex(b"counts.npy"))  # its central entry
    data[entry + 8] |= 0x1  # general purpose flags: bit 0, encrypted
    path.write_bytes(bytes(data))
    refused(UsageStats.load, path, "member 'counts.npy' is marked encrypted")


@pytest.mark.parametrize("count", [1 << 56, 1 << 20])
def test_gguf_array_count_past_the_end_is_refused_at_once(tmp_path, count):
    # gguf's reader loops over an array's count element by element, one empty part for each
    # past the end of the file: 2**56 ran for ever and filled memory (19 GB in a CI run)
    gguf = pytest.importorskip("gguf")
    path = str(tmp_path / "m.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_array("colibri.list", [7, 8, 9])
    w.add_tensor("blk.0.ffn_gate_exps.weight", np.ones((2, 3, 4), np.float32))
    w.add_tensor("blk.0.ffn_up_exps.weight", np.ones((2, 3, 4), np.float32))
    w.add_tensor("blk.0.ffn_down_exps.weight", np.ones((2, 4, 3), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert len(open_weights(path).experts) == 2  # the array is read as it is
    data = bytearray(Path(path).read_bytes())
    header = struct.pack("<IQ", 5, 3)  # the int32 array of 3 items
    at = data.index(header, data.index(b"colibri.list"))
    data[at + 4 : at + 12] = struct.pack("<Q", count)
    Path(path).write_bytes(bytes(data))
    with pytest.raises(FormatError, match=f"an array of {count} items .* bytes left"):
        open_weights(path)
