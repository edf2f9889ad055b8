"""A resident model's decoding step with and without colibri's one-call decoder-layer step
(``model.colibri.decode``), in interleaved fresh processes.

    python bench/bench_decode.py MODEL.gguf            # or a transformers checkpoint folder
    python bench/bench_decode.py MODEL.gguf --pairs 6 --threads 2

Each process loads the model (budget: every expert), generates 16 tokens to warm up, then
three times 33 greedy tokens; a token costs the 33-token run minus a 1-token run, over 32.
"step": the layers' steps as loaded; "own": the same model after the steps are removed (each
layer runs its own ``forward``). The two alternate, one process at a time; printed: each
process's best ms a token, the medians, and own / step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time


def _worker(path: str, mode: str, threads: int) -> float:
    import torch

    from colibri.integrations.transformers import from_pretrained

    torch.set_num_threads(threads)
    model = from_pretrained(path, budget="auto", num_threads=threads)
    if mode == "own":
        for name in model.colibri.decode:
            model.get_submodule(name).__dict__.pop("forward")
    ids = torch.randint(3, 1000, (1, 16), generator=torch.Generator().manual_seed(0))
    best = float("inf")
    with torch.no_grad():
        model.generate(ids, do_sample=False, max_new_tokens=16, pad_token_id=0)
        for _ in range(3):
            start = time.perf_counter()
            model.generate(ids, do_sample=False, max_new_tokens=33, min_new_tokens=33,
                           pad_token_id=0)  # fmt: skip
            middle = time.perf_counter()
            model.generate(ids, do_sample=False, max_new_tokens=1, pad_token_id=0)
            end = time.perf_counter()
            best = min(best, ((middle - start) - (end - middle)) / 32)
    model.colibri.close()
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a GGUF file or a transformers checkpoint folder")
    parser.add_argument("--pairs", type=int, default=4, help="step/own process pairs")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--worker", choices=["step", "own"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(args.model, args.worker, args.threads)))
        return
    times: dict[str, list[float]] = {"step": [], "own": []}
    for pair in range(args.pairs):
        for mode in ("step", "own"):
            run = subprocess.run([sys.executable, __file__, args.model, "--worker", mode,
                                  "--threads", str(args.threads)],
                                 capture_output=True, text=True, check=True)  # fmt: skip
            times[mode].append(json.loads(run.stdout.strip().splitlines()[-1]))
        print(f"pair {pair + 1}: step {times['step'][-1]:.2f} ms, own {times['own'][-1]:.2f} ms")
    step, own = (statistics.median(times[m]) for m in ("step", "own"))
    print(f"median ms a token: step {step:.2f}, own forward {own:.2f}; "
          f"own / step {own / step:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
