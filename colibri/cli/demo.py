"""``colibri demo``: a real transformers MoE checkpoint, generated from under a memory budget.

On first run it writes, once, into a cache folder (``~/.cache/colibri``) a Qwen3-MoE
checkpoint with 26 routed experts per layer, top-2, attention with 16 query / 4 key-value
heads, norms, embeddings, random bfloat16 weights, sharded safetensors as
``save_pretrained`` writes them, and a byte-level BPE tokenizer trained locally with the
``tokenizers`` library (nothing is downloaded). Then it generates with the routed experts paged
from those files under a budget of 1/8 of their size (``colibri generate``'s figures: prefill
and decode tokens/s, hit rate, bytes read per token, prediction recall, peak RSS).
``--partition`` adds Static Expert Partitioning (groups learned from a warm-up run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from colibri._units import format_bytes
from colibri.cli.generate import budget, policy_names

__all__ = ["DemoShape", "add_arguments", "ensure_checkpoint", "run"]

NUM_EXPERTS = 26
TOP_K = 2


@dataclass(frozen=True)
class DemoShape:
    """The demo model's shape (defaults: 26 experts top-2, 2.9 GiB of bf16 experts)."""

    layers: int = 15
    hidden: int = 1024
    expert_intermediate: int = 1280
    vocab: int = 8192
    heads: int = 16
    kv_heads: int = 4
    head_dim: int = 64
    num_experts: int = NUM_EXPERTS
    top_k: int = TOP_K

    @property
    def name(self) -> str:
        return (
            f"demo-qwen3moe-L{self.layers}-E{self.num_experts}k{self.top_k}-H{self.hidden}-"
            f"I{self.expert_intermediate}-V{self.vocab}-A{self.heads}x{self.kv_heads}x"
            f"{self.head_dim}-bf16"
        )

    @property
    def expert_bytes(self) -> int:
        """Bytes of all routed experts (bf16)."""
        return self.layers * self.num_experts * 3 * self.hidden * self.expert_intermediate * 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's options to ``parser``."""
    default_cache = os.environ.get("COLIBRI_CACHE", str(Path.home() / ".cache" / "colibri"))
    parser.add_argument(
        "--cache-dir", default=default_cache, help="where the checkpoint is kept (%(default)s)"
    )
    parser.add_argument(
        "--budget", type=budget, default=None, help="expert memory (default: 1/8 of them)"
    )
    parser.add_argument("--page-size-kb", type=int, default=64, help="pager page size (KiB)")
    parser.add_argument(
        "--policy", default="adaptive", choices=policy_names(),
        help="pager cache policy (default: adaptive)",
    )  # fmt: skip
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch and routing threads (default 1: the other core reads experts ahead, and "
        "two torch threads stall whenever other work shares the cores; bench/README.md)",
    )  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=1, help="sequences (tokens) per step")
    parser.add_argument(
        "--partition", type=int, nargs="?", const=4, default=None, metavar="G",
        help="Static Expert Partitioning: route inside G groups (default 4) learned per layer "
        "from the experts a warm-up run used together; each token uses its best group",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    parser.add_argument("--layers", type=int, default=15, help="layers (15)")
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size (1024)")
    parser.add_argument("--prompt", default="The colibri is a small bird that", help="text")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (64)")
    parser.add_argument(
        "--read-ahead", default="gate", choices=("gate", "previous", "off"),
        help="read the next layer's experts ahead (default gate: layer l+1's router on layer "
        "l's input)",
    )  # fmt: skip
    parser.add_argument(
        "--no-read-ahead", dest="read_ahead", action="store_const", const="off",
        help="= --read-ahead off",
    )  # fmt: skip
    parser.add_argument("--expert-intermediate", type=int, default=1280, help="expert size I")
    parser.add_argument("--vocab", type=int, default=8192, help="tokenizer vocabulary")
    parser.add_argument("--sample", action="store_true", help="sample instead of greedy")
    parser.add_argument("--no-stream", dest="stream", action="store_false", help="print at the end")


# --------------------------------------------------------------------------------------
# The checkpoint.


def _config(shape: DemoShape, tokenizer):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=4 * shape.hidden,  # dense MLP size: unused, every layer is MoE
        moe_intermediate_size=shape.expert_intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        num_experts=shape.num_experts,
        num_experts_per_tok=shape.top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="bfloat16",
    )


