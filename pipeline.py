"""Pipeline parallelism in jax.shard_map: GPipe, 1F1B, zero-bubble and interleaved, the schedule as
data.

What is where: the global batch is split by rows over the mesh axis 'data' (P('data')). The
blocks, stacked along a layer axis as --scan-layers stacks them, are split over 'stage'
(P(None, 'stage'), --mesh data=2,stage=4): each device holds one stage's contiguous blocks and
their Adam moments (interleaved: groups s, s + stages, ... of --virtual-stages times as many,
smaller groups). The embedding runs on the first stage and the head on the last; between steps
they and their Adam moments are split over 'stage' too (at GPT-2's vocabulary they are most of
the model), gathered whole for the step, their gradients reduce-scattered.
A step: each device cuts its rows into --microbatches micro-batches that flow through the
stages, as a table made on the host says (make_schedule; --show-schedule prints it): which
micro-batch each stage runs forward or backward at each tick. GPipe runs every forward, then
every backward; 1F1B starts backwards once the pipeline is full, keeping at most `stages`
micro-batches in flight; zero-bubble (ZB-H1) splits each backward into the input's gradient,
which the previous stage waits for, and the weights' gradient, which fills the ticks 1F1B
leaves idle; interleaved (Megatron's) runs 1F1B over the smaller groups, each micro-batch going
round the ring of stages --virtual-stages times, so filling and draining take ticks of a group.
After each tick every stage passes its output forward and its input's gradient back (ppermute).
A stage keeps only a micro-batch's input between its forward and its backward, which runs
jax.vjp of the stage on it (recomputing it, as --remat does); zero-bubble's B keeps each dense
layer's input and output gradient for its W (x^T dy): the two cost one backward.
Collectives per step: two collective-permutes a tick between neighbouring stages; an all-gather
over 'stage' of the embedding and head and a reduce-scatter of their gradients (together an
all-reduce's bytes); an all-reduce over 'data' of all gradients, as in data parallelism.

What changes from shardmap_dp.py: the parameters are split over 'stage' instead of replicated, and
the step is no longer one forward and one backward of the whole model: it is a schedule of
per-stage forwards and backwards over micro-batches, with activations and gradients sent
between stages, and each stage's gradient made by jax.vjp of its own part of the model.

Run:
  python pipeline.py                     # a laptop: 8 emulated CPU devices, data=2,stage=4
  python pipeline.py --schedule gpipe --show-schedule   # print the ticks, train nothing
  python pipeline.py --schedule zero-bubble   # a third of 1F1B's bubble
  python pipeline.py --schedule interleaved --layers 8   # 2 groups of layers per stage
  python pipeline.py --distributed       # every host of a TPU pod slice (README)

Read before: shardmap_dp.py. Read next: context_parallel.py, which splits the sequence instead.
Read more: GPipe (Huang et al. 2019, arXiv:1811.06965); 1F1B and interleaving (Narayanan et
al. 2021, arXiv:2104.04473); Zero Bubble (Qi et al. 2023, arXiv:2401.10241).
"""

import dataclasses
import functools

import jax
from jax import lax

import common

from flax import nnx
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


SCHEDULES = ("gpipe", "1f1b", "zero-bubble", "interleaved")


