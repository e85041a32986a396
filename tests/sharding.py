"""The strategy is real: a run's final state laid out as its script states, and its compiled
step holding the collectives that layout needs. test_equivalence.py's compare() calls check_real
on every run it compares; a TPU's ragged all-to-all by its definition, for XLA:CPU."""

import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import common
from tools import hlo
import context_parallel
import expert_parallel
import fsdp
import logical_pjit
import explicit_sharding
import pipeline
import pjit_tp
import pmap_dp
import shardmap_dp
from tests.harness import SMALL, STRATEGIES, replica_groups, state_bytes


# What each script splits the batch over (its data-parallel axes): a parameter not split over
# one of them has a copy on each of its devices, whose gradients must be summed across them.
BATCH_AXES = {
    pmap_dp: ("devices",),
    shardmap_dp: ("data",),
    fsdp: ("replica", "data"),
    pjit_tp: ("data",),
    pipeline: ("data",),
    context_parallel: ("data", "context"),
    expert_parallel: ("data", "expert"),
}
# Collectives written in shard_map
RULED = (logical_pjit, explicit_sharding)  # the scripts whose layout is rules on logical names
BY_HAND = (pmap_dp, shardmap_dp, fsdp, pipeline, context_parallel, expert_parallel)


def check_real(name, flags, result):
    """The run was the strategy it claims, whatever the model and flags: every parameter and its
    Adam moments laid out on every device as the script states it (check_layout), and the
    compiled step's collectives what that layout needs (check_collectives). compare() calls it
    on every run it compares, so that every strategy, preset and variant is checked."""
    module, strategy_flags = STRATEGIES[name]
    config = module.Config(**{**SMALL, **strategy_flags, **flags})
    specs, mesh = check_layout(module, config, result.state)
    check_collectives(module, config, result, specs, mesh)


def stated_specs(module, config, state) -> dict:
    """{parameter path: PartitionSpec}, as the script states each parameter's layout: its table
    (pjit_tp.py's PARAM_SPECS, and the model's own mesh axes), its rules (logical_pjit.py's RULES
    on the logical names; a mesh axis's name, itself), the
    axis its boxes name (fsdp.py), its stages (pipeline.py's state_specs), the experts' axis
    (expert_parallel.py's param_specs); P() where the script replicates."""
    leaves = jax.tree_util.tree_leaves_with_path(common.unbox(state.params))
    paths = [
        (jax.tree_util.keystr(path, simple=True, separator="/"), path, leaf)
        for path, leaf in leaves
    ]
    if module is pjit_tp:
        specs = pjit_tp.param_specs(config)
        return {name: pjit_tp.state_spec(path, leaf, specs) for name, path, leaf in paths}
    if module in RULED:
        rules = (*module.RULES[config.rules], *((axis, axis) for axis in config.mesh_axes()))
        return {
            path: nn.logical_to_mesh_axes(box.names, rules)
            for path, box in common.logical_names(config)
        }
    if module is fsdp:
        boxes = jax.tree_util.tree_leaves_with_path(state.params, is_leaf=fsdp.is_sharded)
        return {
            jax.tree_util.keystr(path, simple=True, separator="/"): fsdp.mesh_specs(box)
            for path, box in boxes
        }
    if module is pipeline:
        stages = jax.tree.leaves(state.params)[0].sharding.mesh.shape["stage"]
        specs = jax.tree.leaves(
            pipeline.state_specs(state, stages).params, is_leaf=lambda x: isinstance(x, P)
        )
        return {name: spec for (name, _, _), spec in zip(paths, specs, strict=True)}
    if module is expert_parallel:
        return dict(expert_parallel.param_specs(config))
    return {name: P() for name, _, _ in paths}  # data parallelism: a whole copy on every device


def mesh_of(module, state):
    """The run's mesh; pmap_dp.py's devices as a one-axis mesh named 'devices'."""
    if module is pmap_dp:
        return jax.sharding.Mesh(np.array(jax.devices()), ("devices",))
    return jax.tree.leaves(state.params)[0].sharding.mesh


