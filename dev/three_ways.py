"""One layout, three ways: FSDP+TP on a data=2,model=4 mesh, written in each of JAX's modes.

The layout is logical_pjit.py's `--rules fsdp_tp`: the batch over 'data'; attention heads, MLP
units and the vocabulary over 'model' (Megatron); every parameter's 'embed' axis over 'data'
(FSDP). Three programs train it and compute the same numbers (test_equivalence.py proves each
against one device):

  manual    jax.shard_map, every collective written here (`manual_step`, below): the GPT's
            layers run on their shards, with Megatron's two operators around each split matmul
            and FSDP's all-gather of each piece's parameters
  auto      logical_pjit.py --rules fsdp_tp: jax.jit on Auto axes, the compiler places it all
  explicit  explicit_sharding.py --rules fsdp_tp: jax.jit on Explicit axes, the layout in the
            arrays' types, each change of it written where it happens

This tool compiles each for the scripts' default model (4 layers, width 128, batch 32 x 64) on
8 emulated CPU devices and writes the table of docs/three_ways.md: the collectives each compiled
step holds (count and bytes per step and device), the state and temporaries per device, the
compile time, and the lines of code that state the layout (the definitions LAYOUT names).

  python dev/three_ways.py            # print the table
  python dev/three_ways.py --write    # and rewrite it in docs/three_ways.md
"""

import argparse
import ast
import dataclasses
import functools
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402

if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)

from flax import nnx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import common  # noqa: E402
import explicit_sharding  # noqa: E402
import logical_pjit  # noqa: E402

PAGE = ROOT / "docs" / "three_ways.md"
MARKER = re.compile(r"<!-- three-ways:start -->\n.*?<!-- three-ways:end -->", re.DOTALL)
RULES = logical_pjit.RULES["fsdp_tp"]

# ----------------------------------------------------------------------------------------------
# Manual: FSDP+TP written by hand in shard_map, for the GPT (a model whose layers are nnx.Linear
# and nnx.Embed, and whose attention reshapes by --heads: each device runs heads / model of them)
# ----------------------------------------------------------------------------------------------


@jax.custom_vjp
def copy_to_model(x):
    """Megatron's f, before a column-split matmul: x is whole on every device of 'model'; its
    gradient is each device's part of it, summed (an all-reduce in the backward pass)."""
    return x


copy_to_model.defvjp(lambda x: (x, None), lambda _, g: (lax.psum(g, "model"),))


@jax.custom_vjp
def sum_over_model(x):
    """Megatron's g, after a row-split matmul: the partial sums added up (an all-reduce); the
    gradient of the sum is whole on every device already."""
    return lax.psum(x, "model")


sum_over_model.defvjp(lambda x: (lax.psum(x, "model"), None), lambda _, g: (g,))


@jax.custom_vjp
def gather_over_model(x):
    """The head's logits, each device's part of the vocabulary, made whole for the loss (an
    all-gather); every device's loss is the same, so a part's gradient is its slice."""
    return lax.all_gather(x, "model", axis=x.ndim - 1, tiled=True)


def _slice_mine(_, g):
    size = g.shape[-1] // lax.axis_size("model")
    return (lax.dynamic_slice_in_dim(g, lax.axis_index("model") * size, size, axis=g.ndim - 1),)


gather_over_model.defvjp(lambda x: (gather_over_model(x), None), _slice_mine)


def param_specs(config):
    """{parameter path: PartitionSpec}: the rules on the model's logical names."""
    rules = dict(RULES)
    return {
        path: P(*(rules.get(name) for name in box.names))
        for path, box in common.logical_names(config)
    }


def split_over(spec, axis):
    return [
        i
        for i, axes in enumerate(spec)
        if axis in ((axes,) if isinstance(axes, str) else axes or ())
    ]


def megatron(specs):
    """The `wrap` of the model contract: each nnx.Linear and nnx.Embed of the GPT's pieces on
    its shards, by hand (its matmul, its lookup)."""

    def wrap(run):
        def run_on_shards(piece, params, x, rng):
            return run(piece, params, x, rng, functools.partial(on_shards, piece))

        def on_shards(piece, module):
            places = ["block_0"] if piece.name == "block" else ["embed", "head"]  # the model's
            for path, layer in list(nnx.iter_modules(module)):
                names = ["/".join((place, *map(str, path))) for place in places]
                name = next(
                    (n for n in names if {f"{n}/kernel", f"{n}/embedding"} & set(specs)), names[0]
                )
                if isinstance(layer, nnx.Linear):
                    split = split_over(specs[f"{name}/kernel"], "model")
                    layer.dot_general = functools.partial(matmul, split, name == "head/out")
                if isinstance(layer, nnx.Embed) and split_over(specs[f"{name}/embedding"], "model"):
                    explicit_sharding.replace(module, path, VocabularySplit(layer))
            return module

        return run_on_shards

    return wrap


