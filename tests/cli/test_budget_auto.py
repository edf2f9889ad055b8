"""``--budget auto`` / ``budget="auto"``: the budget the memory this process may use leaves.

The memory facts are read from fake cgroup trees (v1, v2, ``max``, nested paths, a container
whose mount starts below its path); the policy is checked against its stated arithmetic; a
real run in a memory-limited cgroup must finish without an OOM kill.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from colibri import BudgetError
from colibri._memory import MemoryLimit, cgroup_limit, mem_available
from colibri._units import ProcessMemory

MiB = 1 << 20
V1_NONE = "9223372036854771712"  # what v1 says for "no limit"


def _tree(root, files: dict[str, str]):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")


def _limit(tmp_path, proc: str, files: dict[str, str]):
    (tmp_path / "fs").mkdir(parents=True, exist_ok=True)
    _tree(tmp_path / "fs", files)
    (tmp_path / "cgroup").write_text(proc)
    return cgroup_limit(str(tmp_path / "fs"), str(tmp_path / "cgroup"))


def test_v2_the_smallest_limit_on_the_path_up(tmp_path):
    files = {"a/b/c/memory.max": "max", "a/b/memory.max": str(300 * MiB),
             "a/memory.max": str(200 * MiB), "x/memory.max": str(MiB)}  # fmt: skip
    found = _limit(tmp_path, "0::/a/b/c\n", files)
    assert found == MemoryLimit(200 * MiB, f"cgroup v2 {tmp_path}/fs/a/memory.max")
    files["a/b/c/memory.max"] = str(100 * MiB)
    assert _limit(tmp_path, "0::/a/b/c\n", files).nbytes == 100 * MiB


def test_v2_max_everywhere_is_no_limit(tmp_path):
    assert _limit(tmp_path, "0::/a/b\n", {"a/b/memory.max": "max", "a/memory.max": "max"}) is None
    assert _limit(tmp_path / "none", "0::/\n", {}) is None  # the root has no memory.max


def test_v2_in_a_container_and_in_a_hybrid_mount(tmp_path):
    # a cgroup namespace: the mount starts at the container's own cgroup
    assert _limit(tmp_path / "ns", "0::/\n", {"memory.max": str(64 * MiB)}).nbytes == 64 * MiB
    hybrid = _limit(tmp_path / "h", "0::/s\n", {"unified/s/memory.max": str(5 * MiB)})
    assert hybrid.nbytes == 5 * MiB and "/unified/s/memory.max" in hybrid.source


def test_v1_limits_and_no_limit(tmp_path):
    proc = "9:pids:/\n4:memory:/process_api/job\n1:cpu,cpuacct:/\n0::/\n"
    files = {"memory/process_api/job/memory.limit_in_bytes": V1_NONE,
             "memory/process_api/memory.limit_in_bytes": str(512 * MiB),
             "memory/memory.limit_in_bytes": V1_NONE}  # fmt: skip
    found = _limit(tmp_path, proc, files)
    assert found == MemoryLimit(
        512 * MiB, f"cgroup v1 {tmp_path}/fs/memory/process_api/memory.limit_in_bytes"
    )
    files["memory/process_api/memory.limit_in_bytes"] = V1_NONE
    assert _limit(tmp_path / "2", proc, files) is None


def test_v1_shared_hierarchy_container_and_both_versions(tmp_path):
    # memory shares a hierarchy with cpu; the container's mount starts below /docker/abc
    proc = "3:cpu,memory:/docker/abc\n"
    got = _limit(tmp_path / "a", proc, {"memory/memory.limit_in_bytes": str(256 * MiB)})
    assert got.nbytes == 256 * MiB
    both = "4:memory:/j\n0::/j\n"
    files = {"memory/j/memory.limit_in_bytes": str(9 * MiB), "j/memory.max": str(7 * MiB)}
    assert _limit(tmp_path / "b", both, files).source.startswith("cgroup v2")
    assert _limit(tmp_path / "c", "garbage\n", {}) is None
    assert cgroup_limit(str(tmp_path), str(tmp_path / "no-such-file")) is None


def test_mem_available(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  32000 kB\nMemFree:  1000 kB\nMemAvailable:   20480 kB\n")
    assert mem_available(str(meminfo)) == 20480 * 1024
    meminfo.write_text("MemTotal:  32000 kB\n")
    assert mem_available(str(meminfo)) is None
    assert mem_available(str(tmp_path / "none")) is None


# -- the policy -----------------------------------------------------------------------------


@pytest.fixture
def machine(monkeypatch):
    """Set the memory facts ``_budget`` sees: ``machine(limit, available, in_use)``, the
    process's anonymous memory ``in_use`` beside ``mapped`` bytes of mapped files."""
    from colibri import _memory
    from colibri.integrations.transformers import _budget

    def set_(limit, available, in_use, mapped=0):
        cgroup = MemoryLimit(limit, "cgroup v2 /fake/memory.max") if limit else None
        monkeypatch.setattr(_memory, "cgroup_limit", lambda: cgroup)
        monkeypatch.setattr(_memory, "mem_available", lambda: available)
        held = ProcessMemory(in_use + mapped, in_use + mapped, in_use, mapped)
        monkeypatch.setattr(_budget, "process_memory", lambda: held)
        return _budget

    return set_


