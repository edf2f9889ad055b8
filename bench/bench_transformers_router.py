"""Per-call time of a transformers MoE router: its own routing vs colibri's (patched).

The router module is called as the MoE block calls it (gate projection included), on
random hidden states, at decode (1 token) and prefill-like batch sizes. The routers have
the expert counts of real models but a hidden size of --hidden (64 by default), so that
the time is the routing's, not the gate projection's (which is the same torch matmul
either way). Prints the median microseconds per call and the ratio transformers / colibri.

    python bench/bench_transformers_router.py [--threads N] [--repeat 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from colibri.integrations.transformers import patch, unpatch

HIDDEN = 64


def _mixtral():
    from transformers.models.mixtral import configuration_mixtral, modeling_mixtral

    config = configuration_mixtral.MixtralConfig(
        hidden_size=HIDDEN, num_local_experts=8, num_experts_per_tok=2
    )
    return modeling_mixtral.MixtralTopKRouter(config)


def _qwen3_moe():
    from transformers.models.qwen3_moe import configuration_qwen3_moe, modeling_qwen3_moe

    config = configuration_qwen3_moe.Qwen3MoeConfig(
        hidden_size=HIDDEN, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True
    )
    return modeling_qwen3_moe.Qwen3MoeTopKRouter(config)


def _deepseek_v3():
    from transformers.models.deepseek_v3 import configuration_deepseek_v3, modeling_deepseek_v3

    config = configuration_deepseek_v3.DeepseekV3Config(
        hidden_size=HIDDEN, n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4,
        routed_scaling_factor=2.5, norm_topk_prob=True,
    )  # fmt: skip
    return modeling_deepseek_v3.DeepseekV3TopkRouter(config)


def _gemma4():
    from transformers.models.gemma4 import configuration_gemma4, modeling_gemma4

    config = configuration_gemma4.Gemma4TextConfig(
        hidden_size=HIDDEN, enable_moe_block=True, num_experts=128, top_k_experts=8
    )
    return modeling_gemma4.Gemma4TextRouter(config)


ROUTERS = {
    "Mixtral (E 8, k 2)": _mixtral,
    "Qwen3-MoE (E 128, k 8)": _qwen3_moe,
    "DeepSeek-V3 (E 256, k 8, 8 groups keep 4, bias)": _deepseek_v3,
    "Gemma4 (E 128, k 8, per-expert scale)": _gemma4,
}


def _median_us(router, hidden, repeat: int) -> float:
    times = []
    with torch.no_grad():
        for _ in range(5):
            router(hidden)
        for _ in range(repeat):
            start = time.perf_counter_ns()
            router(hidden)
            times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch and colibri threads")
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--hidden", type=int, default=HIDDEN)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256])
    args = parser.parse_args()
    globals()["HIDDEN"] = args.hidden
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} torch threads")
    print(f"{'router':<48} {'T':>4} {'transformers us':>16} {'colibri us':>11} {'ratio':>6}")
    for name, make in ROUTERS.items():
        router = make().eval()
        with torch.no_grad():
            for param in router.parameters():
                param.normal_(0, 0.02)
        hidden_size = args.hidden
        for tokens in args.tokens:
            hidden = torch.randn(tokens, hidden_size)
            reference = _median_us(router, hidden, args.repeat)
            patch(router, routing_threads=args.threads)
            colibri = _median_us(router, hidden, args.repeat)
            unpatch(router)
            print(f"{name:<48} {tokens:>4} {reference:>16.1f} {colibri:>11.1f} "
                  f"{reference / colibri:>6.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
