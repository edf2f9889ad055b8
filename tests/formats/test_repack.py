"""Repacking experts so each partition group is contiguous."""

import hashlib
import json

import numpy as np
import pytest

from _support.paging import hook_io
from colibri.formats import open_weights, repack
from colibri.pager import Pager

safetensors_numpy = pytest.importorskip("safetensors.numpy")

L, E, I, H = 2, 6, 8, 4


class FakePartition:  # the partition helper's contract: .groups, a tuple of tuples
    groups = ((4, 0, 2), (5,), (1, 3))


@pytest.fixture
def source(tmp_path):
    rng = np.random.default_rng(3)
    tensors = {}
    for lay in range(L):
        p = f"model.layers.{lay}.mlp.experts"
        tensors[f"{p}.gate_up_proj"] = rng.standard_normal((E, 2 * I, H)).astype(np.float32)
        tensors[f"{p}.down_proj"] = rng.standard_normal((E, H, I)).astype(np.float32)
    path = tmp_path / "model.safetensors"
    safetensors_numpy.save_file(tensors, str(path))
    return path, tensors


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_groups_become_contiguous_and_bytes_match(tmp_path, source, monkeypatch):
    path, tensors = source
    before = digest(path)
    out = repack(path, tmp_path / "packed.colibri", FakePartition(), page_size_kb=4)
    assert digest(path) == before  # input untouched
    assert out.metadata["groups"] == {"0": [[4, 0, 2], [5], [1, 3]], "1": [[4, 0, 2], [5], [1, 3]]}
    assert out.metadata["page_size"] == 4096
    order = sorted(out.experts, key=lambda k: out.experts[k].gate.offset)
    assert order == [(lay, e) for lay in range(L) for e in (4, 0, 2, 5, 1, 3)]
    for layout in out.experts.values():  # gate|up|down adjacent, expert on a page boundary
        assert layout.gate.offset % 4096 == 0
        assert layout.up.offset == layout.gate.offset + layout.gate.nbytes
        assert layout.down.offset == layout.up.offset + layout.up.nbytes
    reads = []
    hook_io(monkeypatch, lambda kind, *args: reads.append(kind))
    with Pager(out, budget_bytes=1 << 16, page_size_kb=4, io="read") as pager:
        for lay in range(L):
            with pager.load(lay, range(E)) as batch:
                gu = tensors[f"model.layers.{lay}.mlp.experts.gate_up_proj"]
                for e, w in batch.items():
                    np.testing.assert_array_equal(np.concatenate([w.gate, w.up]), gu[e])
                    np.testing.assert_array_equal(
                        w.down, tensors[f"model.layers.{lay}.mlp.experts.down_proj"][e]
                    )
        assert reads == ["read"] * (L * E)  # one read per expert: gate|up|down adjacent


def test_per_layer_partitions_and_list_of_lists(tmp_path, source):
    path, _ = source
    parts = {0: [[0, 1, 2, 3, 4, 5]], 1: [[5, 4], [3, 2, 1, 0]]}
    out = repack(path, tmp_path / "p.colibri", parts)
    assert out.metadata["groups"]["1"] == [[5, 4], [3, 2, 1, 0]]


def test_refuses_overwrite_and_source(tmp_path, source):
    path, _ = source
    dest = tmp_path / "p.colibri"
    repack(path, dest, FakePartition())
    stamp = digest(dest)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        repack(path, dest, [[0, 1, 2, 3, 4, 5]])
    assert digest(dest) == stamp
    repack(path, dest, [[0, 1, 2, 3, 4, 5]], overwrite=True)
    assert json.loads((tmp_path / "p.colibri.json").read_text())["metadata"]["groups"]["0"] == [
        [0, 1, 2, 3, 4, 5]
    ]
    with pytest.raises(ValueError, match="is the source file"):
        repack(path, path, [[0, 1, 2, 3, 4, 5]], overwrite=True)


@pytest.mark.parametrize(
    ("groups", "match"),
    [
        ([[0, 1, 2], [3, 4]], r"missing \[5\]"),
        ([[0, 1, 2], [3, 4, 5, 5]], r"repeated \[5\]"),
        ([[0, 1, 2], [3, 4, 5, 9]], r"unknown \[9\]"),
        ([[0, 1, 2, 3, 4, 5], []], "non-empty"),
    ],
)
def test_bad_partitions(tmp_path, source, groups, match):
    path, _ = source
    with pytest.raises(ValueError, match=match):
        repack(path, tmp_path / "p.colibri", groups)
    assert not (tmp_path / "p.colibri").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left


def test_failed_verification_publishes_nothing(tmp_path, source, monkeypatch):
    path, _ = source
    import colibri.formats.raw as raw

    real_add = raw.RawWriter.add

    def corrupting_add(self, layer, expert, matrices):
        matrices = list(matrices)
        if (layer, expert) == (1, 3):
            dtype, shape, buf = matrices[0]
            buf = buf.copy()
            buf[0] ^= 0xFF
            matrices[0] = (dtype, shape, buf)
        real_add(self, layer, expert, matrices)

    monkeypatch.setattr(raw.RawWriter, "add", corrupting_add)
    with pytest.raises(OSError, match="layer 1 expert 3 reads back different"):
        repack(path, tmp_path / "p.colibri", FakePartition())
    assert not (tmp_path / "p.colibri").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert open_weights(path).format == "safetensors"


def test_accepts_colibri_partition(tmp_path, source):
    import colibri

    path, _ = source
    part = colibri.Partition([[0, 1], [2, 3], [4], [5]])
    out = repack(path, tmp_path / "p.colibri", part)
    assert out.metadata["groups"]["0"] == [list(g) for g in part.groups]


@pytest.mark.parametrize("page_size_kb", [4, 64])
def test_repacked_experts_share_no_page(tmp_path, source, page_size_kb):
    path, _ = source  # 192-byte matrices: in the source, many experts share each page
    with Pager(path, budget_bytes=1 << 20, page_size_kb=page_size_kb, io="mmap") as pager:
        pager.load(0, range(E)).release()
        shared = pager.stats.resident_pages
    out = repack(path, tmp_path / "p.colibri", FakePartition(), page_size_kb=page_size_kb)
    assert json.loads((tmp_path / "p.colibri.json").read_text())["alignment"] == (
        page_size_kb * 1024
    )
    with Pager(out, budget_bytes=1 << 20, page_size_kb=page_size_kb, io="mmap") as pager:
        assert pager.slot_bytes == page_size_kb * 1024  # an expert touches one page
        pager.load(0, range(E)).release()
        assert pager.stats.resident_pages == E > shared  # one page each, none shared
    with pytest.raises(ValueError, match="power of two"):
        repack(path, tmp_path / "q.colibri", FakePartition(), page_size_kb=48)
