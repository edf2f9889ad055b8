"""``colibri generate MODEL_DIR --budget 3GiB --prompt "..."``: a checkpoint bigger than memory.

Loads a transformers MoE checkpoint directory with its routed experts paged under the budget
(:func:`colibri.integrations.transformers.from_pretrained`), streams the generated tokens and
ends with prefill and decode tokens/s, the pager's hit rate, bytes read per decoded token,
the recall of the next-layer prediction and the peak RSS against the budget.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

__all__ = ["add_arguments", "memory", "run", "generate"]


def _size(text: str) -> int:
    from colibri.integrations.transformers._paged import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("from_pretrained(): ", "")) from None


def _policy_names() -> tuple[str, ...]:
    """The cache policies a run can start with ("hot" needs saved usage counts)."""
    from colibri.pager import POLICIES

    return tuple(name for name in POLICIES if name != "hot")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 (got {text!r})")
    return value


def add_arguments(parser: argparse.ArgumentParser, *, model: bool = True) -> None:
    """The ``generate`` options (``model=False``: all but MODEL_DIR, for ``colibri demo``)."""
    if model:
        parser.add_argument("model_dir", metavar="MODEL_DIR", help="checkpoint directory")
        parser.add_argument(
            "--budget",
            type=_size,
            required=True,
            help="memory for expert weights: bytes or with a unit (805306368, 768MiB, 3GiB)",
        )
    parser.add_argument("--prompt", default="The quick brown fox", help="text to continue")
    parser.add_argument(
        "--max-new-tokens", type=_positive, default=32, help="tokens to generate (default 32)"
    )
    parser.add_argument(
        "--policy",
        default="adaptive",
        choices=_policy_names(),
        help="pager cache policy (default: adaptive)",
    )
    parser.add_argument("--page-size-kb", type=int, default=64, help="pager page size (KiB)")
    parser.add_argument("--threads", type=_positive, default=None, help="torch and routing threads")
    parser.add_argument(
        "--batch-size", type=_positive, default=1, help="copies of the prompt generated together"
    )
    parser.add_argument(
        "--prefetch",
        default="gate",
        choices=("gate", "previous", "off"),
        help="read the next layer's experts ahead: its router on this layer's input (gate, "
        "default), the previous token's choices (previous), or not (off)",
    )
    parser.add_argument(
        "--no-prefetch", dest="prefetch", action="store_const", const="off", help="= --prefetch off"
    )
    parser.add_argument(
        "--partition", default=None, help="a colibri Partition JSON: static expert partitioning"
    )
    parser.add_argument(
        "--topk-groups", type=_positive, default=1, help="groups per token with --partition"
    )
    parser.add_argument(
        "--sample", action="store_true", help="sample (temperature 1, top-k 50) instead of greedy"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for --sample")
    parser.add_argument(
        "--no-stream", dest="stream", action="store_false", help="print the text at the end only"
    )


def memory() -> dict[str, int]:
    """This process's memory in bytes: ``peak`` (VmHWM, resident set high-water mark) and,
    on Linux, ``anon`` (RssAnon) and ``file`` (RssFile: mapped file pages)."""
    found: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                name = {"VmHWM": "peak", "RssAnon": "anon", "RssFile": "file", "VmRSS": "rss"}
                if key in name:
                    found[name[key]] = int(value.split()[0]) * 1024
    except OSError:
        pass
    if "peak" not in found:
        try:
            import resource

            scale = 1 if sys.platform == "darwin" else 1024
            found["peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
        except ImportError:  # Windows
            import psutil

            found["peak"] = psutil.Process().memory_info().peak_wset
    return found


def _mib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


class _Streamer:
    """A transformers streamer: prints the first sequence's new text and times the steps."""

    def __init__(self, tokenizer, stream: bool, paging) -> None:
        self.tokenizer, self.stream, self.paging = tokenizer, stream, paging
        self.calls = 0
        self.first = None  # perf_counter when the first new token came (prefill done)
        self.bytes_at_first = 0
        self.ids: list[int] = []
        self.printed = 0

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 1:  # the prompt
            return
        if self.first is None:
            self.first = time.perf_counter()
            self.bytes_at_first = self.paging.stats.bytes_read
        self.ids.append(int(value.reshape(-1)[0]))
        if self.stream and self.tokenizer is not None:
            text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                print(text[self.printed :], end="", flush=True)
                self.printed = len(text)

    def end(self) -> None:
        if self.stream:
            print(flush=True)


