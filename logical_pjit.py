"""Logical axis names mapped to the mesh by rules: one model, six presets of four strategies.

What is where: the model names every parameter axis ('embed', 'heads', 'mlp', 'vocab', ...)
with nnx.with_partitioning and every activation axis ('batch', 'act_heads', ...) with
flax's with_logical_constraint, in common.py. A rules table maps those names to the axes of the
('data', 'model') mesh; a name with no rule stays unsplit. --rules picks a preset:
  dp       the batch over all devices; everything else replicated (as shardmap_dp.py)
  fsdp     the batch and every parameter's 'embed' axis over all devices (as fsdp.py)
  hsdp     fsdp within groups along 'model', replicated across 'data' (as fsdp.py --mesh
           replica=R,data=M: here 'data' holds the replicas and 'model' the shard groups)
  tp       the batch over 'data'; heads, MLP units and the vocabulary over 'model' (as pjit_tp.py)
  tp_sp    tp, and the sequence over 'model' between the matmuls (pjit_tp.py --sequence-parallel)
  fsdp_tp  tp, plus every parameter's 'embed' axis over 'data' (2-D sharding)
A step: the step is written for one device, and jit partitions it (GSPMD) from the
shardings of its inputs and outputs, inserting the collectives itself.
Collectives per step, by preset: dp, an all-reduce of the gradients; fsdp, all-gathers of the
parameters and reduce-scatters of their gradients; hsdp, the same within groups and an
all-reduce across them; tp, all-reduces over 'model' of each block's partial sums; tp_sp,
reduce-scatters of them into sequence pieces and all-gathers along the sequence before each
column-parallel matmul; fsdp_tp, both of fsdp's and tp's.

What changes from pjit_tp.py: the table of PartitionSpecs per parameter path becomes a table
of rules per logical axis name, so the mesh, the model, the step and every flag stay the
same while the rules change. "pjit" is the old name: pjit, once in jax.experimental, was
merged into jax.jit, which takes in_shardings and out_shardings directly.

Run:
  python logical_pjit.py --rules fsdp_tp # a laptop: 8 emulated CPU devices
  python logical_pjit.py --rules fsdp --mesh data=8,model=1 --steps 2000   # a GPU/TPU host
  python logical_pjit.py --distributed   # every host of a TPU pod slice (README)

Read before: pjit_tp.py. Read next: explicit_sharding.py, these presets on JAX's default mesh
(Explicit axes, the layout in the arrays' types); MaxText, which scales them to real models.
Read more: the Flax docs' "Scale up Flax modules on multiple devices" (logical axis
rules); MaxText's configs, which state layouts this way.
"""

import dataclasses
import functools

import jax
import optax

import common

from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# Logical axis name -> mesh axis (or axes). A parameter axis whose name has no rule is not
# split, if UNSPLIT names it; any other name stops the run (exit 2), so that a new model's
# parameter is never replicated unseen: give it a rule, or add its name to UNSPLIT.
UNSPLIT = ("vocab", "pos", "embed", "heads", "kv_heads", "mlp", "norm", "layers", "expert")
TP = (  # Megatron's layout: heads, MLP units and the vocabulary over 'model'
    ("batch", "data"),
    ("heads", "model"),
    ("mlp", "model"),
    ("vocab", "model"),
    ("act_heads", "model"),
    ("act_mlp", "model"),
    ("act_vocab", "model"),
)
RULES = {
    "dp": (("batch", ("data", "model")),),
    "fsdp": (("batch", ("data", "model")), ("embed", ("data", "model"))),
    "hsdp": (("batch", ("data", "model")), ("embed", "model")),
    "tp": TP,
    # tp, and Megatron's sequence parallelism: between the matmuls (the residual stream, the
    # norms, dropout) the sequence split over 'model'. The first rule whose mesh axis is free
    # wins: an activation split by heads, MLP units or vocabulary keeps its whole sequence.
    "tp_sp": (*TP, ("length", "model")),
    # tp, and FSDP's split of the weights' other axis over 'data'
    "fsdp_tp": (*TP, ("embed", "data")),
}


