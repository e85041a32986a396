"""Fully sharded data parallelism (ZeRO-3), written by hand in jax.shard_map.

What is where: the global batch is split by rows over every device (the mesh axis 'data', and
'replica' under HSDP), each device taking an equal share. Every parameter is split into N equal
pieces along one of its axes over 'data' (boxed as nnx.Param, out_sharding naming which), and
so are its Adam moments, so each device stores 1/N of the state; a parameter with no axis that N
divides, or smaller than --min-shard-size, stays replicated. With --mesh replica=R,data=N (hybrid
sharding, HSDP) each group of N devices holds one whole copy, split N ways, and the R groups are
replicas (the mesh axis 'replica'). A step: each piece of the model (the embedding, every block, the
head) all-gathers its full parameters just before it runs, and each block again in the backward
pass rather than keeping them alive in between. Autodiff turns each all-gather into its transpose, a
reduce-scatter, which leaves each device the summed gradient of its own shard (divided by N for the
mean), then all-reduced across the replicas. Adam is elementwise, so each device updates only its
shard. Collectives per step: all-gathers of the parameters (forward and backward, per
micro-batch; --keep-gathered: once a step) and
reduce-scatters of their gradients over 'data', all-reduces of the shards' gradients across
'replica', an all-reduce of any replicated ones, and tiny ones of the gradient norm and of the
metrics.

What changes from shardmap_dp.py: the state is sharded instead of replicated, so each piece
of the model gathers its parameters as it runs (the model's `wrap`), the mean of a sharded
gradient is its reduce-scattered sum over N instead of an all-reduce, and the gradient norm
that clipping needs adds up every device's partial sum over 'data' (common.global_norm).

Run:
  python fsdp.py                         # a laptop: 8 emulated CPU devices
  python fsdp.py --steps 2000            # a GPU or TPU host: all of its devices
  python fsdp.py --mesh replica=2,data=4 # HSDP: shard within groups of 4, replicate across 2
  python fsdp.py --distributed           # every host of a TPU pod slice (README)

Read before: shardmap_dp.py. Read next: pjit_tp.py, where the compiler writes the collectives.
Read more: ZeRO (Rajbhandari et al. 2020, arXiv:1910.02054); PyTorch FSDP (Zhao et al. 2023,
arXiv:2304.11277).
"""

import dataclasses
import functools

import jax
from jax import lax

import common

import numpy as np
from jax.sharding import NamedSharding
from flax import nnx
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class Config(common.Config):
    mesh: str = common.arg(
        "auto",
        "data=N shards over all N devices (FSDP); replica=R,data=M shards within groups of M "
        "devices and replicates across the R groups (HSDP); 'auto' is data=N",
    )
    min_shard_size: int = common.arg(
        0,
        "replicate parameters smaller than this (e.g. 65536 spares tiny all-gathers); 0 shards all",
    )
    keep_gathered: bool = common.arg(
        False,
        "gather the whole model once a step, for all micro-batches: a third fewer collective "
        "bytes (more with --microbatches), but the whole model and its gradient on every device",
    )

    def mesh_axes(self):
        return common.mesh_shape(self.mesh, ("replica", "data"), {"data": jax.device_count()})

    def validate(self):
        super().validate()
        self.mesh_axes()  # a bad --mesh is bad input, before any device work
        common.require(
            self.min_shard_size >= 0,
            "min_shard_size",
            "must be zero or more, e.g. --min-shard-size 0",
        )


def make_mesh(config):
    # ('data',) for FSDP; ('replica', 'data') for HSDP, each group of 'data' devices one replica.
    shape = {axis: size for axis, size in config.mesh_axes().items() if axis == "data" or size > 1}
    # JAX's default mesh, of Explicit axes: shard_map makes every axis manual inside, and asks
    # only that the arrays going in are laid out as its in_specs say.
    return common.make_mesh(shape)


def batch_spec(mesh):
    return P(mesh.axis_names)  # rows split over every device


