"""Context parallelism in jax.shard_map: every sequence split along its length, ring attention.

What is where: the global batch is split by rows over the mesh axis 'data' and every sequence
along its length over the mesh axis 'context' (--mesh data=2,context=4): each device holds
two of the 2N equal pieces of its rows' sequences, piece c and its mirror 2N-1-c, so that under
the causal mask every device has the same attention work (with contiguous pieces, the device
holding the end of the sequence would do N times the work of the first). The sequence is laid
out that way on the host (device_batch). The parameters and optimizer state are replicated, a
full copy on every device, as in data parallelism.
A step: everything but attention works position by position, so each device runs it on its own
pieces, with their global positions (positions). Attention is ring attention: each device keeps
its queries while the keys and values travel around the 'context' ring, N - 1 hops of
lax.ppermute; at each hop a device attends to the block it holds, combining the blocks with an
online softmax (a running maximum and sum) and skipping the piece pairs the causal mask hides
entirely. The backward pass is JAX's autodiff of the ring: the transpose of each ppermute sends
the keys' and values' gradients back around the ring, and each hop's attention is recomputed
rather than stored (jax.checkpoint), so no device ever holds a whole sequence's scores. Each
device computes the gradient of its pieces' loss, and one all-reduce averages the gradients.
--attention-split picks the other two forms of context parallelism (docs/long_sequences.md):
all-gather, every key and value gathered once per layer, the causal mask by their global
positions; ulysses (DeepSpeed-Ulysses), an all-to-all that trades each device's pieces of the
sequence for all of it on heads / N of the heads, one device's attention (any kernel) on those,
and an all-to-all back.
Collectives per step: per layer, N - 1 collective-permutes of a key and value block forward
and N - 1 of their gradients backward (all-gather: an all-gather of the keys and one of the
values, a reduce-scatter of each gradient; ulysses: 4 all-to-alls forward, 4 backward); one
all-reduce of the gradients over 'data' and 'context', and tiny ones of the gradient norm and
of the metrics.

What changes from shardmap_dp.py: the batch is also split along the sequence, so the model
gets each piece's positions and ring attention in place of attention (the model's `positions`
and `attend`), and the gradients are averaged over 'context' too.

Run:
  python context_parallel.py             # a laptop: 8 emulated CPU devices, data=2,context=4
  python context_parallel.py --mesh data=1,context=8 --seq-len 4096   # long sequences
  python context_parallel.py --attention-split ulysses --heads 8   # heads a multiple of N
  python context_parallel.py --distributed   # every host of a TPU pod slice (README)

Read before: shardmap_dp.py. Read next: expert_parallel.py, which splits the experts instead.
Read more: Ring Attention (Liu et al. 2023, arXiv:2310.01889); DeepSpeed-Ulysses (Jacobs et al.
2023, arXiv:2309.14509); Llama 3 (2024, arXiv:2407.21783: all-gather).
"""

import dataclasses
import functools

import jax
import optax
from jax import lax

import common