def check_layout(module, config, state):
    """Every parameter's piece on every device is the shape its stated PartitionSpec gives;
    each of its Adam moments (an optimizer-state leaf whose path ends with the parameter's) the
    same; everything else in the state whole. So the state's bytes per device are the layout's
    prediction, leaf by leaf. Returns the stated specs and the mesh."""
    mesh = mesh_of(module, state)
    specs = stated_specs(module, config, state)
    params = dict(
        (jax.tree_util.keystr(path, simple=True, separator="/"), leaf)
        for path, leaf in jax.tree_util.tree_leaves_with_path(common.unbox(state.params))
    )
    assert set(params) == set(specs), set(params) ^ set(specs)

    def piece(path, shape):  # the shape each device should hold of a leaf of this shape
        if module is pmap_dp:  # one copy per device, stacked: a device holds one
            return shape[1:]
        return NamedSharding(mesh, specs[path]).shard_shape(shape) if path else shape

    def check(path, where, leaf):
        expected = piece(path, leaf.shape)
        for shard in leaf.addressable_shards:
            held = shard.data.shape[1:] if module is pmap_dp else shard.data.shape
            assert held == expected, (
                f"{where} {leaf.shape}: {held} on {shard.device}, stated {expected}"
            )

    predicted = 0
    for path, leaf in params.items():
        check(path, f"parameter {path}", leaf)
        predicted += math.prod(piece(path, leaf.shape)) * leaf.dtype.itemsize
    for path, leaf in jax.tree_util.tree_leaves_with_path(common.unbox(state.opt_state)):
        where = jax.tree_util.keystr(path, simple=True, separator="/")
        of = max(
            (p for p in params if where.endswith("/" + p) and params[p].shape == leaf.shape),
            key=len,
            default=None,
        )
        check(of, f"optimizer state {where}", leaf)
        predicted += math.prod(piece(of, leaf.shape)) * leaf.dtype.itemsize
    check(None, "step", state.step)
    _, per_device = state_bytes(state)
    assert per_device == predicted, (
        f"{per_device:,} state bytes on device 0, the layout predicts {predicted:,}"
    )
    return specs, mesh


def device_groups(mesh, axes):
    """The groups of devices (their places in the mesh, as XLA numbers them) that differ only
    along `axes`: one group per combination of the other axes."""
    ids = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
    varying = [mesh.axis_names.index(axis) for axis in axes]
    kept = [i for i in range(ids.ndim) if i not in varying]
    ids = ids.transpose(kept + varying).reshape(-1, math.prod(ids.shape[i] for i in varying))
    return {frozenset(row.tolist()) for row in ids}


def covers(groups, needed):
    """Whether a collective over `groups` reaches across each of the `needed` groups."""
    return groups is not None and all(any(g <= group for group in groups) for g in needed)


