"""What routing a mixture of experts costs, against the sequence's length: one block's
common.MoeMlp, forward and backward, compiled on one device, dropless (tokens grouped by expert,
a grouped matmul) and with a capacity (one-hot dispatch and combine, GShard). For each: the
compiled program's temporaries (XLA's memory analysis) and FLOPs (its cost analysis), against
the formulas below; the experts' own FLOPs are the same for both (6 x tokens x k x the
expert's 8 d^2 multiply-adds, forward and backward) where their matmuls compute only what is
routed to them.

Formulas, per block, for rows x length tokens, E experts, top-k, d = d_model, C the capacity
(capacity factor x length x k / E, at most the length), float32:
  capacity: dispatch and combine [rows, length, E, C] (two of them, and the one-hot [rows,
    length, k, C] each is made of), and the einsums through them: 2 x rows x length x E x C x d
    multiply-adds each way, so memory and FLOPs of routing grow as length x C: length squared.
  dropless: the sort of the rows x length x k choices, the slots [rows, length x k, d] and the
    outputs, gathered back: memory and FLOPs grow as the length.
XLA:CPU computes jax.lax.ragged_dot as one masked matmul per expert (measured: its cost
analysis counts E x the grouped FLOPs), so on CPU the dropless experts cost E / k times what a
GPU's or TPU's grouped matmul does; the figures show both.

  python dev/routing_cost.py                          # 256, 1k and 4k tokens
  python dev/routing_cost.py --lengths 256 1024 --capacity-factor 2
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import common  # noqa: E402


def skip_experts(x, group_sizes=None):
    return x


# Routing alone: the experts skipped (identity), in both paths.
ROUTING_ONLY = common.Hooks(
    to_experts=lambda experts, slots: slots,
    dropless=lambda mixture, x, expert, gate: common.grouped_by_expert(
        skip_experts, skip_experts, mixture.args[2], x, expert, gate
    ),
)


def cost(length, capacity_factor, routing_only=False, experts=8, top_k=2, d_model=64, rows=1):
    """(temporaries in bytes, FLOPs) of one MoeMlp's forward and backward at this length; of
    its routing alone (the experts skipped) if routing_only."""
    config = common.Config(
        d_model=d_model,
        heads=4,
        seq_len=length,
        experts=experts,
        top_k=top_k,
        capacity_factor=capacity_factor,
    )
    hooks = ROUTING_ONLY if routing_only else common.Hooks()
    moe = common.PieceDef.of("mlp", common.MoeMlp, config, hooks)  # shapes only
    x = jax.ShapeDtypeStruct((rows, length, d_model), jnp.float32)
    params = moe.params

    def loss(params, x):
        out, stats = common.run_piece(moe, params, x)
        return jnp.sum(out**2) + stats["aux_loss_sum"]

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes, compiled.cost_analysis()["flops"]


def expert_flops(length, experts=8, top_k=2, d_model=64, rows=1):
    """The experts' own FLOPs, forward and backward, where each computes only its tokens."""
    return 6 * rows * length * top_k * 2 * (4 * d_model * d_model)


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--capacity-factor", type=float, default=2.0)
    args = parser.parse_args()
    print(
        f"one block, 8 experts, top-2, d_model 64, forward and backward, float32; capacity "
        f"factor {args.capacity_factor:g}; temporaries in MiB, GFLOP"
    )
    print(
        f"{'length':>7} | routing alone: capacity | dropless | whole block: capacity | dropless "
        "| experts' own FLOPs (grouped)"
    )
    for length in args.lengths:
        figures = [
            cost(length, factor, routing_only)
            for routing_only in (True, False)
            for factor in (args.capacity_factor, 0.0)
        ]
        cells = [f"{held / 2**20:8.1f} {flops / 1e9:7.3f}" for held, flops in figures]
        print(f"{length:>7} | " + " | ".join(cells) + f" | {expert_flops(length) / 1e9:.3f}")


if __name__ == "__main__":
    main()
