"""Coverage-guided fuzz campaigns (atheris, libFuzzer) over the targets of tests/test_fuzz.py.

Each target runs in a child process: libFuzzer mutates valid seed files of its format (flips,
inserts, deletes, splices, integer-boundary overwrites, JSON tokens from a dictionary), led by
the branches each input reaches in colibri's Python code and in the gguf package, and hands
every input to the same contract as the hypothesis fuzzer (``_support/contracts.py``): the
public parser must refuse it with colibri's documented error or return a result that checks out.
A broken contract or an undocumented exception is a failure, a signal or a memory blow-up
(``-rss_limit_mb``) a crash, an input running past ``-timeout`` seconds a hang; its input is
saved in ``fuzz_findings/`` beside the ledger, and the ledger's note names it. The counts
(inputs per target, how many were refused) are appended to the ledger, one entry per piece,
``"harness": "atheris"``. The ledger is ``--ledger``, else ``$COLIBRI_FUZZ_LEDGER``, else
``build/fuzz/ledger.jsonl`` under the repository root: a CI artifact, git-ignored, never a
tracked file.

Usage, from the repository root (needs the ``fuzz`` extra)::

    python tests/fuzz_atheris.py [--runs N] [--pieces P] [--ledger FILE] [TARGET ...]

``--runs``: inputs per target and piece (default 20000); no TARGET: all of them.
The exit status is 1 when any piece found a fault.

Besides the parsers of ``_support/contracts.py``, three targets drive the transformers loader
through its entry points on a checkpoint directory where one file is the fuzzed input
(:data:`LOADER_TARGETS`): ``checkpoint-config`` (``config.json``), ``checkpoint-index``
(``model.safetensors.index.json``), both read by ``Checkpoint`` and turned into the
transformers config as ``from_pretrained`` does, and ``checkpoint-partition`` (the
``--partition`` file, ``Partition.load`` with the model's expert count). Their contract: a
``CheckpointError`` / ``FormatError`` or a result that checks out, and the directory left as
it was.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# a campaign's record is an artifact of the run that made it, kept out of the source tree
LEDGER = os.environ.get("COLIBRI_FUZZ_LEDGER") or os.path.join(
    os.path.dirname(HERE), "build", "fuzz", "ledger.jsonl"
)
LOADER_TARGETS = ("checkpoint-config", "checkpoint-index", "checkpoint-partition")
TARGETS = ("json", "safetensors", "index", "manifest", "gguf", "partition", "stats", "trace",
           "dlpack-route", "dlpack-metadata", *LOADER_TARGETS)  # fmt: skip
TIMEOUT = 20  # seconds one input may take before libFuzzer calls it a hang
RSS_LIMIT_MB = 3072
TOKENS = ['"{"', '"}"', '"["', '"]"', '","', '":"', '"\\""', '"null"', '"true"', '"-1"', '"0"',
          '"1e309"', '"NaN"', '"9223372036854775807"', '"18446744073709551616"', '"\\\\u0000"',
          '"dtype"', '"shape"', '"data_offsets"', '"__metadata__"', '"F16"', '"BF16"', '"F32"',
          '"I8"', '"weight_map"', '"metadata"', '"total_size"', '"groups"', '"num_experts"',
          '"version"', '"format"', '"steps"', '"colibri.Partition"', '"tokens"', '"counts"',
          '"coactivation"', '"\\xff\\xff\\xff\\xff\\xff\\xff\\xff\\x7f"', '"\\x00\\x00\\x00\\x80"',
          '"GGUF"', '"model_type"', '"mixtral"', '"auto_map"', '"num_local_experts"',
          '"num_attention_heads"', '"transformers_weights"', '"text_config"']  # fmt: skip


# -- the loader's targets: one fuzzed file in an otherwise valid checkpoint directory ----------

#: A tiny mixtral: 2 experts in layer 0, one shard per expert.
_CONFIG = {
    "model_type": "mixtral", "vocab_size": 16, "hidden_size": 4, "intermediate_size": 2,
    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 2,
    "num_local_experts": 2, "num_experts_per_tok": 1, "max_position_embeddings": 8,
}  # fmt: skip
_EXPERT = "model.layers.0.block_sparse_moe.experts.{}.{}.weight"


def loader_dir(root: str) -> tuple[str, dict[str, bytes]]:
    """A valid checkpoint directory under ``root`` (made once); its JSON files' bytes."""
    import numpy as np
    from safetensors.numpy import save_file

    folder = os.path.join(root, "checkpoint")
    weight_map = {}
    if not os.path.isdir(folder):
        os.makedirs(folder)
        for e in range(2):
            shard = f"model-{e + 1:05d}-of-00002.safetensors"
            tensors = {_EXPERT.format(e, w): np.ones(s, np.float32)
                       for w, s in (("w1", (2, 4)), ("w3", (2, 4)), ("w2", (4, 2)))}  # fmt: skip
            save_file(tensors, os.path.join(folder, shard))
            weight_map.update(dict.fromkeys(tensors, shard))
        files = {
            "config.json": json.dumps(_CONFIG).encode(),
            "model.safetensors.index.json": json.dumps({"weight_map": weight_map}).encode(),
            "groups.json": json.dumps(
                {
                    "format": "colibri.Partition",
                    "version": 1,
                    "num_experts": 2,
                    "groups": [[0], [1]],
                }  # fmt: skip
            ).encode(),
        }
        for name, data in files.items():
            with open(os.path.join(folder, name), "wb") as f:
                f.write(data)
    files = {}
    for name in ("config.json", "model.safetensors.index.json", "groups.json"):
        with open(os.path.join(folder, name), "rb") as f:
            files[name] = f.read()
    return folder, files


