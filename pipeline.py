"""Pipeline parallelism in jax.shard_map: GPipe, 1F1B, zero-bubble, interleaved and ZB-V, the
schedule as data.

What is where: the global batch is split by rows over the mesh axis 'data' (P('data')). The
blocks, stacked along a layer axis as --scan-layers stacks them, are split over 'stage'
(P(None, 'stage'), --mesh data=2,stage=4): each device holds one stage's contiguous blocks and
their Adam moments (interleaved: --virtual-stages times as many, smaller groups: s, s + stages,
...). The embedding runs on the first stage and the head on the last; between steps they too are
split over 'stage' (at GPT-2's vocabulary they are most of the model), gathered for the step.
A step: each device cuts its rows into --microbatches micro-batches that flow through the stages
as a table made on the host says (make_schedule; --show-schedule prints it). GPipe runs every
forward, then every backward; 1F1B starts backwards once the pipeline is full, keeping at most
`stages` micro-batches in flight; zero-bubble (ZB-H1) splits each backward into the input's
gradient, which the previous stage waits for, and the weights', which fills the ticks 1F1B leaves
idle; interleaved (Megatron's) runs 1F1B over the smaller groups, each micro-batch going round
the ring of stages --virtual-stages times, so filling and draining take ticks of a group; zbv
(ZB-V) gives stage s groups s and 2 stages - 1 - s, a micro-batch going up the stages and back
down, B and W split. After each tick every stage passes what it made to both neighbours. A
forward keeps its input, and the backward runs the stage again (--remat, the default); with
--no-remat it keeps what jax.vjp of the stage keeps for the backward in a slot, where a split B
then leaves W each dense layer's input and output gradient: zero-bubble holds 1F1B's peak.
Collectives per step: two collective-permutes a tick between neighbouring stages; an all-gather
over 'stage' of the embedding and head and a reduce-scatter of their gradients; an all-reduce
over 'data' of all gradients, as in data parallelism.

What changes from shardmap_dp.py: the parameters are split over 'stage' instead of replicated, and
the step is a schedule of per-stage forwards and backwards over micro-batches, activations and
gradients sent between stages, each stage's gradient made by jax.vjp of its own part of the model.

Run:
  python pipeline.py                     # a laptop: 8 emulated CPU devices, data=2,stage=4
  python pipeline.py --schedule gpipe --show-schedule   # print the ticks, train nothing
  python pipeline.py --schedule zero-bubble --no-remat   # a third of 1F1B's bubble, at its peak
  python pipeline.py --schedule interleaved --layers 8   # 2 groups of layers per stage
  python pipeline.py --schedule zbv --layers 8   # the V: 6% of the ticks idle at M = 8
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


SCHEDULES = ("gpipe", "1f1b", "zero-bubble", "interleaved", "zbv")


@dataclasses.dataclass(frozen=True)
class Config(common.Config):
    mesh: str = common.arg("auto", "mesh axis sizes, e.g. data=2,stage=4 (auto on 8 devices)")
    schedule: str = common.arg("1f1b", "the micro-batches' order of work", choices=SCHEDULES)
    microbatches: int = common.arg(8, "micro-batches per step and data shard, through the stages")
    virtual_stages: int = common.arg(2, "--schedule interleaved: groups of layers per stage")
    show_schedule: bool = common.arg(False, "print the schedule's ticks and exit, training nothing")
    remat: bool = common.arg(True, "each backward runs its stage again (--no-remat: keeps it)")

    def virtual(self):
        """Groups of layers per stage: --virtual-stages when interleaved, two for zbv, else one."""
        return {"interleaved": self.virtual_stages, "zbv": 2}.get(self.schedule, 1)

    def takes(self, microbatches, stages):
        """Whether the schedule runs this many micro-batches: gpipe and zbv any, the others at
        least one a stage, interleaved a multiple of the stages."""
        if self.schedule == "interleaved":
            return microbatches % stages == 0
        return self.schedule in ("gpipe", "zbv") or microbatches >= stages

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
        common.require(not self.scan_layers, "scan_layers", held)


def make_mesh(config):
    shape = config.mesh_axes()
    # Auto axes: to_saved and from_saved slice the stacked blocks outside shard_map, where
    # Explicit axes would ask for each slice's out_sharding; under Auto the compiler places them.
    return common.make_mesh(shape, jax.sharding.AxisType.Auto)


BATCH_SPEC = P("data")  # rows split over 'data'
# What a stage does at a tick. Zero-bubble splits BACKWARD into INPUT_GRAD (the gradient of the
# stage's input, which the previous stage waits for) and WEIGHT_GRAD (its parameters').
OPS = IDLE, FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD = 0, 1, 2, 3, 4
# The table's columns: what a stage runs, on which micro-batch and group; the slots it reads its
# input and output gradient from; the slots what arrives at the tick's end goes into, from the
# stage below (s - 1), from the one above (s + 1) and from itself (zbv's turn, the loss's
# gradient); the kept slot (what a forward keeps for its backward, INPUT_GRAD for WEIGHT_GRAD).
OP, MICROBATCH, VIRTUAL, INPUT_SLOT, GRADIENT_SLOT = range(5)
FROM_BELOW, FROM_ABOVE, FROM_SELF, KEPT = range(5, 9)


def chunk_of(kind, stages, s, v):
    """Which group of the model's layers stage s's v-th is: v * stages + s, but zbv's V: stage s
    holds groups s and 2 stages - 1 - s, so the first and the last sit on stage 0."""
    return s + v * (2 * stages - 1 - 2 * s) if kind == "zbv" else v * stages + s


def stage_order(kind, stages, microbatches, s, virtual=1):
    """Stage s's work in order: (op, v, m), op on micro-batch m of its v-th group of layers (the
    model's chunk v * stages + s). GPipe: every forward, then every backward. 1F1B: stages - s - 1
    forwards, then a forward and a backward in turn (zero-bubble: INPUT_GRAD for BACKWARD).
    Interleaved (Megatron's): (virtual - 1) * stages + 2 * (stages - s - 1) forwards first, the
    groups taking `stages` micro-batches in turn, backwards from the last."""
    if kind == "gpipe":
        return [(op, 0, m) for op in (FORWARD, BACKWARD) for m in range(microbatches)]
    if kind == "zbv":
        return zbv_order(stages, microbatches, s)
    total, back = virtual * microbatches, INPUT_GRAD if kind == "zero-bubble" else BACKWARD
    warmup = min(total, (virtual - 1) * stages + (stages - s - 1) * (1 + (virtual > 1)))

    def nth(op, k):  # the k-th forward or backward: its group and micro-batch
        v, m = k // stages % virtual, k // (stages * virtual) * stages + k % stages
        return op, v if op == FORWARD else virtual - 1 - v, m

    order = [nth(FORWARD, k) for k in range(warmup)]
    for k in range(total):
        order += [nth(FORWARD, k + warmup)] * (k + warmup < total) + [nth(back, k)]
    return order


def zbv_order(stages, microbatches, s):
    """ZB-V on stage s (Qi et al. 2023, section 6, in the order PyTorch's ScheduleZBVZeroBubble
    gives): 2 (S - s) - 1 forwards of group 0, s of each group in turn, S - s of group 1's F, B
    and W; then each group's F, B and W in turn; then the Bs and Ws left. Group 0 is chunk s,
    group 1 chunk 2 S - 1 - s. At least 2 S - 1 micro-batches are planned, those beyond left out."""
    done, n, (f, b, w) = {}, max(2 * stages - 1, microbatches), (FORWARD, INPUT_GRAD, WEIGHT_GRAD)

    def ops(*pairs, times=1):  # each (op, v) in turn, `times` times, on its next micro-batch
        for _ in range(times):
            for op, v in pairs:
                done[op, v] = done.get((op, v), 0) + 1
                order.append((op, v, done[op, v] - 1))

    order = []
    ops((f, 0), times=2 * (stages - s) - 1)
    ops((f, 1), (f, 0), times=s)
    ops((f, 1), (b, 1), (w, 1), times=stages - s)
    while done[f, 1] < done[f, 0] or done[f, 0] < n:
        ops(*[(f, 0)] * (done[f, 0] < n), (b, 0), (w, 0), (f, 1), (b, 1), (w, 1))
    ops((b, 0), (b, 1), times=s)
    ops((b, 0), (w, 0), times=stages - s)
    ops((w, 1), times=done[b, 1] - done[w, 1])
    ops((w, 0), times=done[b, 0] - done[w, 0])
    return [(op, v, m) for op, v, m in order if m < microbatches]


def make_schedule(kind, stages, microbatches, virtual=1, keep=False):
    """The schedule as data, table[tick, stage] = the columns above (-1: none; the first group
    reads the tokens; `keep`: each forward keeps what its backward reads). Each stage runs
    stage_order's operations in turn, each at the first tick its input is there (the previous
    group's forward of m, or the next group's backward; the last group's: its own forward).
    Zero-bubble (ZB-H1, Qi et al. 2023): a stage that would idle runs the oldest WEIGHT_GRAD it
    owes, holding at most `stages` micro-batches between a forward and its WEIGHT_GRAD (1F1B's
    most); zbv's order names its Ws."""
    chunks = stages * virtual
    orders = [stage_order(kind, stages, microbatches, s, virtual) for s in range(stages)]
    ran = {}  # (op, chunk, m) -> the tick it ran at (INPUT_GRAD as BACKWARD)
    owed, held, rows = [[] for _ in range(stages)], [0] * stages, []
    most = stages if kind == "zero-bubble" else chunks * microbatches  # held, at most
    while any(orders) or any(owed):
        t, row = len(rows), []
        for s in range(stages):
            op, v, m = orders[s][0] if orders[s] else (IDLE, 0, -1)
            c = chunk_of(kind, stages, s, v)
            after = {FORWARD: (FORWARD, c - 1), WEIGHT_GRAD: (BACKWARD, c)}.get(op)
            after = after or ((FORWARD, c) if c == chunks - 1 else (BACKWARD, c + 1))  # waits for
            ready = op != IDLE and (op != FORWARD or held[s] < most)
            if ready and (after[1] < 0 or ran.get((*after, m), t) < t):
                ran[BACKWARD if op == INPUT_GRAD else op, c, m] = t
                orders[s].pop(0)  # an operation of its order: on to the next
            elif owed[s] and kind == "zero-bubble":  # or the oldest WEIGHT_GRAD owed
                op, v, m = WEIGHT_GRAD, *owed[s][0]
            else:
                op, v, m = IDLE, 0, -1
            held[s] += (op == FORWARD) - (op in (BACKWARD, WEIGHT_GRAD))
            owed[s] = [vm for vm in owed[s] if (op, *vm) != (WEIGHT_GRAD, v, m)]
            owed[s] += [(v, m)] * (op == INPUT_GRAD)
            row.append((op, v, m))
        rows.append(row)
    return place_in_slots(rows, kind, stages, virtual, keep)


def place_in_slots(rows, kind, stages, virtual, keep=False):
    """The table from each tick's (op, v, m) per stage: each activation and gradient that arrives
    in the lowest slot free until its last use (inputs and gradients share the slots; the last
    group's forward sends itself the loss's gradient), and in the lowest kept slot free what a
    forward keeps for its backward (with `keep`) and an INPUT_GRAD for its WEIGHT_GRAD."""
    chunks, table, slots = stages * virtual, np.full((len(rows), stages, 9), -1, np.int32), {}
    where = {chunk_of(kind, stages, s, v): (s, v) for s in range(stages) for v in range(virtual)}

    def take(kept, s, *key):  # the lowest of stage s's slots (kept, or what arrives) free now
        taken = {slot for (k, stage, *_), slot in slots.items() if (k, stage) == (kept, s)}
        slots[kept, s, *key] = min(set(range(len(taken) + 1)) - taken)
        return slots[kept, s, *key]

    for t, row in enumerate(rows):
        arriving = []  # (what, from which stage, to which chunk, m), sent at this tick
        for s, (op, v, m) in enumerate(row):
            c, last = chunk_of(kind, stages, s, v), op in (BACKWARD, INPUT_GRAD)
            table[t, s, [OP, MICROBATCH, VIRTUAL]] = op, m, v
            for what, read in (("input", INPUT_SLOT), ("gradient", GRADIENT_SLOT)):
                done = op == FORWARD if keep and what == "input" else last  # its last use
                table[t, s, read] = (slots.pop if done else slots.get)((False, s, what, v, m), -1)
            if op == (FORWARD if keep else INPUT_GRAD):  # what a later op reads
                table[t, s, KEPT] = take(True, s, v, m)
            elif op != FORWARD and (True, s, v, m) in slots:  # read, and freed unless W reads it
                done = op != INPUT_GRAD
                table[t, s, KEPT] = (slots.pop if done else slots.get)((True, s, v, m))
            if op == FORWARD:  # to the next group, or the last's loss's gradient to itself
                arriving.append(("input", s, c + 1, m) if c + 1 < chunks else ("gradient", s, c, m))
            if op in (BACKWARD, INPUT_GRAD) and c > 0:  # to the previous group
                arriving.append(("gradient", s, c - 1, m))
        for what, sender, c, m in arriving:
            s, v = where[c]
            below = s == (sender + 1) % stages if kind == "interleaved" else s == sender + 1
            link = FROM_SELF if s == sender else FROM_BELOW if below else FROM_ABOVE
            table[t, s, link] = take(False, s, what, v, m)
    return table


def in_flight(table):
    """The most micro-batches each stage holds at once, from a forward to its last backward."""
    ops = table[:, :, OP]
    held = np.cumsum((ops == FORWARD).astype(int) - np.isin(ops, (BACKWARD, WEIGHT_GRAD)), axis=0)
    return held.max(0).tolist()


def show_schedule(kind, table):
    """One line per stage, one column per tick: F3 is micro-batch 3's forward, B3 its backward
    (zero-bubble: its input's gradient), W3 its weights' gradient; 5F3 goes through group 5."""
    stages, virtual = table.shape[1], table[:, :, VIRTUAL].max() + 1
    letter = {IDLE: ".", FORWARD: "F", BACKWARD: "B", INPUT_GRAD: "B", WEIGHT_GRAD: "W"}

    def cell(s, op, m, v):
        chunk = f"{chunk_of(kind, stages, s, v)}" if virtual > 1 and op != IDLE else ""
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


def layer_order(kind, layers, stages):
    """The model's layers as the stacked blocks hold them: in order, but zbv's second group of
    layers by stage in reverse, so that stage s holds chunks s and 2 stages - 1 - s."""
    chunks = np.arange(layers).reshape(2 * stages if kind == "zbv" else 1, -1)
    return np.concatenate([chunks[:stages], chunks[stages:][::-1]]).ravel().tolist()


def stack_blocks(tree, virtual=1, order=None):
    """block_0 ... block_{L-1} of a dict as one tree 'blocks' [virtual, L / virtual, ...], in
    `order` (layer_order's): split over 'stage' on the second axis, stage s holds groups s,
    s + stages, ... (zbv: s and 2 stages - 1 - s)"""
    if not isinstance(tree, dict) or "block_0" not in tree:
        return tree
    rest = {k: v for k, v in tree.items() if not k.startswith("block_")}
    layers = [tree[f"block_{i}"] for i in order or range(len(tree) - len(rest))]
    stack = lambda *x: jnp.stack(x).reshape(virtual, -1, *x[0].shape)  # noqa: E731
    return {**rest, "blocks": jax.tree.map(stack, *layers)}


def unstack_blocks(tree, order=None):
    """The inverse of stack_blocks."""
    if not isinstance(tree, dict) or "blocks" not in tree:
        return tree
    blocks = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), tree["blocks"])  # one layer axis
    rest = {k: v for k, v in tree.items() if k != "blocks"}
    order = order or range(jax.tree.leaves(blocks)[0].shape[0])
    at = lambda j: jax.tree.map(lambda x: x[j], blocks)  # noqa: E731
    return {**rest, **{f"block_{i}": at(j) for j, i in enumerate(order)}}


