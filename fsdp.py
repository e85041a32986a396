"""Fully sharded data parallelism (ZeRO-3), written by hand in jax.shard_map.

What is where: the global batch is split by rows over the mesh axis 'data' (P('data')),
each device taking an equal share. Every parameter is split into N equal pieces along one of
its axes over 'data' (boxed as nn.Partitioned, whose names say which axis), and so are its
Adam moments, so each device stores 1/N of the state; a parameter with no axis that N
divides, or smaller than --min-shard-size, stays replicated.
A step: each piece of the model (the embedding, every block, the head) all-gathers its full
parameters just before it runs, and again in the backward pass rather than keeping them
alive in between. Autodiff turns each all-gather into its transpose, a reduce-scatter, which
leaves each device the summed gradient of its own shard (divided by N for the mean). Adam is
elementwise, so each device updates only its shard.
Collectives per step: all-gathers of the parameters (forward and backward) and
reduce-scatters of their gradients, an all-reduce of any replicated ones, and a tiny one of
the metrics.

What changes from shardmap_dp.py: the state is sharded instead of replicated, so each piece
of the model gathers its parameters as it runs (the model's `wrap`), and the mean of a
sharded gradient is its reduce-scattered sum over N instead of an all-reduce.

Run:
  python fsdp.py                         # a laptop: 8 emulated CPU devices
  python fsdp.py --steps 2000            # a GPU or TPU host: all of its devices
  python fsdp.py --distributed           # every host of a TPU pod slice (README)

Read before: shardmap_dp.py. Read next: pjit_tp.py, where the compiler writes the collectives.
"""

import dataclasses
import functools

import jax
from jax import lax

import common

import flax.linen as nn
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class Config(common.Config):
    min_shard_size: int = common.arg(
        0, "replicate parameters smaller than this (e.g. 65536 spares tiny all-gathers); 0 shards all"
    )

    def validate(self):
        super().validate()
        common.require(self.min_shard_size >= 0, "min_shard_size", "must be zero or more, e.g. --min-shard-size 0")


def make_mesh(config):
    # Auto axes: the compiler may place whatever the specs below leave unsaid.
    return jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


BATCH_SPEC = P("data")  # rows split over 'data'


def is_sharded(x):
    return isinstance(x, nn.Partitioned)


def shard_params(params, config):
    """Box each parameter as nn.Partitioned, naming 'data' on the axis it is split along.

    The logical names are dropped but for 'layers', the axis that --scan-layers stacks the
    blocks along: nn.scan needs it named to hand each step of the scan one block's shards.
    """

    def shard(box):
        x, names = box.value, [name if name == "layers" else None for name in box.names]
        if x.size >= config.min_shard_size:
            for axis in np.argsort(x.shape)[::-1]:  # the largest axis that splits evenly
                if names[axis] is None and x.shape[axis] % jax.device_count() == 0:
                    names[axis] = "data"
                    return nn.Partitioned(x, names=tuple(names))
        return x

    return jax.tree.map(shard, params, is_leaf=is_sharded)


def mesh_specs(tree):
    def spec(x):  # only 'data' is a mesh axis; 'layers' and unnamed axes are not split
        return P(*(name if name == "data" else None for name in x.names)) if is_sharded(x) else P()

    return jax.tree.map(spec, tree, is_leaf=is_sharded)


def gather_params(params):
    def gather(p):
        return lax.all_gather(p.value, "data", axis=p.names.index("data"), tiled=True) if is_sharded(p) else p

    return jax.tree.map(gather, params, is_leaf=is_sharded)


def keep_all_but_gathered(primitive, *_, **__):
    return primitive is not lax.all_gather_p


def gather_before_use(piece):
    """Let a piece of the model see full parameters, gathered just before it runs.

    The remat policy keeps every intermediate for the backward pass except the gathered
    parameters, which are gathered again: kept alive instead, every piece's full weights would
    be on every device at once. (XLA's CPU compiler drops remat's optimization barriers early
    and merges the two gathers, except in --scan-layers' loop; the GPU compiler keeps them
    until after scheduling.)
    """
    piece = nn.map_variables(piece, "params", trans_in_fn=gather_params)
    return nn.remat(piece, policy=keep_all_but_gathered, static_argnums=(2,))