def test_the_budget_is_what_the_smaller_limit_leaves(machine):
    budget = machine(limit=1000 * MiB, available=4000 * MiB, in_use=300 * MiB)
    got = budget.auto_budget(resident=50 * MiB, floor=MiB, ceiling=10_000 * MiB)
    margin = 96 * MiB + int(1000 * MiB * 0.02)
    assert got.nbytes == 1000 * MiB - 300 * MiB - 50 * MiB - margin
    assert got.source == "cgroup v2 /fake/memory.max" and not got.capped
    assert str(got).startswith(f"--budget auto: {got.nbytes / MiB:.1f} MiB for experts = ")
    # MemAvailable excludes what the process holds; the limit includes it
    budget = machine(limit=None, available=500 * MiB, in_use=300 * MiB)
    got = budget.auto_budget(resident=50 * MiB, floor=MiB, ceiling=10_000 * MiB)
    assert got.usable == 800 * MiB and got.source == "MemAvailable + in use"
    assert got.nbytes == 800 * MiB - 300 * MiB - 50 * MiB - 96 * MiB - int(800 * MiB * 0.02)


def test_mapped_files_are_not_counted_as_held(machine, monkeypatch):
    """The libraries' code and other mapped files are page cache the kernel takes back under
    the limit: only the process's anonymous memory is what it holds (its whole resident set
    where the OS does not split it)."""
    budget = machine(limit=1000 * MiB, available=4000 * MiB, in_use=300 * MiB, mapped=160 * MiB)
    got = budget.auto_budget(resident=50 * MiB, floor=MiB, ceiling=10_000 * MiB)
    assert got.in_use == 300 * MiB
    assert got.nbytes == 1000 * MiB - 300 * MiB - 50 * MiB - 96 * MiB - 20 * MiB
    unsplit = ProcessMemory(460 * MiB, 460 * MiB, None, None)
    monkeypatch.setattr(budget, "process_memory", lambda: unsplit)
    got = budget.auto_budget(resident=50 * MiB, floor=MiB, ceiling=10_000 * MiB)
    assert got.in_use == 460 * MiB


def test_the_budget_is_capped_at_every_expert_and_floored_at_a_layer(machine):
    budget = machine(limit=1000 * MiB, available=4000 * MiB, in_use=300 * MiB)
    got = budget.auto_budget(resident=0, floor=MiB, ceiling=3 * MiB)
    assert got.nbytes == 3 * MiB and got.capped and "(all of them)" in str(got)
    with pytest.raises(BudgetError, match=r"non-expert weights \(600.0 MiB\) \+ one layer's"):
        budget.auto_budget(resident=600 * MiB, floor=MiB, ceiling=3 * MiB)
    machine(limit=None, available=None, in_use=300 * MiB)
    with pytest.raises(BudgetError, match="give the budget in bytes"):
        budget.auto_budget(resident=0, floor=MiB, ceiling=3 * MiB)