def relaid(fn, state, **jit):
    """The state with fn applied to each tree of parameters in it (theirs, Adam's moments)."""
    params = lambda x: isinstance(x, dict) and bool({"block_0", "blocks"} & set(x))  # noqa: E731
    return jax.jit(lambda s: jax.tree.map(fn, s, is_leaf=params), **jit)(state)


def to_saved(state, order=None):
    """The checkpoint layout: every block on its own, as a run without a pipeline names it."""
    return relaid(functools.partial(unstack_blocks, order=order), state)


def from_saved(saved, state, order=None):
    """A restored state, its blocks stacked again and laid out like `state`."""
    virtual = jax.tree.leaves(state.params["blocks"])[0].shape[0]
    stack = functools.partial(stack_blocks, virtual=virtual, order=order)
    return relaid(stack, saved, out_shardings=jax.tree.map(lambda x: x.sharding, state))


def state_specs(tree, stages):
    """P(None, 'stage') on the stacked blocks, each device holding its stage's groups of layers;
    the embedding, the head and their Adam moments split over 'stage' along the first axis
    `stages` divides (whole if none does), gathered for the step; counters and the key P()."""

    def spec(path, x):
        path = jax.tree_util.keystr(path)
        if "'blocks'" in path:
            return P(None, "stage")
        axis = next((a for a, size in enumerate(x.shape) if size % stages == 0), None)
        split = path.startswith((".params", ".opt_state"))
        return P(*[None] * axis, "stage") if split and axis is not None else P()

    return jax.tree_util.tree_map_with_path(spec, tree)


