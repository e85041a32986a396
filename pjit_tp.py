"""Tensor (model) parallelism by the compiler: jax.jit with shardings on a 2-D mesh.

What is where: the devices form a ('data', 'model') mesh (--mesh, data=2,model=4 on 8
devices). Inside each block the weights are split over 'model' in the Megatron layout: the
first matmul of attention (qkv, which makes each head's query, key and value) and of the MLP
(fc1) by output columns, so each device owns some heads and some hidden units; the second
(attn/out, fc2) by input rows, so each device turns its own heads and units into a partial
sum. The token embedding and the head are split along the vocabulary, so each device makes
only its part of the logits. PARAM_SPECS says this per parameter path, and the Adam moments,
whose paths end with the parameter's, follow it; it replicates the small rest by name, so a
parameter it forgets stops the run instead of being replicated unseen. The global batch is
split by rows over the mesh axis 'data' (P('data')), each device taking an equal share.
A step: the step is written for one device, and jit partitions it (GSPMD) from the
shardings of its inputs and outputs, inserting the collectives itself. --sequence-parallel
(Megatron's sequence parallelism) also splits what lies between the matmuls along the
sequence over 'model': rules on the activations' logical names (SEQUENCE_PARALLEL) split the
residual stream, the norms and dropout, 1/model of them per device.
Collectives per step: per block, an all-reduce over 'model' of the partial sums after
attn/out and after fc2 in the forward pass, and two matching ones in the backward pass; one
after the embedding lookup and one of the head's input gradient; small ones of the loss's
per-position sums over the vocabulary; one all-reduce over 'data' of the gradients, as in data
parallelism, and tiny ones of the gradient norm and of the metrics. With --sequence-parallel
each of those all-reduces becomes a reduce-scatter into sequence pieces, and each norm's output
is all-gathered along the sequence before the matmul after it (and its gradient
reduce-scattered back): the same bytes.

What changes from fsdp.py: no collectives by hand. The mesh gains a 'model' axis, a table of
PartitionSpecs per parameter path replaces the nnx.Param boxes, and the step is the
single-device step. "pjit" is the old name: pjit, once in jax.experimental, was merged into
jax.jit, which takes in_shardings and out_shardings directly.

Run:
  python pjit_tp.py                      # a laptop: 8 emulated CPU devices, data=2,model=4
  python pjit_tp.py --mesh data=1,model=8 --steps 2000   # a GPU or TPU host
  python pjit_tp.py --sequence-parallel --seq-len 1024     # long sequences: 1/model activations
  python pjit_tp.py --distributed        # every host of a TPU pod slice (README)

Read before: fsdp.py. Read next: logical_pjit.py, which states the same layout as rules, and
explicit_sharding.py, which keeps JAX's default mesh (Explicit axes) and writes it in the types.
Read more: Megatron-LM (Shoeybi et al. 2019, arXiv:1909.08053); sequence parallelism
(Korthikanti et al. 2022, arXiv:2205.05198); GSPMD (Xu et al. 2021, arXiv:2105.04663).
"""

import dataclasses
import functools

import jax
import optax

import common

