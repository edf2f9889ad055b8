"""One rank of the expert-parallel tests, run as its own process by test_expert_parallel.py.

``python _rank.py RANK WORLD PORT CHECKPOINT BUDGET MODE OUT [PLACEMENT]``: joins a gloo
group on 127.0.0.1, loads CHECKPOINT with ``expert_parallel`` (PLACEMENT: a saved placement);
rank 0 generates and compares with one process (tokens and every logit bit for bit) and
writes what it saw to OUT (JSON), every rank's pager counters too. MODE on rank 1: ``die``
(SIGKILL itself at its 3rd request), ``hang`` (sleep at it); elsewhere ``run``, or
``split`` (any rank: messages cross in a first part of 256 bytes and a rest).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch

rank, world, port, checkpoint, budget, mode, out = sys.argv[1:8]
placement = sys.argv[8] if len(sys.argv) > 8 else None
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=rank, WORLD_SIZE=world)
torch.set_num_threads(1)

from colibri.distributed import DistributedError, _serve, _wire  # noqa: E402
from colibri.integrations.transformers import from_pretrained  # noqa: E402

if mode == "split":
    _wire.FIRST = 256

if mode in ("die", "hang"):
    answered = [0]
    compute = _serve.compute

    def faulty(*args, **kwargs):
        answered[0] += 1
        if answered[0] == 3:
            if mode == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(600)
        return compute(*args, **kwargs)

    _serve.compute = faulty

IDS = torch.tensor([[5, 17, 42, 8, 63, 21, 9]])
GEN = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
report: dict = {}
start = time.monotonic()
try:
    model = from_pretrained(checkpoint, budget=int(budget), page_size_kb=4,
                            expert_parallel={"timeout": 3.0, "placement": placement})  # fmt: skip
    if model is not None:
        with torch.no_grad():
            got = model.generate(IDS, **GEN)
        remote = model.colibri.remote
        report["sent"], report["received"] = remote.sent_bytes, remote.received_bytes
        report["placement"] = remote.placement.to_dict()
        report["rows_sent"] = remote.rows_sent
        report["ranks"] = remote.rank_stats()
        report["recall"] = model.colibri.prediction["gate"].recall
        model.colibri.close()
        ref = from_pretrained(checkpoint, budget=int(budget), page_size_kb=4)
        with torch.no_grad():
            want = ref.generate(IDS, **GEN)
        report["tokens"] = got.sequences.tolist()
        report["want"] = want.sequences.tolist()
        report["logits_equal"] = all(
            torch.equal(a, b) for a, b in zip(got.logits, want.logits, strict=True)
        )
except DistributedError as exc:
    report["error"] = str(exc)
report["elapsed"] = time.monotonic() - start
with open(out, "w") as f:
    json.dump(report, f)
