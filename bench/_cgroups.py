"""A small machine made honestly, as root: cgroups with a memory limit (page cache included)
and a read cap, v2 (``memory.max`` / ``io.max``) where the memory controller is on the unified
tree, else v1 (``memory.limit_in_bytes`` / ``blkio.throttle.read_bps_device``)."""

from __future__ import annotations

import os
import time

CGROUP = "/sys/fs/cgroup"


def cgroup_kind() -> str | None:
    """``"v2"`` (memory on the unified tree), ``"v1"`` (a ``memory`` mount) or None."""
    try:
        with open(os.path.join(CGROUP, "cgroup.controllers")) as f:
            if "memory" in f.read().split():
                return "v2"
    except OSError:
        pass
    return "v1" if os.path.isdir(os.path.join(CGROUP, "memory")) else None


def block_device(path: str) -> str:
    """``"MAJ:MIN"`` of the whole disk ``path`` is on (a partition's parent)."""
    st = os.stat(path)
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    sys_dir = f"/sys/dev/block/{dev}"
    if not os.path.isdir(sys_dir):
        raise RuntimeError(f"{path} is on device {dev}, which is no block device (an overlay "
                           "or tmpfs?): put the model on a disk to cap its reads")  # fmt: skip
    if os.path.exists(os.path.join(sys_dir, "partition")):
        with open(os.path.join(sys_dir, "..", "dev")) as f:
            dev = f.read().strip()
    return dev


class Group:
    """A cgroup with a memory limit (None: none) and a read cap of ``device`` in bytes/s
    (None: none)."""

    def __init__(self, kind: str, name: str, limit: int | None, cap: int | None = None,
                 device: str | None = None):  # fmt: skip
        self.kind = kind
        if kind == "v2":
            self.dirs = [os.path.join(CGROUP, name)]
            with open(os.path.join(CGROUP, "cgroup.subtree_control"), "w") as f:
                f.write("+memory +io")
        else:
            self.dirs = [os.path.join(CGROUP, c, name) for c in ("memory", "blkio")]
        for d in self.dirs:
            os.makedirs(d, exist_ok=True)
        mem, io = self.dirs[0], self.dirs[-1]
        if limit is not None:
            _write(mem, "memory.max" if kind == "v2" else "memory.limit_in_bytes", limit)
            if kind == "v2" and os.path.exists(os.path.join(mem, "memory.swap.max")):
                _write(mem, "memory.swap.max", 0)
        if cap is not None:
            if kind == "v2":
                _write(io, "io.max", f"{device} rbps={cap}")
            else:
                _write(io, "blkio.throttle.read_bps_device", f"{device} {cap}")

    def join(self) -> None:
        """Put the calling process in the group (``preexec_fn``)."""
        for d in self.dirs:
            _write(d, "cgroup.procs", os.getpid())

    def peak(self) -> int | None:
        """The group's peak memory, page cache included (None where the kernel lacks it)."""
        name = "memory.peak" if self.kind == "v2" else "memory.max_usage_in_bytes"
        try:
            with open(os.path.join(self.dirs[0], name)) as f:
                return int(f.read())
        except (OSError, ValueError):  # memory.peak is Linux >= 5.19
            return None

    def oom_kills(self) -> int:
        name = "memory.events" if self.kind == "v2" else "memory.oom_control"
        try:
            with open(os.path.join(self.dirs[0], name)) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except OSError:
            pass
        return 0

    def remove(self) -> None:
        for d in self.dirs:
            for _ in range(50):  # the exited process leaves its group a moment later
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)


def _write(folder: str, name: str, value) -> None:
    with open(os.path.join(folder, name), "w") as f:
        f.write(str(value))


def drop_caches() -> None:
    """Empty the page cache (all of it: the run starts cold)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")
