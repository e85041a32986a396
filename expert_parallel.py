"""Expert parallelism with jax.shard_map: a mixture of experts, its experts split over devices.

What is where: the mesh has two axes, 'data' and 'expert' (data=2,expert=4 on 8 devices). Every
block's MLP is a mixture of --experts expert MLPs (common.MoeMlp); the experts' weights and
their Adam moments are split over 'expert', each device holding --experts / (the size of
'expert') whole experts, and copies of those along 'data'. Everything else (attention, the
router, the shared experts, the embedding, the head) is replicated, as in data parallelism.
The global batch is split by rows over every device (P(('data', 'expert'))).
A step: each device routes its own tokens. Dropless (the default): an all-gather over 'expert'
brings every device of the group all of the group's tokens with their choices; each runs its
own experts on the choices that are theirs, grouped by expert (a grouped matmul), and a
reduce-scatter adds up each token's outputs and sends them home; on a TPU a ragged all-to-all
sends each choice to its expert's device alone, and its output back (XLA:CPU cannot run it: the
tests prove it by its definition). With --capacity-factor > 0:
each device lays its tokens out in each expert's slots, an all-to-all sends every device the
slots of the experts it holds, from each device of its group; the experts run; a second
all-to-all sends the outputs back. The backward pass runs each collective's reverse. Then the
gradients of replicated parameters are averaged over every device, as in data parallelism,
and each expert's over 'data', across the devices holding the same experts.
Collectives per step: per block, over 'expert': dropless, an all-gather of the group's tokens
and a reduce-scatter of their outputs forward, and the reverse of each backward (N x [rows,
length, d_model] each, N the size of 'expert'), and small ones of their choices and gates (on
a TPU, ragged all-to-alls of a device's choices, k / N of that under even routing);
with a capacity, two all-to-alls of the tokens' slots forward and two backward ([experts,
rows, capacity, d_model] each); the all-reduces of data parallelism; tiny ones of the
gradient norm and of the metrics.

What changes from shardmap_dp.py: the mesh gains an 'expert' axis and the state spec splits
the experts' axis of their parameters over it (stated as data, from the parameters' logical
names); the model gets ways to its experts (dropless_and_back, to_experts_and_back); an
expert's gradient is summed across 'expert' by the collectives' backward pass already, so it
is averaged over 'data' only; and the gradient norm adds up each device's experts.

Run:
  python expert_parallel.py              # a laptop: 8 emulated CPU devices, data=2,expert=4
  python expert_parallel.py --mesh data=1,expert=8 --steps 2000   # a GPU or TPU host
  python expert_parallel.py --distributed   # every host of a TPU pod slice (README)

Read before: shardmap_dp.py. Read next: the README's section on routing and balance.
Read more: GShard (Lepikhin et al. 2020, arXiv:2006.16668); Switch Transformers (Fedus et
al. 2021, arXiv:2101.03961); DeepSeek-V3 (2024, arXiv:2412.19437).
"""

import dataclasses
import functools
import math

import jax
from jax import lax

import common

