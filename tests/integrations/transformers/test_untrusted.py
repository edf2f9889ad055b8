"""A checkpoint directory is untrusted input to ``from_pretrained``.

Which files are the model is decided as transformers decides it (its ``from_pretrained`` on
the same directory is the reference); anything else there (a colibri raw manifest, a FIFO,
a device, a directory under a file's name) is ignored or refused by type, never opened
blocking, and nothing in the directory is ever written, renamed or deleted: every case runs
inside :func:`untouched`, which compares the directory's names, types, bytes and mtimes
before and after. No code of the checkpoint runs, stdin is never read, and sizes are checked
against config.json from the headers before anything is built.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("safetensors")

from _support.hf_families import build_model, logits, randomise_routers, token_ids  # noqa: E402
from colibri._regular import MissingFileError, check_regular, read_regular  # noqa: E402
from colibri.integrations.transformers import (  # noqa: E402
    CheckpointError,
    UnsupportedCheckpointError,
    from_pretrained,
    patch,
    unpatch,
)

BUDGET = "1GiB"


def _snapshot(folder) -> dict:
    """Every entry under ``folder``: its type, mtime and (for files) its bytes."""
    found = {}
    for root, dirs, files in os.walk(folder):
        for name in sorted(dirs + files):
            path = os.path.join(root, name)
            st = os.lstat(path)
            data = None
            if os.path.isfile(path) and not os.path.islink(path):
                with open(path, "rb") as f:
                    data = f.read()
            elif os.path.islink(path):
                data = os.readlink(path)
            found[os.path.relpath(path, folder)] = (st.st_mode, st.st_mtime_ns, data)
    return found


@contextlib.contextmanager
def untouched(folder):
    """Assert that nothing under ``folder`` is created, changed, renamed or deleted."""
    before = _snapshot(folder)
    try:
        yield
    finally:
        assert _snapshot(folder) == before, "the checkpoint directory was modified"


@contextlib.contextmanager
def no_hang(seconds: int = 30):
    """Turn a blocking open (a FIFO read with no writer) into a test failure, not a hang."""

    def fail(*_):
        raise AssertionError("blocked: a FIFO was opened for reading")

    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _reference(model):
    randomise_routers(model, [r.name for r in patch(model)])
    unpatch(model)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Tiny mixtral checkpoints: one file (``single``) and sharded (``sharded``, other
    weights)."""
    root = tmp_path_factory.mktemp("untrusted")
    single = _reference(build_model("mixtral"))
    single.save_pretrained(root / "single")
    other = build_model("mixtral")
    with torch.no_grad():
        gen = torch.Generator().manual_seed(5)
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    other = _reference(other)
    other.save_pretrained(root / "sharded", max_shard_size="20KB")
    return root


@pytest.fixture
def ckpt(saved, tmp_path):
    """A fresh copy of a saved checkpoint: ``ckpt("single")``."""

    def copy(name: str = "single"):
        target = tmp_path / name
        shutil.copytree(saved / name, target)
        return target

    return copy