import re
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class Config(common.Config):
    mesh: str = common.arg(
        "auto", "mesh axis sizes, e.g. data=2,model=4; 'auto' gives that on 8 devices"
    )
    sequence_parallel: bool = common.arg(
        False,
        "Megatron sequence parallelism: between the matmuls (the residual stream, the norms, "
        "dropout) every activation is split along the sequence over 'model', 1/model of it "
        "per device; --seq-len must split evenly",
    )

    def mesh_axes(self):
        return common.mesh_shape(self.mesh, ("data", "model"), self.auto_mesh())

    def auto_mesh(self):
        """'auto': up to 4 devices on 'model' (at most half of them, and a divisor of the
        key-value heads), the rest on 'data'."""
        n, kv = jax.device_count(), self.kv_heads or self.heads
        model = max(m for m in (1, 2, 4) if n % m == 0 and kv % m == 0 and m <= max(1, n // 2))
        return {"data": n // model, "model": model}

    def batch_shards(self):
        return self.mesh_axes()["data"]

    def validate(self):
        super().validate()
        check_layout(self)  # the layout's checks: at the end of this file, before main()


def make_mesh(config):
    shape = config.mesh_axes()
    # Auto axes, on purpose: the compiler places whatever the specs below leave unsaid, which is
    # this script's lesson. (JAX's default is Explicit axes, the shardings part of the types:
    # explicit_sharding.py.)
    return common.make_mesh(shape, jax.sharding.AxisType.Auto)


# Parameter path pattern -> how its axes are split; the first match wins. A parameter that no
# pattern matches stops the run before anything is compiled (exit 2, naming it): P() replicates.
PARAM_SPECS = (
    (r"attn/qkv/kernel", P(None, "model")),  # [embed, heads x (query, key, value) x head_dim]
    (r"attn/query_bias", P("model")),
    (r"attn/out/kernel", P("model", None)),  # [heads x head_dim, embed]
    # [embed, mlp]; [experts, embed, mlp] with --experts; the shared experts' (mlp/shared) too
    (r"mlp/(shared/)?fc1/kernel", P(None, "model")),
    (r"mlp/(shared/)?fc1/bias", P("model")),  # [mlp]
    (r"mlp/(shared/)?fc2/kernel", P("model", None)),  # [mlp, embed]
    # [vocab, embed]: each device a part of the vocabulary
    (r"embed/token/embedding", P("model", None)),
    (r"head/out/kernel", P(None, "model")),  # [embed, vocab]: each device the logits of its part
    # Replicated: small
    (
        r"embed/position/embedding|ln\w*/(scale|bias)|out/bias|fc2/bias|mlp/router/kernel|mlp/router_bias",
        P(),
    ),
)
BATCH_SPEC = P("data")  # rows split over 'data'
# --sequence-parallel: the activations' logical names (common.py's constraints) -> mesh axes. The
# heads, MLP units and vocabulary over 'model' inside attention, the MLP and the head, as above;
# everywhere else the sequence ('length') over 'model': the residual stream, the norms and
# dropout. The first rule whose mesh axis is free wins, so an activation split by heads keeps its
# whole sequence. A norm's output is marked whole along the sequence: gathered (all-gather)
# before each column-parallel matmul; after each row-parallel one, the partial sums are added
# up straight into sequence pieces (a reduce-scatter in place of the all-reduce).
SEQUENCE_PARALLEL = (
    ("batch", "data"),
    ("act_heads", "model"),
    ("act_mlp", "model"),
    ("act_vocab", "model"),
    ("length", "model"),
)


def param_specs(config):
    """PARAM_SPECS, then each parameter the model itself lays out over this mesh's axes (as the
    Flax docs annotate one: P(None, 'model')), no entry covering it: its own; in such a model,
    one it leaves unnamed is whole, as Flax places it."""
    own, whole = [], common.names_mesh_axes(config, config.mesh_axes())  # unnamed: replicated
    for path, box in common.logical_names(config):
        names = box.names[1:] if path.startswith("blocks/") else box.names  # scanned: 'layers'
        if box.declared and set(names) <= {*config.mesh_axes(), None} or whole:
            own.append((f"(^|/){re.escape(path)}$", P(*names)))
    return PARAM_SPECS + tuple(own)


def state_spec(path, leaf, specs=None):
    """The PartitionSpec of one leaf of the state: its parameter's (Adam's moments end with the
    parameter's path), or P() for a number (step counters, the random key)."""
    name = jax.tree_util.keystr(path, simple=True, separator="/")
    spec = next(
        (spec for pattern, spec in specs or PARAM_SPECS if re.search(pattern, name)),
        None if leaf.ndim else P(),
    )
    if spec is None:
        raise common.ConfigError(
            f"{name} {tuple(leaf.shape)} is in no entry of pjit_tp.py's PARAM_SPECS: add one "
            "saying how it is split (P() replicates it)"
        )
    # With --scan-layers the blocks are stacked: the stacking axis comes first, unsplit.
    return P(*[None] * (leaf.ndim - len(spec)), *spec) if spec else spec


def state_shardings(abstract_state, mesh, specs):
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, state_spec(path, x, specs)), abstract_state
    )


def init_state(config, mesh, shapes_only=False):
    create = functools.partial(common.create_state, config, common.make_model(config))
    # Each device computes only its own shards: the full model never exists on one device.
    specs = state_shardings(jax.eval_shape(create), mesh, param_specs(config))
    create = jax.jit(create, out_shardings=specs)
    # The state itself, or only its shapes and shardings (nothing allocated) to compile for.
    return create.eval_shape() if shapes_only else create()


def train_step(state, batch, config):
    """The single-device step, unchanged: jit partitions it over the mesh."""
    rng = jax.random.fold_in(state.rng, state.step)
    grads, metrics = common.accumulate_gradients(state, batch, rng, config.microbatches)
    # The global norm, for clipping: jit adds up its shards' partial sums
    norm = optax.tree.norm(common.learned(grads))
    state = state.apply_gradients(grads=common.clip(grads, norm, config.clip_norm))
    return state, {**metrics, "grad_norm": norm}


def eval_step(state, batch):
    """Summed held-out losses of the batch: jit partitions it like the train step."""
    return common.eval_metrics(state, batch)


def device_batch(batch, mesh):
    # This process's rows become one global array, split over 'data'.
    return jax.make_array_from_process_local_data(NamedSharding(mesh, BATCH_SPEC), batch)


def check_layout(config):
    """The flags against the mesh and the model's parameters (Config.validate's, at the end)."""
    n, kv = jax.device_count(), config.kv_heads or config.heads
    wrote = f"--kv-heads {kv}" if config.kv_heads else f"--heads {kv}"
    common.require(  # auto splits the heads over 'model', or says why it cannot
        config.mesh != "auto" or config.auto_mesh()["model"] > 1 or n < 4 or n % 2,
        "mesh",
        f"auto puts no device on 'model' (no tensor parallelism): 2 does not divide {wrote}; "
        f"make them even, or run without it, e.g. --mesh data={n},model=1",
    )
    model, auto = config.mesh_axes()["model"], config.auto_mesh()
    common.require(
        kv % model == 0,
        "mesh",
        f"model={model} must divide the {kv} key-value heads (each device holds whole ones), "
        f"e.g. --mesh data={auto['data']},model={auto['model']}",
    )
    common.require(
        not config.sequence_parallel or config.seq_len % model == 0,
        "seq_len",
        f"{config.seq_len} under --sequence-parallel: split along the sequence over "
        f"model={model}, it must be a multiple of it, e.g. --seq-len "
        f"{model * max(1, config.seq_len // model)}",
    )
    common.require(
        not config.sequence_parallel or common.splits_sequence(config, SEQUENCE_PARALLEL),
        "sequence_parallel",
        "splits what the model's activations name 'length' (common.constrain, as the GPT's "
        "blocks do), and this model names none: name them, e.g. --no-sequence-parallel",
    )
    # Every parameter in PARAM_SPECS, all the ones missing named at once (the blocks' as one)
    specs, suggest = param_specs(config), f"tools/check.py --model {config.model} suggests entries"
    suggest += " from their logical names, nnx.with_partitioning's"
    missing = dict.fromkeys(  # in order, once each
        f"{re.sub(r'block_[0-9]+', 'block_N', path)} {box.value.shape}"
        for path, box in common.logical_names(config)
        if not any(re.search(pattern, path) for pattern, _ in specs)
    )
    are = f"{'are' if len(missing) > 1 else 'is'} in no entry of pjit_tp.py's PARAM_SPECS"
    common.require(not missing, "model", f"{config.model}: {', '.join(missing)} {are} ({suggest})")
    jax.tree_util.tree_map_with_path(
        lambda path, leaf: state_spec(path, leaf, specs), common.model_shapes(config)
    )
    # Every axis an entry splits over 'model' splits evenly
    for path, box in common.logical_names(config):
        spec = next(spec for pattern, spec in specs if re.search(pattern, path))
        for axis, size in zip(spec, box.value.shape[-len(spec) :] if spec else (), strict=True):
            fits = max(m for m in (1, 2, 4) if size % m == 0 and n % m == 0 and kv % m == 0)
            eg = f"e.g. --mesh data={n // fits},model={fits} (or P() in its entry: whole)"
            uneven = f"model={model} does not divide the axis of {size} of {path}, {eg}"
            common.require(axis != "model" or size % model == 0, "mesh", uneven)


def main(config):
    common.setup(config)
    mesh = make_mesh(config)
    dataset = common.load_dataset(config)
    state_shapes = init_state(config, mesh, shapes_only=True)
    state_sharding = jax.tree.map(lambda x: x.sharding, state_shapes)
    step_fn = jax.jit(
        functools.partial(train_step, config=config),
        in_shardings=(state_sharding, NamedSharding(mesh, BATCH_SPEC)),
        out_shardings=(state_sharding, NamedSharding(mesh, P())),
        donate_argnums=0,
    )
    eval_fn = jax.jit(
        eval_step,
        in_shardings=(state_sharding, NamedSharding(mesh, BATCH_SPEC)),
        out_shardings=NamedSharding(mesh, P()),
    )
    # Compiled for the shapes of the state and of a batch, before either exists: a step too big
    # for the devices stops here, with one line, before anything is allocated.
    batch_shapes = common.batch_shape(config, NamedSharding(mesh, BATCH_SPEC))
    # The activations' logical constraints resolve against these rules while tracing (none
    # without --sequence-parallel: the compiler lays the activations out from the parameters).
    rules = SEQUENCE_PARALLEL if config.sequence_parallel else ()
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        compiled, compile_seconds = common.compile_step(config, step_fn, state_shapes, batch_shapes)
    state = init_state(config, mesh)
    checkpoints = common.Checkpoints(config)
    state, start = checkpoints.restore(state)
    eval_data = [device_batch(b, mesh) for b in common.eval_batches(dataset, config)]
    report = common.cost_report(config, state, compiled, compile_seconds)
    layout = (
        f"mesh data={mesh.shape['data']},model={mesh.shape['model']}, Megatron tensor parallel"
        + (", sequence parallel" if config.sequence_parallel else "")
    )
    log = common.Logger(config, dataset, layout, report, start)
    stop = common.StopSignals()  # Ctrl-C or SIGTERM: the run finishes its step, saves, stops
    try:
        # Each made while the devices run the step before (JAX dispatches asynchronously)
        for step, rows, waited in common.train_batches(dataset, config, start):
            batch = device_batch(rows, mesh)
            # The program compiled above, which the report describes.
            state, metrics = compiled(state, batch)
            log.log(step, metrics, waited)
            if common.log_due(config, step):  # checked as often as printed: a check waits
                if not common.finite(metrics["loss_sum"]):  # summed over every device
                    raise SystemExit(common.not_saved(f"the loss at step {step + 1}"))
            if common.eval_due(config, step):
                with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):  # traced the first time
                    log.eval(step, eval_fn, state, eval_data)
            stopping = stop.requested(step)  # the same step on every process
            if checkpoints.due(step, stopping):  # a policy's step, or the run stops
                if not common.finite(state):
                    raise SystemExit(common.not_saved(f"the state after step {step + 1}"))
                checkpoints.save(step, state, stopping)
            if stopping:
                break
    finally:
        stop.close()  # the signals back to their handlers
        checkpoints.close()  # waits for the saves still being written, whatever happened
    return log.finish(state, compiled)  # the end-of-run report, and what the run made


if __name__ == "__main__":
    main(common.parse_config(Config, __doc__))
