"""Property-based fuzzers over every parser and the DLPack intake.

Each target takes generated hostile input and must either succeed with a result that checks out
against an independent reading (json, the safetensors library, numpy views of the same memory,
a round trip) or raise colibri's documented error: ``FormatError`` for files, ``TypeError`` /
``ValueError`` / ``BufferError`` / ``MemoryError`` for DLPack. Anything else fails the test; a
crash kills it (run under ``.ci/sanitize.sh`` for memory errors that do not crash).

The default suite runs ``COLIBRI_FUZZ_EXAMPLES`` (default 150) examples per target; the
``slow`` twins run 4 times as many. The inputs generated are counted per target and printed
at the end of the session; with ``COLIBRI_FUZZ_LEDGER=<file>`` the counts are also appended
to that JSON-lines ledger (``.ci/fuzz.sh`` runs campaigns into ``build/fuzz/ledger.jsonl``, a
CI artifact that no tracked file holds).
Files go to ``COLIBRI_FUZZ_TMP`` (default: the system's temporary folder). What each target
owes is written once, in ``_support/contracts.py``; ``fuzz_atheris.py`` drives the same checks
coverage-guided, for campaigns of millions of inputs.
"""

from __future__ import annotations

import collections
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("safetensors")
pytest.importorskip("torch")
pytest.importorskip("gguf")

from fuzz_atheris import LOADER_TARGETS  # noqa: E402  (the loader's targets: atheris only)

from _support import contracts  # noqa: E402  (after the skips: it imports them)
from _support.contracts import BASES, E_ROUTE, EXPERT, TARGETS, extent  # noqa: E402
from colibri import _json as strict  # noqa: E402
from colibri.formats._base import DTYPE_SIZES  # noqa: E402

FAST = int(os.environ.get("COLIBRI_FUZZ_EXAMPLES", "150"))
SLOW = 4 * FAST
COUNTS: collections.Counter[str] = collections.Counter()


@pytest.fixture(scope="module", autouse=True)
def _report(request):
    yield
    shutil.rmtree(contracts.TMP, ignore_errors=True)
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    targets = sorted({k.split(":")[0] for k in COUNTS})
    lines = [
        f"  {t}: {COUNTS[t]} inputs, {COUNTS[t + ':refused']} refused with documented errors"
        for t in targets
    ]
    total = sum(COUNTS[t] for t in targets)
    if os.environ.get("COLIBRI_FUZZ_LEDGER") and total:
        _record(os.environ["COLIBRI_FUZZ_LEDGER"], request.session.testsfailed)
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"\nfuzz inputs this session: {total}")
            for line in lines:
                reporter.write_line(line)


def _record(ledger: str, failures: int) -> None:
    """Append this session's counts to the campaign ledger (one JSON object per line)."""
    import datetime
    import platform

    entry = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "examples_per_target": FAST,
        "inputs": {t: COUNTS[t] for t in TARGETS if COUNTS[t]},
        "refused": {t: COUNTS[t + ":refused"] for t in TARGETS if COUNTS[t]},
        "failures": failures, "crashes": 0, "hangs": 0, "machine": platform.machine(),
    }  # fmt: skip
    with open(ledger, "a") as f:
        f.write(json.dumps(entry, sort_keys=True) + "\n")


def check_ledger(ledger: str) -> collections.Counter[str]:
    """Every campaign recorded: its date, its harness (hypothesis unless named), inputs per
    known target; one that found a failure, a crash or a hang says so in a ``note`` ("fixed
    in <commit>: ..." or "open: ..."), it is never recorded as fine. The totals per target."""
    with open(ledger, "rb") as f:
        lines = f.read().splitlines()
    assert lines, "the ledger records at least the campaign that created it"
    totals: collections.Counter[str] = collections.Counter()
    for n, line in enumerate(lines, 1):
        entry = strict.parse(line, f"{ledger}:{n}", what="a ledger entry")
        keys = {"date", "examples_per_target", "inputs", "refused", "failures", "crashes",
                "hangs", "machine"}  # fmt: skip
        assert keys <= set(entry) <= keys | {"note", "harness"}, (n, entry)
        assert entry.get("harness", "hypothesis") in ("hypothesis", "atheris"), (n, entry)
        assert len(entry["date"]) == 20 and entry["date"].endswith("Z"), (n, entry["date"])
        assert set(entry["inputs"]) <= set(TARGETS) | set(LOADER_TARGETS), (n, entry)
        for target, count in entry["inputs"].items():
            assert type(count) is int and count > 0, (n, target)
            assert 0 <= entry["refused"][target] <= count, (n, target)
            totals[target] += count
        faults = entry["failures"] + entry["crashes"] + entry["hangs"]
        if faults:  # a campaign that found a fault says what it was: fixed (where) or open
            note = entry.get("note")
            assert isinstance(note, str) and note.startswith(("fixed in ", "open: ")), (n, entry)
        else:
            assert entry["inputs"] and "note" not in entry, (n, entry)
    return totals