def every_device():
    """Inside the step: the mesh axes that together span every device."""
    return jax.sharding.get_abstract_mesh().axis_names


def is_sharded(x):
    return isinstance(x, nnx.Param)


def shard_params(params, config):
    """Box each parameter split over 'data' as an nnx.Param whose out_sharding names 'data' on
    the axis it is split along: the largest that splits evenly (not --scan-layers' first)."""
    scanned = {"blocks"} if config.scan_layers else set()

    def shard(path, x):
        if x.size >= config.min_shard_size:
            for axis in np.argsort(x.shape)[::-1]:  # the largest axis that splits evenly
                stacked = axis == 0 and path[0].key in scanned
                if not stacked and x.shape[axis] % config.mesh_axes()["data"] == 0:
                    names = [None] * x.ndim
                    names[axis] = "data"
                    return nnx.Param(x, out_sharding=tuple(names), eager_sharding=False)
        return x

    return jax.tree_util.tree_map_with_path(shard, params)


def mesh_specs(tree):
    # Split over 'data', whole across 'replica'
    def spec(x):
        return P(*x.out_sharding) if is_sharded(x) else P()

    return jax.tree.map(spec, tree, is_leaf=is_sharded)


def split_axis(p):
    # counted from the last axis: a scanned block's slice has lost the first
    return p.get_value().ndim + p.out_sharding.index("data") - len(p.out_sharding)


def gather_params(params):
    def gather(p):
        return lax.all_gather(p.get_value(), "data", axis=split_axis(p), tiled=True)

    return jax.tree.map(lambda p: gather(p) if is_sharded(p) else p, params, is_leaf=is_sharded)


def gather_and_keep(run):
    """Let a piece of the model see full parameters, gathered just before nnx.merge makes it
    (run: common.run_piece). Autodiff keeps what the backward pass needs of them."""
    return lambda piece, params, x, rng: run(piece, gather_params(params), x, rng)


def gather_before_use(run):
    """gather_and_keep, and gathered again for the backward pass, as ZeRO-3 does (the default).

    The remat policy keeps the matmuls' outputs for the backward pass and computes the rest
    again, the gathers among them: kept alive instead, every piece's full weights would be on
    every device at once by the end of the forward pass. Not the head's: its backward pass
    follows its forward at once, with nothing to free in between. Not under --remat, which
    computes each block again, its gathers too: this policy's kept matmuls would undo its saving.
    """
    keep, policy = gather_and_keep(run), jax.checkpoint_policies.dots_saveable
    again = jax.checkpoint(keep, policy=policy, static_argnums=(0,))
    return lambda piece, *args: (keep if piece.name == "head" else again)(piece, *args)


def scatter(param, grad):
    """The gathers' transpose: each device keeps its shard of the gradient summed over 'data'."""
    if not is_sharded(param):
        return grad
    shard = lax.psum_scatter(grad, "data", scatter_dimension=split_axis(param), tiled=True)
    return param.replace(value=shard)


def average(grad):
    """The mean over devices of one gradient. A shard's gradient comes out of autodiff already
    reduce-scattered over 'data', since that is the transpose of its all-gather, but summed:
    divide by N; then (HSDP) all-reduce it across the replicas, which hold the same shard. A
    replicated parameter's gradient needs the all-reduce of data parallelism, over every device."""
    if is_sharded(grad):
        mean = grad.get_value() / lax.axis_size("data")
        if "replica" in every_device():  # HSDP: every replica holds the same shard
            mean = lax.pmean(mean, "replica")
        return grad.replace(value=mean)
    return lax.pmean(grad, every_device())


def rebox(saved, state):
    """Restored arrays back into the boxes of `state`: the checkpoint layout has none."""
    return jax.tree.map(
        lambda box, x: box.replace(value=x) if is_sharded(box) else x,
        state,
        saved,
        is_leaf=is_sharded,
    )