def _listing(folder: str) -> dict[str, tuple[int, int]]:
    return {n: (os.lstat(os.path.join(folder, n)).st_mode, os.lstat(os.path.join(folder, n))
                .st_size) for n in os.listdir(folder)}  # fmt: skip


def _refuses_missing_experts(source, checkpoint) -> None:
    """from_pretrained's check of the experts against the model (2 experts, hidden 4,
    intermediate 2) raises CheckpointError for ``source``."""
    import types

    import torch

    from colibri import FormatError
    from colibri.integrations.transformers import _load

    module = types.SimpleNamespace(gate_up_proj=torch.empty(2, 4, 4, device="meta"))
    try:
        _load._check_experts([("model.layers.0.block_sparse_moe.experts", module)], source,
                             checkpoint)  # fmt: skip
    except FormatError:
        return
    raise AssertionError("a checkpoint missing experts passed from_pretrained's expert check")


def loader_check(target: str, root: str):
    """The contract of a loader target: ``check(data) -> accepted``."""
    from colibri import FormatError, Partition
    from colibri.integrations.transformers import _load
    from colibri.integrations.transformers._checkpoint import Checkpoint

    folder, valid = loader_dir(root)
    name = {"checkpoint-config": "config.json", "checkpoint-index": "model.safetensors.index.json",
            "checkpoint-partition": "groups.json"}[target]  # fmt: skip

    def check(data: bytes) -> bool:
        with open(os.path.join(folder, name), "wb") as f:
            f.write(data)
        before = _listing(folder)
        try:
            if target == "checkpoint-partition":
                result = Partition.load(os.path.join(folder, name), num_experts=2)
                assert sorted(e for g in result.groups for e in g) == [0, 1]
            else:
                checkpoint = Checkpoint(folder)
                _load._config(checkpoint)
                assert checkpoint.files and all(
                    os.path.dirname(f) == folder for f in checkpoint.files
                )
                source = checkpoint.expert_source()
                if len(source.experts) != 2:  # an index naming fewer: from_pretrained refuses
                    _refuses_missing_experts(source, checkpoint)
                    return False
        except FormatError:  # CheckpointError and UnsupportedCheckpointError are FormatErrors
            return False
        finally:
            assert _listing(folder) == before, "the loader changed the checkpoint directory"
            with open(os.path.join(folder, name), "wb") as f:
                f.write(valid[name])
        return True

    return check, [valid[name]]


# -- the child: one target under libFuzzer -----------------------------------------------------