def test_from_pretrained_and_the_command(checkpoint, machine, capsys):
    """The floor and the resident bytes come from the checkpoint; the command says what it
    chose, and pages under it."""
    import torch

    from colibri.cli import main
    from colibri.integrations.transformers import from_pretrained

    folder, reference = checkpoint
    resident = sum(t.nbytes for n, t in reference.state_dict().items() if ".experts." not in n)
    tie = reference.config.tie_word_embeddings
    resident -= reference.lm_head.weight.nbytes if tie else 0
    experts = reference.model.layers[0].mlp.experts
    expert = (experts.gate_up_proj[0].numel() + experts.down_proj[0].numel()) * 4  # float32
    top_k = reference.config.num_experts_per_tok
    floor = top_k * (expert + 6 * 4096)  # three matrices rounded out to 4 KiB pages
    in_use = 400 * MiB

    def limit_for(nbytes):  # the cgroup limit that leaves ``nbytes`` for experts
        usable = (nbytes + in_use + resident + 96 * MiB) / 0.98
        return int(usable) + 1

    machine(limit=limit_for(floor + 4096), available=1 << 40, in_use=in_use)
    model = from_pretrained(folder, budget="auto", page_size_kb=4)
    chosen = model.colibri.auto_budget
    assert chosen.resident == resident and chosen.in_use == in_use
    assert floor <= model.colibri.pager.budget_bytes == chosen.nbytes <= floor + 8192
    assert 2 <= model.colibri.pager.capacity < 16  # it pages: not every expert fits
    ids = torch.tensor([[1, 5, 9, 3]])
    torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=1e-5)
    model.colibri.close()
    machine(limit=limit_for(floor - 4096), available=1 << 40, in_use=in_use)
    with pytest.raises(BudgetError, match="cannot hold the model's non-expert weights"):
        from_pretrained(folder, budget="auto", page_size_kb=4)
    assert main(["generate", str(folder), "--budget", "auto", "--page-size-kb", "4"]) == 2
    assert "cannot hold the model's non-expert weights" in capsys.readouterr().err
    machine(limit=limit_for(floor + 4096), available=1 << 40, in_use=in_use)
    argv = ["generate", str(folder), "--budget", "AUTO", "--page-size-kb", "4",
            "--max-new-tokens", "3", "--no-stream"]  # fmt: skip
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == str(chosen) and lines[0].startswith("--budget auto: ")
    assert f"under a {chosen.nbytes / MiB:.1f} MiB budget" in lines[1]


# -- for real: a memory-limited cgroup --------------------------------------------------------


def _cgroup_child(limit: int):
    """A new memory cgroup under this process's own with ``limit`` bytes, as (folder, the file
    to join it, the file that counts OOM kills), or a skip reason."""
    if os.geteuid() != 0:
        return "needs root to create a cgroup"
    with open("/proc/self/cgroup") as f:
        lines = [line.rstrip("\n").split(":", 2) for line in f]
    name = f"colibri-test-{uuid.uuid4().hex[:8]}"
    for hierarchy, controllers, path in lines:
        if hierarchy == "0" and not controllers and os.path.exists("/sys/fs/cgroup/cgroup.procs"):
            parent = "/sys/fs/cgroup" + path
            limit_file, events = "memory.max", "memory.events"
        elif "memory" in controllers.split(","):
            parent = "/sys/fs/cgroup/memory" + path
            limit_file, events = "memory.limit_in_bytes", "memory.oom_control"
        else:
            continue
        folder = os.path.join(parent, name)
        try:
            os.mkdir(folder)
            with open(os.path.join(folder, limit_file), "w") as f:
                f.write(str(limit))
        except OSError as exc:
            if os.path.isdir(folder):
                os.rmdir(folder)
            return f"no writable memory cgroup ({exc})"
        return folder, os.path.join(folder, "cgroup.procs"), os.path.join(folder, events)
    return "no memory cgroup"


