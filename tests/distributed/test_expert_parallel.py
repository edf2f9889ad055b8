"""Expert parallelism over gloo: one model, its experts on 2 or 3 processes on 127.0.0.1.

Each rank is its own process (``_rank.py``, spawned here, bounded in time, killed at the
end) on a tiny bf16 Qwen3-MoE checkpoint (decode rows take colibri's fused kernel, prefill
rows torch's GEMMs: both of the ways one process sums experts). Rank 0 generates with its
experts spread over the ranks and with one process, and compares the tokens and every
logit bit for bit, with and without replicas of experts; each rank's pager shows the
experts rank 0 predicted read ahead. Faults: a rank killed mid-generation, a rank that hangs,
a rank whose checkpoint differs. The placement (replicas too) and the start-up checks
(another colibri version too) are tested as plain functions.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("safetensors")

from _support.hf_families import (  # noqa: E402
    FAMILIES,
    build_model,
    randomise_routers,
    save_tokenizer,
    token_ids,
)
from colibri import FormatError, UsageStats  # noqa: E402
from colibri.distributed import DistributedError, ExpertParallel, Placement, place  # noqa: E402
from colibri.distributed._handshake import problems  # noqa: E402
from colibri.distributed._options import options  # noqa: E402
from colibri.integrations.transformers import from_pretrained, patch, unpatch  # noqa: E402

RANK = os.path.join(os.path.dirname(__file__), "_rank.py")
BUDGET = 64 * 1024  # a few experts of 4.5 KiB in 4 KiB pages: less than a layer's 8
LIMIT = 90  # seconds any rank process may live


def _save(folder, dtype):
    """A tiny Qwen3-MoE (8 experts, top-3, 2 layers) of ``dtype``, sharded, with a
    tokenizer."""
    model = build_model("qwen3_moe").to(dtype)
    randomise_routers(model, [r.name for r in patch(model)])
    unpatch(model)
    model.save_pretrained(folder, max_shard_size="20KB")
    save_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return _save(tmp_path_factory.mktemp("qwen3_moe"), torch.bfloat16)


@pytest.fixture(scope="module")
def checkpoint32(tmp_path_factory):
    """float32: every expert through torch's GEMMs (the fused kernel takes half precision)."""
    return _save(tmp_path_factory.mktemp("qwen3_moe_f32"), torch.float32)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path, folders, modes=None, budgets=None, placement=None) -> list[dict]:
    """Start one process per rank (``folders[r]`` its checkpoint; ``placement``: a saved
    placement's path), wait for rank 0 (at most
    LIMIT seconds) and the others a few seconds more, then kill any left; returns each
    rank's report (``{}``: it wrote none). Their output goes to ``rank{r}.log``."""
    world = len(folders)
    modes = modes or ["run"] * world
    budgets = budgets or [BUDGET] * world
    port = str(_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = []
    try:
        for rank in reversed(range(world)):  # rank 0 last: the others are ready to serve
            out = tmp_path / f"rank{rank}.json"
            args = [sys.executable, RANK, str(rank), str(world), port, str(folders[rank]),
                    str(budgets[rank]), modes[rank], str(out)]  # fmt: skip
            if placement is not None:
                args.append(str(placement))
            with open(tmp_path / f"rank{rank}.log", "wb") as log:
                procs.append(subprocess.Popen(args, env=env, cwd=tmp_path, stdout=log,
                                              stderr=subprocess.STDOUT))  # fmt: skip
        procs[-1].wait(timeout=LIMIT)  # rank 0
        for proc in procs[:-1]:  # they stop with rank 0; a hung rank is killed below
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.1 if "hang" in modes else 10)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    reports = []
    for rank in range(world):
        path = tmp_path / f"rank{rank}.json"
        reports.append(json.loads(path.read_text()) if path.exists() else {})
    return reports