def check_collectives(module, config, result, specs, mesh):
    """The compiled step's collectives are what the stated layout needs.

    Every gradient is summed across the devices holding copies of the same piece of its
    parameter: those along the batch's axes that the parameter is not split over (an all-reduce
    of the piece), and, where it is split along one of them (FSDP), across those too (a
    reduce-scatter of the whole). In the scripts that write their collectives by hand, the
    bytes these move per step are at least the layout's prediction; under jax.jit, where the
    compiler may reduce another way (an all-to-all of activations instead, say), such a
    collective must be there. Then each strategy's own: FSDP's all-gathers of its shards, the
    pipeline's two collective-permutes per tick between neighbouring stages, ring attention's
    hops, expert parallelism's all-to-alls, Megatron's activation all-reduces over 'model'."""
    found = []
    for c in hlo.hlo_collectives(result.compiled.as_text()):
        groups = replica_groups(c["line"])
        found.append(
            (
                c["op"],
                {frozenset(g) for g in groups} if groups else None,
                c["runs"],
                c["bytes"],
                c["line"],
            )
        )
    ops = {op for op, *_ in found}
    batch = BATCH_AXES.get(module) or logical_batch_axes(module, config)
    batch = [axis for axis in batch if axis in mesh.axis_names and mesh.shape[axis] > 1]
    params = {
        jax.tree_util.keystr(path, simple=True, separator="/"): leaf
        for path, leaf in jax.tree_util.tree_leaves_with_path(common.unbox(result.state.params))
    }
    needed = {}  # (device groups, op) -> bytes per step
    for path, leaf in params.items():
        shape = (
            leaf.shape[1:]
            if module is pmap_dp
            else NamedSharding(mesh, specs[path]).shard_shape(leaf.shape)
        )
        held = math.prod(shape) * leaf.dtype.itemsize
        split = set(jax.tree.leaves(tuple(specs[path]))) if module is not pmap_dp else set()
        if copies := [axis for axis in batch if axis not in split]:
            key = frozenset(device_groups(mesh, copies))
            needed[key] = needed.get(key, 0) + held
        # Split along a batch axis: FSDP gathers it for use, so its gradient is reduce-scattered
        # whole; expert parallelism brings the tokens to it instead (the all-to-alls, below).
        if (pieces := [axis for axis in batch if axis in split]) and module is not expert_parallel:
            key = frozenset(device_groups(mesh, pieces))
            needed[key] = needed.get(key, 0) + held * math.prod(mesh.shape[axis] for axis in pieces)
    reductions = (
        ("all-reduce", "reduce-scatter")
        if module in BY_HAND
        else ("all-reduce", "reduce-scatter", "all-to-all")
    )
    for groups, size in needed.items():
        moved = sum(
            runs * nbytes
            for op, g, runs, nbytes, _ in found
            if op in reductions and covers(g, groups)
        )
        what = f"gradient reduction across {sorted(map(sorted, groups))}"
        if module in BY_HAND:
            assert moved >= size, f"{what}: {moved:,} bytes per step, the layout needs {size:,}"
        else:
            assert moved > 0, f"{what}: none in the compiled step"
    layers, micro = config.layers, config.microbatches

    def count(op, groups=None):
        return sum(runs for o, g, runs, *_ in found if o == op and (groups is None or g == groups))

    if module in (pmap_dp, shardmap_dp):
        assert ops <= {"all-reduce"}, ops
    if module is fsdp:  # every shard gathered whole; a block's at least once per micro-batch,
        # or (--keep-gathered) every shard once a step
        data = device_groups(mesh, ["data"])
        split = {p for p in params if "data" in jax.tree.leaves(tuple(specs[p]))}
        shards = {p: x.nbytes for p, x in params.items() if p in split}
        blocks = sum(nbytes for path, nbytes in shards.items() if path.startswith("block"))
        gathered = sum(
            runs * nbytes for op, g, runs, nbytes, _ in found if op == "all-gather" and g == data
        )
        # (XLA may keep a loop-invariant gather outside the blocks across the micro-batches)
        if config.keep_gathered:
            assert gathered == sum(shards.values())
        else:
            assert gathered >= sum(shards.values()) + (micro - 1) * blocks
        assert ops <= {"all-reduce", "all-gather", "reduce-scatter"}
    if module is pipeline:  # two per tick: what each stage made, to the stages on both sides
        stages = mesh.shape["stage"]
        table = pipeline.make_schedule(config.schedule, stages, micro, config.virtual())
        permutes = [
            (pairs_of(line), runs) for op, _, runs, _, line in found if op == "collective-permute"
        ]
        assert sum(runs for _, runs in permutes) == 2 * len(table)
        neighbours = {(s, s + 1) for s in range(stages - 1)} | (
            {(stages - 1, 0)} if config.schedule == "interleaved" else set()  # (zbv turns)
        )
        # Stage is the inner axis: stage s of data row r is device r * stages + s
        row = mesh.shape["stage"]
        ring = {
            (r * row + a, r * row + b) for r in range(mesh.shape["data"]) for a, b in neighbours
        }
        assert all(pairs in (ring, {(b, a) for a, b in ring}) for pairs, _ in permutes)
    if module is context_parallel:
        context, split = frozenset(device_groups(mesh, ["context"])), config.attention_split
        rows = config.batch_size // mesh.shape["data"] // micro
        # One key's or value's block of a device, and the whole sequence's: float32 (ring and
        # all-gather compute in it), or the compute dtype (Ulysses sends the activations as are)
        block = rows * config.seq_len // mesh.shape["context"] * config.d_model
        kv_block = block // config.heads * (config.kv_heads or config.heads)  # grouped-query: fewer
        sizes = [nbytes for op, g, _, nbytes, _ in found if g == context and op != "all-reduce"]
        if split == "ring":  # per layer N - 1 hops of a key and a value block, and back
            hops = layers * 2 * 2 * (mesh.shape["context"] - 1) * micro
            assert count("collective-permute") == hops, (count("collective-permute"), hops)
            moved = {"collective-permute"}
        elif split == "all-gather":  # per layer the keys and values gathered, their grads back
            gathered, n = kv_block * mesh.shape["context"] * 4, 2 * layers * micro
            if not config.experts:  # (whose routing gathers over 'context' too)
                assert count("all-gather", context) == count("reduce-scatter", context) == n
                assert set(sizes) == {gathered}, (sizes, gathered)
            moved = {"all-gather", "reduce-scatter"}
        else:  # Ulysses: per layer q, k, v to a head split and the output back, and backward
            assert count("all-to-all", context) == 8 * layers * micro, count("all-to-all", context)
            if not config.experts:  # in the compute dtype; XLA:CPU sends bfloat16 as float32
                itemsize = jnp.dtype(config.dtype).itemsize
                assert set(sizes) <= {b * n for b in (block, kv_block) for n in (itemsize, 4)}
            moved = {"all-to-all"}
        allowed = (
            {"all-reduce"} | moved | ({"all-gather", "reduce-scatter"} if config.experts else set())
        )
        assert ops <= allowed, ops
    if module is expert_parallel:
        expert = frozenset(device_groups(mesh, ["expert"]))
        if config.capacity_factor:  # per block, the tokens' slots out and back, forward and back
            assert count("all-to-all", expert) == 4 * layers * micro
            assert ops <= {"all-reduce", "all-to-all"}, ops
        elif expert_parallel.ragged_all_to_all() is None:  # dropless, per block: the group's
            # tokens, choices and gates gathered, their outputs reduce-scattered back; backward,
            # the reverse of each (none for the choices)
            assert count("all-gather", expert) == 4 * layers * micro
            assert count("reduce-scatter", expert) == 3 * layers * micro
            assert ops <= {"all-reduce", "all-gather", "reduce-scatter"}, ops
    tensor_parallel = module is pjit_tp or (
        module in RULED and dict(module.RULES[config.rules]).get("mlp")
    )
    # Megatron: per block, 2 forward and 2 backward at least; attention's alone where the MLP is
    # a TPU's grouped matmul, each device its rows with the experts' kernels whole (megablox's)
    if tensor_parallel and mesh.shape["model"] > 1:
        kernel = config.experts and not config.capacity_factor
        kernel = kernel and common.grouped_matmul() is not jax.lax.ragged_dot_general
        per_block = 2 if kernel else 4
        assert count("all-reduce", frozenset(device_groups(mesh, ["model"]))) >= per_block * layers
    if module in RULED:  # a parameter split over the batch's axes is gathered for use (FSDP)
        for path, spec in specs.items():
            gathered = [axis for axis in jax.tree.leaves(tuple(spec)) if axis in batch]
            if gathered:
                groups = frozenset(device_groups(mesh, gathered))
                assert any(op == "all-gather" and covers(g, groups) for op, g, *_ in found), path


