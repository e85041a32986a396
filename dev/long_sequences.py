"""What each way of splitting a long sequence costs, compiled on CPU (no step is run): the figures
of docs/long_sequences.md's tables, each beside its formula.

Context parallelism (context_parallel.py --attention-split), one layer's attention forward and
backward on a mesh context=8 (the queries, keys and values [1, length, 8 heads, 32] = d 256),
at sequence lengths 1k, 4k and 16k:
  sent per layer and device, as a ring sends (a collective-permute sends its whole buffer; an
  all-gather, a reduce-scatter or an all-to-all (N - 1) / N of its whole buffer), with b the
  bytes of one device's block of keys (or values, queries, outputs), length / N x d:
    ring        4 (N - 1) b     N - 1 hops of a key and a value block, their gradients back
    all-gather  4 (N - 1) b     the keys and values gathered, their gradients reduce-scattered
    ulysses     8 (N - 1) / N b q, k, v to a head split and the output back, and backward
  in float32 (ring and all-gather compute in it; Ulysses sends the compute dtype). And the
  compiled temporaries per device: the ring holds a block's scores at a time ((length / N)^2
  per head, hop by hop), all-gather and Ulysses a whole [length / N, length] or [length,
  length] of them per head (N heads / N each).
Sequence parallelism (pjit_tp.py --sequence-parallel): the whole train step's temporaries per
device, with and without, at model = 2, 4 and 8 (the rest 'data', 2 rows of 1,024 tokens
per device along it), against Megatron's formula for a
layer's activations (Korthikanti et al. 2022, s the length, b the rows, h = d_model, a heads, t
= model): sbh (10 + 24 / t + 5 a s / (h t)) without, sbh (34 / t + 5 a s / (h t)) with.

  python dev/long_sequences.py             # both tables (under a minute on 2 cores)
  python dev/long_sequences.py --write     # and put them into docs/long_sequences.md
  python dev/long_sequences.py --lengths 1024 4096
"""

import argparse
import functools
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flax import nnx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import common  # noqa: E402
from tools import hlo  # noqa: E402
import context_parallel  # noqa: E402
import pjit_tp  # noqa: E402

CONTEXT, HEADS, HEAD_DIM = 8, 8, 32
# Per op: the share of its whole buffer a device sends, as a ring runs it
SENT = {"collective-permute": lambda n: 1, "all-to-all": lambda n: (n - 1) / n}
SENT["all-gather"] = SENT["reduce-scatter"] = SENT["all-to-all"]
FORMULA = {  # sent per layer and device, in units of one device's block b
    "ring": lambda n: 4 * (n - 1),
    "all-gather": lambda n: 4 * (n - 1),
    "ulysses": lambda n: 8 * (n - 1) / n,
}
WINS = {
    "ring": "memory: no device holds more than a block of keys and scores at a time",
    "all-gather": "simplicity and short sequences: one collective, the masked attention local",
    "ulysses": "many heads (a multiple of N), an all-to-all fabric: 2/N of the ring's bytes",
}


def attention_cost(split, length):
    """(bytes sent per device, compiled temporaries per device) of one layer's attention, forward
    and backward, under one split, in float32."""
    mesh = jax.make_mesh((CONTEXT,), ("context",), axis_types=(jax.sharding.AxisType.Explicit,))
    attend = {
        "ring": context_parallel.ring_attention,
        "all-gather": context_parallel.all_gather_attention,
        "ulysses": functools.partial(
            context_parallel.ulysses_attention, attend=common.causal_attention
        ),
    }[split]
    spec = P(None, "context")

    def loss(q, k, v, cotangent):  # (a cotangent of ones would fold its all-to-all away)
        out = jax.shard_map(attend, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)(q, k, v)
        return (out * cotangent).sum()

    shape = jax.ShapeDtypeStruct(
        (1, length, HEADS, HEAD_DIM), jnp.float32, sharding=NamedSharding(mesh, spec)
    )
    step = jax.value_and_grad(loss, argnums=(0, 1, 2))  # the loss too: the output is used
    compiled = jax.jit(step).lower(*[shape] * 4).compile()
    sent = sum(
        SENT[c["op"]](CONTEXT) * c["bytes"] * c["runs"]
        for c in hlo.hlo_collectives(compiled.as_text())
        if c["op"] in SENT  # (not the loss's all-reduce, of one number)
    )
    return sent, compiled.memory_analysis().temp_size_in_bytes