@pytest.mark.slow
def test_two_ranks_generate_what_one_process_does(tmp_path, checkpoint):
    first, second = _run(tmp_path, [checkpoint, checkpoint])
    assert "error" not in first, first
    assert first["tokens"] == first["want"]
    assert first["logits_equal"], "every logit must be bit for bit one process's"
    assert first["sent"] > 0 and first["received"] > 0  # rows did cross to rank 1
    assert second == {"elapsed": second["elapsed"]}  # served, then stopped cleanly
    # read-ahead: rank 1 holds 4 experts a layer in 2 slots, so a layer's experts do not
    # stay resident; those rank 0 predicted were fetched ahead and then found there
    ranks = first["ranks"]
    assert ranks[1]["capacity"] < 4 and ranks[1]["answered"] > 0
    assert ranks[1]["prefetched"] > 0 and ranks[1]["prefetch_hits"] > 0, ranks
    assert first["recall"] > 0  # rank 0's prediction is scored (it was 0 before)


@pytest.mark.slow
def test_messages_larger_than_the_first_part_cross_whole(tmp_path, checkpoint):
    """With a 256-byte first part, the prompt's rows, the answers and the counters each
    cross in two messages; the tokens and logits stay one process's."""
    first, second = _run(tmp_path, [checkpoint, checkpoint], modes=["split", "split"])
    assert "error" not in first, first
    assert first["tokens"] == first["want"] and first["logits_equal"]
    assert first["ranks"][1]["answered"] > 0
    assert second == {"elapsed": second["elapsed"]}


@pytest.mark.slow
def test_replicated_experts_generate_what_one_process_does(tmp_path, checkpoint):
    """Experts 0-3 of each layer on both ranks: each step's rows of one go to the holder with
    fewer rows; the tokens stay those of one process."""
    replicas = {layer: {e: [1 - e % 2] for e in range(4)} for layer in (0, 1)}
    placement = Placement({0: np.arange(8) % 2, 1: np.arange(8) % 2}, 2, replicas)
    placement.save(tmp_path / "placement.json")
    first, second = _run(tmp_path, [checkpoint, checkpoint], budgets=[2 * BUDGET] * 2,
                         placement=tmp_path / "placement.json")  # fmt: skip
    assert "error" not in first, first
    assert first["tokens"] == first["want"] and first["logits_equal"]
    assert Placement.from_dict(first["placement"]) == placement
    computed = [{(layer, e) for layer, e in r["experts"]} for r in first["ranks"]]
    assert computed[0] & {(0, 1), (0, 3), (1, 1), (1, 3)}  # rank 0 computed its copies
    assert computed[1] & {(0, 0), (0, 2), (1, 0), (1, 2)}  # and rank 1 its copies


@pytest.mark.slow
def test_three_ranks_with_different_budgets(tmp_path, checkpoint32):
    budget = 4 * BUDGET  # float32 experts are twice the size
    reports = _run(tmp_path, [checkpoint32] * 3, budgets=[budget, 2 * budget, budget])
    first = reports[0]
    assert "error" not in first, first
    assert first["tokens"] == first["want"] and first["logits_equal"]
    held = np.bincount(np.ravel(list(first["placement"]["layers"].values())), minlength=3)
    assert held[1] > held[0] and held[1] > held[2]  # the larger budget owns more experts
    assert all(r == {"elapsed": r["elapsed"]} for r in reports[1:])


@pytest.mark.slow
def test_a_rank_killed_mid_generation_is_an_error_on_rank_0(tmp_path, checkpoint):
    first, _ = _run(tmp_path, [checkpoint, checkpoint], modes=["run", "die"])
    assert first["error"].startswith("expert parallel: rank 1: waiting for layer")
    assert "connection" in first["error"]


@pytest.mark.slow
def test_a_rank_that_hangs_times_out_on_rank_0(tmp_path, checkpoint):
    first, _ = _run(tmp_path, [checkpoint, checkpoint], modes=["run", "hang"])
    assert "rank 1" in first["error"] and "within the timeout of 3 s" in first["error"]
    assert first["elapsed"] < 60