def gather_embed_and_head(params, specs):
    """Everything but the blocks whole on every device (all-gathers over 'stage')."""

    def gather(x, spec):
        if "stage" not in spec:
            return x
        return lax.all_gather(x, "stage", axis=spec.index("stage"), tiled=True)

    return {k: v if k == "blocks" else jax.tree.map(gather, v, specs[k]) for k, v in params.items()}


def scatter_embed_and_head(grads, specs):
    """The inverse for the gradients, each summed over 'stage' (the embedding's from the first
    stage, the head's from the last), each device keeping its piece: reduce-scatters."""

    def scatter(g, spec):
        if "stage" not in spec:
            return lax.psum(g, "stage")
        return lax.psum_scatter(g, "stage", scatter_dimension=spec.index("stage"), tiled=True)

    return {k: v if k == "blocks" else jax.tree.map(scatter, v, specs[k]) for k, v in grads.items()}


def init_state(config, mesh, shapes_only=False):
    # Held as the pipeline holds them: the blocks stacked (common.create_state's `hold`)
    order = layer_order(config.schedule, config.layers, mesh.shape["stage"])
    stacked = functools.partial(stack_blocks, virtual=config.virtual(), order=order)
    create = functools.partial(common.create_state, config, common.make_model(config), stacked)
    # Each device computes only its own pieces: the full model never exists on one device.
    specs = state_specs(jax.eval_shape(create), mesh.shape["stage"])
    create = jax.jit(
        create, out_shardings=jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)
    )
    # The state itself, or only its shapes and shardings (nothing allocated) to compile for.
    return create.eval_shape() if shapes_only else create()


