"""Regenerate the pipeline schedules in the documentation from pipeline.py.

Two blocks, each between its markers: docs/strategies.md's picture of the schedules
(`<!-- schedule:start -->`: what `python pipeline.py --show-schedule` prints for each, 4 stages,
8 micro-batches), and README.md's table of them side by side (`<!-- schedules:start -->`:
ticks, bubble from the table and from its formula, and micro-batches in flight per stage, all
read from make_schedule's tables). tests/test_docs.py fails when either is stale.

  python dev/schedules.py           # rewrite both blocks
  python dev/schedules.py --check   # exit 1 if either differs from pipeline.py
"""

import argparse
import contextlib
import io
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from tools import hlo  # noqa: E402
import pipeline  # noqa: E402

STAGES, MICROBATCHES, VIRTUAL = 4, 8, 2
FORMULAS = {  # the bubble's share of the stages' ticks (tests/test_schedules.py checks them all)
    "gpipe": ("(S − 1)/(M + S − 1)", MICROBATCHES),
    "1f1b": ("(S − 1)/(M + S − 1)", MICROBATCHES),
    "zero-bubble": ("(S − 1)/(3M + S − 1)", 3 * MICROBATCHES),
    "interleaved": ("(S − 1)/(VM + S − 1)", VIRTUAL * MICROBATCHES),
    "zbv": ("(S − 1)/(6M + S − 1)", 6 * MICROBATCHES),
}
TICK = {  # what one tick of a stage is
    "gpipe": "F or a whole backward",
    "1f1b": "F or a whole backward",
    "zero-bubble": "F, B (the input's gradient) or W (the weights')",
    "interleaved": f"F or backward of 1/{VIRTUAL} stage",
    "zbv": "F, B or W of 1/2 stage",
}


def op_costs(blocks=1, config=None):
    """What each op of a tick costs, in the compiled program's matmul FLOPs, on one stage of
    `blocks` blocks of the default model, in forwards of that stage: the forward (F), the
    whole backward of 1F1B and GPipe (jax.vjp, the stage run again from its input; with
    --no-remat a forward less, from what the forward kept), and zero-bubble's B (the same, less
    the dense kernels' gradients, keeping what W needs) and W (those gradients, x^T dy per
    dense layer, from what B kept). Compiled on one device for one micro-batch of the
    default's."""
    config = config or pipeline.Config(layers=blocks, cpu_devices=1)
    layers, model = blocks, pipeline.common.make_model(config)
    rows, length = config.batch_size // 2 // config.microbatches, config.seq_len
    x = jnp.zeros((rows, length, config.d_model), jnp.dtype(config.dtype))
    one = pipeline.common.init_params(model, jax.random.key(0))["block_0"]
    params = {"blocks": jax.tree.map(lambda p: jnp.stack([p] * layers)[None], one)}
    rng, blocks_of = jax.random.key(1), lambda p: jax.tree.map(lambda a: a[0], p["blocks"])
    calls = pipeline.dense_calls(config, params, x)

    def forward(params, x):
        return pipeline.run_blocks(blocks_of(params), x, rng, config)[0]

    def backward(params, x, dy):
        return jax.vjp(forward, params, x)[1](dy)

    def input_grad(params, x, dy):
        deltas = [jnp.zeros((layers, *y.shape), y.dtype) for _, _, y in calls]
        kernels = pipeline.kernels_of(pipeline.group(params, 0), calls)

        def f(rest, x, deltas):  # the dense kernels held fixed: their gradients are W's
            blocks = pipeline.with_kernels(rest, calls, kernels)["blocks"]
            y, _, inputs = pipeline.run_blocks(blocks, x, rng, config, 0, deltas)
            return y, inputs

        rest = pipeline.with_kernels(pipeline.group(params, 0), calls, [None] * len(calls))
        _, vjp, inputs = jax.vjp(f, rest, x, deltas, has_aux=True)
        grads, dx, dense_grads = vjp(dy)
        return grads, dx, inputs, dense_grads

    def weight_grad(params, inputs, dense_grads):
        kernels = [
            jnp.einsum("l...i,l...o->lio", *pair) for pair in zip(inputs, dense_grads, strict=True)
        ]
        return pipeline.with_kernels(pipeline.group(params, 0), calls, kernels)

    inputs, dense_grads = jax.eval_shape(input_grad, params, x, x)[2:]

    def flops(fn, *args):  # its matmuls', each loop's body times its trips (hlo.hlo_flops)
        return hlo.hlo_flops(jax.jit(fn).lower(*args).compile().as_text())

    f = flops(forward, params, x)
    again = f * config.remat  # each backward compiled here runs the forward: all but --remat's
    return {
        pipeline.FORWARD: 1.0,
        pipeline.BACKWARD: (flops(backward, params, x, x) - f + again) / f,
        pipeline.INPUT_GRAD: (flops(input_grad, params, x, x) - f + again) / f,
        pipeline.WEIGHT_GRAD: flops(weight_grad, params, inputs, dense_grads) / f,
    }