def _seeds(contracts, target: str) -> list[bytes]:
    """Valid inputs of ``target``'s format (what libFuzzer mutates from)."""
    import numpy as np

    expert = contracts.EXPERT
    if target == "json":
        return [
            json.dumps(v).encode()
            for v in ({"a": [1, 2.5, None, True], "b": {"c": "d"}}, [[[]]], "x", -(1 << 64), 1e300)
        ]
    if target == "safetensors":
        out = []
        for dtype, width in (("F16", 2), ("BF16", 2), ("F32", 4), ("I8", 1)):
            header, offset = {"__metadata__": {"format": "pt"}}, 0
            for e in range(2):
                for proj in ("gate", "up", "down"):
                    shape = [3, 2] if proj == "down" else [2, 3]
                    header[expert.format(0, e, proj)] = {
                        "dtype": dtype, "shape": shape, "data_offsets": [offset, offset + 6 * width]
                    }  # fmt: skip
                    offset += 6 * width
            out.append(contracts.safetensors_file(header, offset))
        return out
    if target == "index":
        contracts.index_shard()
        names = [expert.format(0, 0, p) for p in ("gate", "up", "down")]
        return [
            json.dumps(
                {
                    "metadata": {"total_size": 24},
                    "weight_map": dict.fromkeys(names, "s.safetensors"),
                }
            ).encode()
        ]
    if target == "manifest":
        return [json.dumps(contracts.raw_manifest()[1]).encode()]
    if target == "gguf":
        import gguf

        file = contracts.path("rich.gguf")  # metadata of every kind: arrays, strings, numbers
        w = gguf.GGUFWriter(file, "qwen2moe")
        w.add_expert_count(2)
        w.add_expert_used_count(1)
        w.add_array("tokenizer.ggml.tokens", ["a", "bc", ""])
        w.add_array("tokenizer.ggml.scores", [0.5, -1.0])
        w.add_array("colibri.nested", [[1, 2], [3]])
        w.add_tensor("blk.0.ffn_gate_exps.weight", np.ones((2, 3, 4), np.float16))
        w.add_tensor("blk.0.ffn_up_exps.weight", np.ones((2, 3, 4), np.float16))
        w.add_tensor("blk.0.ffn_down_exps.weight", np.ones((2, 4, 3), np.float16))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        with open(file, "rb") as f:
            return [contracts.gguf_bytes(), f.read()]
    if target == "partition":
        return [
            json.dumps(
                {"format": "colibri.Partition", "version": 1, "num_experts": n, "groups": g}
            ).encode()
            for n, g in ((4, [[0, 2], [1, 3]]), (1, [[0]]), (6, [[5, 4, 3, 2, 1, 0]]))
        ]
    if target == "stats":
        seeds = contracts.stats_seeds()
        return [b"j" + seeds[".json"], b"n" + seeds[".npz"]]
    if target == "trace":
        return [json.dumps({"steps": [[0, [1, 2]], [3, [0]], [1, []]]}).encode()]
    rng = np.random.default_rng(0)  # dlpack: the provider reads fields from any bytes
    return [rng.bytes(n) for n in (16, 48, 96)]


def _int64(fdp) -> int:
    """Small, boundary or arbitrary: what a hostile producer writes in an int64 field."""
    pick = fdp.ConsumeIntInRange(0, 3)
    if pick == 0:
        return fdp.ConsumeIntInRange(-9, 9)
    if pick == 1:
        return fdp.PickValueInList([0, 1, 7, 8, (1 << 31) - 1, 1 << 31, 1 << 32, (1 << 62) + 1,
                                    (1 << 63) - 1, -(1 << 63), -1 - (1 << 31)])  # fmt: skip
    if pick == 2:
        return fdp.ConsumeInt(8)
    return fdp.ConsumeIntInRange(0, 6)


def _mostly(fdp, good, other):
    """``good()`` four times in five, else ``other()``."""
    return good() if fdp.ConsumeIntInRange(0, 4) else other()