def run_blocks(blocks, x, rng, config, chunk=0, deltas=()):
    """The model's `chunk`-th group of blocks ([layers, ...]) on x: the output, the blocks' sums
    and (with `deltas`) their dense layers' inputs."""
    piece = common.make_model(config).defs["block"]

    def block(x, layer):
        block_params, i, delta = layer
        key, kept = None if rng is None else jax.random.fold_in(rng, i), []
        edit = functools.partial(keep_dense, deltas=delta, kept=kept) if deltas else lambda m: m
        x, stats = common.run_piece(piece, block_params, x, key, edit)
        return x, (stats, [x_in for _, x_in, _ in kept])

    layers = jax.tree.leaves(blocks)[0].shape[0]
    indices = chunk * layers + jnp.arange(layers)
    x, (stats, inputs) = lax.scan(block, x, (blocks, indices, deltas or None))
    return x, jax.tree.map(lambda s: s.sum(0), stats or {}), inputs  # sums over the blocks


def keep_dense(block, deltas, kept):
    """A split backward: the k-th nnx.Linear the block calls appends (its kernel's path, its
    input, its output) to `kept` and adds deltas[k] (zeros) to its output. The gradient of
    deltas[k] is the layer's output gradient dy: with x, all its kernel's x^T dy needs. Other
    layers (experts, norms) get their weights' gradient with the input's."""
    for path, layer in nnx.iter_modules(block):
        if type(layer) is nnx.Linear:

            def keep(x, kernel, *args, path=(*path, "kernel"), **kwargs):
                y = lax.dot_general(x, kernel, *args, **kwargs)
                kept.append((path, x, y))
                return y if deltas is None else y + deltas[len(kept) - 1]

            layer.dot_general = keep
    return block


