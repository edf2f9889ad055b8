"""Failing disks under colibri's writers: the disk fills up (ENOSPC) or the process is killed
(SIGKILL) while a file is written. Afterwards the previous file is intact or the new one is
complete, never a half file, and no temporary is left behind.

Writers: ``Partition.save``, ``UsageStats.save`` (.json, .npz), ``write_experts`` (data and
manifest), ``repack`` and the demo's weight file (``demo.ensure_weight_file``).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import zlib

import numpy as np
import pytest

from colibri import Partition, UsageStats
from colibri.formats import open_weights, repack
from colibri.formats.raw import write_experts


def _experts(scale: float, num: int = 4, rows: int = 8, cols: int = 16):
    rng = np.random.default_rng(int(scale * 10))
    return {
        (0, e): (
            (rng.standard_normal((rows, cols)) * scale).astype(np.float16),
            (rng.standard_normal((rows, cols)) * scale).astype(np.float16),
            (rng.standard_normal((cols, rows)) * scale).astype(np.float16),
        )
        for e in range(num)
    }


def _read_experts(path) -> dict:
    """Every expert's bytes, through the reader users call."""
    source = open_weights(path)
    out = {}
    with open(source.files[0], "rb") as f:
        for key, layout in source.experts.items():
            parts = []
            for ref in layout.matrices:
                f.seek(ref.offset)
                parts.append(f.read(ref.nbytes))
            out[key] = b"".join(parts)
    return out


def _expected_experts(experts) -> dict:
    return {k: b"".join(np.ascontiguousarray(m).tobytes() for m in v) for k, v in experts.items()}


# Each writer: (write(folder, version), read(folder) -> comparable value, expected(version)).
def _partition_writer():
    versions = {0: Partition([[0, 1], [2, 3]]), 1: Partition([[3], [0, 2], [1]])}

    def write(folder, v):
        versions[v].save(os.path.join(folder, "p.json"), overwrite=True)

    return write, lambda folder: Partition.load(os.path.join(folder, "p.json")), versions.get


def _stats_writer(suffix):
    versions = {
        0: UsageStats.from_ids([[0, 1], [1, 2]], 3),
        1: UsageStats.from_ids(
            [np.random.default_rng(t).choice(40, 2, replace=False) for t in range(500)], 40
        ),
    }

    def write(folder, v):
        versions[v].save(os.path.join(folder, "u" + suffix), overwrite=True)

    return write, lambda folder: UsageStats.load(os.path.join(folder, "u" + suffix)), versions.get


def _raw_writer():
    versions = {0: _experts(1.0), 1: _experts(2.0, num=6, rows=16)}

    def write(folder, v):
        write_experts(os.path.join(folder, "x.colibri"), versions[v], overwrite=True)

    def expected(v):
        return _expected_experts(versions[v])

    return write, lambda folder: _read_experts(os.path.join(folder, "x.colibri")), expected


def _repack_writer():
    experts = _experts(3.0)
    partitions = {0: [[0, 1], [2, 3]], 1: [[3, 1], [0], [2]]}

    def write(folder, v):
        source = os.path.join(folder, "source.colibri")
        if not os.path.exists(source + ".json"):
            write_experts(source, experts)
        # 4 KiB pages: the file must fit the 64 KiB tmpfs of the real-ENOSPC test
        out = os.path.join(folder, "r.colibri")
        repack(source, out, partitions[v], page_size_kb=4, overwrite=True)

    def read(folder):
        source = open_weights(os.path.join(folder, "r.colibri"))
        return _read_experts(os.path.join(folder, "r.colibri")), source.metadata["groups"]["0"]

    return write, read, lambda v: (_expected_experts(experts), partitions[v])


WRITERS = {
    "partition": _partition_writer,
    "stats-json": lambda: _stats_writer(".json"),
    "stats-npz": lambda: _stats_writer(".npz"),
    "raw": _raw_writer,
    "repack": _repack_writer,
}


def _listing(folder) -> list[str]:
    """The folder's names; a raw file's two data names (``x``, ``x.alt``) count as one."""
    return sorted(n.removesuffix(".alt") for n in os.listdir(folder))


# -- ENOSPC: injected at every write and at fsync -------------------------------------------------


class _FullDisk:
    """Wraps a file: its writes fail with ENOSPC once ``budget`` bytes are written."""

    def __init__(self, file, budget: list[int]):
        self._file = file
        self._budget = budget

    def write(self, data):
        size = len(data.encode()) if isinstance(data, str) else memoryview(data).nbytes
        if size > self._budget[0]:
            self._budget[0] = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._budget[0] -= size
        return self._file.write(data)

    def __getattr__(self, name):
        return getattr(self._file, name)

    def __iter__(self):
        return iter(self._file)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._file.__exit__(*exc)