def _case(contracts, target: str, data: bytes):
    """The input of ``contracts.CHECKS[target]`` that the bytes ``data`` describe."""
    import atheris

    if target == "stats":
        return (".npz" if data[:1] == b"n" else ".json"), data[1:]
    if target == "dlpack-route":
        fdp = atheris.FuzzedDataProvider(data)
        dtype = fdp.PickValueInList(list(contracts.BASES))
        n = contracts.BASES[dtype].size
        shape = [fdp.ConsumeIntInRange(0, 5)] * fdp.ConsumeIntInRange(0, 1) + [contracts.E_ROUTE]
        strides = [fdp.ConsumeIntInRange(-40, 40) for _ in shape] if fdp.ConsumeBool() else None
        low, high = contracts.extent(shape, strides)
        if high - low >= n:
            strides, low, high = None, 0, math.prod(shape) - 1
        offset = fdp.ConsumeIntInRange(-low, n - 1 - high)
        versioned = fdp.ConsumeBool()
        flags = fdp.ConsumeIntInRange(0, 1) if versioned else 0
        return dtype, shape, strides, offset, versioned, flags, fdp.ConsumeIntInRange(1, 3)
    if target == "dlpack-metadata":
        fdp = atheris.FuzzedDataProvider(data)
        ndim = _mostly(
            fdp, lambda: fdp.ConsumeIntInRange(0, 3), lambda: fdp.ConsumeIntInRange(0, 10)
        )
        shape = [_int64(fdp) for _ in range(ndim)]
        strides = [_int64(fdp) for _ in range(ndim)] if fdp.ConsumeBool() else None
        return {
            "shape": shape,
            "strides": strides,
            "byte_offset": _mostly(fdp, lambda: fdp.PickValueInList([0, 4]),
                                   lambda: fdp.ConsumeUInt(8)),
            "dtype": _mostly(fdp, lambda: fdp.PickValueInList([(2, 32), (2, 64), (2, 16)]),
                             lambda: (fdp.ConsumeUInt(1), fdp.ConsumeUInt(1))),
            "lanes": _mostly(fdp, lambda: 1, lambda: fdp.ConsumeUInt(2)),
            "device": (_mostly(fdp, lambda: 1, lambda: fdp.ConsumeIntInRange(-1, 99)),
                       _mostly(fdp, lambda: 0, lambda: fdp.ConsumeIntInRange(-1, 3))),
            "versioned": fdp.ConsumeBool(),
            "version": (_mostly(fdp, lambda: 1, lambda: fdp.ConsumeUInt(4)), fdp.ConsumeUInt(4)),
            "flags": fdp.ConsumeIntInRange(0, 7),
            "null_data": fdp.ConsumeIntInRange(0, 5) == 0,
            "null_shape": ndim > 0 and fdp.ConsumeIntInRange(0, 9) == 0,
        }  # fmt: skip
    return data


BOUNDARY = [0, 1, -1, 2, 8, 255, 256, (1 << 31) - 1, 1 << 31, (1 << 32) + 1, (1 << 53) + 1,
            (1 << 63) - 1, 1 << 63, 1 << 64, -(1 << 63), 0.5, 1e308, "", "F16", "BF16", "F32",
            "I8", "Q4_K", "gate", "up", "down", "..", "/abs", "s.safetensors", None, True, [],
            {}]  # fmt: skip


def _mutate_tree(rng, tree):
    """Replace, delete, wrap, duplicate or retype one node of a JSON tree, in place."""
    nodes, slots = [tree] if isinstance(tree, dict | list) else [], []
    while nodes:
        node = nodes.pop()
        keys = list(node) if isinstance(node, dict) else range(len(node))
        for key in keys:
            slots.append((node, key))
            if isinstance(node[key], dict | list):
                nodes.append(node[key])
    if not slots:
        return rng.choice(BOUNDARY) if rng.random() < 0.5 else tree
    parent, key = rng.choice(slots)
    action = rng.randrange(6)
    if action == 0 and isinstance(parent, dict):
        del parent[key]
    elif action == 1:
        parent[key] = [parent[key]]
    elif action == 2:  # a sibling's value, or a whole subtree from elsewhere
        other, okey = rng.choice(slots)
        parent[key] = json.loads(json.dumps(other[okey]))
    elif action == 3 and isinstance(parent[key], int) and not isinstance(parent[key], bool):
        parent[key] += rng.choice([-1, 1, -8, 8, 1 << 32])
    elif action == 4 and isinstance(parent, list):
        parent.insert(key, rng.choice(BOUNDARY))
    else:
        parent[key] = json.loads(json.dumps(rng.choice(BOUNDARY)))
    return tree


def _mutate_json(rng, text: bytes) -> bytes | None:
    """A tree mutation of the JSON document ``text``, None when it does not parse."""
    try:
        tree = json.loads(text)
    except (ValueError, RecursionError):
        return None
    for _ in range(rng.randrange(1, 4)):
        tree = _mutate_tree(rng, tree)
    return json.dumps(tree).encode()