def dense_calls(config, params, activation):
    """[(kernel path, input, output)] of every nnx.Linear a block calls, in order, as shapes."""
    block_params = jax.tree.map(lambda p: p[0, 0], params["blocks"])
    calls = []

    def run():
        keep = functools.partial(keep_dense, deltas=None, kept=calls)
        common.run_piece(
            common.make_model(config).defs["block"], block_params, activation, None, keep
        )
        return [(x, y) for _, x, y in calls]

    shapes = jax.eval_shape(run)
    return [(path, x, y) for (path, *_), (x, y) in zip(calls, shapes, strict=True)]


def group(params, v):
    """The parameters with group v's blocks only ([layers, ...])."""
    return {**params, "blocks": jax.tree.map(lambda p: p[v], params["blocks"])}


def in_group(grads, v, virtual):
    """A group's gradients as the stage's: group v's blocks, zeros for the others."""
    put = lambda g: jnp.zeros((virtual, *g.shape), g.dtype).at[v].set(g)  # noqa: E731
    return {**grads, "blocks": jax.tree.map(put, grads["blocks"])}


def with_kernels(tree, calls, kernels):
    """The tree with each dense kernel of its blocks (calls: dense_calls) set to `kernels`."""
    tree = jax.tree.map(lambda x: x, tree)  # its dicts copied
    for (path, *_), kernel in zip(calls, kernels, strict=True):
        functools.reduce(dict.__getitem__, path[:-1], tree["blocks"])[path[-1]] = kernel
    return tree


def kernels_of(tree, calls):
    """Each dense kernel of the tree's blocks, in the order of calls (dense_calls)."""
    return [functools.reduce(dict.__getitem__, path, tree["blocks"]) for path, *_ in calls]


