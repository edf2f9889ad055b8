"""The torch.distributed group an expert-parallel model runs on (gloo, CPU tensors)."""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist

from colibri.distributed._wire import DistributedError

__all__ = ["ENVIRONMENT", "join", "launched"]

#: What torchrun (or any launcher) sets for each process.
ENVIRONMENT = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launched() -> bool:
    """Whether this process was started as one of several ranks (torchrun's environment with
    ``WORLD_SIZE`` > 1)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


def join(group, timeout: float):
    """``(group, rank, world size)``: ``group``, else the default group, initialised with
    gloo from the launcher's environment when it is not yet (``timeout``: how long the ranks
    wait for each other to join, and its collectives' bound).

    Raises
    ------
    DistributedError
        No group and no launcher environment, the other ranks not all joined within
        ``timeout``, or a group whose backend is not gloo.
    """
    if group is None:
        if not dist.is_available():  # pragma: no cover - torch built without distributed
            raise DistributedError("expert parallel: this torch has no torch.distributed")
        if not dist.is_initialized():
            missing = [name for name in ENVIRONMENT if name not in os.environ]
            if missing:
                raise DistributedError(
                    f"expert parallel: no process group and no {', '.join(missing)} in the "
                    "environment; fix: start the program with torchrun (torchrun "
                    "--nproc-per-node 2 ...) or call torch.distributed.init_process_group"
                    '("gloo") first'
                )
            try:
                dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
            except (RuntimeError, TimeoutError, OSError) as exc:  # torch's Dist*Error too
                where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
                raise DistributedError(
                    f"expert parallel: rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} "
                    f"could not join the group at {where} within {timeout:g} s ({exc}); fix: "
                    "start every rank with the same MASTER_ADDR and MASTER_PORT, or raise "
                    "start_timeout= if they start far apart"
                ) from None
        group = dist.group.WORLD
    backend = str(dist.get_backend(group))
    if "gloo" not in backend:
        raise DistributedError(
            f"expert parallel: the process group's backend is {backend!r}; colibri sends CPU "
            'tensors and needs gloo: init_process_group("gloo") (or a gloo group: '
            'dist.new_group(backend="gloo"))'
        )
    return group, dist.get_rank(group), dist.get_world_size(group)
