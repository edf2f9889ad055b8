"""Thread counts: one check (1 to 4x the CPUs) before any pool, torch's or colibri's, sees one."""

from __future__ import annotations

import os

import numpy as np
import pytest

import colibri
from colibri import _validate
from colibri._validate import check_threads
from colibri.layer import _rows

HUGE = (3000, 2**31, 2**63)  # a SIGSEGV in torch; an OverflowError in the C int; both


def test_check_threads_bounds(monkeypatch):
    monkeypatch.setattr(_validate, "_CPUS", 2)
    assert check_threads(1) == 1 and check_threads(np.int64(8)) == 8
    assert type(check_threads(np.int32(3))) is int
    with pytest.raises(ValueError, match=r"^n must be >= 1 \(got 0\)$"):
        check_threads(0, "n")
    with pytest.raises(ValueError, match=r"n must be at most 8, 4x this machine's 2 CPUs \(got 9"):
        check_threads(9, "n")
    for bad in (True, 2.0, "4", None):
        with pytest.raises(TypeError, match="n must be an int"):
            check_threads(bad, "n")
    monkeypatch.setattr(os, "cpu_count", lambda: None)  # unknown: one CPU
    assert _validate._cpu_count() == 1
    monkeypatch.setattr(_validate, "_CPUS", _validate._cpu_count())
    assert check_threads(4) == 4
    with pytest.raises(ValueError, match="at most 4"):
        check_threads(5)


@pytest.mark.parametrize("threads", HUGE)
def test_routing_contexts_refuse_huge_thread_counts(threads):
    with pytest.raises(ValueError, match=rf"routing_threads must be at most .*\(got {threads}\)"):
        colibri.init(8, 2, routing_threads=threads)
    assert colibri.init(8, 2, routing_threads=1).routing_threads == 1


@pytest.mark.parametrize("threads", HUGE)
def test_layer_rows_refuse_huge_thread_counts(threads):
    from colibri.layer import dispatch

    with pytest.raises(ValueError, match=rf"num_threads must be at most .*\(got {threads}\)"):
        _rows.resolve_threads(threads)
    with pytest.raises(ValueError, match="num_threads must be at most"):
        dispatch(np.zeros((3, 2), np.int32), 4, num_threads=threads)
    assert _rows.resolve_threads(2) == 2 and _rows.resolve_threads(None) >= 1


def test_transformers_entry_points_refuse_thread_counts_first(tmp_path):
    """``from_pretrained`` refuses before it reads a file (the directory does not exist);
    ``patch`` before it changes a router; 0 is the argument's fault, not the router's."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from _support.hf_families import build_model
    from colibri.integrations.transformers import from_pretrained, patch, patched_routers

    for threads, match in ((0, r"must be >= 1 \(got 0\)"), (2**31, "must be at most")):
        with pytest.raises(ValueError, match=rf"from_pretrained\(\): num_threads {match}"):
            from_pretrained(tmp_path / "nowhere", budget="1MiB", num_threads=threads)
    model = build_model("qwen3_moe")
    with pytest.raises(ValueError, match=r"patch\(\): num_threads must be at most"):
        patch(model, num_threads=2**31)
    assert patched_routers(model) == []