def vjp_kept(fn, params, *args):
    """jax.vjp of fn, with what it keeps for the backward, less the parameters (found by
    identity), as a list, and how to make the vjp function again from params and that list."""
    out, vjp, aux = jax.vjp(fn, params, *args, has_aux=True)
    leaves, tree = jax.tree.flatten(vjp)
    where = {id(p): i for i, p in enumerate(jax.tree.leaves(params))}
    where = [where.get(id(leaf), -1) for leaf in leaves]

    def again(params, kept):
        kept, params = iter(kept), jax.tree.leaves(params)
        return jax.tree.unflatten(tree, [params[i] if i >= 0 else next(kept) for i in where])

    return out, aux, [leaf for leaf, i in zip(leaves, where, strict=True) if i < 0], again


def pack(arrays, sizes):
    """The arrays raveled into one vector per dtype, zero-padded to sizes[dtype]: one slot."""
    flat = {
        d: jnp.concatenate([jnp.zeros(0, d)] + [a.ravel() for a in arrays if a.dtype == d])
        for d in sizes
    }
    return {d: jnp.pad(v, (0, sizes[d] - v.size)) for d, v in flat.items()}


def unpack(slot, shapes):
    """The arrays of `shapes` back from a slot pack made."""
    at, arrays = dict.fromkeys(slot, 0), []
    for s in shapes:
        d = jnp.dtype(s.dtype).name
        arrays.append(slot[d][at[d] : at[d] + s.size].reshape(s.shape))
        at[d] += s.size
    return arrays


def slot_sizes(*layouts):
    """Per dtype, the most elements any layout (a list of shapes) packs into one slot."""
    dtypes = {jnp.dtype(s.dtype).name for shapes in layouts for s in shapes}
    count = lambda shapes, d: sum(s.size for s in shapes if jnp.dtype(s.dtype).name == d)  # noqa: E731
    return {d: max(count(shapes, d) for shapes in layouts) for d in dtypes}


