"""Generation from a checkpoint bigger than its budget: colibri against the peers.

Every measurement runs in a fresh process (peak RSS is per process), optionally under
``flock -x LOCK`` taken for that process alone, on the same checkpoint, batch 1, a random
16-token prompt, greedy decode; ``--repeat N`` runs each N times and prints medians with
min-max:

- colibri (``from_pretrained``, experts paged) at budgets of 12.5/25/50/100% of the expert
  bytes, with the page cache warm, cold (files evicted with ``posix_fadvise(DONTNEED)``
  before the run) and emptied after every token (what a model bigger than RAM lives through),
  for each read-ahead mode asked for;
- transformers with everything resident (the speed ceiling);
- transformers + accelerate disk offload (``device_map="auto"``, ``max_memory``,
  ``offload_folder``) at the 25% budget;
- llama.cpp (llama-cpp-python, when installed) on the checkpoint converted to GGUF f16 by
  llama.cpp's own converter (taken from the sdist of the installed llama-cpp-python, cached
  with the GGUF beside the checkpoint), mmap on, warm and emptied after every token.

"read/token" is what the process read from storage (``/proc/self/io`` ``read_bytes``) per
decoded token; for colibri "asked" is what the pager fetched (the missed experts' pages, plus
read-ahead) and "read/asked" their ratio.

    python bench/bench_generate.py --lock /tmp/colibri-quiet.lock --repeat 3
    python bench/bench_generate.py --shape olmoe         # 64 experts, top-8
    python bench/bench_generate.py --budgets 0.25 --cache warm --read-ahead off,gate --peers ""

``--breakdown`` adds, under each colibri row, where a decoded token's time goes (exclusive
wall time on the decoding thread, module hooks installed only with the flag): the routed
experts (kernels and their Python), paging (inside the pager's load / advise / prefetch:
waiting for reads), the other linears, attention (all but its linears), routing (the
routers), and the rest (norms, embeddings, the MoE blocks' glue, generate(), Python). The
hooks turn the decoder layers' one-call steps off (``model.colibri.decode``: a module with
hooks runs its own forward), so the breakdown is of the layers' own forward;
``bench/bench_decode.py`` times the steps against it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from colibri._units import process_memory

SHAPES = {
    "demo": dict(),
    "olmoe": dict(layers=12, hidden=1024, expert_intermediate=512, num_experts=64, top_k=8),
}
#: The issue's targets, as (what, ratio wanted).
TARGETS = {
    "full": "colibri 100% warm >= 0.8x llama.cpp f16 warm and >= 1.5x transformers resident",
    "offload": "colibri 25% warm >= 5x accelerate disk offload 25% warm",
    "emptied": "colibri 25% emptied: read <= 1.1x asked, tok/s >= 3x llama.cpp f16 emptied",
}


def _status() -> dict:
    mem = process_memory()
    return {"VmHWM": mem.peak, "VmRSS": mem.rss, "RssAnon": mem.anon, "RssFile": mem.file}


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


def _prompt(folder: str, n: int, seed: int = 0) -> list[int]:
    """The same random prompt for every engine (ids in [10, vocab)); ``seed`` picks another
    one (the rows of a batch)."""
    import numpy as np

    with open(os.path.join(folder, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    return np.random.default_rng(seed).integers(10, vocab, n).tolist()


def _llama(spec: dict, files: list[str], times: list[float], storage_at: list[int]):
    """Greedy decode through llama-cpp-python, mmap on; returns the Llama (kept alive)."""
    import llama_cpp
    import numpy as np

    n_ctx = spec["prompt_tokens"] + max(spec["tokens"], spec.get("warmup", 0)) + 8
    llm = llama_cpp.Llama(model_path=spec["gguf"], n_ctx=n_ctx,
                          n_threads=spec["threads"], n_threads_batch=spec["threads"],
                          use_mmap=True, verbose=False)  # fmt: skip
    if spec["cache"] in ("cold", "emptied"):
        _evict(files)
    return llm, lambda ids: _llama_generate(llm, ids, spec, files, times, storage_at, np)


def _llama_generate(llm, ids, spec, files, times, storage_at, np) -> None:
    times.append(time.perf_counter())
    storage_at.append(_storage_reads())
    _EVICTED.append(_EVICTED[-1])
    llm.eval(ids)
    for _ in range(spec["tokens"]):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        times.append(time.perf_counter())
        storage_at.append(_storage_reads())
        _EVICTED.append(_EVICTED[-1])
        if spec["cache"] == "emptied":
            _empty(files, unmap=True)  # unmap: what the kernel does under memory pressure
        llm.eval([token])


#: Seconds spent emptying the page cache, as of each token (the kernel does it in the
#: background under memory pressure: not part of a token's time).
_EVICTED: list[float] = [0.0]


def _empty(files: list[str], unmap: bool = False) -> None:
    """Empty the page cache of ``files`` (their mappings in this process first, if
    ``unmap``), the time it takes added to ``_EVICTED[-1]``."""
    start = time.perf_counter()
    if unmap:
        _unmap(files)
    _evict(files)
    _EVICTED[-1] += time.perf_counter() - start


def _unmap(files: list[str]) -> None:
    """Take this process's mappings of ``files`` out of its page tables (``MADV_DONTNEED``),
    so that ``_evict`` can drop their pages: the page cache keeps mapped pages."""
    import ctypes

    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].strip() in files:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if madvise(lo, hi - lo, 4):  # MADV_DONTNEED
                    raise OSError(ctypes.get_errno(), f"madvise({parts[5].strip()})")


#: The categories of ``--breakdown``, in print order ("rest" is the token's time left over).
WHERE = ("experts", "paging", "linears", "attention", "routing", "rest")


class _Breakdown:
    """Exclusive wall time per category on the calling thread: entering a category pauses
    the one it is nested in (an attention's linears count as linears, not attention)."""

    def __init__(self) -> None:
        self.spent = dict.fromkeys(WHERE[:-1], 0.0)
        self._stack: list[list] = []  # [category, since]

    def enter(self, category: str) -> None:
        now = time.perf_counter()
        if self._stack:
            top = self._stack[-1]
            self.spent[top[0]] += now - top[1]
        self._stack.append([category, now])

    def leave(self) -> None:
        now = time.perf_counter()
        category, since = self._stack.pop()
        self.spent[category] += now - since
        if self._stack:
            self._stack[-1][1] = now

    def hook(self, module, category: str) -> None:
        module.register_forward_pre_hook(lambda *_: self.enter(category))
        module.register_forward_hook(lambda *_: self.leave())

    def wrap(self, obj, name: str, category: str) -> None:
        method = getattr(obj, name)

        def timed(*args, **kwargs):
            self.enter(category)
            try:
                return method(*args, **kwargs)
            finally:
                self.leave()

        setattr(obj, name, timed)

    def install(self, model, paging) -> None:
        """Hooks on ``model`` (from from_pretrained) and its pager."""
        from torch import nn

        from colibri.integrations.transformers._patch import _STATE

        experts = {id(m) for m in paging.modules.values()}
        inside = set()
        for module in paging.modules.values():
            inside |= {id(m) for m in module.modules()}
        for module in model.modules():
            if id(module) in experts:
                self.hook(module, "experts")
            elif id(module) in inside:
                continue
            elif _STATE in module.__dict__:
                self.hook(module, "routing")
            elif isinstance(module, nn.Linear):
                self.hook(module, "linears")
            elif type(module).__name__.endswith("Attention"):
                self.hook(module, "attention")
        for name in ("load", "advise", "prefetch"):
            self.wrap(paging.pager, name, "paging")


def worker(spec: dict) -> dict:
    """One configuration, in this process."""
    import torch

    torch.set_num_threads(spec["threads"])
    folder = spec["model"]
    files = [os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors")]
    if spec["engine"] == "llama":
        files = [spec["gguf"]]
    if spec["cache"] in ("cold", "emptied"):
        _evict(files)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = time.perf_counter()
    paging = model = run = None
    times: list[float] = []
    experts_at: list[float] = [0.0]  # seconds inside the paged experts so far (colibri)
    experts_mark: list[float] = []
    breakdown = None
    where_mark: list[dict] = []  # breakdown.spent as of each token
    reads_at: list[int] = []
    storage_at: list[int] = []
    if spec["engine"] == "llama":
        model, run = _llama(spec, files, times, storage_at)
    elif spec["engine"] == "colibri":
        from colibri.integrations.transformers import from_pretrained

        model = from_pretrained(folder, budget=spec["budget"], read_ahead=spec["prefetch"],
                                policy=spec["policy"], page_size_kb=spec["page_size_kb"],
                                num_threads=spec["threads"], record_trace=True)  # fmt: skip
        paging = model.colibri
        _time_experts(experts_at)
        if spec.get("breakdown"):
            breakdown = _Breakdown()
            breakdown.install(model, paging)
    else:
        from transformers import AutoModelForCausalLM

        options = {}
        if spec["engine"] == "offload":
            options = dict(device_map="auto", max_memory={"cpu": spec["budget"]},
                           offload_folder=spec["offload_folder"])  # fmt: skip
        model = AutoModelForCausalLM.from_pretrained(folder, **options).eval()
        if spec["engine"] == "offload":  # what it maps per token is its offload folder
            root = spec["offload_folder"]
            files += [os.path.join(root, f) for f in os.listdir(root)]
    if spec["cache"] in ("cold", "emptied") and spec["engine"] != "llama":
        _evict(files)
    load_s = time.perf_counter() - start
    load_peak = _status()["VmHWM"]
    batch = spec.get("batch", 1)
    ids = _prompt(folder, spec["prompt_tokens"])
    rows = [_prompt(folder, spec["prompt_tokens"], seed=b) for b in range(batch)]

    class Clock:
        def put(self, value):
            times.append(time.perf_counter())
            experts_mark.append(experts_at[0])
            if breakdown is not None:
                where_mark.append(dict(breakdown.spent))
            reads_at.append(paging.stats.bytes_read if paging is not None else 0)
            storage_at.append(_storage_reads())
            _EVICTED.append(_EVICTED[-1])
            if spec["cache"] == "emptied":
                _empty(files)

        def end(self):
            pass

    if spec["cache"] == "warm" and spec.get("warmup"):
        _warm_up(spec, folder, model, paging)
    if run is not None:
        run(ids)
    else:
        with torch.no_grad():
            model.generate(torch.tensor(rows), do_sample=False, max_new_tokens=spec["tokens"],
                           streamer=Clock(), pad_token_id=0)  # fmt: skip
    # times[0]: prompt handed over; times[1]: first new token (prefill done)
    decode_tokens = len(times) - 2
    evict_s = _EVICTED[-2] - _EVICTED[1]  # the evictions between times[1] and times[-1]
    decode_s = times[-1] - times[1] - evict_s
    result = dict(spec, load_s=load_s, load_peak=load_peak, prefill_s=times[1] - times[0],
                  decode_tok_s=batch * decode_tokens / decode_s, **_status(),
                  storage_per_token=(storage_at[-1] - storage_at[1]) / (batch * decode_tokens),
                  batch=batch)  # fmt: skip
    if paging is not None:
        from colibri.pager import belady

        result["experts_ms"] = 1e3 * (experts_mark[-1] - experts_mark[1]) / decode_tokens
        result["token_ms"] = 1e3 * decode_s / decode_tokens
        result["linears"] = {
            f"{out}x{inp} {dtype}": [c.engine, c.rows, c.colibri_s, c.torch_s]
            for (out, inp, dtype), c in getattr(paging, "linears", {}).items()
        }  # model.colibri.linears: the engine of each shape, and the timings it chose by
        if breakdown is not None:
            where = {k: 1e3 * (where_mark[-1][k] - where_mark[1][k]) / decode_tokens
                     for k in WHERE[:-1]}  # fmt: skip
            where["rest"] = result["token_ms"] - sum(where.values())
            result["where_ms"] = where

        stats = paging.stats
        result.update(
            hit_rate=stats.hit_rate,
            asked_per_token=(reads_at[-1] - reads_at[1]) / (batch * decode_tokens),
            prefetched=stats.prefetched,
            prefetch_hits=stats.prefetch_hits,
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


def _warm_up(spec: dict, folder: str, model, paging) -> None:
    """A run of ``spec["warmup"]`` tokens on another prompt before the measured one, as a
    long-running server would be: mappings faulted in, colibri's cache filled by its policy;
    colibri's counters and trace restart after it."""
    other = _prompt(folder, spec["prompt_tokens"], seed=1000)
    if spec["engine"] == "llama":
        model.reset()
        model.eval(other)
        for _ in range(spec["warmup"]):
            model.eval([int(model.scores[model.n_tokens - 1].argmax())])
        model.reset()
        return
    import torch

    with torch.no_grad():
        model.generate(torch.tensor([other]), do_sample=False, max_new_tokens=spec["warmup"],
                       pad_token_id=0)  # fmt: skip
    if paging is not None:
        paging.reset_stats()
        if paging.pager.trace is not None:
            paging.pager.trace.steps.clear()


def _time_experts(spent: list[float]) -> None:
    """Add the wall time of every paged-experts call (paging and kernels) to ``spent[0]``:
    colibri's experts implementation, wrapped where transformers looks it up."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

    forward = ALL_EXPERTS_FUNCTIONS["colibri"]

    def timed(self, *args):
        start = time.perf_counter()
        try:
            return forward(self, *args)
        finally:
            spent[0] += time.perf_counter() - start

    ExpertsInterface.register("colibri", timed)


def _run(spec: dict, lock: str | None) -> dict:
    command = [sys.executable, __file__, "--worker", json.dumps(spec)]
    if lock:
        command = ["flock", "-x", lock, *command]
    env = dict(os.environ)
    out = subprocess.run(command, capture_output=True, text=True, timeout=1800, env=env)
    if out.returncode:
        return dict(spec, error=out.stderr.strip().splitlines()[-1] if out.stderr else "failed")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["load_avg"] = os.getloadavg()[0]
    return result


def _repeat(spec: dict, args) -> dict:
    """``args.repeat`` fresh runs of ``spec``: medians, and the tok/s range."""
    return _medians(spec, [_run(spec, args.lock) for _ in range(args.repeat)])


def _medians(spec: dict, runs: list[dict]) -> dict:
    """The first good run of ``runs`` with each measured number the median of the good runs
    (a number some runs lack: of those that have it), and the tok/s range; the first run if
    none is good."""
    good = [r for r in runs if "error" not in r]
    if not good:
        return runs[0]
    out = dict(good[0])
    for key, value in good[0].items():
        if isinstance(value, float | int) and not isinstance(value, bool) and key not in spec:
            out[key] = statistics.median(r[key] for r in good if r.get(key) is not None)
    speeds = [r["decode_tok_s"] for r in good]
    out.update(tok_s_min=min(speeds), tok_s_max=max(speeds), runs=len(good))
    return out


_HEADER = (
    "| engine | budget | cache | read-ahead | setting | decode tok/s | peak RSS GiB (load) "
    "| read/token MiB | asked/token MiB | read/asked | hit rate (Belady) "
    "| recall gate / previous | load avg |\n" + "| --- " * 13 + "|"
)


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f}"


def _converter(cache_dir: str) -> str:
    """llama.cpp's ``convert_hf_to_gguf.py`` from the sdist of the installed llama-cpp-python
    (``pip download`` once, then cached; only the sdist from source: its build requirements,
    cmake among them, as wheels, or pip compiles them to read its metadata)."""
    import tarfile

    import llama_cpp

    root = os.path.join(cache_dir, f"llama-cpp-python-{llama_cpp.__version__}")
    script = os.path.join(root, "convert_hf_to_gguf.py")
    if os.path.exists(script):
        return script
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--no-binary", "llama-cpp-python",
                        f"llama-cpp-python=={llama_cpp.__version__}", "-d", tmp],
                       check=True)  # fmt: skip
        (sdist,) = os.listdir(tmp)
        with tarfile.open(os.path.join(tmp, sdist)) as tar:
            prefix = tar.getnames()[0].split("/")[0] + "/vendor/llama.cpp/"
            keep = [m for m in tar.getmembers() if m.name.startswith(prefix)
                    and m.name[len(prefix):].split("/")[0] in
                    ("convert_hf_to_gguf.py", "conversion", "gguf-py")]  # fmt: skip
            for m in keep:
                m.name = m.name[len(prefix) :]
            tar.extractall(root + ".part", members=keep, filter="data")
        os.replace(root + ".part", root)
    return script


def _is_qwen2_pipeline(folder: str) -> bool:
    """The tokenizer splits text exactly as Qwen2's does (NFC, Qwen2's regex, byte level)."""
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    with open(os.path.join(folder, "tokenizer.json")) as f:
        tok = json.load(f)
    pre = tok.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [])
    return (tok.get("normalizer") == {"type": "NFC"} and len(steps) == 2
            and steps[0].get("type") == "Split" and steps[0].get("behavior") == "Isolated"
            and steps[0].get("pattern") == {"Regex": PRETOKENIZE_REGEX}
            and steps[1].get("type") == "ByteLevel"
            and steps[1].get("use_regex") is False)  # fmt: skip


def convert(job: dict) -> None:
    """Run llama.cpp's converter to f16 in this process. It knows tokenizers by a hash of
    their output; a locally trained one with Qwen2's exact pipeline is Qwen2's ("qwen2")."""
    import runpy

    here = os.path.dirname(job["script"])
    sys.path[:0] = [here, os.path.join(here, "gguf-py")]
    from conversion import base

    known = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            if _is_qwen2_pipeline(job["model"]):
                return "qwen2"
            raise

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    load = base.ModelBase.load_hparams

    def load_hparams(dir_model, is_mistral_format):
        hparams = load(dir_model, is_mistral_format)
        if not hparams.get("architectures"):  # transformers' own class for the model type
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

            hparams["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[hparams["model_type"]]]
        return hparams

    base.ModelBase.load_hparams = staticmethod(load_hparams)
    part = job["out"] + ".part"
    sys.argv = [job["script"], job["model"], "--outtype", "f16", "--outfile", part]
    runpy.run_path(job["script"], run_name="__main__")
    os.replace(part, job["out"])


def _gguf(folder: str, cache_dir: str) -> str | None:
    """The checkpoint as GGUF f16 beside it (converted once), or None saying why not."""
    out = folder.rstrip("/") + "-f16.gguf"
    if os.path.exists(out):
        return out
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        print(f"# llama.cpp not run: llama-cpp-python is not installed ({exc}); "
              "`pip install llama-cpp-python gguf` compiles it (~15 min on 2 cores)")  # fmt: skip
        return None
    job = dict(script=_converter(cache_dir), model=folder, out=out)
    done = subprocess.run([sys.executable, __file__, "--convert", json.dumps(job)],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode:
        tail = done.stderr.strip().splitlines()[-1:] or ["failed"]
        print(f"# llama.cpp not run: converting to GGUF failed: {tail[0]}")
        return None
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--convert", help=argparse.SUPPRESS)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="demo")
    parser.add_argument("--model", help="a checkpoint directory instead of --shape")
    parser.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/colibri"))
    parser.add_argument("--budgets", default="0.125,0.25,0.5,1.0", help="fractions of experts")
    parser.add_argument("--cache", default="warm,cold,emptied", help="page cache states")
    parser.add_argument("--read-ahead", default="gate", help="colibri modes (off,gate,previous)")
    parser.add_argument("--peers", default="resident,offload,llama", help="the other engines")
    parser.add_argument("--policy", default="adaptive")
    parser.add_argument("--page-size-kb", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=32,
                        help="tokens generated on another prompt before a warm row")  # fmt: skip
    parser.add_argument("--repeat", type=int, default=1, help="fresh runs per row (medians)")
    parser.add_argument("--breakdown", action="store_true",
                        help="print where a decoded token's time goes (colibri rows)")  # fmt: skip
    parser.add_argument("--lock", help="run each process under `flock -x LOCK`")
    parser.add_argument("--json", help="append every row here, one JSON object a line")
    parser.add_argument("--plot", help="write a picture of tok/s and peak RSS here (matplotlib)")
    parser.add_argument("--rows", help="print (and plot) the rows of these --json files instead")
    parser.add_argument("--tune", action="store_true",
                        help="also the tuning rows: batch 4/8, pages 4/32 KiB, 1 thread, "
                             "fifo/lru (25%% budget)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    if args.convert:
        convert(json.loads(args.convert))
        return 0
    if args.rows:
        return _replay(args)

    if args.model is None:
        from colibri.cli.demo import DemoShape, ensure_checkpoint

        shape = DemoShape(**SHAPES[args.shape])
        args.model = str(ensure_checkpoint(args.cache_dir, shape))
    from colibri.formats import open_weights

    index = os.path.join(args.model, "model.safetensors.index.json")
    source = open_weights(
        index if os.path.exists(index) else os.path.join(args.model, "model.safetensors")
    )
    expert_bytes = source.total_expert_nbytes
    # a slot is a whole number of pages, and an expert that starts inside a page touches one
    # more: what the pager charges for the experts, so that 100% holds them all
    slack = len(source.experts) * 2 * args.page_size_kb * 1024
    peers = [p for p in args.peers.split(",") if p]
    gguf = _gguf(args.model, args.cache_dir) if "llama" in peers else None
    base = dict(model=args.model, threads=args.threads, tokens=args.tokens, warmup=args.warmup,
                prompt_tokens=args.prompt_tokens, policy=args.policy,
                page_size_kb=args.page_size_kb, breakdown=args.breakdown)  # fmt: skip
    print(f"# {args.model}: {_gib(expert_bytes)} GiB of experts; batch 1, {args.prompt_tokens}"
          f"-token prompt, {args.tokens} greedy tokens, {args.threads} threads, policy "
          f"{args.policy}, {args.page_size_kb} KiB pages; warm rows after a {args.warmup}-token "
          f"warm-up on another prompt; {args.repeat} fresh processes a row "
          f"(median, min-max); load {os.getloadavg()[0]:.2f}")  # fmt: skip
    print(_HEADER)
    rows = []
    for fraction in [float(x) for x in args.budgets.split(",") if x]:
        for cache in args.cache.split(","):
            for prefetch in args.read_ahead.split(","):
                spec = dict(base, engine="colibri", budget=int((expert_bytes + slack) * fraction),
                            fraction=fraction, cache=cache, prefetch=prefetch)  # fmt: skip
                rows.append(_show(_repeat(spec, args), args))
    if args.tune:  # the knobs one at a time, from the defaults, at a 25% budget
        default = dict(batch=1, page_size_kb=args.page_size_kb, threads=args.threads,
                       policy=args.policy)  # fmt: skip
        for knob, values in (("batch", (4, 8)), ("page_size_kb", (4, 32)),
                             ("threads", (1,)), ("policy", ("fifo", "lru"))):  # fmt: skip
            for value in values:
                for cache in ("warm", "emptied") if knob == "page_size_kb" else ("warm",):
                    spec = dict(base, engine="colibri", budget=int((expert_bytes + slack) / 4),
                                fraction=0.25, cache=cache, prefetch=args.read_ahead.split(",")[0],
                                **dict(default, **{knob: value}))  # fmt: skip
                    rows.append(_show(_repeat(spec, args), args))
    with tempfile.TemporaryDirectory() as offload:
        for peer in peers:
            if peer == "llama" and gguf is None:
                continue
            fraction = 0.25 if peer == "offload" else 1.0
            for cache in ("warm",) if peer == "resident" else ("warm", "emptied"):
                spec = dict(base, engine=peer, budget=int(expert_bytes * fraction), cache=cache,
                            fraction=fraction, prefetch="-", offload_folder=offload,
                            gguf=gguf)  # fmt: skip
                rows.append(_show(_repeat(spec, args), args))
    _ratios(rows)
    if args.plot:
        _plot(rows, args.plot)
    return 0


def _replay(args) -> int:
    """The table, the targets and the picture of rows measured before (``--json``)."""
    rows = []
    for path in args.rows.split(","):
        with open(path) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    print(_HEADER)
    args.json = None
    for r in rows:
        _show(r, args)
    _ratios(rows)
    if args.plot:
        _plot(rows, args.plot)
    return 0


def _find(rows, engine, fraction, cache, prefetch=None):
    for r in rows:
        if (r["engine"], r["fraction"], r["cache"]) == (engine, fraction, cache) and (
            prefetch is None or r["prefetch"] == prefetch
        ) and "error" not in r:  # fmt: skip
            return r
    return None


def _ratios(rows) -> None:
    """The issue's targets, as ratios of the rows measured in this run."""
    print("\n| target | measured | ratio | met |\n| --- | --- | --- | --- |")

    def say(what, ours, theirs, key, want, higher=True):
        if ours is None or theirs is None:
            print(f"| {what} | not measured | | |")
            return
        ratio = ours[key] / theirs[key] if theirs[key] else float("inf")
        met = ratio >= want if higher else ratio <= want
        print(f"| {what} | {ours[key]:.2f} vs {theirs[key]:.2f} | {ratio:.2f}x | "
              f"{'yes' if met else 'no'} (want {'>=' if higher else '<='} {want}x) |")  # fmt: skip

    full = _find(rows, "colibri", 1.0, "warm")
    say("100% warm vs llama.cpp f16 warm", full, _find(rows, "llama", 1.0, "warm"),
        "decode_tok_s", 0.8)  # fmt: skip
    say("100% warm vs transformers resident", full, _find(rows, "resident", 1.0, "warm"),
        "decode_tok_s", 1.5)  # fmt: skip
    llama = _find(rows, "llama", 1.0, "warm")
    if full is not None and "experts_ms" in full:
        rest = full["token_ms"] - full["experts_ms"]
        line = (f"| 100% warm, where a token goes | experts {full['experts_ms']:.1f} ms, the "
                f"rest of transformers {rest:.1f} ms")  # fmt: skip
        if llama is not None:
            budget = 1e3 / (0.8 * llama["decode_tok_s"])
            line += f"; 0.8x llama.cpp allows {budget:.1f} ms a token"
        print(line + " | | |")
    say("25% warm vs accelerate offload 25% warm", _find(rows, "colibri", 0.25, "warm"),
        _find(rows, "offload", 0.25, "warm"), "decode_tok_s", 5.0)  # fmt: skip
    emptied = _find(rows, "colibri", 0.25, "emptied")
    if emptied is not None and emptied.get("asked_per_token"):
        emptied = dict(emptied, ratio=emptied["storage_per_token"] / emptied["asked_per_token"])
        read = emptied["storage_per_token"] / 2**20
        print(f"| 25% emptied: storage read / pager asked | {read:.1f}"
              f" vs {emptied['asked_per_token'] / 2**20:.1f} MiB | {emptied['ratio']:.2f}x | "
              f"{'yes' if emptied['ratio'] <= 1.1 else 'no'} (want <= 1.1x) |")  # fmt: skip
    say("25% emptied vs llama.cpp f16 emptied", emptied, _find(rows, "llama", 1.0, "emptied"),
        "decode_tok_s", 3.0)  # fmt: skip


#: The settings of a plain row (others are shown in its "setting" column).
_DEFAULTS = dict(batch=1, page_size_kb=64, threads=2, policy="adaptive")


def _show(r: dict, args) -> dict:
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(r) + "\n")
    if "error" in r:
        print(f"| {r['engine']} | {r['fraction']:.1%} | {r['cache']} | {r['prefetch']} | "
              f"| failed: {r['error'][:80]} | | | | | | | |")  # fmt: skip
        return r
    hit = ""
    if "hit_rate" in r:
        hit = f"{r['hit_rate']:.1%} ({r['belady_hit_rate']:.1%})"
    recall = f"{r['recall_gate']:.1%} / {r['recall_previous']:.1%}" if "recall_gate" in r else ""
    asked = r.get("asked_per_token")
    ratio = f"{r['storage_per_token'] / asked:.2f}" if asked else ""
    speed = f"{r['decode_tok_s']:.2f}"
    if r.get("runs", 1) > 1:
        speed += f" ({r['tok_s_min']:.2f}-{r['tok_s_max']:.2f})"
    setting = " ".join(
        f"{k} {r[k]}"
        for k in ("batch", "page_size_kb", "threads", "policy")
        if k in r and r[k] != _DEFAULTS.get(k) and r["engine"] == "colibri"
    )
    print(f"| {r['engine']} | {r['fraction']:.1%} | {r['cache']} | {r['prefetch']} | {setting} "
          f"| {speed} | "
          f"{_gib(r['VmHWM'])} ({_gib(r['load_peak'])}) | {r['storage_per_token'] / 2**20:.1f} | "
          f"{asked / 2**20 if asked else 0:.1f} | {ratio} | {hit} | {recall} | "
          f"{r.get('load_avg', 0):.2f} |", flush=True)  # fmt: skip
    if "where_ms" in r:
        parts = ", ".join(f"{k} {r['where_ms'][k]:.2f}" for k in WHERE)
        print(f"|   where a token goes, ms of {r['token_ms']:.2f}: {parts} |" + " |" * 12)
        engines = ", ".join(
            f"{shape} {engine} <= {rows} rows"
            + (f" ({1e6 * ours:.0f} vs {1e6 * theirs:.0f} us)" if ours else "")
            for shape, (engine, rows, ours, theirs) in r.get("linears", {}).items()
        )
        print(f"|   linears (1 row: colibri vs torch): {engines} |" + " |" * 12)
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
        style = dict(marker="o", label=key, linestyle="-" if len(points) > 1 else "none")
        speed.plot(x, [p[1] for p in points], **style)
        memory.plot(x, [p[2] for p in points], **style)
    speed.set(xlabel="budget, % of expert bytes", ylabel="decode tokens/s", xscale="log",
              yscale="log")  # fmt: skip
    memory.set(xlabel="budget, % of expert bytes", ylabel="peak RSS, GiB", xscale="log")
    speed.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