def test_a_session_is_recorded_as_a_well_formed_ledger_entry(tmp_path, monkeypatch):
    """What a campaign appends (``_record``, one entry per session) is what ``check_ledger``
    accepts, with its counts per target; a session that failed is not, until its ``note``
    says what the fault was."""
    counts = collections.Counter({"trace": 40, "trace:refused": 31, "stats": 25})
    monkeypatch.setitem(globals(), "COUNTS", counts)
    ledger = str(tmp_path / "ledger.jsonl")
    _record(ledger, 0)
    _record(ledger, 0)
    assert check_ledger(ledger) == {"trace": 80, "stats": 50}
    entry = json.loads((tmp_path / "ledger.jsonl").read_text().splitlines()[0])
    assert entry["refused"] == {"trace": 31, "stats": 0} and entry["failures"] == 0
    _record(ledger, 1)
    with pytest.raises(AssertionError, match="'failures': 1"):
        check_ledger(ledger)


def _atheris(tmp_path, *args, **env):
    ledger = tmp_path / "ledger.jsonl"
    script = os.path.join(os.path.dirname(__file__), "fuzz_atheris.py")
    proc = subprocess.run(
        [sys.executable, script, "--runs", "300", "--ledger", str(ledger), *args],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env=dict(os.environ, COLIBRI_FUZZ_TMP=str(tmp_path), **env),
    )  # fmt: skip
    entries = [json.loads(line) for line in ledger.read_text().splitlines()]
    return proc, entries, check_ledger(str(ledger))


def test_atheris_campaign_counts_every_input(tmp_path):
    """The coverage-guided driver runs each target's contract on exactly ``--runs`` inputs
    and records them; a clean campaign exits 0."""
    pytest.importorskip("atheris")
    proc, entries, totals = _atheris(tmp_path, "trace", "dlpack-metadata")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert totals == {"trace": 300, "dlpack-metadata": 300}
    assert all(e["harness"] == "atheris" and "note" not in e for e in entries)


def test_atheris_loader_targets(tmp_path):
    """The loader's targets (a fuzzed config.json, index or partition file in a valid
    checkpoint directory) run their contract on every input and are recorded."""
    pytest.importorskip("atheris")
    pytest.importorskip("transformers")
    proc, entries, totals = _atheris(tmp_path, *LOADER_TARGETS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert totals == dict.fromkeys(LOADER_TARGETS, 300)


def test_atheris_campaign_records_a_broken_contract(tmp_path):
    """A parser that accepts what it must not (here ``Trace.load`` planted to return a negative
    layer, from a sitecustomize) is a failure: an ``open:`` note, the input kept, exit 1."""
    pytest.importorskip("atheris")
    plant = tmp_path / "plant"
    plant.mkdir()
    (plant / "sitecustomize.py").write_text(
        "from colibri.pager import Trace\n"
        "def load(path):\n"
        "    t = Trace()\n"
        "    t.steps.append((-1, (0,)))\n"
        "    return t\n"
        "Trace.load = staticmethod(load)\n"
    )
    proc, entries, _ = _atheris(tmp_path, "trace", PYTHONPATH=str(plant))
    assert proc.returncode == 1, proc.stderr[-3000:]
    (entry,) = entries
    assert entry["failures"] == 1 and entry["note"].startswith("open: trace"), entry
    assert any(n.startswith("trace-crash-") for n in os.listdir(tmp_path / "fuzz_findings"))


def fuzz(strategy, name):
    """A ``(fast, slow)`` pair of hypothesis tests of ``body(value)``, counted as ``name``."""

    def wrap(body):
        def counted(value):
            COUNTS[name] += 1
            if not body(value):
                COUNTS[name + ":refused"] += 1

        def make(examples):
            config = settings(
                max_examples=examples, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much],
            )  # fmt: skip
            return config(given(strategy)(counted))

        return make(FAST), pytest.mark.slow(make(SLOW))

    return wrap