# On a TPU, XLA computes a weight's gradient that is reduce-scattered over the batch's devices as
# a loop of sends beside partial matmuls (a collective matmul), and for the head that loop keeps
# the logits and their gradient both (786 MiB each on a v5e chip at GPT-2's width, 8 rows a
# chip): --rules fsdp needed 4.8 GiB a chip, data parallelism 4.56; without the loop 3.45 GiB.
NO_COLLECTIVE_MATMUL = {"xla_tpu_enable_windowed_einsum_for_reduce_scatter": False}


@dataclasses.dataclass(frozen=True)
class Config(common.Config):
    mesh: str = common.arg(
        "auto", "mesh axis sizes, e.g. data=2,model=4; 'auto' gives that on 8 devices"
    )
    rules: str = common.arg("fsdp_tp", "logical-to-mesh rules preset", choices=tuple(RULES))

    def mesh_axes(self):
        return common.mesh_shape(self.mesh, ("data", "model"), self.auto_mesh())

    def auto_mesh(self):
        """'auto': up to 4 devices on 'model' (at most half of them, and a divisor of the
        key-value heads), the rest on 'data'."""
        n, kv = jax.device_count(), self.kv_heads or self.heads
        model = max(m for m in (1, 2, 4) if n % m == 0 and kv % m == 0 and m <= max(1, n // 2))
        return {"data": n // model, "model": model}

    def axis_size(self, logical_name):
        """How many ways the rules split a logical axis on this mesh (a mesh axis's name, as the
        Flax docs annotate parameters, P(None, 'model'): over that axis)."""
        shape = self.mesh_axes()
        axes = dict(RULES[self.rules]).get(logical_name, (logical_name,) * (logical_name in shape))
        return functools.reduce(
            lambda n, axis: n * shape[axis], (axes,) if isinstance(axes, str) else axes, 1
        )

    def batch_shards(self):
        return self.axis_size("batch")

    def validate(self):
        common.require(self.rules in RULES, "rules", f"must be one of {', '.join(RULES)}")
        super().validate()
        check_layout(self)  # the layout's checks: at the end of this file, before main()


def make_mesh(config):
    shape = config.mesh_axes()
    # Auto axes, on purpose: the compiler places whatever the specs below leave unsaid, which is
    # this script's lesson. (JAX's default is Explicit axes, the shardings part of the types:
    # explicit_sharding.py.)
    return common.make_mesh(shape, jax.sharding.AxisType.Auto)


def state_shardings(abstract_state, mesh, rules):
    # The boxes' logical names become shardings over the mesh through the rules (Flax NNX's
    # own: a name the rules leave out must map to None), unboxed as the state holds them.
    with nnx.logical_axis_rules((*((name, None) for name in UNSPLIT), *rules)):
        return common.unbox(nnx.get_named_sharding(abstract_state, mesh))


def init_state(config, mesh, shapes_only=False):
    create = functools.partial(common.create_state, config, common.make_model(config))
    # Box the abstract state's parameters with their logical names, to read them; not the real one.
    boxed = jax.eval_shape(functools.partial(create, hold=common.named(config)))
    # Each device computes only its own shards: the full model never exists on one device.
    create = jax.jit(create, out_shardings=state_shardings(boxed, mesh, RULES[config.rules]))
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


def batch_sharding(mesh, rules):
    return NamedSharding(mesh, P(dict(rules)["batch"]))


def device_batch(batch, mesh, rules):
    # This process's rows become one global array, split as the rules split 'batch'.
    return jax.make_array_from_process_local_data(batch_sharding(mesh, rules), batch)


def check_layout(config):
    """The flags against the mesh and the model's parameters (Config.validate's, at the end)."""
    n, kv = jax.device_count(), config.kv_heads or config.heads
    wrote = f"--kv-heads {kv}" if config.kv_heads else f"--heads {kv}"
    common.require(  # auto splits the heads over 'model', or says why it cannot
        config.mesh != "auto"
        or config.auto_mesh()["model"] > 1
        or n < 4
        or n % 2
        or "heads" not in dict(RULES[config.rules]),
        "mesh",
        f"auto puts no device on 'model' (no tensor parallelism): 2 does not divide {wrote}; "
        f"make them even, or run without it, e.g. --mesh data={n},model=1",
    )
    common.require(
        (config.kv_heads or config.heads) % config.axis_size("heads") == 0,
        "mesh",
        f"splits 'heads' {config.axis_size('heads')} ways under --rules {config.rules}, which does "
        f"not divide the {config.kv_heads or config.heads} key-value heads; {example(config)}",
    )
    # Every parameter names its axes: the rules lay out by name (unnamed, it would replicate)
    boxes = common.logical_names(config)
    whole = common.names_mesh_axes(config, config.mesh_axes())  # the rest: as Flax places them
    nameless = [f"{p} {box.value.shape}" for p, box in boxes if not box.declared and not whole]
    common.require(
        not nameless,
        "model",
        f"{config.model}: {', '.join(nameless[:3])}{', ...' * (len(nameless) > 3)} name no "
        "logical axes for the rules to lay out: declare them with nnx.with_partitioning(init, "
        "names), e.g. ('embed', 'mlp')",
    )
    # Every axis name the rules and UNSPLIT do not know, at once (the first parameter of each)
    ruled, unknown = dict(RULES[config.rules]), {}
    for path, box in boxes:
        for name in set(box.names) - {*ruled, *UNSPLIT, *config.mesh_axes(), None}:
            unknown.setdefault(name, f"{path} {box.value.shape}")
    common.require(
        not unknown,
        "rules",
        f"{config.rules} has no rule for the axes "
        + ", ".join(f"'{name}' (of {where})" for name, where in unknown.items())
        + ", and UNSPLIT does not name them: add a rule for each to RULES (e.g. "
        f'("{next(iter(unknown), "")}", "model")), or add them to UNSPLIT to keep them '
        f"whole: {', '.join(map(repr, unknown))}",
    )
    sequence = dict(RULES[config.rules]).get("length")  # tp_sp: the sequence over 'model'
    own = [path for path, box in boxes if sequence and sequence in box.names]
    common.require(
        not sequence or common.splits_sequence(config, RULES[config.rules]),
        "rules",
        f"{config.rules} splits what the model's activations name 'length' (common.constrain, "
        "as the GPT's blocks do), and this model names none: name them, or e.g. --rules tp",
    )
    common.require(
        not own,
        "rules",
        f"{config.rules} splits the sequence over '{sequence}' between the matmuls, where the "
        f"model splits {', '.join(own[:2])} over '{sequence}' itself: e.g. --rules tp",
    )
    common.require(
        config.seq_len % config.axis_size("length") == 0,
        "seq_len",
        f"{config.seq_len} under --rules {config.rules}: split {config.axis_size('length')} ways "
        f"along the sequence, it must be a multiple of that, e.g. --seq-len "
        f"{config.axis_size('length') * max(1, config.seq_len // config.axis_size('length'))}",
    )
    for path, box in common.logical_names(config):
        for name, size in zip(box.names, box.value.shape, strict=True):
            if size % config.axis_size(name):  # --d-model, if it is the GPT's width
                gpt = (name, size) == ("embed", config.d_model)
                common.require(
                    False,
                    "mesh",
                    f"splits '{name}' {config.axis_size(name)} ways under --rules {config.rules}, "
                    f"which does not divide its size {size} in {path}; "
                    + (example(config) if gpt else split_or_keep(config, name, size, box)),
                )


def split_or_keep(config, name, size, box):
    """What would split a parameter's axis evenly, and what keeping it whole would cost."""
    split, n, kv = config.axis_size(name), jax.device_count(), config.kv_heads or config.heads
    fits = max(m for m in (1, 2, 4) if size % m == 0 and n % m == 0 and kv % m == 0)
    return (
        f"give it a size {split} divides ({-(-size // split) * split}) or a mesh that does, "
        f"e.g. --mesh data={n // fits},model={fits}; kept whole (its axis in UNSPLIT), every "
        f"device holds all {box.value.size * 4:,} bytes of it"
    )


def example(config):
    """A valid --kv-heads or --heads, or else --d-model, for these rules and this mesh."""
    split = config.axis_size("heads")
    groups = [k for k in range(split, config.heads + 1, split) if config.heads % k == 0]
    if config.kv_heads and config.kv_heads % split and groups:
        return f"e.g. --kv-heads {groups[0]}"
    if config.heads % split:  # and key-value heads that divide them, if given
        heads = [h for h in range(split, config.d_model + 1, split) if config.d_model % h == 0]
        eg = f"--heads {heads[0]}" if heads else f"--heads {split} --d-model {split * 32}"
        return f"e.g. {eg}" + f" --kv-heads {split}" * bool(config.kv_heads)
    for d_model in range(config.d_model, 16 * config.d_model + 1):
        if d_model % config.heads == 0 and d_model % config.axis_size("embed") == 0:
            return f"e.g. --d-model {d_model}"


def main(config):
    common.setup(config)
    mesh = make_mesh(config)
    dataset = common.load_dataset(config)
    state_shapes = init_state(config, mesh, shapes_only=True)
    state_sharding = jax.tree.map(lambda x: x.sharding, state_shapes)
    rules = RULES[config.rules]
    on_tpu = jax.default_backend() == "tpu"  # FSDP's presets there: no collective matmul
    step_fn = jax.jit(
        functools.partial(train_step, config=config),
        in_shardings=(state_sharding, batch_sharding(mesh, rules)),
        out_shardings=(state_sharding, NamedSharding(mesh, P())),
        donate_argnums=0,
        compiler_options=NO_COLLECTIVE_MATMUL if "embed" in dict(rules) and on_tpu else None,
    )
    eval_fn = jax.jit(
        eval_step,
        in_shardings=(state_sharding, batch_sharding(mesh, rules)),
        out_shardings=NamedSharding(mesh, P()),
    )
    # Compiled for the shapes of the state and of a batch, before either exists: a step too big
    # for the devices stops here, with one line, before anything is allocated.
    batch_shapes = common.batch_shape(config, batch_sharding(mesh, rules))
    # The activations' logical constraints resolve against these rules and mesh while tracing.
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        compiled, compile_seconds = common.compile_step(config, step_fn, state_shapes, batch_shapes)
    state = init_state(config, mesh)
    checkpoints = common.Checkpoints(config)
    state, start = checkpoints.restore(state)
    eval_data = [device_batch(b, mesh, rules) for b in common.eval_batches(dataset, config)]
    report = common.cost_report(config, state, compiled, compile_seconds)
    layout = f"mesh data={mesh.shape['data']},model={mesh.shape['model']}, rules {config.rules}"
    log = common.Logger(config, dataset, layout, report, start)
    stop = common.StopSignals()  # Ctrl-C or SIGTERM: the run finishes its step, saves, stops
    try:
        # Each made while the devices run the step before (JAX dispatches asynchronously)
        for step, rows, waited in common.train_batches(dataset, config, start):
            batch = device_batch(rows, mesh, rules)
            # The program compiled above, which the report describes.
            state, metrics = compiled(state, batch)
            log.log(step, metrics, waited)
            if common.log_due(config, step):  # checked as often as printed: a check waits
                if not common.finite(metrics["loss_sum"]):  # summed over every device
                    raise SystemExit(common.not_saved(f"the loss at step {step + 1}"))
            if common.eval_due(config, step):
                with (
                    jax.set_mesh(mesh),
                    nnx.logical_axis_rules(rules),
                ):  # traced here the first time
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