def _tensors(config):
    """``(name, shape, std)`` of every tensor, in file order, with save_pretrained's names
    (per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight``)."""
    from accelerate import init_empty_weights
    from transformers import Qwen3MoeForCausalLM

    with init_empty_weights():
        model = Qwen3MoeForCausalLM(config)
    hidden = config.hidden_size
    for name, tensor in model.state_dict().items():
        shape = tuple(tensor.shape)
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            num, rows2, cols = shape
            for e in range(num):
                yield f"{base}{e}.gate_proj.weight", (rows2 // 2, cols), cols**-0.5
                yield f"{base}{e}.up_proj.weight", (rows2 // 2, cols), cols**-0.5
                yield f"{base}{e}.down_proj.weight", (cols, rows2 // 2), (rows2 // 2) ** -0.5
        elif name.endswith("mlp.experts.down_proj"):
            continue  # written with gate and up, expert by expert
        elif name.endswith("norm.weight"):
            yield name, shape, 0.0  # ones
        elif name.endswith("mlp.gate.weight"):
            yield name, shape, 2.0 * hidden**-0.5  # routers with spread-out logits
        elif name == "model.embed_tokens.weight":
            yield name, shape, 1.0
        else:
            yield name, shape, shape[-1] ** -0.5


def ensure_checkpoint(
    cache_dir: str | os.PathLike,
    shape: DemoShape = DemoShape(),
    seed: int = 0,
    progress: bool = True,
    shard_bytes: int = 256 << 20,
) -> Path:
    """The cached demo checkpoint directory for ``shape``, written (once, shard by shard,
    with a progress bar) if missing. A write that is interrupted leaves no directory."""
    import torch
    from safetensors.torch import save_file

    folder = Path(cache_dir).expanduser() / f"{shape.name}-s{seed}"
    if (folder / "model.safetensors.index.json").exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    for stale in folder.parent.glob(f".{folder.name}.partial-*"):  # left by a killed run
        if not _alive(stale.name.rpartition("-")[2]):
            shutil.rmtree(stale, ignore_errors=True)
    partial = folder.parent / f".{folder.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        tokenizer = _train_tokenizer(partial, shape.vocab, seed)
        config = _config(shape, tokenizer)
        plan = list(_tensors(config))
        total = sum(2 * _numel(s) for _, s, _ in plan)
        shards: list[list] = [[]]
        size = 0
        for item in plan:
            nbytes = 2 * _numel(item[1])
            if size and size + nbytes > shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(item)
            size += nbytes
        bar = _progress(total, f"writing the demo checkpoint ({format_bytes(total)})", progress)
        gen = torch.Generator().manual_seed(seed)
        weight_map = {}
        for i, items in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            tensors = {}
            for name, dims, std in items:
                if std == 0.0:
                    tensors[name] = torch.ones(dims, dtype=torch.bfloat16)
                else:
                    tensors[name] = (torch.randn(dims, generator=gen) * std).to(torch.bfloat16)
                weight_map[name] = file
            save_file(tensors, str(partial / file), metadata={"format": "pt"})
            bar.update(sum(t.numel() * 2 for t in tensors.values()))
            del tensors
        bar.close()
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (partial / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        config.save_pretrained(partial)
        os.replace(partial, folder)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return folder


def _alive(pid: str) -> bool:
    """Whether the process ``pid`` (a decimal string) still runs; False for a bad name."""
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _corpus(seed: int, words: int = 600_000):
    """Pseudo-text: Zipf-distributed made-up words (and some English), in sentences."""
    import numpy as np

    rng = np.random.default_rng(seed)
    consonants, vowels = "bcdfghjklmnprstvwz", "aeiou"
    syllables = [c + v for c in consonants for v in vowels]
    syllables += [c + v + "n" for c in consonants[:8] for v in vowels]
    english = (  # noqa: SIM905 (a word list reads better as text)
        "the of and to in is that it was for on are with as his they be at one have this from "
        "or had by word but what some we can out other were all there when up use your how "
        "said an each she which do their time if will way about many then them write would "
        "like so these her long make thing see him two has look more day could go come did "
        "number sound no most people my over know water than call first who may down side been "
        "now find small bird colibri fast wing flower quick brown fox jumps lazy dog"
    ).split()
    vocab = english + [
        "".join(rng.choice(syllables, size=rng.integers(1, 4))) for _ in range(20000)
    ]
    p = 1.0 / np.arange(1, len(vocab) + 1)
    drawn = rng.choice(len(vocab), size=words, p=p / p.sum())
    for i in range(0, words, 12):
        sentence = " ".join(vocab[w] for w in drawn[i : i + 12])
        yield sentence[:1].upper() + sentence[1:] + rng.choice([".", ".", ",", "?", "!"])


def _train_tokenizer(folder: Path, vocab_size: int, seed: int):
    """A byte-level BPE with Qwen2's pre-tokenisation, trained here on pseudo-text."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(_corpus(seed), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=specials[0], eos_token=specials[0], pad_token=specials[0]
    )
    fast.save_pretrained(folder)
    return fast


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=not enabled,
                dynamic_ncols=True)  # fmt: skip


# --------------------------------------------------------------------------------------
# Running it.


def _learn_partitions(model, tokenizer, groups: int) -> dict:
    """Per MoE layer, a Partition from the experts a warm-up prefill used together."""
    import torch

    import colibri

    ids: dict[int, list] = {}

    def recorder(layer: int):
        def record(module, args):
            ids.setdefault(layer, []).append(args[1].detach().reshape(-1, args[1].shape[-1]))

        return record

    hooks = [m.register_forward_pre_hook(recorder(layer))
             for layer, m in model.colibri.modules.items()]  # fmt: skip
    text = " ".join(_corpus(1, words=1200))
    with torch.no_grad():
        model(**tokenizer(text, return_tensors="pt", truncation=True, max_length=512))
    for hook in hooks:
        hook.remove()
    model.colibri.reset_stats()
    return {
        layer: colibri.Partition.from_usage(
            colibri.UsageStats.from_ids(torch.cat(seen).numpy(), model.colibri.layers[layer]),
            groups,
        )
        for layer, seen in ids.items()
    }


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns the process exit status."""
    from colibri.cli import generate

    generate.requirements("demo")

    for name in ("layers", "hidden", "expert_intermediate", "vocab", "max_new_tokens",
                 "batch_size"):  # fmt: skip
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1 (got {value})")
    shape = DemoShape(
        layers=args.layers,
        hidden=args.hidden,
        expert_intermediate=args.expert_intermediate,
        vocab=args.vocab,
    )
    start = time.perf_counter()
    folder = ensure_checkpoint(args.cache_dir, shape, args.seed, not args.no_progress)
    budget = args.budget if args.budget is not None else shape.expert_bytes // 8
    args.model_dir, args.partition_file, args.topk_groups = str(folder), None, 1
    learn = args.partition
    args.partition = None
    model, tokenizer = generate.load(args, budget)
    try:
        if learn:
            model = _with_partitions(model, tokenizer, learn, args, budget)
        print(generate.describe(model))
        print(
            f"checkpoint: {shape.layers} layers, {shape.num_experts} experts top-{shape.top_k}, "
            f"hidden {shape.hidden}, expert intermediate {shape.expert_intermediate}, vocab "
            f"{shape.vocab}; ready in {time.perf_counter() - start:.1f} s"
            + (f"; Static Expert Partitioning into {learn} groups" if learn else "")
        )
        generate.generate(model, tokenizer, args)
    finally:
        model.colibri.close()
    return 0


def _with_partitions(model, tokenizer, groups: int, args, budget: int):
    from colibri.integrations.transformers import from_pretrained

    partitions = _learn_partitions(model, tokenizer, groups)
    model.colibri.close()
    return from_pretrained(
        args.model_dir, budget=budget, policy=args.policy, page_size_kb=args.page_size_kb,
        read_ahead=args.read_ahead, num_threads=args.threads, partition=partitions,
        topk_groups=1,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point (``python -m colibri.demo``)."""
    from colibri.cli import main as colibri

    return colibri(["demo", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