# -- generated JSON ----------------------------------------------------------------------------

scalars = (
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70)
    | st.sampled_from([0, 1, -1, 2, 8, 1 << 31, (1 << 63) - 1, 1 << 63, 1 << 64])
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12)
    | st.sampled_from(["F16", "F32", "BF16", "Q4_K", "gate", "up", "down", ""])
)  # fmt: skip
values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=5)
    | st.dictionaries(st.text(max_size=8), inner, max_size=5), max_leaves=20,
)  # fmt: skip


def mutate_tree(draw, tree):
    """Replace, delete or retype one random node of a JSON tree (a deep copy)."""
    tree = json.loads(json.dumps(tree))
    nodes = [([], tree)]
    paths = []
    while nodes:
        at, node = nodes.pop()
        children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(
            node, list) else ()  # fmt: skip
        for key, child in children:
            paths.append((node, key))
            nodes.append((at + [key], child))
    for _ in range(draw(st.integers(1, 3))):
        parent, key = draw(st.sampled_from(paths))
        action = draw(st.sampled_from(["replace", "replace", "delete", "wrap"]))
        if action == "delete" and isinstance(parent, dict):
            parent.pop(key, None)
        elif action == "wrap" and (isinstance(parent, dict) and key in parent or
                                   isinstance(parent, list) and key < len(parent)):  # fmt: skip
            parent[key] = [parent[key]]
        elif isinstance(parent, dict) or key < len(parent):
            parent[key] = draw(values)
    return tree


def _usually(draw, good, bad):
    """``good`` four times in five, else a draw from ``bad``."""
    return good if draw(st.integers(0, 4)) else draw(bad)


def mutate_bytes(draw, data: bytes) -> bytes:
    """Flip, insert, delete or truncate a few bytes."""
    data = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        if not data:
            break
        i = draw(st.integers(0, len(data) - 1))
        action = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
        if action == "flip":
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif action == "set":
            data[i] = draw(st.sampled_from(b'{}[]",:0123456789-eE \x00\xff'))
        elif action == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif action == "delete":
            del data[i : i + draw(st.integers(1, 8))]
        else:
            del data[i:]
    return bytes(data)


# -- the strict JSON reader --------------------------------------------------------------------


@st.composite
def json_documents(draw):
    text = json.dumps(draw(values)).encode()
    return mutate_bytes(draw, text) if draw(st.booleans()) else text


test_json_parse, test_json_parse_long = fuzz(json_documents(), "json")(contracts.check_json)


# -- safetensors headers, checked against the safetensors library ------------------------------


@st.composite
def safetensors_files(draw):
    """A small per-expert checkpoint whose header is generated, then perhaps mutated."""
    rows, cols = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    header, offset = {}, 0
    for expert in range(draw(st.integers(1, 2))):
        for proj in ("gate", "up", "down"):
            shape = [cols, rows] if proj == "down" else [rows, cols]
            if draw(st.integers(0, 9)) == 0:
                shape = draw(st.lists(st.integers(0, 4), max_size=3))
            dtype = draw(st.sampled_from(["F16", "F32", "BF16", "I8"]))
            nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
            header[EXPERT.format(0, expert, proj)] = {
                "dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]
            }  # fmt: skip
            offset += nbytes + draw(st.sampled_from([0, 0, 0, 2]))  # holes are allowed
    if draw(st.booleans()):
        header["__metadata__"] = {"format": "pt"}
    data_len = offset + draw(st.sampled_from([0, 0, 0, 0, 1, -1, -8]))
    if draw(st.integers(0, 2)) == 0:
        header = mutate_tree(draw, header)
    body = contracts.safetensors_file(header, max(data_len, 0), pad=draw(st.integers(0, 8)))
    return mutate_bytes(draw, body) if draw(st.integers(0, 4)) == 0 else body


