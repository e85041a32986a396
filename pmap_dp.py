"""Data parallelism with jax.pmap: the historical starting point.

What is where: the global batch is split by rows, each device taking an equal share. The
parameters and optimizer state are replicated, a full copy on every device, stacked along a
new leading axis with one slice per local device.
A step: each device computes the gradient of its rows, one all-reduce (lax.pmean) averages
the gradients, and every copy applies the same update, so the copies stay equal.
Collectives per step: one all-reduce of the gradients, and a tiny one of the metrics.

What changes from one device: pmap runs the step on every local device at once, each on its
slice of stacked arrays (flax.jax_utils.replicate stacks the state, common_utils.shard splits
the batch). pmap is in maintenance mode: since JAX 0.8 it is implemented with jax.jit and
jax.shard_map. Its arrays are per-device stacks that work only inside pmap, and it maps one
axis of devices, so it cannot express a mesh with a second axis or let the compiler shard
anything. New code should use jax.shard_map: shardmap_dp.py is this script written that way.

Run:
  python pmap_dp.py                      # a laptop: 8 emulated CPU devices
  python pmap_dp.py --steps 2000         # a GPU or TPU host: all of its devices
  python pmap_dp.py --distributed        # every host of a TPU pod slice (README)

Read before: nothing, start here. Read next: shardmap_dp.py, the same algorithm on a mesh.
Read more: docs/concepts.md; the JAX docs' "Parallel evaluation" (pmap) and "Migrating to
shard_map".
"""

import dataclasses
import functools

import jax
import optax
from jax import lax

import common

import numpy as np
from flax.training import common_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class Config(common.Config):
    pass  # no flags of its own: pmap maps over every local device


def init_state(config):
    create = functools.partial(common.create_state, config, common.make_model(config))
    # One copy per local device, stacked: pmap builds the same copy (same seed) on every device,
    # laid out as the state the step returns, so the step is compiled once, not twice.
    return jax.pmap(lambda _: create(), axis_name="data")(np.arange(jax.local_device_count()))


def to_saved(state):
    """The checkpoint layout: each leaf one global array, replicated on every device of every
    process, assembled from the per-device copies where they are."""
    everywhere = NamedSharding(Mesh(np.array(jax.devices()), ("devices",)), P())
    return jax.tree.map(
        lambda x: jax.make_array_from_single_device_arrays(
            x.shape[1:], everywhere, [s.data[0] for s in x.addressable_shards]
        ),
        state,
    )


def from_saved(saved, state):
    """A restored state, back to one stacked copy per local device."""
    return jax.tree.map(
        lambda x, like: jax.make_array_from_single_device_arrays(
            like.shape, like.sharding, [s.data[None] for s in x.addressable_shards]
        ),
        saved,
        state,
    )


def train_step(state, batch, config):
    """One device's share of a step: its full copy of the state, its rows of the batch."""
    # Every device must drop different units: fold the device's index into the step's key.
    rng = jax.random.fold_in(jax.random.fold_in(state.rng, state.step), lax.axis_index("data"))
    grads, metrics = common.accumulate_gradients(state, batch, rng, config.microbatches)
    grads = lax.pmean(grads, "data")  # all-reduce: every copy now applies the same update
    metrics = lax.psum(metrics, "data")
    # The global norm, for clipping: every device holds all of it now
    norm = optax.tree.norm(common.learned(grads))
    state = state.apply_gradients(grads=common.clip(grads, norm, config.clip_norm))
    return state, {**metrics, "grad_norm": norm}


def eval_step(state, batch):
    """Summed held-out losses of one device's rows, added up over all devices."""
    return lax.psum(common.eval_metrics(state, batch), "data")


def device_batch(batch):
    # [rows, ...] -> [local devices, rows per device, ...]: pmap sends slice i to device i.
    return common_utils.shard(batch)


def main(config):
    common.setup(config)
    dataset = common.load_dataset(config)
    state = init_state(config)
    step_fn = jax.pmap(
        functools.partial(train_step, config=config),
        axis_name="data",
        donate_argnums=0,
    )
    eval_fn = jax.pmap(eval_step, axis_name="data")
    # pmap compiles for arrays, not shapes (with several processes it assembles its arguments
    # from every process's pieces), so its step is checked to fit in memory once the state exists.
    first_batch = device_batch(common.host_batch(dataset, config, 0))
    compiled, compile_seconds = common.compile_step(config, step_fn, state, first_batch)
    # Saved as one copy, not one per device
    checkpoints = common.Checkpoints(config, to_saved, from_saved)
    state, start = checkpoints.restore(state)
    eval_data = [device_batch(b) for b in common.eval_batches(dataset, config)]
    report = common.cost_report(config, state, compiled, compile_seconds)
    layout = f"pmap over {jax.local_device_count()} local devices, state replicated"
    log = common.Logger(config, dataset, layout, report, start)
    stop = common.StopSignals()  # Ctrl-C or SIGTERM: the run finishes its step, saves, stops
    try:
        # Each made while the devices run the step before (JAX dispatches asynchronously)
        for step, rows, waited in common.train_batches(dataset, config, start):
            batch = device_batch(rows)
            # pmap runs the program compiled above (it caches it; the tests check that nothing
            # compiles in the loop). `compiled` itself would want every process's rows.
            state, metrics = step_fn(state, batch)
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
