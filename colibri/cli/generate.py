"""``colibri generate MODEL_DIR --budget 3GiB --prompt "..."``: a checkpoint bigger than memory.

Loads a transformers MoE checkpoint directory with its routed experts paged under the budget
(:func:`colibri.integrations.transformers.from_pretrained`), streams the generated tokens and
ends with prefill and decode tokens/s, the pager's hit rate, bytes read per decoded token,
the recall of the next-layer prediction and the peak RSS against the budget.
"""

from __future__ import annotations

import argparse
import os
import time

from colibri._regular import check_regular
from colibri._units import format_bytes, parse_size, process_memory
from colibri._validate import check_page_size_kb, check_threads

__all__ = ["add_arguments", "budget", "compile_forward", "generate", "load", "policy_names", "run"]


def budget(text: str) -> int | str:
    """``--budget``: bytes from ``805306368``, ``768MiB``, ``3GiB``, ``3GB`` (10**9), or
    ``auto``."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return parse_size(text, "budget")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def policy_names() -> tuple[str, ...]:
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


def _checked(check, text: str) -> int:
    """``check(int(text))``, its ValueError as argparse's (which names the option)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer (got {text!r})") from None
    try:
        return check(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds (got {text!r})")
    return value


def _threads(text: str) -> int:
    return _checked(lambda n: check_threads(n, "the thread count"), text)


def _page_size(text: str) -> int:
    return _checked(check_page_size_kb, text)


def _prompt(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("the prompt is empty; give some text to continue")
    return text


def _partition_file(text: str) -> str:
    """A path naming a regular file (or a symlink to one)."""
    try:
        check_regular(text, "the partition file")
    except (OSError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


# Files a transformers tokenizer is saved in; at least one of the first holds its vocabulary.
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt",
                    "spiece.model", "sentencepiece.bpe.model", "tekken.json")  # fmt: skip
TOKENIZER_FILES = VOCABULARY_FILES + ("tokenizer_config.json", "special_tokens_map.json",
                                      "added_tokens.json", "merges.txt")  # fmt: skip


def check_tokenizer(folder: str | os.PathLike) -> None:
    """``folder`` holds a tokenizer's vocabulary, in regular files only."""
    found = [name for name in TOKENIZER_FILES if os.path.lexists(os.path.join(folder, name))]
    for name in found:
        check_regular(os.path.join(folder, name), "a tokenizer file")
    if not set(found) & set(VOCABULARY_FILES):
        raise FileNotFoundError(
            f"{folder}: no tokenizer files (one of {', '.join(VOCABULARY_FILES)}); fix: save "
            "the tokenizer beside the weights (tokenizer.save_pretrained(MODEL_DIR))"
        )


def add_arguments(parser: argparse.ArgumentParser, *, model: bool = True) -> None:
    """The ``generate`` options (``model=False``: all but MODEL_DIR, for ``colibri demo``)."""
    if model:
        parser.add_argument(
            "model_dir", metavar="MODEL_DIR", help="checkpoint directory, or a .gguf model file"
        )
        parser.add_argument(
            "--budget",
            type=budget,
            required=True,
            help="memory for expert weights: bytes or with a unit (805306368, 768MiB, 3GiB = "
            "3*2**30, 3GB = 3*10**9), or auto: what the memory this process may use leaves "
            "(cgroup limit or MemAvailable, less the resident weights and a margin)",
        )
        parser.add_argument(
            "--expert-parallel",
            action="store_true",
            help="spread the experts over the ranks of a torch.distributed (gloo) group; on by "
            "itself when started by torchrun with more than one process (docs/distributed.md)",
        )
        parser.add_argument(
            "--timeout",
            type=_seconds,
            default=None,
            help="expert parallel: seconds rank 0 waits for a rank before it fails (default 120)",
        )
        parser.add_argument(
            "--placement",
            default=None,
            metavar="FILE",
            help="expert parallel: a placement JSON (colibri.distributed.Placement.save)",
        )
    parser.add_argument(
        "--prompt", type=_prompt, default="The quick brown fox", help="text to continue"
    )
    parser.add_argument(
        "--max-new-tokens", type=_positive, default=32, help="tokens to generate (default 32)"
    )
    parser.add_argument(
        "--policy",
        default="adaptive",
        choices=policy_names(),
        help="pager cache policy (default: adaptive)",
    )
    parser.add_argument(
        "--page-size-kb", type=_page_size, default=64, help="pager page size (KiB, 4, 8, ... 64)"
    )
    parser.add_argument(
        "--threads",
        type=_threads,
        default=None,
        help="torch and routing threads (1 to 4x the CPUs)",
    )
    parser.add_argument(
        "--io",
        choices=("mmap", "read"),
        default=None,
        help="how the pager reads experts: mapped from the files (mmap) or read into its own "
        "memory (read, for files that may change or network file systems); default: mmap, "
        "or read around the page cache where memory cannot hold the files",
    )
    parser.add_argument(
        "--batch-size", type=_positive, default=1, help="copies of the prompt generated together"
    )
    parser.add_argument(
        "--read-ahead",
        default="gate",
        choices=("gate", "previous", "off"),
        help="read the next layer's experts ahead: its router on this layer's input (gate, "
        "default), the previous token's choices (previous), or not (off)",
    )
    parser.add_argument(
        "--no-read-ahead",
        dest="read_ahead",
        action="store_const",
        const="off",
        help="= --read-ahead off",
    )
    parser.add_argument(
        "--partition",
        type=_partition_file,
        default=None,
        help="a colibri Partition JSON: static expert partitioning",
    )
    parser.add_argument(
        "--topk-groups", type=_positive, default=1, help="groups per token with --partition"
    )
    parser.add_argument(
        "--sample", action="store_true", help="sample (temperature 1, top-k 50) instead of greedy"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for --sample")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="compile the model's forward with torch.compile (inductor, needs a C++ "
        "compiler) before generating; compiling takes time on the first tokens (tens of "
        "seconds), counted in the prefill figure",
    )
    parser.add_argument(
        "--no-stream", dest="stream", action="store_false", help="print the text at the end only"
    )


class _Streamer:
    """A transformers streamer: prints the first sequence's new text and times the steps.

    The text is decoded a few tokens at a time (:meth:`text`), not the whole of it again for
    each token (which grows with its length: 0.2 ms a token at 1,024 tokens, 0.9 at 4,096)."""

    def __init__(self, tokenizer, stream: bool, paging) -> None:
        self.tokenizer, self.stream, self.paging = tokenizer, stream, paging
        self.calls = 0
        self.first = None  # perf_counter when the first new token came (prefill done)
        self.bytes_at_first = 0
        self.ids: list[int] = []
        self.start = 0  # ids[start:read]: the last printed tokens, decoded again as context
        self.read = 0  # ids before it are printed

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 1:  # the prompt
            return
        if self.first is None:
            self.first = time.perf_counter()
            self.bytes_at_first = self.paging.stats.bytes_read
        self.ids.append(int(value.reshape(-1)[0]))
        if self.stream and self.tokenizer is not None:
            text = self.text()
            if text:
                print(text, end="", flush=True)

    def text(self, last: bool = False) -> str:
        """The text of the tokens not printed yet: ``ids[start:]`` decoded less the text of
        ``ids[start:read]`` (decoded as context: a tokenizer may drop a word's leading space
        at the start of a text). Empty while it ends in a part of a character (unless
        ``last``) or adds nothing. Each window starts where a whole text ended, so the
        pieces add up to the whole text's decoding."""
        decode = self.tokenizer.decode
        before = decode(self.ids[self.start : self.read], skip_special_tokens=True)
        text = decode(self.ids[self.start :], skip_special_tokens=True)
        if len(text) <= len(before) or (text.endswith("\ufffd") and not last):
            return ""
        self.start, self.read = self.read, len(self.ids)
        return text[len(before) :]

    def end(self) -> None:
        if self.stream:
            if self.tokenizer is not None:
                print(self.text(last=True), end="")
            print(flush=True)


def compile_forward(model, backend: str = "inductor") -> None:
    """Replace ``model.forward`` by ``torch.compile`` of it, one graph (``fullgraph=True``:
    colibri's routing and paged experts are custom operators, no graph break); compiled on
    the first call, again when the shapes change (prefill, then decode)."""
    import torch

    model.forward = torch.compile(model.forward, fullgraph=True, backend=backend)


def generate(model, tokenizer, args, *, out=print, compile_backend: str = "inductor") -> dict:
    """Generate with a model from ``from_pretrained`` and print the figures; returns them.
    ``args.compile``: :func:`compile_forward` first, with ``compile_backend``."""
    import torch

    if getattr(args, "compile", False):
        compile_forward(model, compile_backend)
    paging = model.colibri
    encoded = tokenizer([args.prompt] * args.batch_size, return_tensors="pt")
    prompt_len = int(encoded["input_ids"].shape[1])
    if prompt_len == 0:
        raise ValueError(f"--prompt {args.prompt!r} is no token for this tokenizer; give text")
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
    recall = paging.prediction[paging.read_ahead] if paging.read_ahead != "off" else None
    mem = process_memory()
    figures = {
        "prompt_tokens": prompt_len * args.batch_size,
        "new_tokens": new * args.batch_size,
        "prefill_tok_s": prompt_len * args.batch_size / prefill_s if prefill_s > 0 else 0.0,
        "decode_tok_s": decode_tokens / decode_s if decode_s > 0 and decode_tokens else 0.0,
        "hit_rate": stats.hit_rate,
        "bytes_per_token": decode_bytes / decode_tokens if decode_tokens else 0.0,
        "recall": recall.recall if recall is not None else None,
        "peak_rss": mem.peak,
        "budget": paging.pager.budget_bytes,
        "resident_bytes": paging.resident_bytes,
        "rss": mem.rss,
        "anon": mem.anon,
        "file": mem.file,
    }
    out(
        f"prefill {figures['prompt_tokens']} tokens in {prefill_s:.2f} s "
        f"({figures['prefill_tok_s']:.1f} tok/s); decode {decode_tokens} tokens in "
        f"{decode_s:.2f} s ({figures['decode_tok_s']:.1f} tok/s)"
    )
    shown = f"{recall.recall:.1%}" if recall is not None else "n/a (read-ahead off)"
    out(
        f"pager: hit rate {stats.hit_rate:.1%}, {format_bytes(figures['bytes_per_token'])} read "
        f"per decoded token, next-layer prediction ({paging.read_ahead}) recall {shown}, "
        f"{stats.advised} experts read ahead"
    )
    extra = ""
    if mem.anon is not None:
        extra = f" (RssAnon {format_bytes(mem.anon)}, RssFile {format_bytes(mem.file)} now)"
    peak = format_bytes(mem.peak) if mem.peak is not None else "unknown"
    out(
        f"peak RSS {peak} against a budget of {format_bytes(figures['budget'])} for "
        f"experts + {format_bytes(paging.resident_bytes)} of resident weights{extra}"
    )
    return figures


def load(args, budget: int):
    """The model and tokenizer of ``args.model_dir`` (experts paged under ``budget``)."""
    import torch

    from colibri.integrations.transformers import from_pretrained

    gguf = _is_gguf(args.model_dir)
    if not gguf:  # a GGUF file holds its tokenizer; transformers reads it from there
        check_tokenizer(args.model_dir)  # before the weights: a model without one is no use here
    if args.threads:
        torch.set_num_threads(args.threads)
    io = {"io": args.io} if getattr(args, "io", None) else {}
    parallel = _expert_parallel(args)
    model = from_pretrained(
        args.model_dir,
        budget=budget,
        policy=args.policy,
        page_size_kb=args.page_size_kb,
        read_ahead=args.read_ahead,
        num_threads=args.threads,
        partition=args.partition,
        topk_groups=args.topk_groups,
        **io,
        **parallel,
    )
    if model is None:  # a rank that served rank 0's experts until rank 0 was done
        return None, None
    try:
        from transformers import AutoTokenizer

        folder, file = args.model_dir, {}
        if gguf:  # the file's folder and name (a split model's first part) for transformers
            folder, name = os.path.split(model.colibri.checkpoint.path)
            file = {"gguf_file": name}
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False, **file)
    except (OSError, ValueError) as exc:
        model.colibri.close()
        raise ValueError(
            f"{args.model_dir}: transformers cannot load its tokenizer ({exc})"
        ) from None
    except BaseException:
        model.colibri.close()
        raise
    return model, tokenizer


def _expert_parallel(args) -> dict:
    """``from_pretrained``'s ``expert_parallel`` option: with ``--expert-parallel`` or under
    torchrun with more than one process, else none."""
    from colibri.distributed import DEFAULT_TIMEOUT, launched

    if not hasattr(args, "expert_parallel"):  # colibri demo: one process
        return {}
    if not (args.expert_parallel or launched()):
        return {}
    timeout = getattr(args, "timeout", None) or DEFAULT_TIMEOUT
    return {"expert_parallel": {"timeout": timeout, "placement": getattr(args, "placement", None)}}


def _is_gguf(path: str) -> bool:
    """A GGUF model file, as ``from_pretrained`` tells (a ``*.gguf`` name, no directory)."""
    return str(path).endswith(".gguf") and not os.path.isdir(path)


def describe(model) -> str:
    paging = model.colibri
    cfg = model.config
    counts = sorted(set(paging.layers.values()))
    experts = counts[0] if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    return (
        f"{paging.checkpoint.path} ({cfg.model_type}): {len(paging.layers)} MoE layers x "
        f"{experts} experts, {format_bytes(paging.expert_bytes)} of experts paged under a "
        f"{format_bytes(paging.pager.budget_bytes)} budget ({paging.pager.policy}, "
        f"{paging.pager.page_size // 1024} KiB pages), {format_bytes(paging.resident_bytes)} "
        "resident"
    )


def requirements(command: str) -> None:
    """torch, transformers and accelerate, or an ImportError saying what to install."""
    try:
        import accelerate  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            f"colibri {command} needs torch, transformers and accelerate ({exc}); fix: pip "
            "install 'colibri-moe[cli]' torch"
        ) from None


def run(args: argparse.Namespace) -> int:
    """Entry point of ``colibri generate`` (errors: see :func:`colibri.cli.main`)."""
    if not os.path.isdir(args.model_dir) and not _is_gguf(args.model_dir):
        raise NotADirectoryError(
            f"{args.model_dir}: not a checkpoint directory (nor a .gguf model file)"
        )
    requirements("generate")
    model, tokenizer = load(args, args.budget)
    if model is None:  # expert parallel: this rank served rank 0, which prints the text
        return 0
    try:
        if model.colibri.auto_budget is not None:
            print(model.colibri.auto_budget)
        print(describe(model))
        generate(model, tokenizer, args)
    finally:
        model.colibri.close()
    return 0