@contextlib.contextmanager
def disk_full(monkeypatch, budget: int | None, fsync_fails: bool = False):
    """Writes to files colibri opens fail with ENOSPC after ``budget`` bytes in all."""
    left = [budget if budget is not None else 1 << 62]
    fdopen = os.fdopen

    def full_fdopen(fd, *args, **kwargs):
        return _FullDisk(fdopen(fd, *args, **kwargs), left)

    def failing_fsync(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as patch:
        patch.setattr(os, "fdopen", full_fdopen)
        if fsync_fails:
            patch.setattr(os, "fsync", failing_fsync)
        yield


@pytest.mark.parametrize("writer", sorted(WRITERS))
@pytest.mark.parametrize("budget", [0, 1, 64, 1000, 5000, "fsync"])
def test_enospc_keeps_the_previous_file(tmp_path, monkeypatch, writer, budget):
    write, read, expected = WRITERS[writer]()
    folder = str(tmp_path)
    write(folder, 0)
    before = _listing(folder)
    full = disk_full(monkeypatch, None if budget == "fsync" else budget, budget == "fsync")
    try:
        with full:
            write(folder, 1)
    except OSError as error:
        assert error.errno == errno.ENOSPC
        assert _listing(folder) == before  # no temporary left, nothing new published
        assert read(folder) == expected(0)  # the previous file, intact
        assert budget != 5000 or writer in ("raw", "repack", "stats-json")
    else:  # the new version fitted in the budget: complete
        assert budget not in (0, 1, "fsync")
        assert read(folder) == expected(1)
        assert _listing(folder) == before
        return
    write(folder, 1)  # and the disk, once it has room again, takes the new one
    assert read(folder) == expected(1)
    assert _listing(folder) == before


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 64 KiB tmpfs: a real ENOSPC from the kernel (needs mount rights, else skipped)."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                          capture_output=True)  # fmt: skip
    if done.returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield str(mount)
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_real_enospc_on_the_demos_first_write(tiny_tmpfs):
    """The demo checkpoint does not fit the 64 KiB file system: the write fails with ENOSPC
    and leaves nothing a later run would take for a checkpoint."""
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from colibri.cli import demo

    shape = demo.DemoShape(layers=2, hidden=64, expert_intermediate=64, vocab=600)
    with pytest.raises(Exception, match="No space left on device"):  # safetensors' own error
        demo.ensure_checkpoint(tiny_tmpfs, shape, progress=False)
    assert _listing(tiny_tmpfs) == []


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_real_enospc_on_a_full_tmpfs(tiny_tmpfs, writer):
    write, read, expected = WRITERS[writer]()
    write(tiny_tmpfs, 0)
    before = _listing(tiny_tmpfs)
    filler = os.path.join(tiny_tmpfs, "filler")
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    with contextlib.suppress(OSError):  # fill the file system to the last byte
        while True:
            os.write(fd, b"\0" * 512)
    os.close(fd)
    with pytest.raises(OSError) as info:
        write(tiny_tmpfs, 1)
    assert info.value.errno == errno.ENOSPC  # from the kernel
    assert _listing(tiny_tmpfs) == sorted([*before, "filler"])
    assert read(tiny_tmpfs) == expected(0)
    os.unlink(filler)
    write(tiny_tmpfs, 1)
    assert read(tiny_tmpfs) == expected(1)


# -- SIGKILL at random points of the writes ---------------------------------------------------


_CHILD = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    import test_faults
    write, _, _ = test_faults.WRITERS[{writer!r}]()
    v = 0
    print("ready", flush=True)
    while True:
        write({folder!r}, v)
        v = 1 - v
    """
)


def _kill_at_random(writer: str, folder: str, rounds: int, rng: random.Random) -> int:
    """Run the writer in a loop in a child, SIGKILL it at a random moment, ``rounds`` times."""
    kills = 0
    code = _CHILD.format(tests=os.path.dirname(__file__), writer=writer, folder=folder)
    for _ in range(rounds):
        # cwd: `python -c` puts it first on sys.path, where a source tree would shadow colibri
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, cwd=folder)
        try:
            assert child.stdout.readline() == b"ready\n"
            time.sleep(rng.uniform(0.0, 0.25))
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=30)
            child.stdout.close()
        kills += child.returncode == -signal.SIGKILL
    return kills


def _check_after_kills(writer: str, folder: str, rounds: int, seed: int) -> None:
    write, read, expected = WRITERS[writer]()
    write(folder, 0)
    names = _listing(folder)
    rng = random.Random(seed)
    for _ in range(rounds):
        assert _kill_at_random(writer, folder, 1, rng) == 1
        _check_old_or_new(folder, names, read, expected)
        write(folder, 0)  # the next write removes the dead writer's temporaries
        assert _listing(folder) == names


def _check_old_or_new(folder, names, read, expected) -> None:
    """The previous version or the new one, complete: never a half file or a mixture."""
    assert read(folder) in (expected(0), expected(1))
    leftovers = set(_listing(folder)) - set(names)
    assert all(n.startswith(".") and n.endswith(".tmp") for n in leftovers), leftovers


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_sigkill_leaves_old_or_new(tmp_path, writer):
    _check_after_kills(writer, str(tmp_path), rounds=4, seed=zlib.crc32(writer.encode()))


@pytest.mark.slow
@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_sigkill_leaves_old_or_new_long(tmp_path, writer):
    _check_after_kills(writer, str(tmp_path), rounds=12, seed=7)


_STEP_CHILD = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    import test_faults
    write, _, _ = test_faults.WRITERS[{writer!r}]()
    calls = [0]

    def counted(call):
        def step(*args, **kwargs):
            calls[0] += 1
            if calls[0] == {kill_at}:
                os.kill(os.getpid(), signal.SIGKILL)
            return call(*args, **kwargs)
        return step

    for name in test_faults.STEPS:
        setattr(os, name, counted(getattr(os, name)))
    write({folder!r}, 1)
    print(calls[0], flush=True)
    """
)