def mutator(target: str, seeds: list[bytes]):
    """libFuzzer's byte mutations, and half the time a mutation aware of ``target``'s format:
    a JSON node replaced by a boundary value, deleted, wrapped, copied (the safetensors header
    inside its length prefix; the JSON statistics); a GGUF header integer overwritten; a
    quarter of those start again from one of the valid ``seeds``."""
    import random

    import atheris

    def mutate(data: bytes, max_size: int, seed: int) -> bytes:
        rng = random.Random(seed)
        if target in ("dlpack-route", "dlpack-metadata") or rng.random() < 0.5:
            return atheris.Mutate(data, max_size)
        if seeds and rng.random() < 0.25:  # a step away from a valid file reaches deepest
            data = rng.choice(seeds)
        out = None
        if target == "safetensors" and len(data) >= 8:
            n = int.from_bytes(data[:8], "little")
            header = _mutate_json(rng, data[8 : 8 + n]) if n <= len(data) - 8 else None
            if header is not None:
                tail = data[8 + n :]
                tail = tail[: max(0, len(tail) + rng.choice([0, 0, 0, 1, -1, -4]))]
                out = len(header).to_bytes(8, "little") + header + tail
        elif target == "stats" and data[:1] == b"j":
            body = _mutate_json(rng, data[1:])
            out = None if body is None else b"j" + body
        elif target == "gguf" and len(data) >= 32:
            out = bytearray(data)
            width = rng.choice([1, 4, 8])
            at = rng.randrange(0, min(len(out), 512) - width)
            value = rng.choice([0, 1, 2, 255, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 56,
                                (1 << 63) - 1, (1 << 64) - 1]) % (1 << (8 * width))  # fmt: skip
            out[at : at + width] = value.to_bytes(width, "little")
            out = bytes(out)
        elif target in ("json", "index", "manifest", "partition", "trace", *LOADER_TARGETS):
            out = _mutate_json(rng, data)
        if out is None or len(out) > max_size:
            return atheris.Mutate(data, max_size)
        return out

    return mutate


def child(target: str, runs: int, corpus: str, counts_file: str, artifacts: str) -> None:
    """Fuzz ``target`` for ``runs`` inputs; write ``{"inputs", "refused"}`` to ``counts_file``."""
    import atheris

    with atheris.instrument_imports(include=["colibri", "gguf"]):
        from _support import contracts  # noqa: PLC0415  (instrumented where imported)

        if target in LOADER_TARGETS:
            check, seeds = loader_check(target, os.path.dirname(corpus))
    if target not in LOADER_TARGETS:
        check = contracts.CHECKS[target]
        seeds = _seeds(contracts, target)
    for i, seed in enumerate(seeds):
        with open(os.path.join(corpus, f"seed-{i}"), "wb") as f:
            f.write(seed)
    dictionary = os.path.join(artifacts, "tokens.dict")
    with open(dictionary, "w") as f:
        f.write("\n".join(TOKENS) + "\n")
    counts = {"inputs": 0, "refused": 0}

    def flush() -> None:
        with open(counts_file + ".tmp", "w") as f:
            json.dump(counts, f)
        os.replace(counts_file + ".tmp", counts_file)

    def one(data: bytes) -> None:
        counts["inputs"] += 1
        if not check(_case(contracts, target, data)):
            counts["refused"] += 1
        if counts["inputs"] % 1000 == 0 or counts["inputs"] == runs:
            flush()  # libFuzzer exits the process at the last run, without Python's atexit

    atheris.Setup(
        [sys.argv[0], corpus, f"-runs={runs}", f"-timeout={TIMEOUT}",
         f"-rss_limit_mb={RSS_LIMIT_MB}", f"-dict={dictionary}", "-max_len=8192",
         f"-artifact_prefix={artifacts}/", "-print_final_stats=1"], one,
        custom_mutator=mutator(target, seeds),
    )  # fmt: skip
    atheris.Fuzz()


# -- the driver: pieces, ledger ----------------------------------------------------------------