def pipeline_gradients(params, batch, rng, config, table):
    """Run the schedule, tick by tick as `table` says: every stage's gradient of the mean loss of
    this device's rows, and the summed loss (on the last stage)."""
    stage, stages = lax.axis_index("stage"), lax.axis_size("stage")
    microbatches, virtual, keep = config.microbatches, config.virtual(), not config.remat
    # Micro-batch i takes rows i, i + m, i + 2m, ... (as common.accumulate_gradients does).
    pieces = batch.reshape(-1, microbatches, batch.shape[-1]).swapaxes(0, 1)
    # How many activations and gradients a stage keeps at once, the most any stage does.
    size = max(1, table[:, :, [FROM_BELOW, FROM_ABOVE, FROM_SELF]].max() + 1)
    # What passes between stages: the embedding's output, of the shape of every block's.
    model = common.make_model(config)
    defs = model.defs
    embed = lambda: common.run_piece(defs["embed"], params["embed"], pieces[0][:, :-1])  # noqa: E731
    activation = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(embed))
    ring = config.schedule == "interleaved"  # the last stage on to the first, and back
    up = [(s, (s + 1) % stages) for s in range(stages - 1 + ring)]
    down = [(b, a) for a, b in up]
    # The mean over this device's tokens
    loss_scale = 1.0 / (pieces.shape[0] * pieces.shape[1] * config.seq_len)

    # What the blocks report (a mixture of experts' routing), summed over the micro-batches.
    block_params = jax.tree.map(lambda p: p[0, 0], params["blocks"])
    block = lambda: common.run_piece(defs["block"], block_params, activation)[1]  # noqa: E731
    stats = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(block) or {})

    # A split backward (zero-bubble, zbv): B leaves each dense layer's input and output gradient
    split = bool((table[:, :, OP] == WEIGHT_GRAD).any())
    calls = dense_calls(config, params, activation) if split else []
    layers = jax.tree.leaves(params["blocks"])[0].shape[1]
    stacked = lambda a: jax.ShapeDtypeStruct((layers, *a.shape), a.dtype)  # noqa: E731
    inputs, outputs = [stacked(x) for _, x, _ in calls], [stacked(y) for *_, y in calls]
    deltas = [jnp.zeros(y.shape, y.dtype) for y in outputs]

    def stage_fn(g, tokens, key, chunk):
        """The model's `chunk`-th group (the embedding first on the first) as jax.vjp takes it:
        (parameters, input, deltas) -> (output, balance loss), (sums, dense layers' inputs).
        A split backward holds the dense kernels at g's: their gradients are W's."""
        kernels = kernels_of(g, calls)

        def fn(p, x, d):
            p = with_kernels(p, calls, kernels)
            embed = lambda: common.run_piece(defs["embed"], p["embed"], tokens[:, :-1], key)  # noqa: E731
            x = lax.cond(chunk == 0, embed, lambda: x)
            x, stats, inputs = run_blocks(p["blocks"], x, key, config, chunk, d)
            return (x, stats.get("aux_loss_sum", jnp.float32(0))), (stats, inputs)

        return fn

    # A kept slot: what a forward keeps for its backward (but --remat), then what B leaves W
    def kept_shapes():
        g, key = group(params, 0), rng if config.dropout > 0 else None
        return vjp_kept(stage_fn(g, pieces[0], key, stage), g, activation, deltas)[2]

    held = jax.eval_shape(kept_shapes) if keep else []
    sizes = slot_sizes(*[inputs + held] * keep, *[inputs + outputs] * split)
    count = max(1, table[:, :, KEPT].max() + 1)
    kept = {d: jnp.zeros((count, n), d) for d, n in sizes.items()}

    def tick(carry, row):
        made = {}  # the forward's vjp_kept rebuilder (lax.switch traces the forward first)
        slots, kept, grads, loss_sum, stats_sum = carry
        op, m, v, input_slot, gradient_slot, below, above, itself, kept_slot = row[stage]
        kept_slot, tokens = jnp.maximum(kept_slot, 0), pieces[m]
        chunk = chunk_of(config.schedule, stages, stage, v)
        key = jax.random.fold_in(rng, m) if config.dropout > 0 else None  # no key: no dropout
        none = lambda: jax.tree.map(jnp.zeros_like, params)  # noqa: E731
        nothing = {d: jnp.zeros(n, d) for d, n in sizes.items()}

        # Read inside the branches (XLA would copy them out first). Slot -1: none; the first
        # group reads the tokens.
        def x():
            return slots[jnp.maximum(input_slot, 0)]

        def idle():
            return jnp.zeros_like(activation), none(), nothing, jnp.float32(0), stats

        def forward():
            """The stage, keeping what its backward reads (--remat: nothing); on the last group
            the head, its backward too, and the loss's gradient sent to itself."""
            g, leavings, dense_in = group(params, v), [], []
            fn = stage_fn(g, tokens, key, chunk)
            if keep:
                (out, _), (sums, dense_in), leavings, made["again"] = vjp_kept(fn, g, x(), deltas)
            else:
                (out, _), (sums, _) = fn(g, x(), ())

            def head():  # a tied head reads the embedding's table: its gradient adds both uses
                def loss(p, y):
                    head = common.with_tied(p["head"], p["embed"], model.tied)
                    logits = common.run_piece(model.defs["head"], head, y, key)
                    return common.cross_entropy(logits, tokens[:, 1:]).sum()

                loss, vjp = jax.vjp(loss, params, out)
                return *vjp(jnp.float32(loss_scale))[::-1], loss

            on = lambda: (out, none(), jnp.float32(0))  # noqa: E731  (to the next group)
            sent, grad_params, loss = lax.cond(chunk == virtual * stages - 1, head, on)
            return sent, grad_params, pack(dense_in + leavings, sizes), loss, sums

        def backward_of():
            """The stage's jax.vjp, from what its forward kept (--remat: run again)."""
            g = group(params, v)
            if not keep:
                fn = stage_fn(g, tokens, key, chunk)
                _, vjp, (_, dense_in) = jax.vjp(fn, g, x(), deltas, has_aux=True)
                return vjp, dense_in
            mine = unpack({d: kept[d][kept_slot] for d in sizes}, inputs + held)
            return made["again"](g, mine[len(inputs) :]), mine[: len(inputs)]

        def backward():
            gradient = jnp.where(gradient_slot >= 0, slots[jnp.maximum(gradient_slot, 0)], 0)
            vjp, dense_in = backward_of()
            grad_params, grad_input, dense_grads = vjp((gradient, jnp.float32(loss_scale)))
            left = pack(dense_in + dense_grads, sizes) if split else nothing
            return grad_input, in_group(grad_params, v, virtual), left, jnp.float32(0), stats

        def weight_grad():
            """A split backward's W: each dense kernel's gradient, x^T dy, from what B kept."""
            xs_dys = unpack({d: kept[d][kept_slot] for d in sizes}, inputs + outputs)
            xs, dys = xs_dys[: len(calls)], xs_dys[len(calls) :]
            grads = [jnp.einsum("l...i,l...o->lio", x, dy) for x, dy in zip(xs, dys, strict=True)]
            grads = [
                g.astype(k.dtype) for g, k in zip(grads, kernels_of(params, calls), strict=True)
            ]
            blocks = in_group(with_kernels(group(none(), 0), calls, grads), v, virtual)
            return jnp.zeros_like(activation), blocks, nothing, jnp.float32(0), stats

        # Each op's work: only those the table has are compiled (XLA:CPU keeps each apart)
        backwards = {BACKWARD: backward}  # a split backward: the input's half, then the weights'
        backwards = {INPUT_GRAD: backward, WEIGHT_GRAD: weight_grad} if split else backwards
        ops = {IDLE: idle, FORWARD: forward, **backwards}
        branch = np.zeros(len(OPS), np.int32)  # op -> its branch of lax.switch
        branch[list(ops)] = np.arange(len(ops))
        sent, grad_params, left, loss, more = lax.switch(jnp.asarray(branch)[op], [*ops.values()])
        # What an op leaves for a later one, into its slot outside the branches (through: copied)
        if sizes:
            leaves = jnp.asarray((FORWARD,) * keep + (INPUT_GRAD,) * split)
            new = lambda: {d: kept[d].at[kept_slot].set(left[d]) for d in sizes}  # noqa: E731
            kept = lax.cond(jnp.isin(op, leaves), new, lambda: kept)
        # After each tick, what it made to the stages on both sides: each keeps what its table
        # says arrives (an activation on its way up the model, or a gradient on its way down;
        # the last group's forward the loss's gradient, to itself).
        arrived = [lax.ppermute(sent, "stage", up), lax.ppermute(sent, "stage", down), sent]
        put = lambda slots, i, x: slots.at[i].set(x)  # noqa: E731
        for slot, value in zip((below, above, itself), arrived, strict=True):
            slots = lax.cond(slot >= 0, put, lambda slots, *_: slots, slots, slot, value)
        grads = jax.tree.map(jnp.add, grads, grad_params)
        stats_sum = jax.tree.map(jnp.add, stats_sum, more)
        return (slots, kept, grads, loss_sum + loss, stats_sum), None

    carry = (
        jnp.zeros((size, *activation.shape), activation.dtype),
        kept,
        jax.tree.map(jnp.zeros_like, params),
        jnp.zeros((), jnp.float32),
        stats,
    )

    (_, _, grads, loss_sum, stats), _ = lax.scan(tick, carry, jnp.asarray(table))
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
    # The loss summed on the last stage, the blocks' sums on each; the tokens counted on each
    metrics = {
        **lax.psum(metrics, ("data", "stage")),
        "tokens": lax.psum(metrics["tokens"], "data"),
    }
    split = jax.tree.map(lambda spec: "stage" in spec, specs, is_leaf=lambda x: isinstance(x, P))
    norm = common.global_norm(common.learned(grads), split, "stage")
    state = state.apply_gradients(grads=common.clip(grads, norm, config.clip_norm))
    return state, {**metrics, "grad_norm": norm}