def _altered(checkpoint, folder, rank_owns):
    """A copy of ``checkpoint`` whose expert ``rank_owns`` of layer 0 has other weights."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(checkpoint, folder)
    prefix = f"model.layers.0.mlp.experts.{rank_owns}."
    for name in os.listdir(folder):
        if not name.endswith(".safetensors"):
            continue
        tensors = load_file(folder / name)
        if any(k.startswith(prefix) for k in tensors):
            for k in tensors:
                if k.startswith(prefix):
                    tensors[k] = tensors[k] * 2
            save_file(tensors, folder / name, metadata={"format": "pt"})
    return folder


@pytest.mark.slow
def test_a_mismatched_checkpoint_is_refused_on_every_rank(tmp_path, checkpoint):
    other = _altered(checkpoint, tmp_path / "other", rank_owns=1)  # uniform: 1, 3, 5, 7
    reports = _run(tmp_path, [checkpoint, other])
    for report in reports:
        assert "refused at start: rank 1's checkpoint differs" in report["error"]
        assert "layer 0 expert 1" in report["error"]


@pytest.mark.slow
def test_torchrun_colibri_generate(tmp_path, checkpoint):
    """``torchrun --nproc-per-node 2 --standalone colibri generate``: the text of one
    process, printed by rank 0 alone; every process gone at the end."""
    args = ["generate", str(checkpoint), "--budget", str(BUDGET), "--page-size-kb", "4",
            "--max-new-tokens", "8", "--no-stream", "--prompt", "hello"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--standalone", "-m", "colibri"]  # fmt: skip
    outputs = []
    for command in (
        torchrun + args + ["--timeout", "30"],
        [sys.executable, "-m", "colibri", *args],
    ):
        proc = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            out, _ = proc.communicate(timeout=LIMIT)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)  # torchrun's workers too, if any is left
            proc.wait()
        assert proc.returncode == 0, out.decode()
        outputs.append([line for line in out.decode().splitlines() if line.startswith("hello")])
    assert len(outputs[0]) == 1 and outputs[0] == outputs[1]


# -- start-up checks and placement: plain functions ------------------------------------------


def test_problems_name_the_rank_and_the_cause():
    base = {"version": "1.0", "layers": {0: 8}, "fingerprints": {(0, 1): "a", (0, 3): "b"}}
    same = dict(base)
    assert problems([base, same], {1: {(0, 1): "a", (0, 3): "b"}}) == []
    found = problems([base, same, same], {1: {(0, 1): "a"}, 2: {(0, 3): "c"}})
    assert len(found) == 1 and found[0].startswith("rank 2's checkpoint differs")
    assert "layer 0 expert 3" in found[0]
    assert "rank 1 runs colibri 2.0" in problems([base, {**base, "version": "2.0"}])[0]
    assert "other MoE layers" in problems([base, {**base, "layers": {0: 4}}])[0]


def test_placement_balances_skewed_usage():
    counts = np.round(4000 / (1 + np.arange(64)) ** 1.1)  # one expert as hot as a rank's share
    placement = place({0: 64, 3: 64}, [1 << 30] * 4, {0: counts})
    held = np.bincount(placement.owners(0), minlength=4)
    assert (held == 16).all()  # memory: a quarter of the experts each
    load = np.bincount(placement.owners(0), weights=counts, minlength=4)
    # no placement of 16 experts a rank does better than the hottest one with the 15 coldest
    best = max(counts.sum() / 4, counts[0] + np.sort(counts)[:15].sum())
    assert load.max() <= 1.02 * best
    assert placement.expected_load({0: counts}).tolist() == (load + 16).tolist()  # + layer 3
    dealt = np.bincount(np.arange(64) % 4, weights=counts)  # round robin, blind to usage
    assert dealt.max() > 1.3 * best
    assert (np.bincount(placement.owners(3), minlength=4) == 16).all()  # no usage: uniform
    ints = counts.astype(np.int64)
    stats = UsageStats(ints, np.diag(ints), int(ints.max()))
    assert place({0: 64}, [1] * 4, {0: stats}).owners(0).tolist() == placement.owners(0).tolist()


def test_hot_experts_are_replicated_where_memory_is_spare():
    counts = np.round(4000 / (1 + np.arange(64)) ** 1.1)
    usage = {0: counts}
    alone = place({0: 64, 3: 64}, [1 << 30] * 4, usage)
    placement = place({0: 64, 3: 64}, [1 << 30] * 4, usage, capacities=[40] * 4)
    copies = placement.replicas(0)
    assert copies and placement.replicas(3) == {}  # no usage: no expert is hot
    assert set(copies) <= set(np.flatnonzero(counts > counts.mean()))  # the hot ones
    assert len(copies[0]) == 3  # the hottest on every rank
    held = placement.holders(0).sum(axis=0) + placement.holders(3).sum(axis=0)
    assert (held <= 40).all() and held.sum() == 128 + sum(len(r) for r in copies.values())
    load = placement.expected_load(usage) - 16  # layer 3: 16 experts each, uniform
    assert load.max() <= 1.02 * counts.sum() / 4  # balanced, which no placement without
    assert (alone.expected_load(usage) - 16).max() > 1.15 * counts.sum() / 4  # copies is
    assert place({0: 64}, [1] * 4, usage, capacities=[16] * 4).replicas(0) == {}  # no spare
    # routing: every row of an expert to one holder, the least loaded; deterministic
    experts = np.sort(np.random.default_rng(0).choice(64, 400, p=counts / counts.sum()))
    ranks = placement.route(0, experts)
    assert all(len(set(ranks[experts == e])) == 1 for e in np.unique(experts))
    assert all(ranks[experts == e][0] in (placement.owners(0)[e], *copies.get(e, ()))
               for e in np.unique(experts))  # fmt: skip
    spread, fixed = np.bincount(ranks, minlength=4), np.bincount(alone.route(0, experts))
    assert spread.max() - spread.min() < fixed.max() - fixed.min()
    assert placement.route(0, experts).tolist() == ranks.tolist()
    with pytest.raises(ValueError, match="capacities must give one count per rank"):
        place({0: 4}, [1, 1], usage={0: [1, 2, 3, 4]}, capacities=[8])


def test_placement_honours_budgets():
    placement = place({0: 12}, [3 << 30, 1 << 30, 0])
    assert np.bincount(placement.owners(0), minlength=3).tolist() == [9, 3, 0]
    assert placement.experts_of(1)[0].tolist() == np.flatnonzero(placement.owners(0) == 1).tolist()
    with pytest.raises(ValueError, match="positive budget"):
        place({0: 4}, [0, 0])
    with pytest.raises(ValueError, match="usage of layer 0 must be 4"):
        place({0: 4}, [1], {0: [1, 2]})


def test_placement_save_and_load(tmp_path):
    placement = place({0: 8, 2: 8}, [1, 1, 2], {0: [9, 1, 1, 1, 1, 1, 1, 1]}, [6, 6, 9])
    assert placement.replicas(0)  # expert 0 is hot, and the ranks have room to spare
    placement.save(tmp_path / "p.json")
    assert Placement.load_file(tmp_path / "p.json") == placement
    assert Placement.load_file(tmp_path / "p.json").replicas(0) == placement.replicas(0)
    assert Placement.from_dict(placement.to_dict()) == placement
    assert placement != Placement({0: placement.owners(0), 2: placement.owners(2)}, 3)
    with pytest.raises(FileExistsError):
        placement.save(tmp_path / "p.json")
    document = placement.to_dict()
    document["layers"]["0"][0] = 3
    (tmp_path / "bad.json").write_text(json.dumps(document))
    with pytest.raises(FormatError, match=r"bad.json: 'layers\[0\]\[0\]' must be an integer"):
        Placement.load_file(tmp_path / "bad.json")
    document = placement.to_dict()
    document["replicas"]["0"]["0"] = [int(placement.owners(0)[0])]  # its owner again
    (tmp_path / "twice.json").write_text(json.dumps(document))
    with pytest.raises(FormatError, match="twice.json: invalid placement: replicas"):
        Placement.load_file(tmp_path / "twice.json")
    with pytest.raises(ValueError, match="layer 0 expert 9, which the placement"):
        Placement({0: [0, 1]}, 2, {0: {9: [1]}})


def test_options_are_checked():
    assert options(None) is None and options(False) is None
    assert options(True) == ExpertParallel()
    assert options({"timeout": 5}).timeout == 5
    with pytest.raises(ValueError, match="no option 'timout'"):
        options({"timout": 5})
    with pytest.raises(ValueError, match="timeout must be positive"):
        options({"timeout": 0})
    with pytest.raises(ValueError, match="start_timeout must be positive"):
        options({"start_timeout": float("inf")})


def test_no_group_and_no_launcher_is_a_clear_error(monkeypatch, checkpoint):
    import torch.distributed as dist

    if dist.is_initialized():  # pragma: no cover - the suite starts no group
        pytest.skip("a process group exists")
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(DistributedError, match="no process group and no RANK"):
        from_pretrained(checkpoint, budget=BUDGET, page_size_kb=4, expert_parallel=True)


def test_ranks_that_never_join_are_a_clear_error_within_the_start_timeout(monkeypatch):
    """Rank 0 of 2 alone: the rendezvous ends after start_timeout in one named error (not
    torch's store traceback), and leaves no group behind."""
    import time

    import torch.distributed as dist

    from colibri.distributed._group import join

    if dist.is_initialized():  # pragma: no cover - the suite starts no group
        pytest.skip("a process group exists")
    env = dict(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    start = time.monotonic()
    with pytest.raises(DistributedError, match=r"rank 0 of 2 could not join .* within 1 s"):
        join(None, 1.0)
    assert time.monotonic() - start < 30
    assert not dist.is_initialized()


# -- every family the paged path serves: the split and the sum, in one process --------------


@pytest.fixture
def one_rank_group():
    """A gloo group of this process alone: every expert is rank 0's own share, so a model
    runs the whole split / compute / combine path without other processes."""
    import torch.distributed as dist

    if dist.is_initialized():  # pragma: no cover - the suite starts no group
        pytest.skip("a process group exists")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_port()}", rank=0,
                            world_size=1)  # fmt: skip
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_every_family_sums_as_one_process(tmp_path, one_rank_group):
    """bf16: decode rows take the fused kernel (float32 sums), prefill rows torch's GEMMs
    (bf16 sums); both replayed bit for bit."""

    def save(family):
        folder = tmp_path / family
        model = build_model(family).to(torch.bfloat16)
        randomise_routers(model, [r.name for r in patch(model)])
        unpatch(model)
        model.save_pretrained(folder, max_shard_size="20KB")
        return folder

    paged = [f for f in FAMILIES if f not in ("llama4_text", "dbrx", "gpt_oss")]
    for family in paged:
        folder = save(family)
        spread = from_pretrained(folder, budget=BUDGET, page_size_kb=4, expert_parallel=True)
        alone = from_pretrained(folder, budget=BUDGET, page_size_kb=4)
        for ids in (token_ids(3), token_ids(4, batch=3, length=1)):  # prefill, decode
            with torch.no_grad():
                got, want = spread(ids).logits, alone(ids).logits
            assert torch.equal(got, want), f"{family}: not bit for bit"
        assert spread.colibri.remote.placement.num_ranks == 1
        spread.colibri.close()
        alone.colibri.close()
    # gpt-oss computes its experts its own way: refused, not computed wrong
    with pytest.raises(DistributedError, match="computed their own way"):
        from_pretrained(save("gpt_oss"), budget=1 << 20, page_size_kb=4, expert_parallel=True)