def _write_big_checkpoint(folder) -> int:
    """A qwen3_moe checkpoint of 4 layers x 64 bf16 experts (768 MiB), written a layer per
    shard without building the model; returns the experts' bytes."""
    import torch
    from safetensors.torch import save_file

    from _support.hf_families import save_tokenizer

    H, I, E, L, V = 512, 1024, 64, 4, 128  # noqa: E741
    config = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=V,
                  hidden_size=H, intermediate_size=I, moe_intermediate_size=I,
                  num_hidden_layers=L, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  num_experts=E, num_experts_per_tok=8, max_position_embeddings=128,
                  tie_word_embeddings=False, dtype="bfloat16", norm_topk_prob=True)  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(0)

    def rand(*shape, scale=0.02):
        return (torch.randn(shape, generator=gen) * scale).to(torch.bfloat16)

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    shards = [{"model.embed_tokens.weight": rand(V, H), "lm_head.weight": rand(V, H),
               "model.norm.weight": ones(H)}]  # fmt: skip
    total = 0
    for layer in range(L):
        p = f"model.layers.{layer}."
        shard = {p + "input_layernorm.weight": ones(H), p + "post_attention_layernorm.weight":
                 ones(H), p + "self_attn.q_norm.weight": ones(64), p + "self_attn.k_norm.weight":
                 ones(64), p + "self_attn.q_proj.weight": rand(256, H),
                 p + "self_attn.k_proj.weight": rand(128, H), p + "self_attn.v_proj.weight":
                 rand(128, H), p + "self_attn.o_proj.weight": rand(H, 256),
                 p + "mlp.gate.weight": rand(E, H, scale=0.5)}  # fmt: skip
        for e in range(E):
            for proj, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                shard[f"{p}mlp.experts.{e}.{proj}.weight"] = rand(*shape)
                total += I * H * 2
        shards.append(shard)
    weight_map = {}
    for index, shard in enumerate(shards):
        file = f"model-{index:05d}.safetensors"
        save_file(shard, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    save_tokenizer(folder)
    return total


# The child joins the cgroup, then runs the command with the pager's read backend: its pool is
# anonymous memory the cgroup must hold (mapped weights are page cache, which the kernel
# reclaims under the limit instead of killing, so a budget too large would only thrash).
_CHILD = """
import sys
open(sys.argv[1], "w").write("0")
from colibri.cli import main
sys.exit(main([*sys.argv[2:], "--io", "read"]))
"""


def _uncache(folder) -> None:
    """Take ``folder``'s files out of the page cache: read again, they are charged to the
    cgroup that reads them, not to this process's."""
    for name in os.listdir(folder):
        fd = os.open(os.path.join(folder, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs Linux")
def test_a_run_in_a_memory_limited_cgroup(tmp_path):
    """768 MiB of experts, a cgroup of 700 MiB for the process and its page cache: with
    ``--budget auto`` the run finishes and the cgroup saw no OOM kill (a budget of 2 GiB is
    killed there; so is one that forgets the ~380 MiB the process holds after its imports)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    limit = 700 * MiB
    made = _cgroup_child(limit)
    if isinstance(made, str):
        pytest.skip(made)
    folder, procs, events = made
    try:
        experts = _write_big_checkpoint(tmp_path)
        assert experts > limit
        _uncache(tmp_path)
        result = subprocess.run(
            [sys.executable, "-c", _CHILD, procs, "generate", str(tmp_path), "--budget", "auto",
             "--max-new-tokens", "4", "--no-stream", "--threads", "1"],
            capture_output=True, text=True, timeout=600,
            env=dict(os.environ, PYTHONWARNINGS="ignore"),
        )  # fmt: skip
        with open(events) as f:
            oom_kills = [int(line.split()[1]) for line in f if line.startswith("oom_kill ")]
    finally:
        os.rmdir(folder)  # empty again: its one process has ended
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert oom_kills in ([], [0]), oom_kills
    first = result.stdout.splitlines()[0]
    assert first.startswith("--budget auto: ") and "cgroup v" in first, first
    assert f"{limit / MiB:.1f} MiB this process may use" in first, first