def eval_step(state, batch, config, specs):
    """Summed held-out losses of one device's rows: the stages one after another, each device
    running the whole model with the blocks of every stage gathered (no schedule, no backward)."""
    params = gather_embed_and_head(state.params, specs)
    params = {**params, "blocks": lax.all_gather(params["blocks"], "stage", axis=1, tiled=True)}
    order = layer_order(config.schedule, config.layers, lax.axis_size("stage"))
    params = unstack_blocks(params, order)
    return lax.psum(common.eval_metrics(state.replace(params=params), batch), "data")


def device_batch(batch, mesh):
    # This process's rows become one global array, split over 'data'.
    return jax.make_array_from_process_local_data(NamedSharding(mesh, BATCH_SPEC), batch)


def main(config):
    common.setup(config)
    mesh = make_mesh(config)
    dataset = common.load_dataset(config)
    stages, keep = mesh.shape["stage"], not config.remat
    table = make_schedule(config.schedule, stages, config.microbatches, config.virtual(), keep)
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
            # Stages run different code and take their gradients with jax.vjp: every sum over
            # devices is written by hand (train_step), no replication for check_vma to track.
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
    order = layer_order(config.schedule, config.layers, mesh.shape["stage"])
    saved = functools.partial(to_saved, order=order), functools.partial(from_saved, order=order)
    checkpoints = common.Checkpoints(config, *saved)
    state, start = checkpoints.restore(state)
    eval_data = [device_batch(b, mesh) for b in common.eval_batches(dataset, config)]
    bubble = float((table[:, :, OP] == IDLE).mean())
    report = {**common.cost_report(config, state, compiled, compile_seconds), "bubble": bubble}
    groups = f" ({config.virtual()} groups of layers per stage)" * (config.virtual() > 1)
    layout = f"mesh data={mesh.shape['data']},stage={mesh.shape['stage']}, {config.schedule}"
    layout += f"{groups} over {config.microbatches} micro-batches, {table.shape[0]} ticks, "
    layout += f"bubble {bubble:.0%}"
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