def init_state(config, mesh, shapes_only=False):
    again = not (config.keep_gathered or config.remat)
    model = common.make_model(config, wrap=gather_before_use if again else gather_and_keep)
    shard = functools.partial(shard_params, config=config)
    create = functools.partial(common.create_state, config, model, shard)
    # Each device computes only its own shards: the full model never exists on one device.
    specs = mesh_specs(jax.eval_shape(create))
    create = jax.jit(
        create, out_shardings=jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)
    )
    # The state itself, or only its shapes and shardings (nothing allocated) to compile for.
    return create.eval_shape() if shapes_only else create()


def train_step(state, batch, config):
    """One device's share of a step: its shards of the state, its rows of the batch."""
    # Every device must drop different units: fold the device's index into the step's key.
    rng = jax.random.fold_in(
        jax.random.fold_in(state.rng, state.step), lax.axis_index(every_device())
    )
    # Mark the parameters as varying over every device so their gradients are local, as in
    # shardmap_dp.py: replicated ones over every axis, shards over the replicas if any (they
    # vary over 'data' already).
    replicas = tuple(axis for axis in every_device() if axis != "data")
    params = jax.tree.map(
        lambda p: lax.pcast(p, replicas if is_sharded(p) else every_device(), to="varying"),
        state.params,
        is_leaf=is_sharded,
    )
    # --keep-gathered: the whole model for every micro-batch, gathered and scattered once
    local = state.replace(params=gather_params(params) if config.keep_gathered else params)
    grads, metrics = common.accumulate_gradients(local, batch, rng, config.microbatches)
    if config.keep_gathered:
        grads = jax.tree.map(scatter, params, grads, is_leaf=is_sharded)
    grads = jax.tree.map(average, grads, is_leaf=is_sharded)
    metrics = lax.psum(metrics, every_device())
    # Of the shards, and the rest
    split = jax.tree.map(is_sharded, grads, is_leaf=is_sharded)
    norm = common.global_norm(common.learned(grads), split, "data")
    state = state.apply_gradients(grads=common.clip(grads, norm, config.clip_norm))
    return state, {**metrics, "grad_norm": norm}


def eval_step(state, batch):
    """Summed held-out losses of one device's rows, added up over all devices."""
    return lax.psum(common.eval_metrics(state, batch), every_device())


def device_batch(batch, mesh):
    # This process's rows become one global array, split over every device.
    return jax.make_array_from_process_local_data(NamedSharding(mesh, batch_spec(mesh)), batch)


def main(config):
    common.setup(config)
    mesh = make_mesh(config)
    dataset = common.load_dataset(config)
    state_shapes = init_state(config, mesh, shapes_only=True)
    state_spec = mesh_specs(state_shapes)  # P(..., 'data', ...) for shards, P() otherwise
    step_fn = jax.jit(
        jax.shard_map(
            functools.partial(train_step, config=config),
            mesh=mesh,
            in_specs=(state_spec, batch_spec(mesh)),
            out_specs=(state_spec, P()),
        ),
        donate_argnums=0,
    )
    eval_fn = jax.jit(
        jax.shard_map(eval_step, mesh=mesh, in_specs=(state_spec, batch_spec(mesh)), out_specs=P())
    )
    # Compiled for the shapes of the state and of a batch, before either exists: a step too big
    # for the devices stops here, with one line, before anything is allocated.
    batch_shapes = common.batch_shape(config, NamedSharding(mesh, batch_spec(mesh)))
    compiled, compile_seconds = common.compile_step(config, step_fn, state_shapes, batch_shapes)
    state = init_state(config, mesh)
    # Saved without boxes
    checkpoints = common.Checkpoints(config, to_saved=common.unbox, from_saved=rebox)
    state, start = checkpoints.restore(state)
    eval_data = [device_batch(b, mesh) for b in common.eval_batches(dataset, config)]
    report = common.cost_report(config, state, compiled, compile_seconds)
    axes = ",".join(f"{axis}={size}" for axis, size in mesh.shape.items())
    layout = f"mesh {axes}, parameters and optimizer state sharded"
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