@dataclasses.dataclass(frozen=True)
class Config(common.Config):
    mesh: str = common.arg("auto", "mesh axis sizes, e.g. data=2,stage=4 (auto on 8 devices)")
    schedule: str = common.arg("1f1b", "the micro-batches' order of work", choices=SCHEDULES)
    microbatches: int = common.arg(8, "micro-batches per step and data shard, through the stages")
    virtual_stages: int = common.arg(2, "--schedule interleaved: groups of layers per stage")
    show_schedule: bool = common.arg(False, "print the schedule's ticks and exit, training nothing")

    def virtual(self):
        """Groups of layers per stage: --virtual-stages when interleaved, else one."""
        return self.virtual_stages if self.schedule == "interleaved" else 1

    def takes(self, microbatches, stages):
        """Whether the schedule runs this many micro-batches: gpipe any, the others at least one
        a stage, interleaved a multiple of the stages."""
        if self.schedule == "interleaved":
            return microbatches % stages == 0
        return self.schedule == "gpipe" or microbatches >= stages

    def mesh_axes(self):
        # 'auto' even for flags that validate() refuses next (--virtual-stages 0, --layers 3)
        n, groups = jax.device_count(), max(1, self.virtual())
        stage = max(  # up to 4 stages, each with its layers and (gpipe aside) a micro-batch
            (
                s
                for s in (1, 2, 4)
                if n % s == 0
                and self.layers % (s * groups) == 0
                and s <= max(2, n // 2)  # at most half the devices, both of 2
                and self.takes(self.microbatches, s)
            ),
            default=1,
        )
        return common.mesh_shape(self.mesh, ("data", "stage"), {"data": n // stage, "stage": stage})

    def batch_shards(self):
        return self.mesh_axes()["data"]

    def validate(self):
        # The schedule's own flags first: the batch's checks below divide by what they make.
        only = "is for --schedule interleaved only, e.g. --schedule interleaved"
        interleaved = self.schedule == "interleaved"
        common.require(interleaved or self.virtual_stages == 2, "virtual_stages", only)
        one = "must be at least 2, e.g. --virtual-stages 2 (one group per stage is --schedule 1f1b)"
        common.require(self.virtual_stages >= 2, "virtual_stages", one)
        stages, groups, n = self.mesh_axes()["stage"], self.virtual(), jax.device_count()
        split = stages if stages > 1 or n % 2 else 2  # one stage pipelines nothing (below)
        over = f"over stage={split}" + f" x {groups} groups" * (groups > 1)
        eg = f"e.g. --layers {split * groups * max(1, self.layers // (split * groups))}"
        evenly = f"{self.layers} must split evenly {over}, {eg}"
        common.require(self.layers % (stages * groups) == 0, "layers", evenly)
        if stages == 1 and n % 2 == 0:  # nothing pipelined: a mesh of 2 stages, and what it takes
            layers = 2 * groups * -(-self.layers // (2 * groups))
            m = next(m for m in range(self.microbatches, 3 * self.microbatches) if self.takes(m, 2))
            eg = f"--mesh data={n // 2},stage=2" + f" --layers {layers}" * (layers != self.layers)
            eg += f" --microbatches {m}" * (m != self.microbatches)
            why = f"gives stage=1 under --schedule {self.schedule}: nothing is pipelined"
            common.require(False, "mesh", f"{self.mesh} {why}; e.g. {eg}")
        data, size, count = self.mesh_axes()["data"], self.batch_size, self.microbatches
        fits = [m for m in range(1, size // data + 1) if size % (data * m) == 0]  # micro-batches
        fits = [m for m in fits if self.takes(m, stages)]  # that the schedule takes
        m = max([m for m in fits if m <= count] or fits[:1] or [0])
        eg = f"--microbatches {m} (or --batch-size {data * count * max(1, size // (data * count))})"
        divisible = f"{size} must be divisible by {data} batch shards x {count} micro-batches"
        divides = size % (data * count) == 0 or not m  # not m: the shared check suggests a size
        common.require(divides, "batch_size", f"{divisible}, e.g. {eg}")
        super().validate()
        eg = f"--microbatches {m}" if m else f"--microbatches {stages} --batch-size {data * stages}"
        rule = "a multiple of" if interleaved else "at least"
        many = f"must be {rule} the {stages} stages for --schedule {self.schedule}, e.g. {eg}"
        common.require(self.takes(count, stages), "microbatches", many)
        held = "is how the pipeline holds its blocks already, e.g. --no-scan-layers"
        common.require(not self.scan_layers, "scan_layers", held + " --no-remat" * self.remat)
        redone = "is what each stage's backward does already, e.g. --no-remat"
        common.require(not self.remat, "remat", redone)


def make_mesh(config):
    shape = config.mesh_axes()
    # Auto axes, not JAX's default Explicit ones: to_saved and from_saved (below) slice the
    # stacked blocks along 'stage' outside shard_map, where Explicit axes would refuse to guess
    # each slice's sharding (they ask for an out_sharding); under Auto the compiler places them.
    return common.make_mesh(shape, jax.sharding.AxisType.Auto)


BATCH_SPEC = P("data")  # rows split over 'data'
# What a stage does at a tick. BACKWARD is the whole backward of a micro-batch; zero-bubble
# splits it into INPUT_GRAD (the gradient of the stage's input, which the previous stage waits
# for) and WEIGHT_GRAD (the gradient of its parameters, which nobody waits for).
OPS = IDLE, FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD = 0, 1, 2, 3, 4
# The columns of the schedule's table (make_schedule): what a stage runs, on which micro-batch
# and group of layers; the slots of its buffers it reads its input and its output's gradient
# from; the slots an activation and a gradient arriving at the end of the tick go into.
OP, MICROBATCH, VIRTUAL, INPUT_SLOT, GRADIENT_SLOT, INPUT_ARRIVES, GRADIENT_ARRIVES = range(7)
# What passes between stages, and the table's columns for each: (where it is read, where it
# arrives).
COLUMNS = {"input": (INPUT_SLOT, INPUT_ARRIVES), "gradient": (GRADIENT_SLOT, GRADIENT_ARRIVES)}


def stage_order(kind, stages, microbatches, s, virtual=1):
    """Stage s's work in order: (op, v, m), op on micro-batch m of its v-th group of layers (the
    model's chunk v * stages + s; v is 0 but interleaved). GPipe: every forward, then every
    backward. 1F1B: stages - s - 1 forwards to fill the pipeline, then a forward and a backward
    in turn, so at most stages - s micro-batches wait for their backward on stage s. Zero-bubble:
    1F1B's, INPUT_GRAD for BACKWARD (make_schedule places the WEIGHT_GRADs). Interleaved
    (Megatron's, PyTorch's ScheduleInterleaved1F1B): (virtual - 1) * stages + 2 * (stages - s - 1)
    forwards first, the groups taking `stages` micro-batches in turn, backwards from the last."""
    if kind == "gpipe":
        return [(op, 0, m) for op in (FORWARD, BACKWARD) for m in range(microbatches)]
    total, back = virtual * microbatches, INPUT_GRAD if kind == "zero-bubble" else BACKWARD
    warmup = min(total, (virtual - 1) * stages + (stages - s - 1) * (1 + (virtual > 1)))

    def nth(op, k):  # the k-th forward or backward: its group and micro-batch
        v, m = k // stages % virtual, k // (stages * virtual) * stages + k % stages
        return op, v if op == FORWARD else virtual - 1 - v, m

    order = [nth(FORWARD, k) for k in range(warmup)]
    for k in range(total):
        order += [nth(FORWARD, k + warmup)] * (k + warmup < total) + [nth(back, k)]
    return order


def make_schedule(kind, stages, microbatches, virtual=1):
    """The schedule as data: table[t, s] = (op, m, v, input slot, gradient slot, arriving input's
    slot, arriving gradient's slot): at tick t stage s runs `op` on micro-batch m of its group v,
    reading its input and its output's gradient from those slots of its buffers (-1: none: the
    first group reads the tokens, the last's gradient is the loss's), and at the end of the tick
    receives an activation from the previous stage and a gradient from the next into the
    arriving slots (-1: none); interleaved, the last stage sends on to the first, and back.

    Each stage runs stage_order's operations in turn, each at the first tick its input is there:
    a forward once the previous group's forward of m ran (at an earlier tick), a backward once
    the next group's backward of m did (the last group's: its own forward). Zero-bubble (ZB-H1,
    Qi et al. 2023): a stage that cannot run its next operation runs the oldest WEIGHT_GRAD it
    owes instead of idling, and holds at most `stages` micro-batches between a forward and its
    WEIGHT_GRAD (1F1B's most, on its first stage)."""
    chunks = stages * virtual
    orders = [stage_order(kind, stages, microbatches, s, virtual) for s in range(stages)]
    ran = {}  # (FORWARD or BACKWARD, chunk, m) -> the tick it ran at (INPUT_GRAD as BACKWARD)
    owed, held, rows = [[] for _ in range(stages)], [0] * stages, []
    most = stages if kind == "zero-bubble" else chunks * microbatches  # held, at most
    while any(orders) or any(owed):
        t, row = len(rows), []
        for s in range(stages):
            op, v, m = orders[s][0] if orders[s] else (IDLE, 0, -1)
            c = v * stages + s
            # What it waits for: the previous group's forward, or the next group's backward (the
            # last group's: its own forward)
            after = (FORWARD, c - 1) if op == FORWARD else (FORWARD, c) if c == chunks - 1 else None
            after = after or (BACKWARD, c + 1)
            ready = op != IDLE and (op != FORWARD or held[s] < most)
            if not (ready and (after[1] < 0 or ran.get((*after, m), t) < t)):
                op, v, m = (WEIGHT_GRAD, *owed[s][0]) if owed[s] else (IDLE, 0, -1)  # or idles
            if op in (FORWARD, BACKWARD, INPUT_GRAD):  # an operation of its order: on to the next
                ran[min(op, BACKWARD), v * stages + s, m] = t
                orders[s].pop(0)
            held[s] += (op == FORWARD) - (op in (BACKWARD, WEIGHT_GRAD))
            owed[s] = owed[s][op == WEIGHT_GRAD :] + [(v, m)] * (op == INPUT_GRAD)
            row.append((op, v, m))
        rows.append(row)
    return place_in_slots(rows, stages, virtual)


def place_in_slots(rows, stages, virtual):
    """The table of make_schedule from each tick's (op, v, m) per stage: where each activation
    and each gradient that arrives is kept until its last use, the lowest slot free then."""
    chunks, last = stages * virtual, {BACKWARD, WEIGHT_GRAD}
    table = np.full((len(rows), stages, 7), -1, np.int32)
    slots = {}  # (what, stage, v, m) -> the slot holding it; what: "input" or "gradient"
    for t, row in enumerate(rows):
        arriving = []  # (what, stage, v, m), sent at this tick
        for s, (op, v, m) in enumerate(row):
            c = v * stages + s
            table[t, s, [OP, MICROBATCH, VIRTUAL]] = op, m, v
            if op == IDLE:
                continue
            for what, (read, _) in COLUMNS.items():
                table[t, s, read] = slots.get((what, s, v, m), -1)
                if op in last:
                    slots.pop((what, s, v, m), None)
            if op == FORWARD and c + 1 < chunks:  # to the next group, on the next stage
                arriving.append(("input", (s + 1) % stages, (c + 1) // stages, m))
            if op in (BACKWARD, INPUT_GRAD) and c > 0:  # to the previous group
                arriving.append(("gradient", (s - 1) % stages, (c - 1) // stages, m))
        for what, s, v, m in arriving:
            taken = {slot for (w, stage, *_), slot in slots.items() if (w, stage) == (what, s)}
            slots[what, s, v, m] = min(set(range(len(taken) + 1)) - taken)
            table[t, s, COLUMNS[what][1]] = slots[what, s, v, m]
    return table


def in_flight(table):
    """The most micro-batches each stage holds at once (interleaved: pairs of a group of layers
    and a micro-batch), from a forward to the last operation that reads its input (BACKWARD, or
    zero-bubble's WEIGHT_GRAD)."""
    most = []
    for s in range(table.shape[1]):
        held, peak = set(), 0
        for op, m, v in table[:, s, :3]:
            if op == FORWARD:
                held.add((v, m))
            elif op in (BACKWARD, WEIGHT_GRAD):
                held.discard((v, m))
            peak = max(peak, len(held))
        most.append(peak)
    return most


def show_schedule(kind, table):
    """One line per stage, one column per tick: F3 is micro-batch 3's forward, B3 its backward
    (zero-bubble: its input's gradient), W3 its weights' gradient (zero-bubble); interleaved,
    5F3 is micro-batch 3's forward through the model's group of layers 5 (as PyTorch writes it)."""
    stages, virtual = table.shape[1], table[:, :, VIRTUAL].max() + 1
    letter = {IDLE: ".", FORWARD: "F", BACKWARD: "B", INPUT_GRAD: "B", WEIGHT_GRAD: "W"}

    def cell(s, op, m, v):
        chunk = f"{v * stages + s}" if virtual > 1 and op != IDLE else ""
        return chunk + letter[op] + (f"{m}" if op != IDLE else "")

    idle = (table[:, :, OP] == IDLE).mean()
    microbatches = table[:, :, MICROBATCH].max() + 1
    groups = f", {virtual} groups of layers per stage" if virtual > 1 else ""
    print(f"--schedule {kind} on {stages} stages, {microbatches} micro-batches{groups}:")
    print(f"schedule: {table.shape[0]} ticks, {idle:.0%} of the stages' ticks idle (the bubble)")
    print("micro-batches in flight on each stage, at most: " + " ".join(map(str, in_flight(table))))
    cells = [[cell(s, *table[t, s, :3]) for t in range(table.shape[0])] for s in range(stages)]
    width = max(len(c) for row in cells for c in row)
    for s, row in enumerate(cells):
        print(f"stage {s}: " + " ".join(c.rjust(width) for c in row))


def stack_blocks(tree, virtual=1):
    """block_0 ... block_{L-1} of a dict as one tree 'blocks' [virtual, L / virtual, ...]:
    splitting the second axis over 'stage' (P(None, 'stage')) gives stage s its groups s,
    s + stages, ... (interleaved), or with one row one contiguous group."""
    if not isinstance(tree, dict) or "block_0" not in tree:
        return tree
    rest = {k: v for k, v in tree.items() if not k.startswith("block_")}
    layers = [tree[f"block_{i}"] for i in range(len(tree) - len(rest))]
    stack = lambda *x: jnp.stack(x).reshape(virtual, -1, *x[0].shape)  # noqa: E731
    return {**rest, "blocks": jax.tree.map(stack, *layers)}


def unstack_blocks(tree):
    """The inverse of stack_blocks."""
    if not isinstance(tree, dict) or "blocks" not in tree:
        return tree
    blocks = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), tree["blocks"])  # one layer axis
    rest = {k: v for k, v in tree.items() if k != "blocks"}
    layers = range(jax.tree.leaves(blocks)[0].shape[0])
    return {**rest, **{f"block_{i}": jax.tree.map(lambda x, i=i: x[i], blocks) for i in layers}}


def every_dict(fn, tree):
    """fn applied to every dict of a tree of dicts and (named) tuples, such as the parameters
    and the optimizer state (whose Adam moments are trees like the parameters)."""
    if isinstance(tree, dict):
        return fn({k: every_dict(fn, v) for k, v in tree.items()})
    if isinstance(tree, tuple | list):
        children = [every_dict(fn, v) for v in tree]
        return type(tree)(*children) if hasattr(tree, "_fields") else type(tree)(children)
    return tree


def relaid(fn, state, **jit):
    """The state with fn applied to every dict of its parameters and optimizer state."""
    each = functools.partial(every_dict, fn)
    return jax.jit(lambda s: s.replace(params=each(s.params), opt_state=each(s.opt_state)), **jit)(
        state
    )


def to_saved(state):
    """The checkpoint layout: every block on its own, as a run without a pipeline names it."""
    return relaid(unstack_blocks, state)


def from_saved(saved, state):
    """A restored state, its blocks stacked again and laid out like `state`."""
    virtual = jax.tree.leaves(state.params["blocks"])[0].shape[0]
    stack = functools.partial(stack_blocks, virtual=virtual)
    return relaid(stack, saved, out_shardings=jax.tree.map(lambda x: x.sharding, state))


def state_specs(tree, stages):
    """P(None, 'stage') on the stacked blocks, each device holding its stage's groups of layers.
    Every other parameter (the embedding, the head) and its Adam moments split over 'stage' too,
    along the first axis `stages` divides (whole if none does): between steps each device keeps
    1/stages of them, not a copy, and the step gathers them (gather_embed_and_head). Counters and
    the key: P()."""

    def spec(path, x):
        path = jax.tree_util.keystr(path)
        if "'blocks'" in path:
            return P(None, "stage")
        axis = next((a for a, size in enumerate(x.shape) if size % stages == 0), None)
        split = path.startswith((".params", ".opt_state"))
        return P(*[None] * axis, "stage") if split and axis is not None else P()

    return jax.tree_util.tree_map_with_path(spec, tree)


def is_spec(x):
    return isinstance(x, P)


def gather_embed_and_head(params, specs):
    """The parameters with everything but the blocks whole on every device (all-gathers over
    'stage'): the embedding for the first stage, the head for the last."""

    def gather(x, spec):
        if "stage" not in spec:
            return x
        return lax.all_gather(x, "stage", axis=spec.index("stage"), tiled=True)

    return {k: v if k == "blocks" else jax.tree.map(gather, v, specs[k]) for k, v in params.items()}


def scatter_embed_and_head(grads, specs):
    """The inverse for the gradients: the embedding's comes from the first stage, the head's
    from the last, zeros elsewhere; each is summed over 'stage' and each device keeps its piece
    (reduce-scatters: the same bytes as an all-reduce's half, and the all-gather is the other)."""

    def scatter(g, spec):
        if "stage" not in spec:
            return lax.psum(g, "stage")
        return lax.psum_scatter(g, "stage", scatter_dimension=spec.index("stage"), tiled=True)

    return {k: v if k == "blocks" else jax.tree.map(scatter, v, specs[k]) for k, v in grads.items()}


def init_state(config, mesh, shapes_only=False):
    # Held as the pipeline holds them: the blocks stacked (common.create_state's `hold`)
    stacked = functools.partial(stack_blocks, virtual=config.virtual())
    create = functools.partial(common.create_state, config, common.make_model(config), stacked)
    # Each device computes only its own pieces: the full model never exists on one device.
    specs = state_specs(jax.eval_shape(create), mesh.shape["stage"])
    create = jax.jit(
        create, out_shardings=jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)
    )
    # The state itself, or only its shapes and shardings (nothing allocated) to compile for.
    return create.eval_shape() if shapes_only else create()


def stage_forward(params, x, tokens, rng, config, v=0, deltas=None, head=True):
    """One stage's part of the model on one micro-batch, its group of layers v: the embedding
    on the model's first group (in place of `x`), the group's blocks, and on its last (unless
    `head` is False) the head and the summed loss. Returns (the output, what it adds to the loss:
    that and a mixture's balancing loss), then, for the metrics, the summed loss and the blocks'
    sums, and with `deltas` (zeros, one per dense layer) the dense layers' inputs (keep_dense)."""
    stage, stages = lax.axis_index("stage"), lax.axis_size("stage")
    virtual = jax.tree.leaves(params["blocks"])[0].shape[0]
    # Which group of the model's layers: 0 first, virtual * stages - 1 last
    chunk = v * stages + stage
    model = common.make_model(config)  # its pieces: model.defs, model.tied
    rng = rng if config.dropout > 0 else None  # dropout given a key, none without

    def embed():
        return common.run_piece(model.defs["embed"], params["embed"], tokens[:, :-1], rng)

    x = lax.cond(chunk == 0, embed, lambda: x)

    blocks = jax.tree.map(lambda p: p[v], params["blocks"])  # the group's layers
    x, stats, inputs = run_blocks(blocks, x, rng, config, chunk, deltas)

    def loss():
        # A tied head reads the embedding's table: the first and last stages both hold it, and
        # the sum of its gradients over 'stage' adds up the two uses (scatter_embed_and_head).
        head = common.with_tied(params["head"], params["embed"], model.tied)
        logits = common.run_piece(model.defs["head"], head, x, rng)
        return common.cross_entropy(logits, tokens[:, 1:]).sum()

    none = jnp.zeros((), jnp.float32)
    loss = lax.cond(chunk == virtual * stages - 1, loss, lambda: none) if head else none
    return (x, loss + stats.get("aux_loss_sum", 0.0)), (loss, stats, inputs)


def run_blocks(blocks, x, rng, config, chunk=0, deltas=None):
    """A group of blocks ([layers, ...] stacked) on x, the group being the model's `chunk`-th:
    the output, the blocks' sums, and (with `deltas`, see stage_forward) their dense layers'
    inputs, [layers, ...] each."""
    piece = common.make_model(config).defs["block"]

    def block(x, layer):
        block_params, i, delta = layer
        module = common.merge(
            piece, block_params, None if rng is None else jax.random.fold_in(rng, i)
        )
        kept = []
        if deltas:
            keep_dense(module, delta, kept)
        x, stats = common.call(piece, module, x)
        return x, (stats, [x_in for _, x_in, _ in kept])

    layers = jax.tree.leaves(blocks)[0].shape[0]
    indices = chunk * layers + jnp.arange(layers)
    x, (stats, inputs) = lax.scan(block, x, (blocks, indices, deltas or None))
    return x, jax.tree.map(lambda s: s.sum(0), stats or {}), inputs  # sums over the blocks


def keep_dense(block, deltas, kept):
    """Zero-bubble's split backward, in a block made for one call (nnx.merge): the k-th
    nnx.Linear it calls appends (its kernel's path in the block, its input as it multiplies it,
    in the compute dtype, its output) to `kept` and adds deltas[k] (zeros; none if `deltas` is
    None) to its output, through its dot_general. The gradient with respect to deltas[k] is that
    layer's output gradient dy: with the input x, all the kernel's gradient x^T dy needs. Any
    other layer (a mixture's experts, a norm) is left alone: its weights' gradient is computed
    with the input's."""
    for path, layer in nnx.iter_modules(block):
        if type(layer) is nnx.Linear:

            def keep(x, kernel, *args, path=(*path, "kernel"), **kwargs):
                y = lax.dot_general(x, kernel, *args, **kwargs)
                kept.append((path, x, y))
                return y if deltas is None else y + deltas[len(kept) - 1]

            layer.dot_general = keep


def dense_calls(config, params, activation):
    """[(kernel path, input, output)] of every nnx.Linear a block calls, in order, as shapes."""
    block_params = jax.tree.map(lambda p: p[0, 0], params["blocks"])
    calls = []

    def run():
        block = common.merge(common.make_model(config).defs["block"], block_params)
        keep_dense(block, None, calls)
        block(activation)
        return [(x, y) for _, x, y in calls]

    shapes = jax.eval_shape(run)
    return [(path, x, y) for (path, *_), (x, y) in zip(calls, shapes, strict=True)]


def with_kernel(grads, v, path, value):
    """The gradients with one block kernel's (at `path` in a block) for group v: `value`
    [layers, in, out], or zeros (None)."""
    grads = dict(grads)
    blocks = grads["blocks"] = dict(grads["blocks"])
    *folders, name = path
    for folder in folders:
        blocks[folder] = dict(blocks[folder])
        blocks = blocks[folder]
    kernel = jnp.zeros_like(blocks[name])  # [virtual, layers, in, out]
    blocks[name] = kernel if value is None else kernel.at[v].set(value.astype(kernel.dtype))
    return grads


def place_kept(table):
    """Zero-bubble: where each stage keeps what a micro-batch's INPUT_GRAD leaves for its
    WEIGHT_GRAD ([ticks, stages], -1 at any other op), the lowest slot free then."""
    slots = np.full(table.shape[:2], -1, np.int32)
    for s in range(table.shape[1]):
        held = {}  # (v, m) -> slot
        for t, (op, m, v) in enumerate(table[:, s, :3]):
            if op == INPUT_GRAD:
                held[v, m] = slots[t, s] = min(set(range(len(held) + 1)) - set(held.values()))
            elif op == WEIGHT_GRAD:
                slots[t, s] = held.pop((v, m))
    return slots


def pipeline_gradients(params, batch, rng, config, table):
    """Run the schedule: every stage's gradient of the mean loss of this device's rows, and the
    summed loss (on the last stage). Forwards and backwards of the micro-batches at each tick as
    `table` says, the outputs passed to the neighbouring stages after each tick."""
    stage, stages = lax.axis_index("stage"), lax.axis_size("stage")
    microbatches = config.microbatches
    # Micro-batch i takes rows i, i + m, i + 2m, ... (as common.accumulate_gradients does).
    pieces = batch.reshape(-1, microbatches, batch.shape[-1]).swapaxes(0, 1)
    # How many activations, and gradients, a stage keeps at once, the most any stage does.
    slots, grad_slots = (
        max(1, table[:, :, column].max() + 1) for column in (INPUT_ARRIVES, GRADIENT_ARRIVES)
    )
    # What passes between stages: the embedding's output, of the shape of every block's.
    defs = common.make_model(config).defs
    embed = lambda: common.run_piece(defs["embed"], params["embed"], pieces[0][:, :-1])  # noqa: E731
    activation = jax.eval_shape(embed)
    activation = jnp.zeros(activation.shape, activation.dtype)
    to_next = [(s, s + 1) for s in range(stages - 1)]
    to_previous = [(s + 1, s) for s in range(stages - 1)]
    if jax.tree.leaves(params["blocks"])[0].shape[0] > 1:  # interleaved: a ring of stages, the
        to_next.append((stages - 1, 0))  # last stage's output going on to the first's next group
        to_previous.append((0, stages - 1))
    # The mean over this device's tokens
    loss_scale = 1.0 / (pieces.shape[0] * pieces.shape[1] * config.seq_len)

    # What the blocks report (a mixture of experts' routing), summed over the micro-batches.
    block_params = jax.tree.map(lambda p: p[0, 0], params["blocks"])
    block = lambda: common.run_piece(defs["block"], block_params, activation)[1]  # noqa: E731
    stats = jax.eval_shape(block) or {}
    stats = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), stats)

    # Zero-bubble: what each INPUT_GRAD keeps for its WEIGHT_GRAD, per dense layer of a block,
    # for each of this group's layers: its input and its output's gradient, in kept slots.
    zero_bubble = bool((table[:, :, OP] == WEIGHT_GRAD).any())
    kept_slots = place_kept(table) if zero_bubble else np.full(table.shape[:2], -1, np.int32)
    calls = dense_calls(config, params, activation) if zero_bubble else []
    layers = jax.tree.leaves(params["blocks"])[0].shape[1]
    kept_count = max(1, kept_slots.max() + 1)
    kept = [
        tuple(jnp.zeros((kept_count, layers, *a.shape), a.dtype) for a in (x, y))
        for _, x, y in calls
    ]

    def tick(carry, rows):
        inputs, output_grads, kept, grads, loss_sum, stats_sum = carry
        row, kept_row = rows
        op, m, v, input_slot, gradient_slot, input_arrives, gradient_arrives = row[stage]
        kept_slot = jnp.maximum(kept_row[stage], 0)
        tokens, key = pieces[m], jax.random.fold_in(rng, m)

        # Read inside the branches that use them (XLA would otherwise copy them out first). Slot
        # -1: none. The first group reads the tokens (any input will do) and the last group's
        # output is only the loss's, so its gradient is zero (interleaved, the slots hold others').
        def x():
            return inputs[jnp.maximum(input_slot, 0)]

        def gradient():
            return jnp.where(gradient_slot >= 0, output_grads[jnp.maximum(gradient_slot, 0)], 0)

        def forward():  # the loss is the backward's: it runs the stage again, the head with it
            return stage_forward(params, x(), tokens, key, config, v, head=False)[0][0]

        def nothing_kept():  # what an op other than INPUT_GRAD leaves for a WEIGHT_GRAD
            return [tuple(jnp.zeros(a.shape[1:], a.dtype) for a in pair) for pair in kept]

        def no_backward():
            zeros = jax.tree.map(jnp.zeros_like, (params, activation, stats))
            return *zeros[:2], nothing_kept(), jnp.zeros((), jnp.float32), zeros[2]

        def backward():
            """jax.vjp of the stage, recomputed from its input."""
            forward = functools.partial(stage_forward, tokens=tokens, rng=key, config=config, v=v)
            _, vjp, (loss, stats, _) = jax.vjp(forward, params, x(), has_aux=True)
            grad_params, grad_input = vjp((gradient(), jnp.float32(loss_scale)))
            return grad_params, grad_input, nothing_kept(), loss, stats

        def input_grad():
            """Zero-bubble's B: the backward of the stage, recomputed from its input, but for
            its dense kernels' gradients (zeros: XLA drops their matmuls). It leaves what they
            need: each dense layer's input, and its output's gradient (the gradient of its
            delta, keep_dense)."""
            deltas = [jnp.zeros((layers, *y.shape), y.dtype) for _, _, y in calls]
            forward = functools.partial(stage_forward, tokens=tokens, rng=key, config=config, v=v)
            _, vjp, (loss, stats, dense_inputs) = jax.vjp(
                lambda p, x, d: forward(p, x, deltas=d), params, x(), deltas, has_aux=True
            )
            grad_params, grad_input, dense_grads = vjp((gradient(), jnp.float32(loss_scale)))
            for path, *_ in calls:
                grad_params = with_kernel(grad_params, v, path, None)
            left = list(zip(dense_inputs, dense_grads, strict=True))
            return grad_params, grad_input, left, loss, stats

        def weight_grad():
            """Zero-bubble's W: each dense kernel's gradient, x^T dy per layer, from what B kept;
            nothing recomputed."""
            grad_params = jax.tree.map(jnp.zeros_like, params)
            for (path, *_), (xs, dys) in zip(calls, kept, strict=True):
                kernel = jnp.einsum("l...i,l...o->lio", xs[kept_slot], dys[kept_slot])
                grad_params = with_kernel(grad_params, v, path, kernel)
            _, grad_input, left, loss, none = no_backward()
            return grad_params, grad_input, left, loss, none

        # The backward each op runs (none for IDLE and FORWARD): only the backwards the table
        # has are compiled, since XLA:CPU keeps each branch's temporaries apart.
        backwards = {BACKWARD: backward}  # zero-bubble: the input's half, then the weights'
        backwards = {INPUT_GRAD: input_grad, WEIGHT_GRAD: weight_grad} if zero_bubble else backwards
        branch = np.zeros(len(OPS), np.int32)  # op -> its branch of lax.switch, 0: no_backward
        branch[list(backwards)] = np.arange(1, len(backwards) + 1)

        output = lax.cond(op == FORWARD, forward, lambda: jnp.zeros_like(activation))
        grad_params, grad_input, left, loss, more = lax.switch(
            jnp.asarray(branch)[op], [no_backward, *backwards.values()]
        )
        # What B leaves for W, into its slot outside the branches (a buffer that went through
        # them would be copied: XLA:CPU keeps each branch's results apart).
        kept = lax.cond(
            op == INPUT_GRAD,
            lambda: [
                (xs.at[kept_slot].set(x_in), dys.at[kept_slot].set(dy))
                for (xs, dys), (x_in, dy) in zip(kept, left, strict=True)
            ],
            lambda: kept,
        )
        # After each tick: activations to the next stage, their gradients to the previous one.
        received = lax.ppermute(output, "stage", to_next)
        received_gradient = lax.ppermute(grad_input, "stage", to_previous)
        inputs = lax.cond(
            input_arrives >= 0, lambda: inputs.at[input_arrives].set(received), lambda: inputs
        )
        output_grads = lax.cond(
            gradient_arrives >= 0,
            lambda: output_grads.at[gradient_arrives].set(received_gradient),
            lambda: output_grads,
        )
        grads = jax.tree.map(jnp.add, grads, grad_params)
        stats_sum = jax.tree.map(jnp.add, stats_sum, more)
        return (inputs, output_grads, kept, grads, loss_sum + loss, stats_sum), None

    carry = (
        jnp.zeros((slots, *activation.shape), activation.dtype),
        jnp.zeros((grad_slots, *activation.shape), activation.dtype),
        kept,
        jax.tree.map(jnp.zeros_like, params),
        jnp.zeros((), jnp.float32),
        stats,
    )
    rows = (jnp.asarray(table), jnp.asarray(kept_slots))
    (_, _, _, grads, loss_sum, stats), _ = lax.scan(tick, carry, rows)
    tokens = jnp.int32(pieces.size - pieces.shape[0] * pieces.shape[1])
    return grads, {"loss_sum": loss_sum, "tokens": tokens, **stats}


def train_step(state, batch, config, table, specs):
    """One device's share of a step: its stage's blocks, its rows of the batch."""
    # Every data shard must drop different units: fold its index into the step's key.
    rng = jax.random.fold_in(jax.random.fold_in(state.rng, state.step), lax.axis_index("data"))
    # The embedding and head whole, for this step
    params = gather_embed_and_head(state.params, specs)
    grads, metrics = pipeline_gradients(params, batch, rng, config, table)
    # Summed over 'stage', each device keeping its piece
    grads = scatter_embed_and_head(grads, specs)
    grads = lax.pmean(grads, "data")  # all-reduce: the mean over the data shards
    # The loss is summed on the last stage only, the blocks' sums on each stage for its blocks;
    # each stage counted the same tokens.
    metrics = {
        **lax.psum(metrics, ("data", "stage")),
        "tokens": lax.psum(metrics["tokens"], "data"),
    }
    split = jax.tree.map(lambda spec: "stage" in spec, specs, is_leaf=is_spec)
    norm = common.global_norm(common.learned(grads), split, "stage")
    state = state.apply_gradients(grads=common.clip(grads, norm, config.clip_norm))
    return state, {**metrics, "grad_norm": norm}


def eval_step(state, batch, config, specs):
    """Summed held-out losses of one device's rows: the stages one after another, each device
    running the whole model with the blocks of every stage gathered (no schedule, no backward)."""
    params = gather_embed_and_head(state.params, specs)
    params = {**params, "blocks": lax.all_gather(params["blocks"], "stage", axis=1, tiled=True)}
    return lax.psum(
        common.eval_metrics(state.replace(params=unstack_blocks(params)), batch), "data"
    )


def device_batch(batch, mesh):
    # This process's rows become one global array, split over 'data'.
    return jax.make_array_from_process_local_data(NamedSharding(mesh, BATCH_SPEC), batch)


def main(config):
    common.setup(config)
    mesh = make_mesh(config)
    dataset = common.load_dataset(config)
    table = make_schedule(
        config.schedule, mesh.shape["stage"], config.microbatches, config.virtual()
    )
    if config.show_schedule:  # print it, train nothing
        if common.is_main_process():
            show_schedule(config.schedule, table)
        return None
    state_shapes = init_state(config, mesh, shapes_only=True)
    # Every parameter split over 'stage'
    state_spec = state_specs(state_shapes, mesh.shape["stage"])
    step_fn = jax.jit(
        jax.shard_map(
            functools.partial(train_step, config=config, table=table, specs=state_spec.params),
            mesh=mesh,
            in_specs=(state_spec, BATCH_SPEC),
            out_specs=(state_spec, P()),
            # The stages run different code (lax.cond on the stage's index) and each takes its
            # gradient with jax.vjp, so every sum over devices is written by hand (train_step)
            # and there is no replication for check_vma to track.
            check_vma=False,
        ),
        donate_argnums=0,
    )
    eval_fn = jax.jit(
        jax.shard_map(
            functools.partial(eval_step, config=config, specs=state_spec.params),
            mesh=mesh,
            in_specs=(state_spec, BATCH_SPEC),
            out_specs=P(),
            check_vma=False,
        )
    )
    # Compiled for the shapes of the state and of a batch, before either exists: a step too big
    # for the devices stops here, with one line, before anything is allocated.
    batch_shapes = common.batch_shape(config, NamedSharding(mesh, BATCH_SPEC))
    compiled, compile_seconds = common.compile_step(config, step_fn, state_shapes, batch_shapes)
    state = init_state(config, mesh)
    # Saved block by block, unstacked
    checkpoints = common.Checkpoints(config, to_saved, from_saved)
    state, start = checkpoints.restore(state)
    eval_data = [device_batch(b, mesh) for b in common.eval_batches(dataset, config)]
    bubble = float((table[:, :, OP] == IDLE).mean())
    report = {**common.cost_report(config, state, compiled, compile_seconds), "bubble": bubble}
    layout = (
        f"mesh data={mesh.shape['data']},stage={mesh.shape['stage']}, {config.schedule}"
        + (f" ({config.virtual()} groups of layers per stage)" if config.virtual() > 1 else "")
        + f" over "
        f"{config.microbatches} micro-batches, {table.shape[0]} ticks, bubble {bubble:.0%}"
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