def matmul(split, logits, x, kernel, *args, **kwargs):
    """A matmul on the 'model' axis' shards: split by output columns (x whole, y split; the
    logits gathered whole) or by input rows (x split, the partial sums added up)."""
    if split == [1]:
        y = lax.dot_general(copy_to_model(x), kernel, *args, **kwargs)
        return gather_over_model(y) if logits else y  # (no bias: the head's has none)
    if split == [0]:  # (the bias, whole, added to the sum after it)
        return sum_over_model(lax.dot_general(x, kernel, *args, **kwargs))
    return lax.dot_general(x, kernel, *args, **kwargs)


class VocabularySplit(nnx.Module):
    """The vocabulary split: each device looks up the tokens in its rows, zeros elsewhere."""

    def __init__(self, embed):
        self.embed = embed

    def __call__(self, tokens):
        table = self.embed.embedding[...].astype(self.embed.dtype)
        rows = table.shape[0]
        mine = tokens - lax.axis_index("model") * rows
        here = (mine >= 0) & (mine < rows)
        return sum_over_model(jnp.where(here[..., None], table[jnp.clip(mine, 0, rows - 1)], 0))


def gathered_over_data(params, specs):
    """FSDP: each parameter's 'data'-split axis gathered whole (an all-gather per parameter, here
    once for the step's forward and backward passes); the transpose of all_gather is the
    reduce-scatter of the gradient, summed over 'data'."""

    def gather(path, p):
        axes = split_over(specs[jax.tree_util.keystr(path, simple=True, separator="/")], "data")
        return lax.all_gather(p, "data", axis=axes[0], tiled=True) if axes else p

    return jax.tree_util.tree_map_with_path(gather, params)


def manual_step(state, batch, config):
    """One device's step: its shards of the state (laid out as logical_pjit.py's fsdp_tp lays
    them out), its rows of the batch (the same rows on every device of 'model')."""
    specs = param_specs(config)
    # Every device of 'model' draws the same dropout masks: they fall where the activations are
    # whole (after each block's sums); devices of 'data' draw their own, as in fsdp.py.
    rng = jax.random.fold_in(jax.random.fold_in(state.rng, state.step), lax.axis_index("data"))
    # The model as each device holds it: its heads, and its rows of the embedding table (Flax
    # checks a table's shape against the vocabulary; the head's matmul is written below).
    shards = lax.axis_size("model")
    local = dataclasses.replace(
        config, heads=config.heads // shards, vocab_size=config.vocab_size // shards
    )
    model = common.make_model(local, wrap=megatron(specs))

    def apply_fn(params, tokens, rng=None):
        return model(gathered_over_data(params, specs), tokens, rng)

    grads, metrics = common.accumulate_gradients(
        state.replace(apply_fn=apply_fn), batch, rng, config.microbatches
    )
    # The mean over 'data': a 'data'-split gradient arrives reduce-scattered (summed), the rest
    # is all-reduced. Over 'model' each device holds its piece whole, or the same whole copy.
    grads = jax.tree_util.tree_map_with_path(
        lambda path, g: (
            g / lax.axis_size("data")
            if split_over(specs[jax.tree_util.keystr(path, simple=True, separator="/")], "data")
            else lax.pmean(g, "data")
        ),
        grads,
    )
    metrics = lax.psum(metrics, "data")  # each row's sums once: the rows of 'data'
    norm = global_norm(grads, specs)
    state = state.apply_gradients(grads=common.clip(grads, norm, config.clip_norm))
    return state, {**metrics, "grad_norm": norm}


def global_norm(grads, specs):
    """The norm over the whole model: each gradient's sum of squares, added up over the axes
    that split it (a piece per device), once over those that copy it."""
    total = jnp.zeros(())
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        spec = specs[jax.tree_util.keystr(path, simple=True, separator="/")]
        axes = tuple(a for a in ("data", "model") if split_over(spec, a))
        square = jnp.sum(jnp.square(g))
        total += lax.psum(square, axes) if axes else square
    return jnp.sqrt(total)