def average(grad):
    """The mean over devices of one gradient. A shard's gradient comes out of autodiff already
    reduce-scattered, since that is the transpose of its all-gather, but summed: divide by N.
    A replicated parameter's gradient needs the all-reduce of data parallelism."""
    if is_sharded(grad):
        return grad.replace(value=grad.value / lax.axis_size("data"))
    return lax.pmean(grad, "data")


def rebox(saved, state):
    """Restored arrays back into the boxes of `state`: the checkpoint layout has none."""
    return jax.tree.map(lambda box, x: box.replace(value=x) if is_sharded(box) else x, state, saved, is_leaf=is_sharded)


def init_state(config, mesh):
    model = common.GPT(config, wrap=gather_before_use)
    create = functools.partial(common.create_state, config, model, functools.partial(shard_params, config=config))
    # Each device computes only its own shards: the full model never exists on one device.
    specs = mesh_specs(jax.eval_shape(create))
    return jax.jit(create, out_shardings=jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs))()


def train_step(state, batch, microbatches):
    """One device's share of a step: its shards of the state, its rows of the batch."""
    # Every device must drop different units: fold the device's index into the step's key.
    rng = jax.random.fold_in(jax.random.fold_in(state.rng, state.step), lax.axis_index("data"))
    # Mark the replicated parameters as varying over 'data' so their gradients are local, as
    # in shardmap_dp.py. Shards differ per device already.
    params = jax.tree.map(
        lambda p: p if is_sharded(p) else lax.pcast(p, "data", to="varying"), state.params, is_leaf=is_sharded
    )
    local = state.replace(params=params)
    grads, metrics = common.accumulate_gradients(local, batch, rng, microbatches)
    grads = jax.tree.map(average, grads, is_leaf=is_sharded)
    metrics = lax.psum(metrics, "data")
    return state.apply_gradients(grads=grads), metrics


def eval_step(state, batch):
    """Summed held-out losses of one device's rows, added up over all devices."""
    return lax.psum(common.eval_metrics(state, batch), "data")


def device_batch(batch, mesh):
    # This process's rows become one global array, split over 'data'.
    return jax.make_array_from_process_local_data(NamedSharding(mesh, BATCH_SPEC), batch)


def main(config):
    common.setup(config)
    mesh = make_mesh(config)
    dataset = common.load_dataset(config)
    state = init_state(config, mesh)
    checkpoints = common.Checkpoints(config, to_saved=nn.unbox, from_saved=rebox)  # saved without boxes
    state, start = checkpoints.restore(state)
    state_spec = mesh_specs(state)  # P(..., 'data', ...) for shards, P() otherwise
    step_fn = jax.jit(
        jax.shard_map(
            functools.partial(train_step, microbatches=config.microbatches),
            mesh=mesh,
            in_specs=(state_spec, BATCH_SPEC),
            out_specs=(state_spec, P()),
        ),
        donate_argnums=0,
    )
    eval_fn = jax.jit(jax.shard_map(eval_step, mesh=mesh, in_specs=(state_spec, BATCH_SPEC), out_specs=P()))
    eval_data = [device_batch(b, mesh) for b in common.eval_batches(dataset, config)]
    first_batch = device_batch(common.host_batch(dataset, config, 0), mesh)
    compiled, compile_seconds = common.compile_step(step_fn, state, first_batch)
    report = common.cost_report(config, state, compiled, compile_seconds)
    layout = f"mesh data={mesh.shape['data']}, parameters and optimizer state sharded"
    log = common.Logger(config, dataset, layout, report, state.params, start)
    try:
        for step in range(start, config.steps):
            batch = device_batch(common.host_batch(dataset, config, step), mesh)
            # The program compiled above, which the report describes.
            state, metrics = compiled(state, batch)
            log.log(step, metrics)
            if log.eval_due(step):
                log.eval(step, eval_fn, state, eval_data)
            if checkpoints.save(step, state, log):  # Ctrl-C or SIGTERM: saved, stop
                break
    finally:
        checkpoints.close()  # lets the saves still being written finish, whatever happened
    summary = log.finish()
    return common.Result(log.losses.values, state, summary, compiled)


if __name__ == "__main__":
    main(common.parse_config(Config, __doc__))