# The calls that change or flush the file system; a kill lands just before one of them.
STEPS = ("fsync", "link", "replace", "rename", "unlink")


def _write_killed_at(writer: str, folder: str, kill_at: int) -> int | None:
    """Write version 1 in a child killed at its ``kill_at``-th file-system step (0: never);
    returns the child's step count when it finished."""
    code = _STEP_CHILD.format(
        tests=os.path.dirname(__file__), writer=writer, folder=folder, kill_at=kill_at
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, cwd=folder,
                          timeout=120)  # fmt: skip
    if done.returncode == -signal.SIGKILL:
        return None
    assert done.returncode == 0, done.stderr.decode()
    return int(done.stdout)


@pytest.mark.parametrize("overwrites", [1, 2], ids=["first-overwrite", "second-overwrite"])
@pytest.mark.parametrize("writer", ["raw", pytest.param("repack", marks=pytest.mark.slow)])
def test_sigkill_at_every_step_of_an_overwrite(tmp_path, writer, overwrites):
    """Killed before any one of an overwrite's file-system calls (between the data's and the
    manifest's publication included), the previous weights load whole or the new ones do."""
    write, read, expected = WRITERS[writer]()
    steps = None
    for kill_at in itertools.count(1):
        folder = str(tmp_path / f"k{kill_at}")
        os.mkdir(folder)
        for _ in range(overwrites):  # 1: the overwrite writes .alt; 2: the plain name again
            write(folder, 0)
        names = _listing(folder)
        finished = _write_killed_at(writer, folder, kill_at)
        _check_old_or_new(folder, names, read, expected)
        write(folder, 0)  # takes over from the dead write
        assert read(folder) == expected(0)
        assert _listing(folder) == names
        if finished is not None:
            steps = finished
            break
    assert steps is not None and steps >= 4  # every step of the write was a kill point


@pytest.mark.parametrize("delay", [0.1, 1.5])
def test_sigkill_during_the_demos_first_write(tmp_path, delay):
    """A demo killed while it writes its checkpoint leaves no directory a later run would
    trust; the next run writes it whole and removes the dead run's temporary."""
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    shape = "dict(layers=2, hidden=64, expert_intermediate=64, vocab=600)"
    code = textwrap.dedent(
        f"""
        from colibri.cli import demo
        print("ready", flush=True)
        demo.ensure_checkpoint({str(tmp_path)!r}, demo.DemoShape(**{shape}), progress=False)
        """
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    with child.stdout:
        assert child.stdout.readline() == b"ready\n"
        time.sleep(delay)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    assert [n for n in _listing(tmp_path) if not n.startswith(".")] == []  # nothing to trust
    from colibri.cli import demo

    folder = demo.ensure_checkpoint(tmp_path, demo.DemoShape(**eval(shape)), progress=False)
    assert open_weights(folder / "model.safetensors.index.json").num_experts(0) == 26
    assert [n for n in _listing(tmp_path) if n.startswith(".")] == []  # the temporary is gone
