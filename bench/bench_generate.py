"""Generation from a checkpoint bigger than its budget: colibri against the peers.

Every configuration runs in a fresh process (peak RSS is per process) on the same
checkpoint, batch 1, a random 16-token prompt, greedy decode:

- colibri (``from_pretrained``, experts paged) at budgets of 12.5/25/50/100% of the expert
  bytes, with the page cache warm, cold (files evicted with ``posix_fadvise(DONTNEED)``
  before the run) and emptied after every token (what a model bigger than RAM lives through),
  for each prefetch mode asked for;
- transformers with everything resident (the speed ceiling);
- transformers + accelerate disk offload (``device_map="auto"``, ``max_memory``,
  ``offload_folder``) at the 25% budget.

llama.cpp (llama-cpp-python) is not run here: building it takes ~15 minutes of both cores.

    python bench/bench_generate.py                       # the demo checkpoint (2.9 GiB experts)
    python bench/bench_generate.py --shape olmoe         # 64 experts, top-8
    python bench/bench_generate.py --budgets 0.25 --cache warm --prefetch off,gate
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

SHAPES = {
    "demo": dict(),
    "olmoe": dict(layers=12, hidden=1024, expert_intermediate=512, num_experts=64, top_k=8),
}


def _status() -> dict:
    found = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                found[key] = int(value.split()[0]) * 1024
    return found


def _storage_reads() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def _evict(files) -> None:
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def worker(spec: dict) -> dict:
    """One configuration, in this process."""
    import torch

    torch.set_num_threads(spec["threads"])
    folder = spec["model"]
    files = [os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors")]
    if spec["cache"] in ("cold", "emptied"):
        _evict(files)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = time.perf_counter()
    paging = None
    if spec["engine"] == "colibri":
        from colibri.integrations.transformers import from_pretrained

        model = from_pretrained(folder, budget=spec["budget"], prefetch=spec["prefetch"],
                                policy=spec["policy"], page_size_kb=spec["page_size_kb"],
                                record_trace=True)  # fmt: skip
        paging = model.colibri
    else:
        from transformers import AutoModelForCausalLM

        options = {}
        if spec["engine"] == "offload":
            options = dict(device_map="auto", max_memory={"cpu": spec["budget"]},
                           offload_folder=spec["offload_folder"])  # fmt: skip
        model = AutoModelForCausalLM.from_pretrained(folder, **options).eval()
    load_s = time.perf_counter() - start
    load_peak = _status()["VmHWM"]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(10, model.config.vocab_size, (1, spec["prompt_tokens"]), generator=gen)
    times: list[float] = []
    reads_at: list[int] = []

    class Clock:
        def put(self, value):
            times.append(time.perf_counter())
            reads_at.append(paging.stats.bytes_read if paging is not None else 0)
            if spec["cache"] == "emptied":
                _evict(files)

        def end(self):
            pass

    storage = _storage_reads()
    with torch.no_grad():
        model.generate(ids, do_sample=False, max_new_tokens=spec["tokens"], streamer=Clock(),
                       pad_token_id=0)  # fmt: skip
    # times[0]: prompt handed over; times[1]: first new token (prefill done)
    decode_tokens = len(times) - 2
    decode_s = times[-1] - times[1]
    result = dict(spec, load_s=load_s, load_peak=load_peak, prefill_s=times[1] - times[0],
                  decode_tok_s=decode_tokens / decode_s, **_status(),
                  storage_per_token=(_storage_reads() - storage) / (decode_tokens + 1))  # fmt: skip
    if paging is not None:
        from colibri.pager import belady

        stats = paging.stats
        result.update(
            hit_rate=stats.hit_rate,
            bytes_per_token=(reads_at[-1] - reads_at[1]) / decode_tokens,
            resident_bytes=paging.resident_bytes,
            expert_bytes=paging.expert_bytes,
            recall_gate=paging.prediction["gate"].recall,
            recall_previous=paging.prediction["previous"].recall,
            precision_gate=paging.prediction["gate"].precision,
            read_seconds=stats.read_seconds,
            belady_hit_rate=belady(paging.pager.trace, paging.pager.capacity).hit_rate,
        )
        paging.close()
    return result


def _run(spec: dict) -> dict:
    out = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)],
                         capture_output=True, text=True, timeout=1800)  # fmt: skip
    if out.returncode:
        return dict(spec, error=out.stderr.strip().splitlines()[-1] if out.stderr else "failed")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="demo")
    parser.add_argument("--model", help="a checkpoint directory instead of --shape")
    parser.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/colibri"))
    parser.add_argument("--budgets", default="0.125,0.25,0.5,1.0", help="fractions of experts")
    parser.add_argument("--cache", default="warm,cold,emptied", help="page cache states")
    parser.add_argument("--prefetch", default="off,gate,previous", help="colibri modes")
    parser.add_argument("--peers", default="resident,offload", help="transformers peers")
    parser.add_argument("--policy", default="lru")
    parser.add_argument("--page-size-kb", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--plot", help="write a picture of tok/s and peak RSS here (matplotlib)")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0

    if args.model is None:
        from colibri.cli.demo import DemoShape, ensure_checkpoint

        shape = DemoShape(**SHAPES[args.shape])
        args.model = str(ensure_checkpoint(args.cache_dir, shape))
        expert_bytes = shape.expert_bytes
    else:
        from colibri.formats import open_weights

        index = os.path.join(args.model, "model.safetensors.index.json")
        single = os.path.join(args.model, "model.safetensors")
        expert_bytes = open_weights(index if os.path.exists(index) else single).total_expert_nbytes
    base = dict(model=args.model, threads=args.threads, tokens=args.tokens,
                prompt_tokens=args.prompt_tokens, policy=args.policy,
                page_size_kb=args.page_size_kb)  # fmt: skip
    print(f"# {args.model}: {_gib(expert_bytes)} GiB of experts; batch 1, {args.prompt_tokens}"
          f"-token prompt, {args.tokens} greedy tokens, {args.threads} threads; "
          f"load {os.getloadavg()[0]:.2f}")  # fmt: skip
    print("| engine | budget | cache | prefetch | decode tok/s | peak RSS GiB (load) | "
          "read/token MiB | hit rate (Belady) | recall gate / previous |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = []
    fractions = [float(x) for x in args.budgets.split(",") if x]
    for fraction in fractions:
        for cache in args.cache.split(","):
            for prefetch in args.prefetch.split(","):
                spec = dict(base, engine="colibri", budget=int(expert_bytes * fraction) + (1 << 20),
                            fraction=fraction, cache=cache, prefetch=prefetch)  # fmt: skip
                rows.append(_show(_run(spec)))
    with tempfile.TemporaryDirectory() as offload:
        for peer in args.peers.split(","):
            if not peer:
                continue
            fraction = 1.0 if peer == "resident" else 0.25
            for cache in ("warm", "emptied") if peer == "offload" else ("warm",):
                spec = dict(base, engine=peer, budget=int(expert_bytes * fraction), cache=cache,
                            fraction=fraction, prefetch="-", offload_folder=offload)  # fmt: skip
                rows.append(_show(_run(spec)))
    if args.plot:
        _plot(rows, args.plot)
    return 0


def _show(r: dict) -> dict:
    if "error" in r:
        print(f"| {r['engine']} | {r['fraction']:.1%} | {r['cache']} | {r['prefetch']} | "
              f"failed: {r['error'][:80]} | | | | |")  # fmt: skip
        return r
    hit = ""
    if "hit_rate" in r:
        belady = r.get("belady_hit_rate")
        hit = f"{r['hit_rate']:.1%}" + (f" ({belady:.1%})" if belady is not None else "")
    recall = f"{r['recall_gate']:.1%} / {r['recall_previous']:.1%}" if "recall_gate" in r else ""
    read = r.get("bytes_per_token", r["storage_per_token"]) / (1 << 20)
    print(f"| {r['engine']} | {r['fraction']:.1%} | {r['cache']} | {r['prefetch']} | "
          f"{r['decode_tok_s']:.2f} | {_gib(r['VmHWM'])} ({_gib(r['load_peak'])}) | "
          f"{read:.1f} | {hit} | {recall} |", flush=True)  # fmt: skip
    return r


def _plot(rows, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, memory) = plt.subplots(1, 2, figsize=(11, 4))
    lines: dict = {}
    for r in rows:
        if "error" in r:
            continue
        key = f"{r['engine']} {r['cache']}" + (f" {r['prefetch']}" if r["engine"] == "colibri"
                                               else "")  # fmt: skip
        lines.setdefault(key, []).append((r["fraction"], r["decode_tok_s"], r["VmHWM"] / 2**30))
    for key, points in lines.items():
        points.sort()
        x = [p[0] * 100 for p in points]
        speed.plot(x, [p[1] for p in points], marker="o", label=key)
        memory.plot(x, [p[2] for p in points], marker="o", label=key)
    speed.set(xlabel="budget, % of expert bytes", ylabel="decode tokens/s", xscale="log")
    memory.set(xlabel="budget, % of expert bytes", ylabel="peak RSS, GiB", xscale="log")
    speed.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