def sp_temporaries(model, sequence_parallel, dropout):
    """The compiled train step's temporaries per device, pjit_tp.py on 8 devices, `model` of
    them along 'model', 2 rows of 1,024 tokens per group of 'model'."""
    config = pjit_tp.Config(
        mesh=f"data={8 // model},model={model}",
        layers=2,
        d_model=256,
        heads=8,
        seq_len=1024,
        batch_size=2 * (8 // model),
        dropout=dropout,
        sequence_parallel=sequence_parallel,
        cpu_devices=8,
    )
    mesh = pjit_tp.make_mesh(config)
    state = pjit_tp.init_state(config, mesh, shapes_only=True)
    shardings = jax.tree.map(lambda x: x.sharding, state)
    step = jax.jit(
        functools.partial(pjit_tp.train_step, config=config),
        in_shardings=(shardings, NamedSharding(mesh, pjit_tp.BATCH_SPEC)),
        out_shardings=(shardings, NamedSharding(mesh, P())),
    )
    batch = common.batch_shape(config, NamedSharding(mesh, pjit_tp.BATCH_SPEC))
    rules = pjit_tp.SEQUENCE_PARALLEL if sequence_parallel else ()
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        compiled = step.lower(state, batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes, config


def megatron_ratio(config, model):
    """Megatron's activations per layer with sequence parallelism over those without."""
    a, s, h = config.heads, config.seq_len, config.d_model
    return (34 / model + 5 * a * s / (h * model)) / (10 + 24 / model + 5 * a * s / (h * model))


def context_table(lengths):
    sizes = " | ".join(f"{n // 1024}k" for n in lengths)
    rows = [
        f"| attention split | sent per layer and device: formula | {sizes} | temporaries per "
        f"device: {sizes} | wins for |",
        "|---|---|" + "---|" * (2 * len(lengths)) + "---|",
    ]
    expression = {"ring": "4 (N − 1) b", "all-gather": "4 (N − 1) b", "ulysses": "8 (N − 1) / N b"}
    for split in FORMULA:
        sent, temporaries = [], []
        for length in lengths:
            bytes_sent, temp = attention_cost(split, length)
            block = length // CONTEXT * HEADS * HEAD_DIM * 4
            formula = FORMULA[split](CONTEXT) * block
            assert abs(bytes_sent - formula) <= 0.01 * formula, (split, length, bytes_sent, formula)
            sent.append(f"{bytes_sent / 1e6:.2f} MB (formula {formula / 1e6:.2f})")
            temporaries.append(f"{temp / 1e6:,.1f} MB")
        rows.append(
            f"| {split} | {expression[split]} | {' | '.join(sent)} | {' | '.join(temporaries)} | "
            f"{WINS[split]} |"
        )
    return "\n".join(rows)


def sequence_table(models):
    rows = [
        "| model | temporaries per device without | with `--sequence-parallel` | ratio | "
        "ratio, dropout 0 | Megatron's formula | everything 1/model |",
        "|---|---|---|---|---|---|---|",
    ]
    for model in models:
        ratios = {}
        for dropout in (0.1, 0.0):
            without, config = sp_temporaries(model, False, dropout)
            with_sp, _ = sp_temporaries(model, True, dropout)
            ratios[dropout] = (without, with_sp, with_sp / without)
        without, with_sp, ratio = ratios[0.1]
        rows.append(
            f"| {model} | {without / 1e6:.1f} MB | {with_sp / 1e6:.1f} MB | {ratio:.2f} | "
            f"{ratios[0.0][2]:.2f} | {megatron_ratio(config, model):.2f} | {1 / model:.2f} |"
        )
    return "\n".join(rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--models", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument(
        "--write", action="store_true", help="put the tables into docs/long_sequences.md"
    )
    args = parser.parse_args()
    jax.config.update("jax_num_cpu_devices", 8)
    tables = {"sp": sequence_table(args.models), "cp": context_table(args.lengths)}
    for text in tables.values():
        print(text + "\n")
    if args.write:
        readme = ROOT / "docs" / "long_sequences.md"
        text = readme.read_text()
        for key, table in tables.items():
            marker = re.compile(f"<!-- {key}:start -->.*?<!-- {key}:end -->", re.DOTALL)
            text = marker.sub(
                lambda _, t=table, k=key: f"<!-- {k}:start -->\n{t}\n<!-- {k}:end -->", text
            )
        readme.write_text(text)


if __name__ == "__main__":
    main()