def main(config):
    """Train the layout by hand: logical_pjit.py's main, its step in shard_map."""
    assert config.rules == "fsdp_tp" and config.model == "gpt" and not config.experts
    common.setup(config)
    mesh = common.make_mesh(config.mesh_axes())
    dataset = common.load_dataset(config)
    state_shapes = logical_pjit.init_state(config, mesh, shapes_only=True)
    state_spec = jax.tree.map(lambda x: x.sharding.spec, state_shapes)
    batch_spec = P("data")
    step_fn = jax.jit(
        jax.shard_map(
            functools.partial(manual_step, config=config),
            mesh=mesh,
            in_specs=(state_spec, batch_spec),
            out_specs=(state_spec, P()),
            check_vma=False,  # Megatron's operators above say where every sum goes
        ),
        donate_argnums=0,
    )
    batch_shapes = common.batch_shape(config, NamedSharding(mesh, batch_spec))
    compiled, compile_seconds = common.compile_step(config, step_fn, state_shapes, batch_shapes)
    state = logical_pjit.init_state(config, mesh)
    report = common.cost_report(config, state, compiled, compile_seconds)
    layout = f"mesh data={mesh.shape['data']},model={mesh.shape['model']}, FSDP+TP by hand"
    log = common.Logger(config, dataset, layout, report, 0)
    for step, rows, waited in common.train_batches(dataset, config, 0):
        batch = jax.make_array_from_process_local_data(NamedSharding(mesh, batch_spec), rows)
        state, metrics = compiled(state, batch)
        log.log(step, metrics, waited)
    return log.finish(state, compiled)


# ----------------------------------------------------------------------------------------------
# The table
# ----------------------------------------------------------------------------------------------

MODES = {
    "manual": "`jax.shard_map`, collectives by hand (this tool's `manual_step`)",
    "auto": "`logical_pjit.py --rules fsdp_tp` (Auto axes: the compiler places it)",
    "explicit": "`explicit_sharding.py --rules fsdp_tp` (Explicit axes: the layout in the types)",
}
# The code that states the layout, per mode: (file, its top-level definitions). All three share
# the rules (logical names -> mesh axes) and the parameters' logical names in common.py.
LAYOUT = {
    "manual": (
        "dev/three_ways.py",
        [
            "copy_to_model",
            "sum_over_model",
            "gather_over_model",
            "_slice_mine",
            "param_specs",
            "split_over",
            "megatron",
            "matmul",
            "VocabularySplit",
            "gathered_over_data",
            "manual_step",
            "global_norm",
        ],
    ),
    "auto": ("logical_pjit.py", ["make_mesh", "state_shardings", "batch_sharding"]),
    "explicit": (
        "explicit_sharding.py",
        [
            "make_mesh",
            "axes_of",
            "gather_for_use",
            "state_layouts",
            "replace",
            "matmul",
            "Lookup",
            "attend_as_queries",
            "explicit_layout",
            "explicit_model",
            "state_shardings",
            "batch_sharding",
        ],
    ),
}


def code_lines(file: str, names: list) -> int:
    """The lines of code of the named top-level definitions: no blank line, comment or docstring."""
    source = (ROOT / file).read_text()
    tree = ast.parse(source)
    docstrings = {
        line
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module)) and ast.get_docstring(node)
        for line in range(node.body[0].lineno, node.body[0].end_lineno + 1)
    }
    lines = source.splitlines()
    count = 0
    for node in tree.body:
        if getattr(node, "name", None) in names:
            start = min([d.lineno for d in node.decorator_list] + [node.lineno])
            for number in range(start, node.end_lineno + 1):
                text = lines[number - 1].strip()
                if text and not text.startswith("#") and number not in docstrings:
                    count += 1
    return count


def run(mode: str) -> dict:
    """Compile the mode's step for the scripts' default model and train it one step: its report."""
    flags = dict(steps=1, eval_every=0, log_every=1, rules="fsdp_tp", mesh="data=2,model=4")
    if mode == "manual":
        return main(logical_pjit.Config(**flags)).summary
    module = logical_pjit if mode == "auto" else explicit_sharding
    return module.main(module.Config(**flags)).summary


def row(mode: str, summary: dict) -> str:
    collectives = ", ".join(
        f"{op} {c['count']} ({c['bytes'] / 1e6:.2f} MB)"
        for op, c in summary["collectives"].items()
        if c["count"]
    )
    file, names = LAYOUT[mode]
    return (
        f"| {mode} | {MODES[mode]} | {collectives} "
        f"| {summary['state_bytes_per_device'] / 1e6:.2f} MB "
        f"| {summary['compiled_temp_bytes'] / 1e6:.2f} MB | {summary['compile_seconds']:.1f} s "
        f"| {code_lines(file, names)} |"
    )


def table() -> str:
    rows = [
        "| mode | how | collectives per step and device | state per device | temporaries "
        "| compile | lines stating the layout |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode in MODES:
        started = time.monotonic()
        rows.append(row(mode, run(mode)))
        print(f"{mode}: {time.monotonic() - started:.0f}s", file=sys.stderr)
    return "\n".join(rows)


def cli():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--write", action="store_true", help="rewrite docs/three_ways.md's table")
    args = parser.parse_args()
    text = table()
    print(text)
    if args.write:
        new = f"<!-- three-ways:start -->\n{text}\n<!-- three-ways:end -->"
        PAGE.write_text(MARKER.sub(lambda _: new, PAGE.read_text()))
        print(f"wrote {PAGE.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    cli()
