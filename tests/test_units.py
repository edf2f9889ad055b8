"""Sizes and memory readings: one meaning of every unit, everywhere."""

import os
import subprocess
import sys

import numpy as np
import pytest

from colibri._units import format_bytes, parse_size, process_memory


@pytest.mark.parametrize(
    ("text", "size"),
    [
        (805306368, 805306368),
        (np.int64(4096), 4096),
        ("4096", 4096),
        ("768MiB", 768 << 20),
        ("3GiB", 3 << 30),
        ("3 gib", 3 << 30),
        ("3GB", 3 * 10**9),
        ("2gb", 2 * 10**9),
        ("500MB", 500 * 10**6),
        ("64kB", 64_000),
        ("64KiB", 64 << 10),
        ("1.5G", 3 << 29),
        ("512M", 512 << 20),
        ("1T", 1 << 40),
        ("1TB", 10**12),
        (" 2 GiB ", 2 << 30),
    ],
)
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("bad", ["", "abc", "-1", "0", "3 parsecs", "1e3", "GB", 0, -5, True, 1.5])
def test_parse_size_refuses(bad):
    with pytest.raises(ValueError, match=r"budget must be a positive size .*'3GB' \(10\*\*9"):
        parse_size(bad, "budget")


def test_format_bytes():
    assert format_bytes(365.6 * (1 << 20)) == "365.6 MiB"
    assert format_bytes(3 << 30) == "3.00 GiB"
    assert format_bytes(0) == "0.0 MiB"


def test_process_memory_reads_this_process():
    mem = process_memory()
    assert mem.peak is not None and mem.peak > 0
    if not os.path.exists("/proc/self/status"):
        return
    assert mem.rss > 0 and mem.anon > 0 and mem.file > 0 and mem.peak >= mem.rss
    # in a fresh process (no freed arena to reuse): 64 MiB touched are 64 MiB more RssAnon
    code = (
        "import numpy as np; from colibri._units import process_memory as m; a = m().anon; "
        "b = np.ones(64 << 20, np.uint8); print(m().anon - a, m().peak - m().rss)"
    )
    grown, peak_over_rss = map(
        int,
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.split(),
    )
    assert 60 << 20 <= grown <= 72 << 20 and peak_over_rss >= 0
