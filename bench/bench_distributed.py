"""Expert parallelism on one machine: what the network costs and what it saves.

Every rank is its own process in its own memory cgroup (v1 or v2, made as root; without root
or a memory controller the rows say "no cgroup") whose limit is the rank's expert budget
plus ``--overhead`` for everything else of the process (Python, torch, the resident
weights), and whose storage reads are capped at ``--read-cap`` bytes/s (2 GB/s: a laptop's
NVMe drive), so that "N machines of X GiB" is simulated honestly: the page cache a rank
faults in is charged to it, and a miss costs what a drive costs. The ranks talk over
loopback (gloo). Rows, each a fresh set of processes, same checkpoint, same random prompt,
greedy decode, page cache emptied of the checkpoint before each row, then ``--warmup``
tokens of another prompt (the experts each rank holds paged in) before the timed ones:

- 1 rank with the whole budget (every expert held: the speed ceiling of one machine);
- 1 rank with one rank's budget (``--share`` of the experts: paging from disk);
- 1, 2 and 3 ranks at ``--share`` each (``--ranks``).

Columns: decode tok/s, bytes rank 0 sent and received per token and per MoE layer, the
per-layer round trip (rank 0's experts call: rows out, its own share, answers in, combined),
expert bytes read from storage per token (every rank's pager), read-ahead hits of the other
ranks, each rank's peak cgroup memory. The ratios at the end are the issue's targets: 2 ranks
at half the experts each >= 0.7x one rank holding all of them and >= 2x one rank paging at
half the memory.

    python bench/bench_distributed.py                      # the demo model (2.9 GiB)
    python bench/bench_distributed.py --shape tiny --tokens 8 --warmup 8 --read-cap 0
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

from _cgroups import Group, block_device, cgroup_kind
from bench_generate import _evict, _prompt, _status

from colibri._units import format_bytes, parse_size

SHAPES = {
    "demo": dict(),
    "tiny": dict(layers=4, hidden=256, expert_intermediate=256, vocab=1024, num_experts=16),
}
TARGETS = (
    ("2 ranks / 1 rank holding all", 2, "all", 0.7),
    ("2 ranks / 1 rank paging at one rank's budget", 2, "share", 2.0),
)


# -- cgroups --------------------------------------------------------------------------------


# -- one rank -------------------------------------------------------------------------------


class _Timed:
    """``model.colibri.remote`` (or None), its calls timed: each MoE layer's round trip."""

    def __init__(self, remote) -> None:
        self.remote, self.seconds = remote, []

    def __call__(self, *args):
        start = time.perf_counter()
        try:
            return self.remote(*args)
        finally:
            self.seconds.append(time.perf_counter() - start)

    def __getattr__(self, name):
        return getattr(self.remote, name)


def worker(spec: dict) -> dict | None:
    """One rank: load, warm up, then (rank 0) time a greedy decode; rank 0's figures."""
    import torch

    from colibri.integrations.transformers import from_pretrained

    torch.set_num_threads(spec["threads"])
    parallel = {"timeout": spec["timeout"]} if spec["world"] > 1 else None
    model = from_pretrained(spec["model"], budget=spec["budget"], expert_parallel=parallel,
                            num_threads=spec["threads"])  # fmt: skip
    if model is None:  # served rank 0 until it closed its model
        return None
    paging = model.colibri
    timed = _Timed(paging.remote) if paging.remote is not None else None
    if timed is not None:
        paging.remote = timed
    prompt = torch.tensor([_prompt(spec["model"], spec["prompt_tokens"])])
    stamps: list[float] = []

    def stamp(input_ids, scores):
        stamps.append(time.perf_counter())
        return scores

    with torch.no_grad():
        model.generate(torch.tensor([_prompt(spec["model"], 8, seed=1)]),
                       max_new_tokens=spec["warmup"], do_sample=False)  # fmt: skip
        sent = received = 0
        before: list[dict] = []
        if timed is not None:
            sent, received = timed.sent_bytes, timed.received_bytes
            before = timed.rank_stats()  # the other ranks' counters run on: subtracted
            timed.seconds.clear()
        paging.reset_stats()
        model.generate(prompt, max_new_tokens=spec["tokens"], do_sample=False,
                       logits_processor=[stamp])  # fmt: skip
    decoded = len(stamps) - 1  # the first stamp ends the prefill
    row = {"tok_s": decoded / (stamps[-1] - stamps[0]) if decoded > 0 else 0.0,
           "tokens": len(stamps), "moe_layers": len(paging.layers)}  # fmt: skip
    ranks = [{"bytes_read": paging.stats.bytes_read, "prefetch_hits": paging.stats.prefetch_hits}]
    if timed is not None:
        row["sent"] = timed.sent_bytes - sent
        row["received"] = timed.received_bytes - received
        calls = timed.seconds[len(paging.layers) :]  # the decode steps' (not the prefill's)
        row["round_trip_ms"] = 1e3 * sum(calls) / max(len(calls), 1)
        ranks[1:] = [{k: r[k] - b[k] for k in ranks[0]}
                     for r, b in zip(timed.rank_stats()[1:], before[1:], strict=True)]  # fmt: skip
    row["ranks"] = ranks
    row["status"] = _status()
    paging.close()
    return row