def logical_batch_axes(module, config):
    axes = dict(module.RULES[config.rules])["batch"]
    return (axes,) if isinstance(axes, str) else axes


def pairs_of(line):
    """A collective-permute's (source, target) pairs."""
    return {
        tuple(map(int, p))
        for p in re.findall(r"\{(\d+),(\d+)\}", line.split("source_target_pairs=")[1])
    }


def ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name
):
    """jax.lax.ragged_all_to_all by its definition, from an all-gather: XLA:CPU cannot run it.
    Each device i writes operand_i[input_offsets_i[j]:][:send_sizes_i[j]] into device j's
    output at output_offsets_i[j]; the rest of the output stays as it was. The op types its
    result as `output` is: it must vary as the operand does."""
    varying = [jax.typeof(x).manual_axis_type.varying for x in (operand, output)]
    assert varying[0] <= varying[1], varying
    me, n = lax.axis_index(axis_name), lax.axis_size(axis_name)
    every = (operand, input_offsets, send_sizes, output_offsets)
    operands, starts, sizes, ats = lax.all_gather(every, axis_name)
    place = jnp.arange(output.shape[0])
    for i in range(n):
        offset = place - ats[i, me]
        came = (offset >= 0) & (offset < sizes[i, me])
        row = operands[i][jnp.clip(starts[i, me] + offset, 0, operand.shape[0] - 1)]
        output = jnp.where(came.reshape(-1, *[1] * (output.ndim - 1)), row, output)
    return output
