"""Data parallelism with jax.shard_map: pmap_dp.py's algorithm, written the current way.

What is where: the global batch is split by rows over the mesh axis 'data' (P('data')),
each device taking an equal share. The parameters and optimizer state are replicated, a full
copy on every device (PartitionSpec P()).
A step: each device computes the gradient of its rows, one all-reduce (lax.pmean) averages
the gradients, and every copy applies the same update, so the copies stay equal.
Collectives per step: one all-reduce of the gradients, and a tiny one of the metrics.

What changes from pmap_dp.py: arrays are global jax.Arrays laid out on a Mesh instead of
per-device stacks, so the same arrays work with jax.jit, meshes of several axes and several
hosts; the body of shard_map sees each device's piece, as pmap's did; and check_vma
verifies, while tracing, that everything returned as replicated is the same on every device.

Run:
  python shardmap_dp.py                  # a laptop: 8 emulated CPU devices
  python shardmap_dp.py --steps 2000     # a GPU or TPU host: all of its devices
  python shardmap_dp.py --distributed    # every host of a TPU pod slice (README)

Read before: pmap_dp.py. Read next: fsdp.py, which shards what this script replicates.
Read more: docs/concepts.md (varying and invariant values, pcast); the JAX docs' "Manual
parallelism with shard_map".
"""

import dataclasses
import functools

import jax
import optax
from jax import lax

import common

from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class Config(common.Config):
    pass  # no flags of its own: the mesh is every device along one axis, 'data'


def make_mesh(config):
    # JAX's default mesh, of Explicit axes: shard_map makes every axis manual inside, and asks
    # only that the arrays going in are laid out as its in_specs say.
    return common.make_mesh({"data": jax.device_count()})


STATE_SPEC = P()  # replicated: every device holds the whole TrainState
BATCH_SPEC = P("data")  # rows split over 'data'


def init_state(config, mesh, shapes_only=False):
    create = functools.partial(common.create_state, config, common.make_model(config))
    create = jax.jit(create, out_shardings=NamedSharding(mesh, STATE_SPEC))
    # The state itself, or only its shapes and shardings (nothing allocated) to compile for.
    return create.eval_shape() if shapes_only else create()


def train_step(state, batch, config):
    """One device's share of a step: its full copy of the state, its rows of the batch."""
    # Every device must drop different units: fold the device's index into the step's key.
    rng = jax.random.fold_in(jax.random.fold_in(state.rng, state.step), lax.axis_index("data"))
    # Differentiate this device's copy (marked as varying over 'data'), so the gradients are
    # its own and averaging them is ours to write, as in pmap. Left unmarked, check_vma would
    # insert the reduction itself: a psum, which is a sum, not the mean we want.
    local = state.replace(params=lax.pcast(state.params, "data", to="varying"))
    grads, metrics = common.accumulate_gradients(local, batch, rng, config.microbatches)
    grads = lax.pmean(grads, "data")  # all-reduce: every copy now applies the same update
    metrics = lax.psum(metrics, "data")
    # The global norm, for clipping: every device holds all of it now
    norm = optax.tree.norm(common.learned(grads))
    state = state.apply_gradients(grads=common.clip(grads, norm, config.clip_norm))
    return state, {**metrics, "grad_norm": norm}


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
    state_shapes = init_state(config, mesh, shapes_only=True)
    step_fn = jax.jit(
        jax.shard_map(
            functools.partial(train_step, config=config),
            mesh=mesh,
            in_specs=(STATE_SPEC, BATCH_SPEC),
            out_specs=(STATE_SPEC, P()),
        ),
        donate_argnums=0,
    )
    eval_fn = jax.jit(
        jax.shard_map(eval_step, mesh=mesh, in_specs=(STATE_SPEC, BATCH_SPEC), out_specs=P())
    )
    # Compiled for the shapes of the state and of a batch, before either exists: a step too big
    # for the devices stops here, with one line, before anything is allocated.
    batch_shapes = common.batch_shape(config, NamedSharding(mesh, BATCH_SPEC))
    compiled, compile_seconds = common.compile_step(config, step_fn, state_shapes, batch_shapes)
    state = init_state(config, mesh)
    checkpoints = common.Checkpoints(config)
    state, start = checkpoints.restore(state)
    eval_data = [device_batch(b, mesh) for b in common.eval_batches(dataset, config)]
    report = common.cost_report(config, state, compiled, compile_seconds)
    layout = f"mesh data={mesh.shape['data']}, state replicated"
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