test_safetensors_header, test_safetensors_header_long = fuzz(safetensors_files(), "safetensors")(
    contracts.check_safetensors
)


@st.composite
def indexes(draw):
    names = [EXPERT.format(0, 0, p) for p in ("gate", "up", "down")]
    shards = st.sampled_from(
        ["s.safetensors", "s.safetensors", "missing.safetensors", "", ".", "..", "a/b", "/abs",
         "x\x00y", 3, None, ["s.safetensors"]]
    )  # fmt: skip
    index = {"metadata": {"total_size": 24},
             "weight_map": {n: _usually(draw, "s.safetensors", shards) for n in names}}  # fmt: skip
    if draw(st.booleans()):
        index = mutate_tree(draw, index)
    text = json.dumps(index).encode()
    return mutate_bytes(draw, text) if draw(st.integers(0, 3)) == 0 else text


test_sharded_index, test_sharded_index_long = fuzz(indexes(), "index")(contracts.check_index)


# -- colibri raw manifests ---------------------------------------------------------------------


@st.composite
def manifests(draw):
    _, manifest = contracts.raw_manifest()
    if draw(st.integers(0, 3)):
        manifest = mutate_tree(draw, manifest)
    text = json.dumps(manifest).encode()
    return mutate_bytes(draw, text) if draw(st.integers(0, 3)) == 0 else text


test_raw_manifest, test_raw_manifest_long = fuzz(manifests(), "manifest")(contracts.check_manifest)


# -- GGUF, through the gguf package ------------------------------------------------------------


@st.composite
def gguf_files(draw):
    data = bytearray(contracts.gguf_bytes())
    for _ in range(draw(st.integers(0, 4))):  # header fields: counts, lengths, types, offsets
        i = draw(st.integers(0, min(len(data), 400) - 1))
        data[i] = draw(st.sampled_from([0, 1, 2, 0x7F, 0x80, 0xFF, data[i] ^ 1]))
    if draw(st.integers(0, 4)) == 0:
        del data[draw(st.integers(0, len(data))) :]
    return bytes(data)


test_gguf, test_gguf_long = fuzz(gguf_files(), "gguf")(contracts.check_gguf)


# -- partitions, usage statistics, traces: refused, or a value that round-trips ------------------

group_lists = st.lists(st.lists(st.integers(-2, 9) | values, max_size=5), max_size=5)


@st.composite
def partitions(draw):
    groups = draw(st.permutations(range(draw(st.integers(1, 6)))))
    cut = draw(st.integers(1, len(groups)))
    groups = [list(groups[:cut]), list(groups[cut:])] if cut < len(groups) else [list(groups)]
    if draw(st.integers(0, 2)) == 0:
        groups = draw(group_lists)
    num = len(groups) if draw(st.integers(0, 3)) == 0 else sum(len(g) for g in groups)
    doc = {"format": "colibri.Partition", "version": 1, "num_experts": num, "groups": groups}
    if draw(st.booleans()):
        doc = mutate_tree(draw, doc)
    text = json.dumps(doc).encode()
    return mutate_bytes(draw, text) if draw(st.integers(0, 3)) == 0 else text


test_partition_load, test_partition_load_long = fuzz(partitions(), "partition")(
    contracts.check_partition
)


@st.composite
def stats_files(draw):
    seeds = contracts.stats_seeds()
    if draw(st.booleans()):  # .npz: bytes of a valid archive, mutated
        return ".npz", mutate_bytes(draw, seeds[".npz"])
    document = json.loads(seeds[".json"])
    text = json.dumps(mutate_tree(draw, document) if draw(st.integers(0, 3)) else document).encode()
    return ".json", mutate_bytes(draw, text) if draw(st.integers(0, 3)) == 0 else text


test_stats_load, test_stats_load_long = fuzz(stats_files(), "stats")(contracts.check_stats)