def _transformers_logits(folder, ids):
    """What transformers itself loads from ``folder``, run on ``ids``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=False)
    with torch.no_grad():
        return model(ids).logits


# -- 1. which files are the model: transformers' choice, nothing ever deleted ----------------


def test_stray_raw_manifest_is_ignored_and_nothing_is_deleted(ckpt, tmp_path):
    """A colibri raw manifest ``model.safetensors.json`` naming other experts: transformers
    ignores it, so colibri does; the old loader served its experts and deleted
    ``model.safetensors``."""
    from colibri.formats import open_weights
    from colibri.formats.raw import write_experts

    folder = ckpt("single")
    source = open_weights(folder / "model.safetensors")
    rng = np.random.default_rng(0)
    other = {
        key: tuple(rng.standard_normal(r.shape).astype(np.float32) for r in layout.matrices)
        for key, layout in source.experts.items()
    }
    stray = tmp_path / "stray"
    stray.mkdir()
    write_experts(stray / "model.safetensors", other)
    manifest = json.loads((stray / "model.safetensors.json").read_text())
    manifest["data"] = "model.safetensors.alt"
    (folder / "model.safetensors.json").write_text(json.dumps(manifest))
    shutil.copy(stray / "model.safetensors", folder / "model.safetensors.alt")
    ids = token_ids(length=5)
    with untouched(folder):
        model = from_pretrained(folder, budget=BUDGET, page_size_kb=4)
        got = logits(model, ids)
        model.colibri.close()
    torch.testing.assert_close(got, _transformers_logits(folder, ids), rtol=0, atol=1e-5)


def test_single_file_wins_over_an_index(ckpt):
    """``model.safetensors`` and an index with other shards: transformers loads the single
    file, so colibri serves it (the old loader served the index's shards)."""
    folder = ckpt("single")
    sharded = ckpt("sharded")
    for name in os.listdir(sharded):
        if name.startswith("model-") or name.endswith(".index.json"):
            shutil.copy(sharded / name, folder / name)
    ids = token_ids(length=5, seed=1)
    with untouched(folder):
        model = from_pretrained(folder, budget=BUDGET, page_size_kb=4)
        got = logits(model, ids)
    want = _transformers_logits(folder, ids)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert not torch.allclose(want, _transformers_logits(sharded, ids), atol=1e-3)


def test_transformers_weights_in_config_names_the_file(ckpt):
    """config.json's ``transformers_weights`` picks the file, as in transformers; a name
    outside the directory or of another kind is refused as transformers refuses it."""
    folder = ckpt("single")
    sharded = ckpt("sharded")
    for name in os.listdir(sharded):
        if name.startswith("model-") or name.endswith(".index.json"):
            shutil.copy(sharded / name, folder / name)
    os.rename(folder / "model.safetensors.index.json", folder / "chosen.safetensors.index.json")
    config = json.loads((folder / "config.json").read_text())
    config["transformers_weights"] = "chosen.safetensors.index.json"
    (folder / "config.json").write_text(json.dumps(config))
    ids = token_ids(length=5, seed=2)
    with untouched(folder):
        got = logits(from_pretrained(folder, budget=BUDGET, page_size_kb=4), ids)
    torch.testing.assert_close(got, _transformers_logits(folder, ids), rtol=0, atol=1e-5)
    torch.testing.assert_close(got, _transformers_logits(sharded, ids), rtol=0, atol=1e-5)
    for bad in ("../elsewhere.safetensors", "weights.bin"):
        config["transformers_weights"] = bad
        (folder / "config.json").write_text(json.dumps(config))
        with untouched(folder), pytest.raises(CheckpointError, match="'transformers_weights'"):
            from_pretrained(folder, budget=BUDGET)


# -- 2. only regular files, never a blocking open --------------------------------------------


def _fifo(path):
    os.remove(path) if os.path.lexists(path) else None
    os.mkfifo(path)


def _directory(path):
    os.remove(path) if os.path.lexists(path) else None
    os.mkdir(path)


def _device(path):
    os.remove(path) if os.path.lexists(path) else None
    os.symlink("/dev/zero", path)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize(
    ("name", "make", "kind"),
    [
        ("config.json", _fifo, "a FIFO"),
        ("config.json", _directory, "a directory"),
        ("config.json", _device, "a character device"),
        ("model.safetensors", _fifo, "a FIFO"),
        ("model.safetensors", _directory, "a directory"),
        ("generation_config.json", _fifo, "a FIFO"),
        ("shard", _fifo, "a FIFO"),
        ("shard", _directory, "a directory"),
        ("index", _fifo, "a FIFO"),
    ],
)
def test_only_regular_files_are_opened(ckpt, name, make, kind):
    """Refused by type with the file named, before any open that could block."""
    folder = ckpt("sharded" if name in ("shard", "index") else "single")
    if name == "shard":
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        name = sorted(set(index["weight_map"].values()))[-1]
    elif name == "index":
        name = "model.safetensors.index.json"
    make(folder / name)
    with untouched(folder), no_hang(), pytest.raises(CheckpointError, match=rf"{name}.* is {kind}"):
        from_pretrained(folder, budget=BUDGET)


def test_a_directory_named_model_safetensors_is_not_skipped(ckpt):
    """transformers would skip a directory named ``model.safetensors`` and load the index:
    colibri refuses the ambiguity instead of serving other weights than the name says."""
    folder = ckpt("sharded")
    (folder / "model.safetensors").mkdir()
    with untouched(folder), pytest.raises(CheckpointError, match=r"model\.safetensors: .* a dir"):
        from_pretrained(folder, budget=BUDGET)


def test_symlinks_to_regular_files_load(ckpt, tmp_path):
    """A Hugging Face cache snapshot: every file a symlink into ``blobs/`` elsewhere."""
    folder = ckpt("sharded")
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for i, name in enumerate(sorted(os.listdir(folder))):
        os.rename(folder / name, blobs / f"blob{i}")
        os.symlink(blobs / f"blob{i}", folder / name)
    ids = token_ids(length=5, seed=3)
    with untouched(folder), untouched(blobs):
        got = logits(from_pretrained(folder, budget=BUDGET, page_size_kb=4), ids)
    torch.testing.assert_close(got, _transformers_logits(folder, ids), rtol=0, atol=1e-5)


def test_regular_file_helpers(tmp_path):
    path = tmp_path / "a.json"
    path.write_bytes(b"x" * 10)
    assert check_regular(str(path), "a.json") == path
    assert read_regular(path, "a.json", 10) == b"x" * 10
    with pytest.raises(CheckpointError, match=r"a\.json: a\.json is 10 bytes, more than the 9"):
        read_regular(path, "a.json", 9)
    with pytest.raises(MissingFileError, match="tokenizer.json is missing") as err:
        check_regular(tmp_path / "nope", "tokenizer.json")
    assert isinstance(err.value, FileNotFoundError)
    os.symlink(tmp_path / "gone", tmp_path / "dangling")
    with pytest.raises(FileNotFoundError):
        read_regular(tmp_path / "dangling", "x", 10)


# -- 3. no code of the checkpoint runs, stdin is never read ----------------------------------

_REMOTE = r"""
import sys
from colibri.integrations.transformers import UnsupportedCheckpointError, from_pretrained
try:
    from_pretrained(sys.argv[1], budget="1GiB")
except UnsupportedCheckpointError as error:
    print("REFUSED", error)
"""


def test_remote_code_is_refused_without_prompting(ckpt, tmp_path):
    """A config with ``auto_map`` and a model_type transformers does not know: transformers
    would ask on stdin whether to run the checkpoint's Python; answering "y" would run it.
    colibri refuses before that, and the checkpoint's code (which leaves a marker) never
    runs."""
    folder = ckpt("single")
    marker = tmp_path / "ran"
    (folder / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import MixtralConfig, MixtralForCausalLM\n"
        "class EvilConfig(MixtralConfig):\n    model_type = 'evil_moe'\n"
        "class EvilModel(MixtralForCausalLM):\n    config_class = EvilConfig\n"
    )
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "evil_moe"
    config["auto_map"] = {
        "AutoConfig": "evil.EvilConfig",
        "AutoModelForCausalLM": "evil.EvilModel",
    }
    (folder / "config.json").write_text(json.dumps(config))
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    with untouched(folder):
        result = subprocess.run(
            [sys.executable, "-c", _REMOTE, str(folder)], input="y\ny\n", capture_output=True,
            text=True, env=env, timeout=300,
        )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "REFUSED" in result.stdout and "'auto_map'" in result.stdout, result.stdout
    assert not marker.exists()


def test_unknown_model_type_is_refused(ckpt):
    folder = ckpt("single")
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "no_such_moe"
    (folder / "config.json").write_text(json.dumps(config))
    with untouched(folder), pytest.raises(UnsupportedCheckpointError, match="'no_such_moe' is not"):
        from_pretrained(folder, budget=BUDGET)


def test_config_field_transformers_refuses(ckpt):
    """A field transformers' config class refuses by type (found by the fuzzer: a null
    ``intermediate_size`` escaped as huggingface_hub's StrictDataclassFieldValidationError)."""
    folder = ckpt("single")
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = None
    (folder / "config.json").write_text(json.dumps(config))
    with (
        untouched(folder),
        pytest.raises(
            UnsupportedCheckpointError, match=r"config\.json: transformers .* cannot read it"
        ),
    ):
        from_pretrained(folder, budget=BUDGET)


# -- 4. sizes checked from the headers before anything is built ------------------------------


def _write_header_only(path, tensors: dict) -> None:
    """A safetensors file whose data section is a hole (zeros, nothing written)."""
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        nbytes = int(np.prod(shape)) * {"F16": 2, "F32": 4}[dtype]
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + offset)


