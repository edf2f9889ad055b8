"""Fuzz throughput: inputs per second through every target's contract, by harness.

Run from the repository root: ``python bench/bench_fuzz.py [--examples 150] [--runs 20000]``.

Measured in the same run, over all targets of tests/test_fuzz.py, both harnesses checking the
same contracts (tests/_support/contracts.py) through colibri's public parsers:

- hypothesis: one ``pytest`` session of the default-suite fuzzers at ``COLIBRI_FUZZ_EXAMPLES``
  examples per target (what ``.ci/fuzz.sh`` runs per piece), session start included;
- atheris: ``tests/fuzz_atheris.py --runs`` inputs per target, one child per target, its start
  included (needs the ``fuzz`` extra).

Wall-clock seconds of each whole command, printed as markdown tables.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def timed(cmd: list[str], env: dict) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return seconds, proc.stdout + proc.stderr


def measure(args, work: str, env: dict):
    """``[(harness, inputs, seconds)]`` and atheris's per-target lines."""
    rows = []
    seconds, out = timed(
        ["pytest", "-q", "-p", "no:randomly", "-m", "not slow", "tests/test_fuzz.py",
         "-k", "not ledger and not atheris"], env,
    )  # fmt: skip
    inputs = int(re.search(r"fuzz inputs this session: (\d+)", out).group(1))
    rows.append(("hypothesis (pytest session)", inputs, seconds))
    seconds, out = timed(
        [sys.executable, "tests/fuzz_atheris.py", "--runs", str(args.runs),
         "--ledger", os.path.join(work, "ledger.jsonl")], env,
    )  # fmt: skip
    per = re.findall(r"^([\w-]+): (\d+) inputs, (\d+) refused, 0 faults, ([\d.]+) s$", out, re.M)
    rows.append(("atheris (a child per target)", sum(int(p[1]) for p in per), seconds))
    return rows, per


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=150)
    parser.add_argument("--runs", type=int, default=20000)
    args = parser.parse_args()
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    work = tempfile.mkdtemp(prefix="bench-fuzz-", dir=shm)
    env = dict(os.environ, COLIBRI_FUZZ_TMP=work, COLIBRI_FUZZ_EXAMPLES=str(args.examples))
    env.pop("COLIBRI_FUZZ_LEDGER", None)
    try:
        rows, per = measure(args, work, env)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = rows[0][1] / rows[0][2]
    print("| harness | inputs | seconds | inputs/s | vs hypothesis |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, n, s in rows:
        print(f"| {name} | {n} | {s:.1f} | {n / s:.0f} | {n / s / base:.1f}x |")
    print("\n| atheris target | inputs | refused | seconds (child start included) | inputs/s |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for target, n, refused, s in per:
        print(f"| {target} | {n} | {refused} | {float(s):.1f} | {int(n) / float(s):.0f} |")


if __name__ == "__main__":
    main()