import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class Config(common.Config):
    mesh: str = common.arg(
        "auto", "mesh axis sizes, e.g. data=2,context=4; 'auto' gives that on 8 devices"
    )
    attention_split: str = common.arg(
        "ring",
        "how attention reaches the keys and values of the other pieces: ring (N - 1 hops of a "
        "block, never a whole sequence's keys on a device), all-gather (every key and value "
        "gathered once per layer) or ulysses (all-to-alls trade the sequence split for a split "
        "of the heads, which 'context' must divide)",
        choices=("ring", "all-gather", "ulysses"),
    )

    def mesh_axes(self):
        n = jax.device_count()
        context = max(c for c in (1, 2, 4) if n % c == 0 and c <= max(1, n // 2))
        return common.mesh_shape(
            self.mesh, ("data", "context"), {"data": n // context, "context": context}
        )

    def batch_shards(self):
        return self.mesh_axes()["data"]

    def validate(self):
        kernel = self.attention in ("cudnn", "splash")
        common.require(
            not kernel or self.attention_split == "ulysses",
            "attention",
            f"{self.attention}: --attention-split {self.attention_split} computes attention "
            "itself, from pieces of the sequence; the kernels run under --attention-split "
            "ulysses, e.g. --attention auto",
        )
        super().validate()
        context = self.mesh_axes()["context"]
        common.require(
            self.attention_split != "ulysses" or self.heads % context == 0,
            "heads",
            f"{self.heads} under --attention-split ulysses: each device of 'context' attends "
            f"with heads / context of the heads, so context={context} must divide them, e.g. "
            f"--heads {context * max(1, self.heads // context)}",
        )
        pieces = 2 * context
        common.require(
            self.seq_len % pieces == 0,
            "seq_len",
            f"must split into 2 x context = {pieces} equal pieces, e.g. --seq-len "
            f"{pieces * max(1, self.seq_len // pieces)}",
        )
        # A model attending, or placing its tokens, without the hooks this script replaces would
        # see each device's pieces as whole sequences, and train another model silently: traced
        # once, on shapes.
        called = set()

        def attend(q, k, v):
            called.add("attend(q, k, v)")
            return q

        def places(length):
            called.add("positions(length)")
            return jnp.arange(length)

        hooks = common.Hooks(attend=attend, positions=places)
        model = common.Model(self, common.model_class(self), hooks=hooks)
        params = jax.eval_shape(lambda: common.init_params(model, jax.random.key(0)))
        jax.eval_shape(model, params, jax.ShapeDtypeStruct((1, self.seq_len), jnp.int32))
        missing = " or hooks.".join(sorted({"attend(q, k, v)", "positions(length)"} - called))
        common.require(not missing, "model", f"never calls hooks.{missing}, which this replaces")


def make_mesh(config):
    shape = config.mesh_axes()
    # JAX's default mesh, of Explicit axes: shard_map makes every axis manual inside, and asks
    # only that the arrays going in are laid out as its in_specs say.
    return common.make_mesh(shape)


STATE_SPEC = P()  # replicated: every device holds the whole TrainState
# [rows, (inputs, labels), length]: rows over 'data', length over 'context'
BATCH_SPEC = P("data", None, "context")


def pieces_of(device, devices):
    """The two pieces of every sequence that a device along 'context' holds: c and 2N-1-c."""
    return device, 2 * devices - 1 - device


def balanced_order(length, devices):
    """The order of a sequence's positions on the devices: device 0's two pieces, then device
    1's, ...; a contiguous split of it over 'context' gives each device its two pieces."""
    pieces = np.arange(length).reshape(2 * devices, -1)
    return np.concatenate([pieces[list(pieces_of(d, devices))].ravel() for d in range(devices)])


def positions(length):
    """The global positions of this device's tokens, `length` of them (its two pieces)."""
    piece = length // 2
    first, second = pieces_of(lax.axis_index("context"), lax.axis_size("context"))
    return jnp.concatenate([first * piece + jnp.arange(piece), second * piece + jnp.arange(piece)])


def attention_work(devices, balanced=True):
    """How many (query piece, key piece) blocks each device attends to over a step's hops: the
    pairs the causal mask does not hide entirely. Balanced: 2N + 1 on every device; with
    contiguous pieces, device c would do 4c + 3."""
    held = [pieces_of(d, devices) if balanced else (2 * d, 2 * d + 1) for d in range(devices)]
    return [
        sum(k <= q for q in held[d] for source in range(devices) for k in held[source])
        for d in range(devices)
    ]


def for_each_head(x, q):
    """Keys or values [batch, length, key-value heads, head_dim] repeated for each query head
    that shares them (grouped-query attention), on this device: what travels stays one per group."""
    return jnp.repeat(x, q.shape[2] // x.shape[2], axis=2)


def ring_attention(q, k, v):
    """Causal attention of this device's queries to the whole sequence, the keys and values
    travelling around the 'context' ring. q [batch, local length, heads, head_dim], k and v the
    same with key-value heads, the local length being this device's two pieces."""
    devices, device = lax.axis_size("context"), lax.axis_index("context")
    piece = q.shape[1] // 2
    # Computed in float32 whatever the compute dtype: the scores and softmax, as
    # jax.nn.dot_product_attention does, and also q, k and v and their gradients. A key piece's
    # gradient is a sum over every query piece it meets, one block and one hop at a time; each
    # block's part rounded to bfloat16 made ring attention's gradients twice as far off as
    # JAX's, which sums them in one matmul. (On a TPU a float32 matmul at default precision
    # takes bfloat16 inputs, on a GPU TensorFloat-32: about as fast. In bfloat16 each hop sends
    # twice the bytes; a custom backward pass could send bfloat16 and keep float32 sums.)
    compute = q.dtype
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    q_pieces = pieces_of(device, devices)
    scale = q.shape[-1] ** -0.5
    # Per query position: the running maximum of its scores, the running sum of their
    # exponentials (both relative to that maximum) and the running weighted sum of values.
    # (Made "like" q, so that they vary over the devices as q does: check_vma tracks that.)
    running_max = jnp.full_like(jnp.swapaxes(q[..., 0], 1, 2), -jnp.inf, jnp.float32)
    running_sum = jnp.zeros_like(running_max)
    out = jnp.zeros_like(q, jnp.float32)

    @jax.checkpoint  # the backward pass recomputes each hop's scores rather than keeping them
    def attend_block(running, k, v, hop):
        """Fold the key/value block that came `hop` hops around the ring into `running`."""
        k_pieces = pieces_of((device - hop) % devices, devices)
        for i, q_piece in enumerate(q_pieces):
            for j, k_piece in enumerate(k_pieces):
                rows, cols = slice(i * piece, (i + 1) * piece), slice(j * piece, (j + 1) * piece)

                def update(running, rows=rows, cols=cols, q_piece=q_piece, k_piece=k_piece):
                    running_max, running_sum, out = running
                    k_, v_ = (for_each_head(x[:, cols], q) for x in (k, v))
                    scores = jnp.einsum("bqhd,bkhd->bhqk", q[:, rows], k_) * scale
                    # Within a piece paired with itself, a query sees only the keys up to its own.
                    visible = (q_piece > k_piece) | (
                        jnp.arange(piece)[:, None] >= jnp.arange(piece)[None, :]
                    )
                    scores = jnp.where(visible, scores, -jnp.inf)
                    new_max = jnp.maximum(running_max[..., rows], scores.max(-1))
                    rescale = jnp.exp(running_max[..., rows] - new_max)
                    weights = jnp.exp(scores - new_max[..., None])
                    block_out = jnp.einsum("bhqk,bkhd->bqhd", weights, v_)
                    return (
                        running_max.at[..., rows].set(new_max),
                        running_sum.at[..., rows].set(
                            running_sum[..., rows] * rescale + weights.sum(-1)
                        ),
                        out.at[:, rows].set(
                            out[:, rows] * jnp.swapaxes(rescale, 1, 2)[..., None] + block_out
                        ),
                    )

                # A key piece after the query piece is hidden entirely: skip the block.
                running = lax.cond(k_piece <= q_piece, update, lambda running: running, running)
        return running

    ring = [(d, (d + 1) % devices) for d in range(devices)]

    def hop(carry, hop):
        running, k, v = carry
        running = attend_block(running, k, v, hop)
        return (running, lax.ppermute(k, "context", ring), lax.ppermute(v, "context", ring)), None

    (running, k, v), _ = lax.scan(
        hop, ((running_max, running_sum, out), k, v), jnp.arange(devices - 1)
    )
    # The last block: no hop after it
    running_max, running_sum, out = attend_block(running, k, v, devices - 1)
    return (out / jnp.swapaxes(running_sum, 1, 2)[..., None]).astype(compute)


def all_gather_attention(q, k, v):
    """Causal attention of this device's queries to the whole sequence, every key and value
    gathered from the devices of 'context' (one all-gather each per layer; its transpose, a
    reduce-scatter, returns their gradients). The gathered keys are in the devices' order; each
    one's global position (balanced_order) decides what the mask hides, so the causal load stays
    balanced as in the ring. Computed in float32, as ring_attention is and for the same reason:
    a key's gradient sums the contributions of every device's queries."""
    devices = lax.axis_size("context")
    compute = q.dtype
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    k, v = (for_each_head(lax.all_gather(x, "context", axis=1, tiled=True), q) for x in (k, v))
    key_positions = jnp.asarray(balanced_order(k.shape[1], devices))
    visible = positions(q.shape[1])[:, None] >= key_positions[None, :]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    weights = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v).astype(compute)


def ulysses_attention(q, k, v, attend):
    """Causal attention by DeepSpeed-Ulysses: an all-to-all over 'context' trades each device's
    pieces of the sequence for all of it, on heads / N of the heads; `attend` (one device's
    attention, any kernel) runs on the whole sequences of those heads; one all-to-all trades
    back. Four all-to-alls per layer forward (q, k, v, the output), four backward (the
    transpose of an all-to-all is the all-to-all back)."""
    devices = lax.axis_size("context")
    order = balanced_order(q.shape[1] * devices, devices)  # the gathered positions' order
    back = np.argsort(order)  # ... and how to put them back in sequence order

    def heads_split(x):  # [b, L/N, h, d] -> [b, L, h/N, d], in sequence order
        x = lax.all_to_all(x, "context", split_axis=2, concat_axis=1, tiled=True)
        return x[:, back]

    if k.shape[2] % devices:  # fewer key-value heads than devices: one per query head instead
        k, v = (for_each_head(x, q) for x in (k, v))
    out = attend(*(heads_split(x) for x in (q, k, v)))
    return lax.all_to_all(out[:, order], "context", split_axis=1, concat_axis=2, tiled=True)


ATTENTION_SPLITS = {"ring": ring_attention, "all-gather": all_gather_attention}


def init_state(config, mesh, shapes_only=False):
    create = functools.partial(common.create_state, config, make_model(config))
    create = jax.jit(create, out_shardings=NamedSharding(mesh, STATE_SPEC))
    # The state itself, or only its shapes and shardings (nothing allocated) to compile for.
    return create.eval_shape() if shapes_only else create()


def whole_sequence(x):
    """Something of each of this device's tokens, [rows, local length, ...], gathered from every
    device of 'context': the same for all the tokens of the rows' sequences, in the devices'
    order (`positions` says where each token is). A mixture of experts routes a sequence as a
    whole: an expert's capacity and the load balance count all of its tokens."""
    return lax.all_gather(x, "context", axis=1, tiled=True)


@functools.cache  # one model per config: the state holds it, and equal configs make equal states
def make_model(config):
    if config.attention_split == "ulysses":  # one device's attention, on whole sequences
        kernel = common.attention_kernel(config)
        attend = functools.partial(
            ulysses_attention,
            attend=functools.partial(common.causal_attention, implementation=kernel),
        )
    else:
        attend = ATTENTION_SPLITS[config.attention_split]
    hooks = common.Hooks(attend=attend, positions=positions, whole_sequence=whole_sequence)
    return common.make_model(config, hooks=hooks)


def train_step(state, batch, config):
    """One device's share of a step: its full copy of the state, its pieces of its rows."""
    # Every device must drop different units: fold the device's index into the step's key.
    rng = jax.random.fold_in(
        jax.random.fold_in(state.rng, state.step), lax.axis_index(("data", "context"))
    )
    # Differentiate this device's copy (marked as varying over both axes), so the gradients are
    # its own and averaging them is ours to write, as in shardmap_dp.py.
    local = state.replace(params=lax.pcast(state.params, ("data", "context"), to="varying"))
    grads, metrics = common.accumulate_gradients(local, batch, rng, config.microbatches)
    # All-reduce: every copy now applies the same update
    grads = lax.pmean(grads, ("data", "context"))
    metrics = lax.psum(metrics, ("data", "context"))
    # The global norm, for clipping: every device holds all of it now
    norm = optax.tree.norm(common.learned(grads))
    state = state.apply_gradients(grads=common.clip(grads, norm, config.clip_norm))
    return state, {**metrics, "grad_norm": norm}


def eval_step(state, batch):
    """Summed held-out losses of one device's pieces, added up over all devices."""
    return lax.psum(common.eval_metrics(state, batch), ("data", "context"))


def device_batch(batch, mesh):
    # Each row of tokens becomes its inputs and labels, [rows, 2, length], with the positions
    # in balanced order, so that splitting the length over 'context' gives each device its two
    # pieces; then this process's rows become one global array.
    order = balanced_order(batch.shape[1] - 1, mesh.shape["context"])
    pairs = np.stack([batch[:, :-1][:, order], batch[:, 1:][:, order]], axis=1)
    return jax.make_array_from_process_local_data(NamedSharding(mesh, BATCH_SPEC), pairs)


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
    batch_shapes = jax.ShapeDtypeStruct(
        (config.batch_size, 2, config.seq_len), np.int32, sharding=NamedSharding(mesh, BATCH_SPEC)
    )
    compiled, compile_seconds = common.compile_step(config, step_fn, state_shapes, batch_shapes)
    state = init_state(config, mesh)
    checkpoints = common.Checkpoints(config)
    state, start = checkpoints.restore(state)
    eval_data = [device_batch(b, mesh) for b in common.eval_batches(dataset, config)]
    work = attention_work(mesh.shape["context"])
    report = {
        **common.cost_report(config, state, compiled, compile_seconds),
        "attention_blocks_per_device": work,
        "attention_split": config.attention_split,
    }
    layout = (
        f"mesh data={mesh.shape['data']},context={mesh.shape['context']}, sequences in "
        f"{2 * mesh.shape['context']} pieces, {config.attention_split} attention, {work[0]} "
        "attention blocks per device, state replicated"
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