def test_expert_count_is_checked_from_the_header(ckpt):
    """A stacked tensor claiming a million experts (a 12 MB file) is refused from its header
    line: the old loader split it into 3 million ranges first (55 s, 2 GB)."""
    folder = ckpt("single")
    os.remove(folder / "model.safetensors")
    _write_header_only(
        folder / "model.safetensors",
        {"model.layers.0.mlp.experts.gate_up_proj": ("F16", (1_000_000, 2, 3))},
    )
    with (
        untouched(folder),
        pytest.raises(
            CheckpointError,
            match=r"'model\.layers\.0\.mlp\.experts\.gate_up_proj' stores 1000000 experts but "
            r"config\.json gives 8",
        ),
    ):
        from_pretrained(folder, budget=BUDGET)


def test_expert_index_beyond_config(ckpt):
    folder = ckpt("single")
    os.remove(folder / "model.safetensors")
    name = "model.layers.1.block_sparse_moe.experts.8.w1.weight"
    _write_header_only(folder / "model.safetensors", {name: ("F32", (4, 4))})
    with untouched(folder), pytest.raises(CheckpointError, match=rf"'{name}' stores 9 experts"):
        from_pretrained(folder, budget=BUDGET)


# -- 5. one-line errors for what used to crash -----------------------------------------------


def _rewrite(path, change) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _expert_names(path):
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return [n for n in f.keys() if ".experts." in n]  # noqa: SIM118 (not a dict)


