"""The compilers and emulators the C-header tests build and run programs with (installed by
.ci/toolchains.sh; tests skip cleanly without them), and a wine prefix of the suite's own."""

from __future__ import annotations

import os
import shutil
import subprocess


def _tool(name: str, debian: str) -> str | None:
    return shutil.which(name) or (debian if os.path.exists(debian) else None)


WINE = _tool("wine64", "/usr/lib/wine/wine64")
WINESERVER = _tool("wineserver", "/usr/lib/wine/wineserver")
HOST_CC = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
AARCH64_CC = shutil.which("aarch64-linux-gnu-gcc")
QEMU = [shutil.which("qemu-aarch64")] if shutil.which("qemu-aarch64") else None
MINGW_CC = shutil.which("x86_64-w64-mingw32-gcc")
# strict C99 (the headers' promise), and no warning from GCC (the compiler CI builds with)
COMMON = ["-O2", "-std=c99", "-ffp-contract=off", "-Wall"]


def boot_wine(folder) -> dict[str, str]:
    """A wine prefix in ``folder``, booted and settled before any program runs in it; the
    environment that selects it.

    A program started while wine still builds a fresh prefix can fail before it runs (seen in
    CI: exit 1, nothing on stdout or stderr). So the prefix is made once with ``wineboot``,
    wineserver is waited on, and the user's ``~/.wine`` is never touched.
    """
    env = {"WINEPREFIX": os.path.join(os.fspath(folder), "prefix"), "WINEDEBUG": "-all"}
    full = {**os.environ, **env}
    boot = subprocess.run(
        [WINE, "wineboot", "--init"], env=full, capture_output=True, text=True, timeout=300
    )
    assert boot.returncode == 0, f"wineboot --init failed ({boot.returncode}): {boot.stderr}"
    settle_wine(env)
    return env


def settle_wine(env: dict[str, str], kill: bool = False) -> None:
    """Wait for the prefix's wineserver to finish (or stop it, with ``kill``)."""
    if WINESERVER:
        subprocess.run([WINESERVER, "--kill" if kill else "--wait"], env={**os.environ, **env},
                       timeout=300, check=False)  # fmt: skip