import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class Config(common.Config):
    experts: int = common.arg(8, "experts in every block's MLP (a mixture of experts)")
    mesh: str = common.arg(
        "auto", "mesh axis sizes, e.g. data=2,expert=4; 'auto' gives that on 8 devices"
    )

    def mesh_axes(self):
        # 'auto': 'expert' within a host's count: on GPUs, one host (NVLink); TPU: a box of chips
        expert = math.gcd(self.experts, max(1, jax.device_count() // 2), jax.local_device_count())
        return common.mesh_shape(
            self.mesh, ("data", "expert"), {"data": jax.device_count() // expert, "expert": expert}
        )

    def validate(self):
        super().validate()
        common.require(
            self.experts > 0,
            "experts",
            "must be positive: this script splits experts, e.g. --experts 8",
        )
        common.require(
            any("expert" in box.names for _, box in common.logical_names(self)),
            "model",
            f"{self.model} has no parameter with an axis named 'expert', so there are no experts "
            "to split: use common.MoeMlp in its Block (or name your experts' axis 'expert'), e.g. "
            "--model gpt",
        )
        expert = self.mesh_axes()["expert"]
        common.require(
            self.experts % expert == 0,
            "mesh",
            f"expert={expert} must divide --experts {self.experts}, e.g. --mesh "
            f"data={jax.device_count()},expert=1",
        )


def make_mesh(config):
    shape = config.mesh_axes()
    # JAX's default mesh, of Explicit axes: shard_map makes every axis manual inside, and asks
    # only that the arrays going in are laid out as its in_specs say.
    return common.make_mesh(shape)


BATCH_SPEC = P(("data", "expert"))  # rows split over every device


@functools.cache
def param_specs(config):
    """{parameter path: PartitionSpec}: an axis named 'expert' (common.ExpertDense) is split over
    the mesh axis 'expert'; everything else is whole on every device."""
    return {
        path: P(*("expert" if name == "expert" else None for name in box.names))
        for path, box in common.logical_names(config)
    }


def state_spec(config, state):
    """The PartitionSpec of every leaf of the state: its parameter's (Adam's moments end with the
    parameter's path), or P() for a number (step counters, the random key)."""
    specs = param_specs(config)

    def spec(path, leaf):
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        return next((s for p, s in specs.items() if name == p or name.endswith("/" + p)), P())

    return jax.tree_util.tree_map_with_path(spec, state)


def is_split(spec):
    return "expert" in spec


def is_spec(x):
    return isinstance(x, P)


def to_experts_and_back(experts, x):
    """Run the experts on the tokens this device routed. x: [experts, rows, capacity, d], this
    device's tokens in every expert's slots. With N devices along 'expert', the first all-to-all
    sends each of them the slots of the experts it holds, from every device of the group:
    [experts / N, N x rows, capacity, d]; the second sends the outputs back."""
    x = lax.all_to_all(x, "expert", split_axis=0, concat_axis=1, tiled=True)
    return lax.all_to_all(experts(x), "expert", split_axis=1, concat_axis=0, tiled=True)


def dropless_and_back(mixture, x, expert, gate):
    """Dropless: every token through its experts, whichever devices hold them. x: [rows, length,
    d], this device's tokens; expert, gate: [rows, length, k], their choices. With N devices
    along 'expert', an all-gather brings each of them the tokens of the whole group (N x rows,
    with their choices), each runs its own experts on the choices that are theirs (the others
    skipped), and a reduce-scatter adds up each token's outputs from the N devices and sends
    them back where the token came from: [rows, length, d]. Bytes leaving a device each way:
    (N - 1) x rows x length x d x 4 (float32), and the choices. A ragged all-to-all sends only
    each choice to its expert's device, k / N of that under even routing (on a TPU; XLA:CPU
    cannot run it, jax issue 34755); a fixed-size all-to-all must size every buffer for the
    worst case, all of a device's choices to one device: min(k, experts per device) times as
    much."""
    x, expert, gate = (lax.all_gather(t, "expert", axis=0, tiled=True) for t in (x, expert, gate))
    out = mixture(x, expert, gate, lax.axis_index("expert"), lax.axis_size("expert"))
    return lax.psum_scatter(out, "expert", tiled=True)


def ragged_all_to_all():
    """XLA's ragged all-to-all where it runs, a TPU; None on XLA:CPU, which cannot run it."""
    return lax.ragged_all_to_all if jax.devices()[0].platform == "tpu" else None


@functools.cache  # one function per count, so that a model made again is the same model
def dropless_by_ragged_all_to_all(experts):
    """dropless_and_back on a TPU: each choice sent to its expert's device alone, and its output
    back (a ragged all-to-all each way, the sizes told by an all-gather of the counts). A device
    receives into room for the worst case, every choice of the group."""

    def dropless(mixture, x, expert, gate):
        n, me = lax.axis_size("expert"), lax.axis_index("expert")
        (rows, length, k), d = expert.shape, x.shape[-1]
        choices = expert.reshape(-1)  # [rows x length x k]: each choice's expert
        order = jnp.argsort(choices, stable=True)  # grouped by expert, so by device too
        sizes = jnp.zeros(n, jnp.int32).at[choices // (experts // n)].add(1)  # to each device
        table = lax.all_gather(sizes, "expert")  # [from, to]: every device's sizes
        start = jnp.cumsum(table, 1) - table  # where each device's choices for each begin
        at = jnp.cumsum(table, 0) - table  # where they go in the receiving device's room

        def send(rows, into, *offsets_and_sizes):  # into `into` (its result typed as it is)
            into = lax.pcast(into, tuple(jax.typeof(rows).manual_axis_type.varying), to="varying")
            return ragged_all_to_all()(rows, into, *offsets_and_sizes, axis_name="expert")

        there, room = (start[me], table[me], at[me], table[:, me]), n * choices.size
        tokens = send(x.reshape(-1, d)[order // k], jnp.zeros((room, d), x.dtype), *there)
        theirs = send(choices[order], jnp.full(room, -1, choices.dtype), *there)  # -1: none
        ones = jnp.ones((1, room, 1), gate.dtype)
        out = mixture(tokens[None], theirs[None, :, None], ones, me, n)[0]
        home = (at[:, me], table[:, me], start[:, me], table[me])
        back = send(out, jnp.zeros((choices.size, d), out.dtype), *home)
        back = back[jnp.argsort(order)].reshape(rows, length, k, d)
        return jnp.einsum("blkd,blk->bld", back, gate.astype(back.dtype))

    return dropless


def make_model(config):
    # On a TPU each choice goes to its expert's device alone; XLA:CPU cannot run that exchange.
    ragged = ragged_all_to_all() and dropless_by_ragged_all_to_all(config.experts)
    hooks = common.Hooks(to_experts=to_experts_and_back, dropless=ragged or dropless_and_back)
    return common.make_model(config, hooks=hooks)


def average(grad, spec):
    """The mean over devices of one gradient. A replicated parameter's needs the all-reduce of
    data parallelism. An expert's is already summed over the 'expert' group (the backward pass
    of the all-to-all brings each device's contribution to the device holding the expert), so
    it is summed over 'data' and divided by the number of devices."""
    if is_split(spec):
        return lax.psum(grad, "data") / lax.axis_size(("data", "expert"))
    return lax.pmean(grad, ("data", "expert"))


def init_state(config, mesh, shapes_only=False):
    create = functools.partial(common.create_state, config, make_model(config))
    specs = state_spec(config, jax.eval_shape(create))
    create = jax.jit(
        create, out_shardings=jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)
    )
    # The state itself, or only its shapes and shardings (nothing allocated) to compile for.
    return create.eval_shape() if shapes_only else create()


def train_step(state, batch, config):
    """One device's share of a step: its experts and a copy of the rest, its rows of the batch."""
    # Every device must drop different units: fold the device's index into the step's key.
    rng = jax.random.fold_in(
        jax.random.fold_in(state.rng, state.step), lax.axis_index(("data", "expert"))
    )
    # Differentiate this device's copy, so the gradients are its own and averaging them is ours
    # to write: replicated parameters vary over both axes now, the experts (already different
    # on each device of 'expert') over 'data'.
    specs = state_spec(config, state.params)
    params = jax.tree.map(
        lambda p, s: lax.pcast(p, "data" if is_split(s) else ("data", "expert"), to="varying"),
        state.params,
        specs,
    )
    grads, metrics = common.accumulate_gradients(
        state.replace(params=params), batch, rng, config.microbatches
    )
    grads = jax.tree.map(average, grads, specs)
    metrics = lax.psum(metrics, ("data", "expert"))
    # The experts', and the rest
    split = jax.tree.map(is_split, specs, is_leaf=is_spec)
    norm = common.global_norm(common.learned(grads), split, "expert")
    state = state.apply_gradients(grads=common.clip(grads, norm, config.clip_norm))
    return state, {**metrics, "grad_norm": norm}


def eval_step(state, batch):
    """Summed held-out losses of one device's rows, added up over all devices."""
    return lax.psum(common.eval_metrics(state, batch), ("data", "expert"))


def device_batch(batch, mesh):
    # This process's rows become one global array, split over every device.
    return jax.make_array_from_process_local_data(NamedSharding(mesh, BATCH_SPEC), batch)


def main(config):
    common.setup(config)
    mesh = make_mesh(config)
    dataset = common.load_dataset(config)
    state_shapes = init_state(config, mesh, shapes_only=True)
    specs = state_spec(config, state_shapes)
    step_fn = jax.jit(
        jax.shard_map(
            functools.partial(train_step, config=config),
            mesh=mesh,
            in_specs=(specs, BATCH_SPEC),
            out_specs=(specs, P()),
        ),
        donate_argnums=0,
    )
    eval_fn = jax.jit(
        jax.shard_map(eval_step, mesh=mesh, in_specs=(specs, BATCH_SPEC), out_specs=P())
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
    layout = (
        f"mesh data={mesh.shape['data']},expert={mesh.shape['expert']}, experts split over 'expert'"
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
