"""A weight file truncated or replaced while a generation runs: every backend raises
:class:`FileChangedError` naming the file, never dies of ``SIGBUS``, whether the file changes
between tokens or while the fused kernel reads an expert's mapped pages.

Each generation runs in a child process (a ``SIGBUS`` would kill pytest itself); the parent
reads how the child ended."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from colibri.formats.raw import write_experts
from colibri.pager import IO_BACKENDS, FileChangedError, Pager

posix = pytest.mark.skipif(
    sys.platform == "win32", reason="Windows refuses to truncate a mapped file"
)

E, I, H = 4, 64, 64  # one float16 expert: 3 * 64 * 64 * 2 = 24 KiB
EXPERT = 3 * I * H * 2

# A generation of four tokens on one layer; `truncating` changes the file at the moment
# `when` names: after a token (between tokens) or right after a load, before the fused
# kernel reads the expert's pages (while an expert is computed); "held": between tokens, the
# experts held (no load after the first token).
CHILD = textwrap.dedent(
    """
    import os, sys
    import numpy as np
    from colibri.layer import HeldExperts, run_experts
    from colibri.pager import Pager

    path, io, when, how = sys.argv[1:]
    pager = Pager(path, budget_bytes={budget}, page_size_kb=4, io=io)

    def change():
        if how == "truncate":
            with open(path, "r+b") as f:
                f.truncate({expert})  # only expert 0 is left
        else:  # replaced: a new file under the name, as a download or a repack does
            os.replace(path + ".new", path)

    class Store:
        capacity, slot_bytes = pager.capacity, pager.slot_bytes

        def load(self, layer, ids):
            batch = pager.load(layer, ids)
            if when == "computing" and token == 1:
                change()
            return batch

        def advise(self, layer, ids):
            return 0

    held = HeldExperts(pager, 0, num_experts={experts}) if when == "held" else None
    rng = np.random.default_rng(0)
    for token in range(4):
        x = rng.standard_normal((1, {hidden}), np.float32)
        ids, weights = np.array([[2, 3]]), np.ones((1, 2), np.float32)
        if held is None:
            y = run_experts(Store(), 0, x, ids, weights, num_experts={experts})
        else:
            y = held(x, ids, weights)
        assert np.isfinite(y).all()
        if when in ("between", "held") and token == 1:
            change()
    print("four tokens")
    """
)


def _experts(seed=0):
    rng = np.random.default_rng(seed)
    return {
        (0, e): (
            rng.standard_normal((I, H)).astype(np.float16),
            rng.standard_normal((I, H)).astype(np.float16),
            rng.standard_normal((H, I)).astype(np.float16),
        )
        for e in range(E)
    }


def _generate(tmp_path, io, when, how):
    path = write_experts(tmp_path / "w.colibri", _experts())
    write_experts(tmp_path / "new.colibri", _experts(seed=1))
    os.replace(tmp_path / "new.colibri", str(path) + ".new")
    code = CHILD.format(budget=2 * EXPERT, expert=EXPERT, hidden=H, experts=E)
    return subprocess.run(
        [sys.executable, "-c", code, str(path), io, when, how],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@posix
@pytest.mark.parametrize("how", ["truncate", "replace"])
@pytest.mark.parametrize("when", ["between", "computing", "held"])
@pytest.mark.parametrize("io", IO_BACKENDS)
def test_a_file_changed_during_a_generation_raises_not_sigbus(tmp_path, io, when, how):
    if io == "mmap" and sys.platform == "win32":
        pytest.skip("no mmap backend here")
    done = _generate(tmp_path, io, when, how)
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr[-2000:])
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("colibri._files.FileChangedError:"), done.stderr[-2000:]
    assert "w.colibri" in last
    assert "four tokens" not in done.stdout


@posix
@pytest.mark.parametrize("io", IO_BACKENDS)
def test_a_changed_file_is_never_served_again(tmp_path, io):
    """After the error, the experts of the changed file stay out of the pager: a later load
    raises again (it does not hand out the zeros a guard put where the pages were)."""
    path = write_experts(tmp_path / "w.colibri", _experts())
    with Pager(path, budget_bytes=2 * EXPERT, page_size_kb=4, io=io) as pager:
        with pager.load(0, [2]) as batch:
            np.testing.assert_array_equal(batch[2].gate, _experts()[(0, 2)][0])
        with open(path, "r+b") as f:
            f.truncate(EXPERT)
        for _ in range(2):
            with pytest.raises(FileChangedError, match="w.colibri' must not change"):
                pager.load(0, [2])


@posix
@pytest.mark.parametrize("flags", [[], ["-X", "faulthandler"]])
def test_a_sigbus_outside_the_pagers_mappings_still_kills(tmp_path, flags):
    """The guard takes only faults in the pager's own mappings: a truncated mapping of
    another file dies of SIGBUS as it would without colibri (the previous handler, here
    faulthandler's, runs)."""
    path = write_experts(tmp_path / "w.colibri", _experts())
    other = tmp_path / "other.bin"
    other.write_bytes(b"x" * 65536)
    code = textwrap.dedent(
        f"""
        import mmap
        from colibri.pager import Pager
        pager = Pager({str(path)!r}, budget_bytes={2 * EXPERT}, page_size_kb=4, io="mmap")
        pager.load(0, [1]).release()  # the guard is installed
        with open({str(other)!r}, "r+b") as f:
            m = mmap.mmap(f.fileno(), 65536, access=mmap.ACCESS_READ)
            f.truncate(0)
            print(m[40000])
        """
    )
    done = subprocess.run([sys.executable, *flags, "-c", code], capture_output=True, timeout=120)
    assert done.returncode == -7, (done.returncode, done.stderr[-2000:])
    assert (b"Bus error" in done.stderr) == bool(flags)  # faulthandler's report