@st.composite
def traces(draw):
    layers = st.integers(0, 3) | st.integers(-1, 3) | values
    ids = st.lists(st.integers(0, 9), max_size=4) | st.lists(st.integers(-1, 9) | values)
    steps = draw(st.lists(st.tuples(layers, ids), max_size=6))
    doc = {"steps": [list(s) for s in steps]}
    text = json.dumps(doc).encode()
    return mutate_bytes(draw, text) if draw(st.integers(0, 3)) == 0 else text


test_trace_load, test_trace_load_long = fuzz(traces(), "trace")(contracts.check_trace)


# -- DLPack intake: hand-made capsules ----------------------------------------------------------


@st.composite
def in_bounds(draw):
    """Shape, strides (any sign, zero included) and byte offset whose elements all lie inside
    the base array: colibri must read exactly what numpy reads through the same geometry."""
    dtype = draw(st.sampled_from(list(BASES)))
    n = BASES[dtype].size
    shape = [draw(st.integers(0, 5))] * draw(st.integers(0, 1)) + [E_ROUTE]
    strides = None
    if draw(st.booleans()):
        strides = [draw(st.integers(-40, 40)) for _ in shape]
    low, high = extent(shape, strides)
    if high - low >= n:
        strides = None
        low, high = 0, math.prod(shape) - 1
    offset = draw(st.integers(-low, n - 1 - high))
    versioned = draw(st.booleans())
    flags = draw(st.sampled_from([0, 1])) if versioned else 0  # READ_ONLY is fine for logits
    return dtype, shape, strides, offset, versioned, flags, draw(st.integers(1, 3))


test_dlpack_route_geometry, test_dlpack_route_geometry_long = fuzz(in_bounds(), "dlpack-route")(
    contracts.check_route
)

big_ints = st.sampled_from([0, 1, 2, 7, (1 << 31) - 1, 1 << 31, 1 << 32, (1 << 62) + 1,
                            (1 << 63) - 1]) | st.integers(0, (1 << 63) - 1)  # fmt: skip
any_int64 = big_ints | big_ints.map(lambda v: -v - 1) | st.integers(-64, 64)


@st.composite
def hostile_capsules(draw):
    ndim = _usually(draw, draw(st.integers(0, 3)), st.integers(0, 10))
    shape = [_usually(draw, draw(st.integers(0, 6)), st.integers(-3, -1) | big_ints)
             for _ in range(ndim)]  # fmt: skip
    strides = None
    if draw(st.booleans()):
        strides = [_usually(draw, draw(st.integers(-9, 9)), any_int64) for _ in range(ndim)]
    dtypes = st.sampled_from(
        [(4, 16), (0, 32), (0, 64), (1, 8), (6, 8), (2, 8), (5, 64), (3, 64), (7, 32)]
    ) | st.tuples(st.integers(0, 255), st.integers(0, 255))
    return {
        "shape": shape,
        "strides": strides,
        "byte_offset": _usually(draw, draw(st.sampled_from([0, 4])), st.sampled_from(
            [3, 1 << 40, (1 << 63) + 8, (1 << 64) - 4]) | st.integers(0, (1 << 64) - 1)),
        "dtype": _usually(draw, draw(st.sampled_from([(2, 32), (2, 64), (2, 16)])), dtypes),
        "lanes": _usually(draw, 1, st.sampled_from([0, 2, 65535])),
        "device": (_usually(draw, 1, st.sampled_from([2, 3, 4, 13, 99, -1])),
                   _usually(draw, 0, st.integers(-1, 3))),
        "versioned": draw(st.booleans()),
        "version": (_usually(draw, 1, st.sampled_from([0, 2, 1 << 31])),
                    draw(st.integers(0, 1 << 31))),
        "flags": draw(st.integers(0, 7)),
        "null_data": draw(st.integers(0, 5)) == 0,
        "null_shape": ndim > 0 and draw(st.integers(0, 9)) == 0,
    }  # fmt: skip


test_dlpack_metadata, test_dlpack_metadata_long = fuzz(hostile_capsules(), "dlpack-metadata")(
    contracts.check_metadata
)