def test_expert_with_mixed_dtypes(ckpt):
    folder = ckpt("single")
    name = next(n for n in _expert_names(folder / "model.safetensors") if n.endswith("w2.weight"))
    _rewrite(folder / "model.safetensors", lambda t: t.update({name: t[name].half()}))
    with untouched(folder), pytest.raises(CheckpointError, match=rf"mixes dtypes .*'{name}' F16"):
        from_pretrained(folder, budget=BUDGET)


def test_integer_tensor_where_floats_are_needed(ckpt):
    folder = ckpt("single")
    name = "model.norm.weight"
    _rewrite(folder / "model.safetensors", lambda t: t.update({name: t[name].int()}))
    with (
        untouched(folder),
        pytest.raises(
            CheckpointError,
            match=rf"'{name}' is stored as I32, but the model's {name} holds floats",
        ),
    ):
        from_pretrained(folder, budget=BUDGET)


@pytest.mark.parametrize(
    ("key", "value"),
    [("num_attention_heads", 0), ("num_key_value_heads", -1), ("head_dim", 0), ("vocab_size", 0)],
)
def test_zero_or_negative_dims_in_config(ckpt, key, value):
    folder = ckpt("single")
    config = json.loads((folder / "config.json").read_text())
    config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    with untouched(folder), pytest.raises(CheckpointError, match=rf"config\.json: '{key}' must be"):
        from_pretrained(folder, budget=BUDGET)


def test_accelerate_missing(ckpt, monkeypatch):
    folder = ckpt("single")
    monkeypatch.setitem(sys.modules, "accelerate", None)
    with (
        untouched(folder),
        pytest.raises(
            ImportError,
            match=r'accelerate is not installed: pip install "colibri-moe\[transformers\]"',
        ),
    ):
        from_pretrained(folder, budget=BUDGET)


# -- 6. a shard truncated during or after the load: an exception, not SIGBUS -----------------

_TRUNCATE = r"""
import os, sys
import torch
from colibri.integrations.transformers import _load, from_pretrained
folder, when = sys.argv[1], sys.argv[2]
shard = os.path.join(folder, "model.safetensors")

def cut():
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)

if when == "between":
    real = _load._load_resident
    def load_resident(*args):
        cut()
        return real(*args)
    _load._load_resident = load_resident
try:
    model = from_pretrained(folder, budget="1GiB", page_size_kb=4)
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7]]))
    cut()
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7]]))
    print("RAN", float(model.lm_head.weight.sum()), float(model.model.norm.weight.sum()))
    print(float(model.model.embed_tokens.weight.sum()))
except Exception as error:
    print("RAISED", type(error).__name__, error)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="SIGBUS from truncated mappings: Linux")
@pytest.mark.parametrize("when", ["between", "after"])
def test_truncated_shard_is_an_exception_not_sigbus(ckpt, when):
    folder = ckpt("single")
    result = subprocess.run(
        [sys.executable, "-c", _TRUNCATE, str(folder), when], capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert "RAISED" in result.stdout, result.stdout
    expected = "truncated while loading" if when == "between" else "must not change"
    assert expected in result.stdout, result.stdout


# -- 7. io reaches the pager; generation_config.json is read ---------------------------------


@pytest.mark.parametrize("io", ["read", "mmap"])
def test_io_reaches_the_pager(ckpt, io):
    folder = ckpt("single")
    ids = token_ids(length=5, seed=4)
    with untouched(folder):
        model = from_pretrained(folder, budget=BUDGET, page_size_kb=4, io=io)
        assert model.colibri.pager.io == io
        torch.testing.assert_close(
            logits(model, ids), _transformers_logits(folder, ids), rtol=0, atol=1e-5
        )
    with pytest.raises(ValueError, match=r"from_pretrained\(\): io must be one of"):
        from_pretrained(folder, budget=BUDGET, io="fast")


def test_generation_config_stops_at_its_eos(ckpt):
    """generation_config.json's eos is a token the model emits early: colibri's generate
    stops where transformers' model, loaded from the same directory, stops."""
    from transformers import AutoModelForCausalLM

    folder = ckpt("single")
    ids = token_ids(length=5, seed=5, batch=1)
    greedy = dict(do_sample=False, max_new_tokens=8)
    free = AutoModelForCausalLM.from_pretrained(folder).generate(ids, **greedy, eos_token_id=None)
    eos = int(free[0, ids.shape[1] + 2])  # the third new token
    (folder / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos, "pad_token_id": 0, "max_new_tokens": 8})
    )
    want = AutoModelForCausalLM.from_pretrained(folder).generate(ids, do_sample=False)
    assert want.shape[1] < free.shape[1] and int(want[0, -1]) == eos
    with untouched(folder):
        model = from_pretrained(folder, budget=BUDGET, page_size_kb=4)
        got = model.generate(ids, do_sample=False)
    assert torch.equal(got, want)
    assert model.generation_config.eos_token_id == eos