def generate(model, tokenizer, args, *, out=print) -> dict:
    """Generate with a model from ``from_pretrained`` and print the figures; returns them."""
    import torch

    paging = model.colibri
    if tokenizer is None:
        raise SystemExit("colibri generate: no tokenizer in the checkpoint directory")
    encoded = tokenizer([args.prompt] * args.batch_size, return_tensors="pt")
    prompt_len = int(encoded["input_ids"].shape[1])
    if args.stream:
        print(args.prompt, end="", flush=True)
    streamer = _Streamer(tokenizer, args.stream, paging)
    paging.reset_stats()
    options = dict(max_new_tokens=args.max_new_tokens, streamer=streamer)
    options["pad_token_id"] = tokenizer.pad_token_id or tokenizer.eos_token_id or 0
    if args.sample:
        torch.manual_seed(args.seed)
        options.update(do_sample=True, top_k=50, temperature=1.0)
    else:
        options.update(do_sample=False)
    start = time.perf_counter()
    with torch.no_grad():
        output = model.generate(**encoded, **options)
    end = time.perf_counter()
    if not args.stream:
        out(tokenizer.decode(output[0], skip_special_tokens=True))
    new = int(output.shape[1]) - prompt_len
    stats = paging.stats
    first = streamer.first or end
    prefill_s = first - start
    decode_tokens = max(new - 1, 0) * args.batch_size
    decode_s = end - first
    decode_bytes = stats.bytes_read - streamer.bytes_at_first
    recall = paging.prediction[paging.prefetch] if paging.prefetch != "off" else None
    mem = memory()
    figures = {
        "prompt_tokens": prompt_len * args.batch_size,
        "new_tokens": new * args.batch_size,
        "prefill_tok_s": prompt_len * args.batch_size / prefill_s if prefill_s > 0 else 0.0,
        "decode_tok_s": decode_tokens / decode_s if decode_s > 0 and decode_tokens else 0.0,
        "hit_rate": stats.hit_rate,
        "bytes_per_token": decode_bytes / decode_tokens if decode_tokens else 0.0,
        "recall": recall.recall if recall is not None else None,
        "peak_rss": mem["peak"],
        "budget": paging.pager.budget_bytes,
        "resident_bytes": paging.resident_bytes,
        **{k: v for k, v in mem.items() if k != "peak"},
    }
    out(
        f"prefill {figures['prompt_tokens']} tokens in {prefill_s:.2f} s "
        f"({figures['prefill_tok_s']:.1f} tok/s); decode {decode_tokens} tokens in "
        f"{decode_s:.2f} s ({figures['decode_tok_s']:.1f} tok/s)"
    )
    shown = f"{recall.recall:.1%}" if recall is not None else "n/a (prefetch off)"
    out(
        f"pager: hit rate {stats.hit_rate:.1%}, {_mib(figures['bytes_per_token'])} read per "
        f"decoded token, next-layer prediction ({paging.prefetch}) recall {shown}, "
        f"{stats.advised} experts read ahead"
    )
    extra = ""
    if "anon" in mem:
        extra = f" (RssAnon {_mib(mem['anon'])}, RssFile {_mib(mem['file'])} now)"
    out(
        f"peak RSS {_mib(mem['peak'])} against a budget of {_mib(figures['budget'])} for "
        f"experts + {_mib(paging.resident_bytes)} of resident weights{extra}"
    )
    return figures


def load(args, budget: int):
    """The model and tokenizer of ``args.model_dir`` (experts paged under ``budget``)."""
    import torch

    from colibri.integrations.transformers import from_pretrained

    if args.threads:
        torch.set_num_threads(args.threads)
    model = from_pretrained(
        args.model_dir,
        budget=budget,
        policy=args.policy,
        page_size_kb=args.page_size_kb,
        prefetch=args.prefetch,
        num_threads=args.threads,
        partition=args.partition,
        topk_groups=args.topk_groups,
    )
    tokenizer = None
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    except (OSError, ValueError) as exc:
        model.colibri.close()
        raise SystemExit(
            f"colibri generate: {args.model_dir} has no tokenizer transformers can load ({exc})"
        ) from None
    return model, tokenizer


def describe(model) -> str:
    paging = model.colibri
    cfg = model.config
    layers = len(paging.layers)
    experts = paging.layers[0].num_experts
    return (
        f"{paging.checkpoint.path} ({cfg.model_type}): {layers} MoE layers x {experts} experts, "
        f"{_mib(paging.expert_bytes)} of experts paged under a {_mib(paging.pager.budget_bytes)} "
        f"budget ({paging.pager.policy}, {paging.pager.page_size // 1024} KiB pages), "
        f"{_mib(paging.resident_bytes)} resident"
    )


def run(args: argparse.Namespace) -> int:
    """Entry point of ``colibri generate``."""
    from colibri.integrations.transformers import CheckpointError
    from colibri.pager import BudgetError

    if not os.path.isdir(args.model_dir):
        print(f"colibri generate: {args.model_dir!r} is not a directory", file=sys.stderr)
        return 2
    try:
        model, tokenizer = load(args, args.budget)
    except (CheckpointError, BudgetError) as exc:
        print(f"colibri generate: {exc}", file=sys.stderr)
        return 2
    try:
        print(describe(model))
        generate(model, tokenizer, args)
    finally:
        model.colibri.close()
    return 0