# -- a row: N ranks, each in its cgroup --------------------------------------------------------


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_row(args, world: int, budget: int, limit_s: float) -> dict:
    """Start ``world`` ranks of ``budget`` each, every one in its cgroup; rank 0's row with
    each rank's peak memory and OOM kills."""
    _evict(os.path.join(args.model, f) for f in os.listdir(args.model))
    port = str(_port())
    groups, procs = [], []
    kind = cgroup_kind() if os.geteuid() == 0 else None
    cap = int(args.read_cap) or None
    device = block_device(args.model) if kind is not None and cap else None
    try:
        for rank in reversed(range(world)):  # rank 0 last: the others are ready to serve
            group = None
            if kind is not None:
                group = Group(kind, f"colibri-bench-rank{rank}", budget + args.overhead, cap,
                              device)  # fmt: skip
            groups.insert(0, group)
            spec = {"model": args.model, "budget": budget, "world": world, "threads": args.threads,
                    "tokens": args.tokens, "prompt_tokens": args.prompt_tokens,
                    "warmup": args.warmup, "timeout": args.timeout}  # fmt: skip
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                   "OMP_NUM_THREADS": str(args.threads)}  # fmt: skip
            command = [sys.executable, __file__, "--worker", json.dumps(spec)]
            procs.insert(0, subprocess.Popen(command, env=env, text=True, stdout=subprocess.PIPE
                                             if rank == 0 else subprocess.DEVNULL,
                                             preexec_fn=group.join if group else None))  # fmt: skip
        text = procs[0].communicate(timeout=limit_s)[0].strip().splitlines()
        for proc in procs[1:]:
            proc.wait(timeout=30)
        row = json.loads(text[-1]) if procs[0].returncode == 0 and text else {"error": "failed"}
    except subprocess.TimeoutExpired:
        row = {"error": "timed out"}
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        row_peaks = [g.peak() if g else None for g in groups]
        row_kills = [g.oom_kills() if g else None for g in groups]
        for group in groups:
            if group is not None:
                group.remove()
    row.update(world=world, budget=budget, peaks=row_peaks, oom_kills=row_kills,
               cgroup=kind is not None)  # fmt: skip
    return row


def _kib(n: float) -> str:
    return f"{n / 1024:.1f} KiB"


def _show(name: str, row: dict) -> None:
    if "tok_s" not in row:
        print(f"| {name} | {row['world']} | {format_bytes(row['budget'])} | failed: "
              f"{row.get('error')} |")  # fmt: skip
        return
    tokens, layers = max(row["tokens"], 1), max(row["moe_layers"], 1)
    wire = row.get("sent", 0) + row.get("received", 0)
    read = sum(r["bytes_read"] for r in row["ranks"]) / tokens
    hits = sum(r["prefetch_hits"] for r in row["ranks"][1:])
    peaks = ", ".join(format_bytes(p) if p else "-" for p in row["peaks"])
    if not row["cgroup"]:
        peaks = "no cgroup"
    trip = f"{row['round_trip_ms']:.2f}" if "round_trip_ms" in row else "-"
    print(f"| {name} | {row['world']} | {format_bytes(row['budget'])} | {row['tok_s']:.2f} | "
          f"{_kib(wire / tokens)} | {_kib(wire / tokens / layers)} | {trip} | {_kib(read)} | "
          f"{hits} | {peaks} | {row['oom_kills']} |")  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="demo")
    parser.add_argument("--model", help="a checkpoint directory instead of --shape")
    parser.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/colibri"))
    parser.add_argument("--share", type=float, default=0.5,
                        help="each rank's budget, a fraction of the expert bytes")  # fmt: skip
    parser.add_argument("--ranks", default="1,2,3")
    parser.add_argument("--overhead", type=parse_size, default=parse_size("1GiB"),
                        help="each cgroup's memory beyond the budget (process, resident "
                             "weights)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1, help="threads per rank")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument(
        "--warmup",
        type=int,
        default=32,
        help="greedy tokens of another prompt first (experts paged in)",
    )
    parser.add_argument("--read-cap", type=float, default=2e9,
                        help="each group's storage reads, bytes/s, as a laptop's drive reads "
                             "(0: none)")  # fmt: skip
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    if args.worker:
        row = worker(json.loads(args.worker))
        if row is not None:
            print(json.dumps(row))
        return 0
    if args.model is None:
        from colibri.cli.demo import DemoShape, ensure_checkpoint

        args.model = str(ensure_checkpoint(args.cache_dir, DemoShape(**SHAPES[args.shape])))
    from colibri.integrations.transformers._checkpoint import Checkpoint

    experts = Checkpoint(args.model).expert_source().total_expert_nbytes
    share = int(experts * args.share)
    print(f"{args.model}: experts {format_bytes(experts)}; a rank's budget {args.share:g} of "
          f"them ({format_bytes(share)}); cgroup limit budget + {format_bytes(args.overhead)}, "
          f"reads capped at {args.read_cap:g} B/s; "
          f"{args.threads} thread(s) a rank; load {os.getloadavg()[0]:.1f}")  # fmt: skip
    print("\n| run | ranks | budget/rank | tok/s | wire/token | wire/layer | round trip ms "
          "| read/token | read-ahead hits | peak/rank | OOM kills |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")
    limit_s = 60 + 10 * args.tokens
    rows = {}
    for name, world, budget in [("1 rank, all experts", 1, experts + (16 << 20)),
                                *[(f"{n} rank(s) at the share", n, share)
                                  for n in map(int, args.ranks.split(","))]]:  # fmt: skip
        rows[(world, "all" if budget > share else "share")] = row = run_row(
            args, world, budget, limit_s
        )
        _show(name, row)
    print()
    for what, world, base, want in TARGETS:
        ours, theirs = rows.get((world, "share"), {}), rows.get((1, base), {})
        if ours.get("tok_s") and theirs.get("tok_s"):
            ratio = ours["tok_s"] / theirs["tok_s"]
            verdict = "met" if ratio >= want else "NOT met"
            print(f"{what}: {ratio:.2f}x (target >= {want}x: {verdict})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