def piece(target: str, runs: int, corpus: str, work: str, keep: str) -> dict:
    """One child run of ``target``; its ledger entry. The inputs of a fault go to ``keep``."""
    counts_file = os.path.join(work, f"{target}.counts")
    artifacts = os.path.join(work, f"{target}.artifacts")
    os.makedirs(artifacts, exist_ok=True)
    for name in os.listdir(artifacts):
        os.remove(os.path.join(artifacts, name))
    with open(counts_file, "w") as f:
        json.dump({"inputs": 0, "refused": 0}, f)
    env = dict(os.environ, COLIBRI_FUZZ_TMP=work)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", target, str(runs), corpus,
           counts_file, artifacts]  # fmt: skip
    limit = 60 + runs * TIMEOUT  # libFuzzer's own -timeout reports a hang long before
    try:
        proc = subprocess.run(cmd, cwd=HERE, env=env, capture_output=True, text=True,
                              timeout=limit, check=False)  # fmt: skip
        rc, log = proc.returncode, proc.stderr + proc.stdout
    except subprocess.TimeoutExpired as exc:
        rc, log = None, f"the child ran past {limit} s: {exc}"
    with open(counts_file) as f:
        counts = json.load(f)
    done = re.search(r"Done (\d+) runs", log)
    ran = re.search(r"stat::number_of_executed_units: *(\d+)", log)  # printed on a fault too
    if ran and int(ran.group(1)) > counts["inputs"]:  # flushed every 1000: refused is a floor
        counts["inputs"] = int(ran.group(1))
    entry = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "harness": "atheris", "examples_per_target": runs, "machine": platform.machine(),
        "inputs": {target: counts["inputs"]} if counts["inputs"] else {},
        "refused": {target: counts["refused"]} if counts["inputs"] else {},
        "failures": 0, "crashes": 0, "hangs": 0,
    }  # fmt: skip
    if rc == 0 and done and counts["inputs"] == int(done.group(1)) == runs:
        return entry
    kind = ("hangs" if rc is None or "libFuzzer: timeout" in log else
            "failures" if "Uncaught Python exception" in log else "crashes")  # fmt: skip
    entry[kind] = 1
    saved = sorted(os.listdir(artifacts))
    os.makedirs(keep, exist_ok=True)
    for name in saved:
        if name != "tokens.dict":
            shutil.copy(os.path.join(artifacts, name), os.path.join(keep, f"{target}-{name}"))
    lines = [ln for ln in log.splitlines() if ln.strip()]
    entry["note"] = (f"open: {target}: rc={rc}, inputs saved as {keep}/{target}-*; "
                     + " | ".join(lines[-6:]))[:2000]  # fmt: skip
    print(log[-6000:], file=sys.stderr)
    return entry


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:
        target, runs, corpus, counts_file, artifacts = argv[1:]
        sys.path.insert(0, HERE)
        child(target, int(runs), corpus, counts_file, artifacts)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("targets", nargs="*", choices=[[], *TARGETS], default=[])
    parser.add_argument("--runs", type=int, default=20000)
    parser.add_argument("--pieces", type=int, default=1)
    parser.add_argument("--ledger", default=LEDGER)
    args = parser.parse_args(argv)
    base = os.environ.get("COLIBRI_FUZZ_TMP") or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    work = tempfile.mkdtemp(prefix="colibri-atheris-", dir=base)
    os.makedirs(os.path.dirname(os.path.abspath(args.ledger)), exist_ok=True)
    keep = os.path.join(os.path.dirname(os.path.abspath(args.ledger)), "fuzz_findings")
    status = 0
    try:
        for target in args.targets or TARGETS:
            corpus = os.path.join(work, f"{target}.corpus")  # kept across pieces
            os.makedirs(corpus, exist_ok=True)
            for _ in range(args.pieces):
                start = time.perf_counter()
                entry = piece(target, args.runs, corpus, work, keep)
                seconds = time.perf_counter() - start
                with open(args.ledger, "a") as f:
                    f.write(json.dumps(entry, sort_keys=True) + "\n")
                faults = entry["failures"] + entry["crashes"] + entry["hangs"]
                print(
                    f"{target}: {entry['inputs'].get(target, 0)} inputs, "
                    f"{entry['refused'].get(target, 0)} refused, {faults} faults, {seconds:.1f} s",
                    flush=True,
                )
                status |= bool(faults)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