def predicted(schedule, costs):
    """A schedule's step time, in forwards of a stage, and its bubble, from the ops' costs: the
    stages run in lockstep (a tick's activations move at its end), so each tick takes as long
    as its slowest stage's op; the bubble is the share of the stages' time spent waiting."""
    cost = np.vectorize(lambda op: costs.get(op, 0.0))(schedule[:, :, pipeline.OP])
    # Interleaved: an op runs 1/V of the stage's layers
    cost = cost / max(1, schedule[:, :, pipeline.VIRTUAL].max() + 1)
    step = cost.max(axis=1).sum()
    return step, 1 - cost.sum() / (step * schedule.shape[1])


def picture():
    """What `python pipeline.py --show-schedule --schedule KIND` prints for each schedule
    (its main calls show_schedule on make_schedule's table, as here)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for kind in pipeline.SCHEDULES:
            groups = {"interleaved": VIRTUAL, "zbv": 2}.get(kind, 1)
            table = pipeline.make_schedule(kind, STAGES, MICROBATCHES, groups)
            pipeline.show_schedule(kind, table)
    return "<!-- schedule:start -->\n```\n" + out.getvalue() + "```\n<!-- schedule:end -->"


def table():
    rows = [
        f"S = {STAGES} stages, M = {MICROBATCHES} micro-batches, V = {VIRTUAL} groups of layers "
        "per stage (interleaved, zbv); F a forward. In flight: from a forward to its last "
        "backward (W where split), per group. `python pipeline.py --show-schedule --schedule "
        "KIND` prints each.",
        "",
        "| `--schedule` | ticks | bubble: idle ticks | formula | a tick | in flight, stage 0 … 3 "
        "| step in forwards (bubble), by measured costs |",
        "|---|---|---|---|---|---|---|",
    ]
    costs = op_costs()
    for kind in pipeline.SCHEDULES:
        schedule = pipeline.make_schedule(
            kind, STAGES, MICROBATCHES, {"interleaved": VIRTUAL, "zbv": 2}.get(kind, 1)
        )
        idle = (schedule[:, :, pipeline.OP] == pipeline.IDLE).mean()
        formula, work = FORMULAS[kind]
        held = " / ".join(map(str, pipeline.in_flight(schedule)))
        step, bubble = predicted(schedule, costs)
        rows.append(
            f"| {kind} | {schedule.shape[0]} | {idle:.1%} | {formula} = "
            f"{(STAGES - 1) / (work + STAGES - 1):.1%} | {TICK[kind]} | {held} | "
            f"{step:.1f} ({bubble:.1%}) |"
        )
    rows += [
        "",
        "The costs, in matmul FLOPs of one stage's compiled ops (`op_costs`, the default block, "
        "one micro-batch), in forwards: a whole backward "
        f"{costs[pipeline.BACKWARD]:.2f}, zero-bubble's B {costs[pipeline.INPUT_GRAD]:.2f} and W "
        f"{costs[pipeline.WEIGHT_GRAD]:.2f} (`--no-remat`: a forward less each). A tick lasts "
        "as long as its slowest stage's op.",
    ]
    return "<!-- schedules:start -->\n" + "\n".join(rows) + "\n<!-- schedules:end -->"


BLOCKS = [
    (
        ROOT / "docs" / "strategies.md",
        re.compile(r"<!-- schedule:start -->.*?<!-- schedule:end -->", re.DOTALL),
        picture,
    ),
    (
        ROOT / "README.md",
        re.compile(r"<!-- schedules:start -->.*?<!-- schedules:end -->", re.DOTALL),
        table,
    ),
]


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--check", action="store_true", help="only check; exit 1 if a block is stale"
    )
    args = parser.parse_args()
    for page, marker, make in BLOCKS:
        text = page.read_text()
        if not marker.search(text):
            sys.exit(f"{page.name}: no {marker.pattern.split('.')[0]} block")
        block = make()
        fresh = marker.sub(lambda _, block=block: block, text)
        if args.check and fresh != text:
            sys.exit(
                f"{page.name}'s pipeline schedules differ from pipeline.py: run python "
                "dev/schedules.py"
            )
        if not args.check:
            page.write_text(fresh)
        print(f"{page.name}: the schedules {'match pipeline.py' if args.check else 'rewritten'}")


if __name__ == "__main__":
    main()
