"""Every strategy computes what one device computes, and really shards what it claims.

On 8 emulated CPU devices (conftest.py), float32 and dropout 0, each script and each logical
rules preset trains a small model for 20 steps and is compared with a single-device
reference: plain jax.jit on one device, the same model, data, optimizer and seed. Then the
final state's shardings and the collectives in the compiled step show that the work was
really split the way the script says, so a script that silently ran on one device could not
pass. Last, each script runs as 2 processes of 4 devices and matches 1 process of 8.

Everything else (the cost report, the data, the command line, checkpoints, faults, the
documentation) is tested in tests/, one file per concern; tests/harness.py runs the scripts.
"""

import functools
import json
import re
import typing

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import common
import context_parallel
import fsdp
import pipeline
import pjit_tp
from tests.harness import (
    ALL, DATA_GROUPS, DEFAULTS, DEVICES, EVERY_SCRIPT, MODEL_GROUPS, PROCESSES, RTOL, SMALL, STRATEGIES,
    as_flags, cluster, collectives, matrix, model_flags, MOE, replica_groups, run, run_uncached, shard_shapes,
    state_bytes, wait_ok,
)  # fmt: skip


class Reference(typing.NamedTuple):
    losses: list  # every step's mean loss
    grad_norms: list  # every step's global gradient norm, before clipping
    state: common.TrainState  # the final state
    conditioned: dict  # per parameter element: were its Adam steps insensitive to rounding?
    router: list  # a mixture of experts' routing, every step (common.routing)


# AdamW moves an element by m / (sqrt(v) + eps), m and v being running means of its gradient
# and squared gradient. A strategy sums a gradient in another order than one device, so each
# element of it differs by a rounding difference d, of the order of the gradient's typical
# size times float32's precision, and its step by about d / (sqrt(v) + eps). For almost every
# element that is the gradient's relative difference, about 1e-6. An element whose only
# gradients were tiny has sqrt(v) near eps, and there d is a sizeable part of it: with
# --vocab-size 4096, a token seen once whose gradient happened to be 1e-9 to 1e-8 (eps is
# 1e-8) ended up 1.3e-4 apart (on an element of 0.02) on an AVX2 CPU, and 1e-5 by norm for the
# whole embedding; how much shows depends on the CPU's rounding, not on the strategy. So final
# parameters are compared on the elements whose sqrt(v) stayed at or above CONDITIONED times
# the model's typical sqrt(v) (its root mean square) at every step that gave them a gradient.
# Measured on the reference runs below: below 1e-4 of the typical sqrt(v) lie all the elements
# that differ by more than 1e-5 (0.09% of the model with --vocab-size 4096); at 1e-4, 3e-4 and
# 1e-3 the worst parameter differs by the same 2.6e-6. The elements left out, which the
# reference alone decides, are counted and must stay a small share of the model.
CONDITIONED = 1e-4
ILL_CONDITIONED_SHARE = 0.01  # measured: 0.09% (--vocab-size 4096) to 0.37% (8 layers)


@functools.cache
def reference(**overrides):
    """The same training, with no parallelism at all: plain jax.jit on one device."""
    config = common.Config(**{**SMALL, **overrides})
    dataset = common.load_dataset(config)
    state = jax.jit(functools.partial(common.create_state, config, common.make_model(config)))()

    @jax.jit
    def train_step(state, batch, conditioned):
        grads, metrics = common.accumulate_gradients(
            state, batch, jax.random.fold_in(state.rng, state.step), config.microbatches
        )
        state = state.apply_gradients(grads=grads)
        adam = state.opt_state[1][0]  # after the clipping's state: optax.scale_by_adam's
        v = jax.tree.leaves(optax.tree.bias_correction(adam.nu, common.ADAM["b2"], adam.count))
        typical = jnp.sqrt(sum(x.sum() for x in v) / sum(x.size for x in v))
        v = jax.tree.unflatten(jax.tree.structure(adam.nu), v)
        conditioned = jax.tree.map(
            lambda c, g, v: c & ((g == 0) | (jnp.sqrt(v) >= CONDITIONED * typical)), conditioned, grads, v
        )
        return state, metrics, conditioned

    losses, grad_norms, router = [], [], []
    conditioned = jax.tree.map(lambda p: jnp.ones(p.shape, bool), state.params)
    for step in range(config.steps):
        state, metrics, conditioned = train_step(state, dataset.batch(step, 0, config.batch_size), conditioned)
        losses.append(float(metrics["loss_sum"]) / float(metrics["tokens"]))
        grad_norms.append(float(common.gradient_norm(state)))
        if config.experts:
            router.append(common.routing(metrics, config.layers))
    assert len(jax.tree.leaves(state.params)[0].devices()) == 1
    return Reference(losses, grad_norms, state, jax.tree.map(np.asarray, conditioned), router)


def global_params(name, state):
    """The parameters as plain global numpy arrays, whatever the strategy's layout."""
    params = nn.unbox(state.params)  # fsdp.py's nn.Partitioned boxes hold global arrays
    if name.startswith("pipeline"):  # its blocks stacked, each stage holding its own
        params = pipeline.unstack_blocks(params)
    if name.split()[0] == "pmap_dp":  # one stacked copy per device: check they agree, keep one
        for leaf in jax.tree.leaves(params):
            copies = np.asarray(leaf)
            assert copies.shape[0] == DEVICES and (copies == copies[0]).all()
        params = jax.tree.map(lambda x: x[0], params)
    return jax.tree.map(np.asarray, params)


def relative(mine, ref):
    """The largest difference between two lists of numbers, relative to the reference's."""
    return max(abs(a - b) / abs(b) for a, b in zip(mine, ref, strict=True))


def compare(name, result, ref, rtol=(RTOL, RTOL, RTOL), routing=True):
    """Per-step losses and gradient norms, and final parameters, against the reference, all
    relative: the difference over the reference's value, and for each parameter
    ||mine - ref|| / ||ref|| over its elements whose Adam steps were well conditioned (see
    CONDITIONED)."""
    loss_diff, norm_diff = relative(result.losses, ref.losses), relative(result.grad_norms, ref.grad_norms)
    mine, theirs = global_params(name, result.state), global_params("reference", ref.state)
    assert jax.tree.structure(mine) == jax.tree.structure(theirs)
    triples = list(zip(jax.tree.leaves(mine), jax.tree.leaves(theirs), jax.tree.leaves(ref.conditioned), strict=True))
    param_diff = max(np.linalg.norm((a - b)[keep]) / np.linalg.norm(b[keep]) for a, b, keep in triples if keep.any())
    abs_diff = max(np.abs(a - b).max() for a, b, _ in triples)
    left_out = sum((~keep).sum() for *_, keep in triples) / sum(keep.size for *_, keep in triples)
    print(
        f"\n{name}: loss {loss_diff:.1e}, gradient norm {norm_diff:.1e}, parameters {param_diff:.1e} "
        f"(largest |difference| {abs_diff:.1e}; {left_out:.2%} of elements ill-conditioned, left out)"
    )
    assert loss_diff <= rtol[0] and norm_diff <= rtol[1] and param_diff <= rtol[2]
    assert left_out <= ILL_CONDITIONED_SHARE
    if routing:
        compare_routing(name, result.router, ref.router)


def compare_routing(name, mine, ref):
    """A mixture of experts routes exactly as one device does: per step, the same fewest and
    most tokens per expert and the same tokens dropped (counts, equal to the token), and the
    load-balancing loss within RTOL. A token's experts are its top-k router probabilities: a
    rounding difference could only change them where two of them tie to within it; the
    closest call in these runs was 1.7e-6 apart (relative), 17 times float32's 1e-7."""
    assert len(mine) == len(ref)
    if not ref:
        return
    counts = ("expert_tokens_min", "expert_tokens_max", "dropped_share")
    assert [[step[key] for key in counts] for step in mine] == [[step[key] for key in counts] for step in ref]
    aux_diff = relative([step["aux_loss"] for step in mine], [step["aux_loss"] for step in ref])
    print(f"{name}: routing the same at every step, load-balancing loss {aux_diff:.1e}")
    assert aux_diff <= RTOL


@pytest.mark.parametrize("name", STRATEGIES)
def test_matches_single_device_reference(name):
    compare(name, run(name), reference(**model_flags(name)))
    assert run(name).losses[-1] < run(name).losses[0] - 1  # and it learned something


DENSE = [name for name in STRATEGIES if not name.startswith("expert")]  # the strategies of any model


@pytest.mark.parametrize("name", matrix(DENSE, EVERY_SCRIPT))
def test_a_mixture_of_experts_matches(name):
    """Every other strategy trains the mixture of experts too (its expert weights split as any
    parameter of theirs), and routes it as one device does."""
    compare(f"{name} {as_flags(MOE)}", run(name, **MOE), reference(**MOE, **model_flags(name)))


# What a user adds to pjit_tp.py's PARAM_SPECS to train tests/llama.py (the other scripts need
# nothing): its parameters' names, in the Megatron layout.
LLAMA_SPECS = (
    (r"/(q|gate|up)/kernel", P(None, "model")),  # by output columns: whole heads, hidden units
    (r"/(o|down)/kernel", P("model", None)),  # by input rows: partial sums
    (r"/kv/kernel", P()),  # 2 key/value heads, fewer than model=4: kept whole, as Megatron does
    (r"norm/scale", P()),
)


@pytest.mark.parametrize("name", matrix(DENSE, EVERY_SCRIPT))
def test_a_model_the_scripts_do_not_know_matches(name, monkeypatch):
    """tests/llama.py (RMSNorm, rotary positions, SwiGLU, no biases, untied head, grouped-query
    attention) through every script and preset, against one device training it."""
    monkeypatch.setattr(pjit_tp, "PARAM_SPECS", LLAMA_SPECS + pjit_tp.PARAM_SPECS)
    compare(name, run_uncached(name, model="tests.llama"), reference(model="tests.llama", **model_flags(name)))


@pytest.mark.parametrize("name", ["expert_parallel", "context_parallel"])
def test_the_same_tokens_are_dropped(name):
    """With capacity for half the tokens, about half the choices are dropped: the same ones as on
    one device, where each device holds some of a sequence's tokens (context_parallel.py) or
    sends them to other devices' experts (expert_parallel.py)."""
    flags = {**MOE, "capacity_factor": 0.5, "steps": 10}
    ref = reference(**flags)
    assert min(step["dropped_share"] for step in ref.router) > 0.3
    compare(f"{name} --capacity-factor 0.5", run(name, **flags), ref)


# Micro-batches are common.accumulate_gradients in every script but pipeline.py (its schedule):
# one script per way of splitting the rows (by hand in shard_map, by the compiler's shardings),
# and those that split a sequence or send tokens to experts.
MICRO = ["shardmap_dp", "pjit_tp", "pipeline_1f1b", "context_parallel", "expert_parallel"]


@pytest.mark.parametrize("name", matrix(list(DEFAULTS.values()), MICRO))
def test_microbatches_match(name):
    result = run(name, microbatches=4, batch_size=32)
    compare(f"{name} --microbatches 4", result, reference(batch_size=32, **model_flags(name)))


@pytest.mark.parametrize("name", ["fsdp", "pjit_tp", "logical_fsdp_tp"])  # the scripts that handle scanning
def test_scanned_layers_match(name):
    result = run(name, scan_layers=True)
    scanned = reference(scan_layers=True)
    compare(f"{name} --scan-layers", result, reference()._replace(state=scanned.state, conditioned=scanned.conditioned))


def test_remat_matches():
    for name in ("shardmap_dp", "fsdp", "logical_fsdp_tp"):
        compare(f"{name} --remat", run(name, remat=True), reference())


# The logical presets take the norm as pjit_tp.py does (the compiler, from the shardings): one
# of them stands for all; so does one of expert_parallel.py's meshes.
CLIPPED = [name for name in STRATEGIES if name not in ("logical_dp", "logical_fsdp", "logical_hsdp", "logical_tp")]


@pytest.mark.parametrize("name", [name for name in CLIPPED if name != "expert_parallel_8"])
def test_clipping_matches(name):
    """Clipping by the global norm, with a threshold so low that it binds on every step: the
    norm is over the whole model, whatever piece of the gradient each device holds."""
    ref = reference(clip_norm=0.05, steps=10, **model_flags(name))
    assert min(ref.grad_norms) > 0.05  # it clips every step
    compare(f"{name} --clip-norm 0.05", run(name, clip_norm=0.05, steps=10), ref)


@pytest.mark.parametrize("name", ["pjit_tp", "logical_tp"])
def test_vocabulary_is_split_over_model(name):
    """The token embedding and the head split along the vocabulary, a quarter per 'model'
    device; the loss needs no all-gather of logits-sized arrays."""
    result, d = run(name, vocab_size=4096), SMALL["d_model"]
    shapes = shard_shapes(result)
    assert shapes["embed/token/embedding"] == (4096 // 4, d) and shapes["head/out/kernel"] == (d, 4096 // 4)
    quarter_logits = SMALL["batch_size"] // 2 * SMALL["seq_len"] * 4096 // 4 * 4  # float32, data=2
    gathers = [c["bytes"] for c in common.hlo_collectives(result.compiled.as_text()) if c["op"] == "all-gather"]
    print(f"\n{name} --vocab-size 4096: all-gathers {gathers} bytes; a device's logits {quarter_logits:,} bytes")
    assert all(size < quarter_logits / 4 for size in gathers)
    compare(f"{name} --vocab-size 4096", result, reference(vocab_size=4096))


# Each schedule on a deeper pipeline (all run on data=4,stage=2 above): --mesh, --layers; the
# others with -m full. Interleaved: two groups of layers per stage, so twice the layers.
PIPELINES = [("gpipe", "data=2,stage=4", 4), ("1f1b", "data=1,stage=8", 8), ("interleaved", "data=2,stage=4", 8)]
PIPELINES += [("zero-bubble", "data=2,stage=4", 4), ("zero-bubble", "data=1,stage=8", 8)]
PIPELINES += [("interleaved", "data=1,stage=8", 16)]


@pytest.mark.parametrize(
    "schedule, mesh, layers", matrix(PIPELINES, PIPELINES[:3]), ids=[f"{s}-{m}" for s, m, _ in PIPELINES]
)
def test_pipeline_matches(schedule, mesh, layers):
    result = run(f"pipeline_{schedule}", mesh=mesh, layers=layers, microbatches=8)
    compare(f"pipeline {schedule} --mesh {mesh}", result, reference(layers=layers))


def test_context_parallel_matches_on_eight():
    compare("context_parallel --mesh data=1,context=8", run("context_parallel", mesh="data=1,context=8"), reference())


# --dtype bfloat16: activations and matmuls in bfloat16; parameters, Adam's moments, the loss,
# softmax statistics and the router in float32. Two bfloat16 runs of the same step that sum in
# another order differ by bfloat16's rounding (8 bits: 4e-3 per value), far above float32's, so
# the bounds are bfloat16's: measured over 5 steps on every strategy (AMD EPYC, JAX 0.10.2),
# the largest differences from the bfloat16 reference were loss 1.7e-5, gradient norm 2.7e-3
# and parameters 2.5e-2 (pipeline interleaved, on its 4 layers: 8.3e-6, 3.6e-3 and 2.9e-2); the reference itself with --microbatches 2 (the same sums, in
# another order) differs from it by 1.6e-5, 1.3e-3 and 2.8e-2, and the float32 reference by
# 2.3e-5, 2.5e-3 and 2.1e-2. Each bound is about twice the largest of these. A strategy off by
# a constant factor in its gradient (a sum where a mean belongs) would be 100% off in the norm.
# A mixture of experts moves more: a token whose two best experts' router scores tie to within
# bfloat16's rounding may go to the other one. Measured the same way (expert_parallel on both
# meshes, and fsdp, pjit_tp and context_parallel training it): at most 1.4e-4, 4.5e-3 and 0.14;
# --microbatches 2 6.6e-5, 2.5e-3 and 6.6e-2; float32 1.1e-4, 4.3e-3 and 0.12.
BF16 = {"dtype": "bfloat16", "steps": 5}
BF16_RTOL = (5e-5, 6e-3, 6e-2)  # loss, gradient norm, parameters
BF16_MOE_RTOL = (3e-4, 1e-2, 0.3)


@pytest.mark.parametrize("name", matrix(list(STRATEGIES), EVERY_SCRIPT))
def test_bfloat16_matches(name):
    """Every strategy in bfloat16 against one device in bfloat16. A mixture of experts' routing
    is not compared token for token: in bfloat16 two experts' router scores can tie to within
    the rounding, and which of them wins may differ (the losses still agree)."""
    ref = reference(**BF16, **model_flags(name))
    result = run(name, **BF16)
    rtol = BF16_MOE_RTOL if model_flags(name) else BF16_RTOL
    compare(f"{name} --dtype bfloat16", result, ref, rtol, routing=False)
    assert jax.tree.leaves(result.state.params)[0].dtype == jnp.float32  # the parameters stay float32


# ----------------------------------------------------------------------------------------------
# The strategy is real: shardings of the final state, collectives in the compiled step
# ----------------------------------------------------------------------------------------------


def test_pmap_replicates():
    result = run("pmap_dp")
    for leaf in jax.tree.leaves(result.state.params):
        assert leaf.shape[0] == DEVICES and len(leaf.sharding.device_set) == DEVICES
    ops = collectives(result.compiled)
    assert ALL in ops["all-reduce"]
    assert "all-gather" not in ops and "reduce-scatter" not in ops


def test_shardmap_dp_replicates():
    result = run("shardmap_dp")
    for leaf in jax.tree.leaves((result.state.params, result.state.opt_state)):
        assert leaf.sharding.is_fully_replicated and len(leaf.sharding.device_set) == DEVICES
    ops = collectives(result.compiled)
    assert ALL in ops["all-reduce"]
    assert "all-gather" not in ops and "reduce-scatter" not in ops


def test_fsdp_shards_parameters_and_optimizer_state():
    result = run("fsdp")
    config = fsdp.Config(**SMALL)
    params = result.state.params
    sharded = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(params, is_leaf=fsdp.is_sharded):
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        value = leaf.value if fsdp.is_sharded(leaf) else leaf
        if value.size >= config.min_shard_size:
            assert fsdp.is_sharded(leaf), name
            axis = leaf.names.index("data")
            expected = value.shape[:axis] + (value.shape[axis] // DEVICES,) + value.shape[axis + 1 :]
            assert value.addressable_data(0).shape == expected, name
            sharded += 1
        else:
            assert value.sharding.is_fully_replicated, name
    assert sharded >= 6 * SMALL["layers"]  # every kernel of every block, at least
    leaves = jax.tree.leaves((result.state.params, result.state.opt_state), is_leaf=fsdp.is_sharded)
    expected = sum(x.value.nbytes // DEVICES if fsdp.is_sharded(x) else x.nbytes for x in leaves)
    total, per_device = state_bytes(result.state)
    print(f"\nfsdp: {per_device} of {total} state bytes on device 0 ({per_device / total * DEVICES:.3f} x total/8)")
    assert per_device == expected  # shards are exactly 1/8; only the small parameters are whole
    ops = collectives(result.compiled)
    assert ALL in ops["all-gather"] and ALL in ops["reduce-scatter"]


def primitive_count(jaxpr, name):
    """How many times a primitive runs in a jaxpr, counting inside every nested jaxpr."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == name
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    count += primitive_count(sub, name)
    return count


@pytest.mark.parametrize("keep", [False, True], ids=["gathers-again", "keep-gathered"])
def test_fsdp_gathers_again_for_the_backward_pass_unless_told_to_keep(keep):
    """By default each sharded matmul kernel is all-gathered for the forward pass and again for
    the backward (its input gradient needs it), rather than kept alive in between; every other
    parameter only once: the backward pass of an embedding, a bias or a LayerNorm does not need
    the parameter itself. With --keep-gathered, every parameter once. Both in the program JAX
    hands to XLA and in the compiled step, the program that runs (common.CPU_COMPILER_OPTIONS
    keeps XLA:CPU from merging the two gathers), and both train as one device does."""
    config = fsdp.Config(**SMALL, keep_gathered=keep)
    result = run("fsdp", keep_gathered=True) if keep else run("fsdp")
    mesh, state = fsdp.make_mesh(config), result.state
    spec = fsdp.mesh_specs(state)
    step_fn = jax.jit(
        jax.shard_map(
            functools.partial(fsdp.train_step, microbatches=1),
            mesh=mesh,
            in_specs=(spec, fsdp.batch_spec(mesh)),
            out_specs=(spec, fsdp.P()),
        )
    )
    batch = fsdp.device_batch(common.load_dataset(config).batch(0, 0, config.batch_size), mesh)
    leaves = jax.tree_util.tree_leaves_with_path(state.params, is_leaf=fsdp.is_sharded)
    sharded = {jax.tree_util.keystr(path): p.value.nbytes for path, p in leaves if fsdp.is_sharded(p)}
    kernels = {name: size for name, size in sharded.items() if name.endswith("['kernel']")}
    assert len(kernels) == 4 * SMALL["layers"] + 1  # qkv, out, fc1, fc2 in every block; the head
    gathers = primitive_count(jax.make_jaxpr(step_fn)(state, batch).jaxpr, "all_gather")
    gathered = result.summary["collectives"]["all-gather"]["bytes"]
    print(
        f"\nfsdp, keep gathered {keep}: {gathers} all-gathers for {len(sharded)} sharded parameters, {len(kernels)} "
        f"of them kernels; compiled: {gathered:,} bytes, {gathered / sum(sharded.values()):.2f} x the parameters"
    )
    assert gathers == len(sharded) + (0 if keep else len(kernels))
    assert gathered == sum(sharded.values()) + (0 if keep else sum(kernels.values()))
    compare("fsdp", result, reference())


def test_pjit_tp_splits_blocks_over_model():
    result = run("pjit_tp")
    shapes, d = shard_shapes(result), SMALL["d_model"]
    for layer in range(SMALL["layers"]):
        block = f"block_{layer}"
        assert shapes[f"{block}/attn/qkv/kernel"] == (d, 3 * d // 4)
        assert shapes[f"{block}/attn/out/kernel"] == (d // 4, d)
        assert shapes[f"{block}/mlp/fc1/kernel"] == (d, 4 * d // 4)
        assert shapes[f"{block}/mlp/fc2/kernel"] == (4 * d // 4, d)
    assert shapes["embed/token/embedding"] == (common.BYTES // 4, d)  # the vocabulary split too
    assert shapes["head/out/kernel"] == (d, common.BYTES // 4)
    ops = collectives(result.compiled)
    assert MODEL_GROUPS in ops["all-reduce"]  # the partial sums of the row-parallel matmuls
    assert DATA_GROUPS in ops["all-reduce"]  # the data-parallel gradient reduction


@pytest.mark.parametrize("name, expert", [("expert_parallel", 4), ("expert_parallel_8", 8)])
def test_expert_parallel_splits_experts_and_sends_tokens_by_all_to_all(name, expert):
    """Each device holds experts/E' whole experts (and their Adam moments), everything else
    whole; per block, four all-to-alls over 'expert' (tokens there and back, forward and
    backward), each carrying a device's slots: experts x rows x capacity x d_model x 4 bytes,
    of which (E' - 1) / E' leave the device; nothing else moves but the reductions."""
    result = run(name)
    shapes, d, experts = shard_shapes(result), SMALL["d_model"], MOE["experts"]
    for layer in range(SMALL["layers"]):
        mlp = f"block_{layer}/mlp"
        assert shapes[f"{mlp}/fc1/kernel"] == (experts // expert, d, 4 * d)
        assert shapes[f"{mlp}/fc2/kernel"] == (experts // expert, 4 * d, d)
        assert shapes[f"{mlp}/router/kernel"] == (d, experts)  # replicated
        assert shapes[f"block_{layer}/attn/qkv/kernel"] == (d, 3 * d)
    total, per_device = state_bytes(result.state)
    expert_bytes = sum(
        x.nbytes for path, x in jax.tree_util.tree_leaves_with_path((result.state.params, result.state.opt_state))
        if "fc" in jax.tree_util.keystr(path) and "mlp" in jax.tree_util.keystr(path)
    )  # fmt: skip
    assert per_device == (total - expert_bytes) + expert_bytes // expert  # the layout's prediction
    config = common.Config(**{**SMALL, **MOE})
    rows = SMALL["batch_size"] // DEVICES
    slots = experts * rows * common.capacity(config, SMALL["seq_len"]) * d * 4
    to_all = [c for c in common.hlo_collectives(result.compiled.as_text()) if c["op"] == "all-to-all"]
    assert len(to_all) == 4 * SMALL["layers"] and all(c["bytes"] == slots for c in to_all)
    groups = {tuple(row) for row in np.arange(DEVICES).reshape(DEVICES // expert, expert).tolist()}
    assert all(replica_groups(c["line"]) == groups for c in to_all)
    assert set(collectives(result.compiled)) == {"all-to-all", "all-reduce"}
    print(
        f"\n{name}: {len(to_all)} all-to-alls of {slots:,} bytes per step, {slots * (expert - 1) // expert:,} of "
        f"each leaving the device; state {per_device:,} of {total:,} bytes per device"
    )


@pytest.mark.parametrize("name", ["pjit_tp", "logical_tp"])
def test_tensor_parallelism_is_megatron(name):
    """Per block, two all-reduces of an activation over 'model' forward (after attn/out and
    fc2) and two backward (the input gradients of qkv and fc1); with the vocabulary split, one
    after the embedding lookup (each device looks up its part of the vocabulary) and one of the
    head's input gradient; no weight is all-gathered; the only other collective is the
    data-parallel gradient all-reduce."""
    summary = run(name).summary
    activation = SMALL["batch_size"] // 2 * SMALL["seq_len"] * SMALL["d_model"] * 4  # float32, data=2
    by_group = {}
    for c in common.hlo_collectives(run(name).compiled.as_text()):
        groups = frozenset(replica_groups(c["line"]) or ())
        by_group.setdefault((c["op"], groups), []).append(c["bytes"] * c["runs"])
    model_reduces = by_group.pop(("all-reduce", frozenset(MODEL_GROUPS)))
    gradient_reduces = by_group.pop(("all-reduce", frozenset(DATA_GROUPS)))
    # Besides the activations, small ones: the loss's per-position maxima and sums over the split
    # vocabulary, and the clipping norm's partial sums; XLA may fuse one into an activation's.
    per_position = SMALL["batch_size"] // 2 * SMALL["seq_len"] * 4
    activations = [size for size in model_reduces if size >= activation]
    print(f"\n{name}: {len(activations)} activation all-reduces over model, {len(gradient_reduces)} over data")
    assert len(activations) == 4 * SMALL["layers"] + 2
    assert all(size - activation <= per_position + 64 for size in activations)
    assert all(size <= per_position for size in model_reduces if size < activation)
    assert len(gradient_reduces) >= 1 and not by_group, by_group
    assert summary["collectives"]["all-gather"]["bytes"] < 0.1 * summary["param_bytes"]


def test_hsdp_shards_within_groups_and_replicates_across():
    """fsdp.py --mesh replica=2,data=4: 1/4 of the state per device; parameters gathered and
    gradients reduce-scattered within each group of 4, then all-reduced across the 2 groups."""
    result = run("hsdp")
    total, per_device = state_bytes(result.state)
    print(f"\nhsdp: {per_device / total * 4:.4f} x total/4 state bytes on device 0")
    assert abs(per_device / total * 4 - 1) <= 0.05
    groups_of_4, pairs = MODEL_GROUPS, DATA_GROUPS  # the rows and columns of the 2 x 4 mesh
    ops = collectives(result.compiled)
    assert {frozenset(g) for g in ops["all-gather"]} == {frozenset(groups_of_4)}
    assert {frozenset(g) for g in ops["reduce-scatter"]} == {frozenset(groups_of_4)}
    assert pairs in ops["all-reduce"]


@pytest.mark.parametrize("schedule, layers", [("1f1b", 4), ("interleaved", 8)])
def test_pipeline_splits_the_blocks_over_stages(schedule, layers):
    """Each device holds one stage's blocks and their moments (interleaved: layers s and s + 4 on
    stage s of 4), and a quarter of the embedding's and the head's; activations and gradients
    move between neighbouring stages (collective-permutes; interleaved, from the last stage on to
    the first too), gradients are all-reduced over 'data'."""
    result = run(f"pipeline_{schedule}", mesh="data=2,stage=4", layers=layers, microbatches=8)
    groups = layers // 4
    layer = global_params("pipeline", result.state)  # block_0 ... by the model's numbering
    for path, leaf in jax.tree.leaves_with_path(result.state.params["blocks"]):
        for shard in leaf.addressable_shards:
            stage = shard.index[1].start  # which piece of each group's row of 4 layers
            assert shard.data.shape[:2] == (groups, 1)  # one layer of each group
            for v in range(groups):
                model_layer = functools.reduce(lambda t, k: t[k.key], path, layer[f"block_{v * 4 + stage}"])
                assert np.array_equal(shard.data[v, 0], model_layer)
    for leaf in jax.tree.leaves(result.state.opt_state[1][0].mu["blocks"]):
        assert leaf.addressable_data(0).shape[:2] == (groups, 1)
    # The embedding and the head, and their moments, split over 'stage' too: a quarter each.
    moments = result.state.opt_state[1][0]
    for tree in (result.state.params, moments.mu, moments.nu):
        for leaf in jax.tree.leaves({k: v for k, v in tree.items() if k != "blocks"}):
            assert leaf.addressable_data(0).size * 4 == leaf.size
    ops = collectives(result.compiled)  # gathered whole for the step, their gradients reduce-scattered
    assert MODEL_GROUPS in ops["all-gather"] and MODEL_GROUPS in ops["reduce-scatter"]
    neighbours = {(s, s + 1) for s in (0, 1, 2, 4, 5, 6)} | ({(3, 0), (7, 4)} if groups > 1 else set())
    pairs = set()
    for c in common.hlo_collectives(result.compiled.as_text()):
        if c["op"] == "collective-permute":
            pairs |= {
                tuple(map(int, p)) for p in re.findall(r"\{(\d+),(\d+)\}", c["line"].split("source_target_pairs=")[1])
            }
    assert pairs == neighbours | {(b, a) for a, b in neighbours}  # forward and backward
    assert DATA_GROUPS in collectives(result.compiled)["all-reduce"]


@pytest.mark.parametrize("mesh, context", [("data=2,context=4", 4), ("data=1,context=8", 8)])
def test_ring_attention_passes_keys_and_values_around_the_ring(mesh, context):
    """Per layer, N - 1 hops of a key block and a value block forward, and of their gradients
    backward, each one device's piece of the sequence; nothing gathers a whole sequence's keys
    or values. Each hop sends to the next device of the same 'data' row of the mesh."""
    result = run("context_parallel", mesh=mesh)
    block = SMALL["batch_size"] // (DEVICES // context) * SMALL["seq_len"] // context * SMALL["d_model"] * 4
    permutes = [c for c in common.hlo_collectives(result.compiled.as_text()) if c["op"] == "collective-permute"]
    hops = sum(c["runs"] for c in permutes)
    print(f"\n{mesh}: {hops} collective-permutes of {block:,} bytes per step ({SMALL['layers']} layers)")
    assert hops == SMALL["layers"] * 2 * 2 * (context - 1) and {c["bytes"] for c in permutes} == {block}
    ring = {(row + d, row + (d + 1) % context) for row in range(0, DEVICES, context) for d in range(context)}
    for c in permutes:
        pairs = {tuple(map(int, p)) for p in re.findall(r"\{(\d+),(\d+)\}", c["line"].split("source_target_pairs=")[1])}
        assert pairs == ring or pairs == {(b, a) for a, b in ring}  # forward, or the gradients' way back
    gathers = [c["bytes"] for c in common.hlo_collectives(result.compiled.as_text()) if c["op"] == "all-gather"]
    assert all(size < block for size in gathers)


def test_causal_attention_work_is_balanced():
    """Each device holds a piece of the sequence and its mirror, so under the causal mask every
    device attends to as many (query piece, key piece) blocks; contiguous pieces would not."""
    for devices in (4, 8):
        balanced = context_parallel.attention_work(devices)
        contiguous = context_parallel.attention_work(devices, balanced=False)
        print(f"\ncontext={devices}: blocks per device {balanced}; contiguous pieces would give {contiguous}")
        assert max(balanced) <= 1.1 * min(balanced) and max(contiguous) >= 4 * min(contiguous)
        order = context_parallel.balanced_order(4 * devices, devices)  # pieces of 2 positions
        assert sorted(order) == list(range(4 * devices)) and list(order[:4]) == [0, 1, 4 * devices - 2, 4 * devices - 1]


def test_ring_attention_in_bfloat16_is_as_accurate_as_jax():
    """Ring attention in bfloat16 (context=8, 1,024 positions) errs no more than 1.2 x as much as
    jax.nn.dot_product_attention in bfloat16, in its output and in the gradients of q, k and v:
    both compute the scores and the softmax in float32. (The reference is float32: its own error,
    about 1e-7, is nothing beside bfloat16's, about 1e-3.)"""
    length, devices = 1024, 8
    mesh = jax.make_mesh((devices,), ("context",), axis_types=(jax.sharding.AxisType.Auto,))
    order = context_parallel.balanced_order(length, devices)
    back = np.argsort(order)
    q, k, v, cotangent = (
        jnp.asarray(np.random.default_rng(i).standard_normal((2, length, 4, 32)), jnp.bfloat16) for i in range(4)
    )

    def ring(q, k, v):
        spec = P(None, "context")
        attend = jax.shard_map(context_parallel.ring_attention, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
        return attend(q[:, order], k[:, order], v[:, order])[:, back]

    def out_and_grads(attend, dtype):
        out, vjp = jax.vjp(jax.jit(attend), *(x.astype(dtype) for x in (q, k, v)))
        return [out, *vjp(cotangent.astype(dtype))]

    exact = out_and_grads(common.causal_attention, jnp.float32)

    def errors(attend):
        got = out_and_grads(attend, jnp.bfloat16)
        return [
            float(jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(b))
            for a, b in zip(got, exact, strict=True)
        ]

    ring_errors, jax_errors = errors(ring), errors(common.causal_attention)
    print(f"\nbfloat16, relative to float32 (output, dq, dk, dv): ring {ring_errors}, JAX's {jax_errors}")
    assert all(r <= 1.2 * j for r, j in zip(ring_errors, jax_errors, strict=True))


def test_attention_kernel_on_this_machine():
    """--attention auto is XLA's kernel on a CPU (cuDNN's needs an NVIDIA GPU and bfloat16); an
    explicit kernel is passed through."""
    assert jax.default_backend() == "cpu"
    assert common.attention_kernel(common.Config(dtype="bfloat16")) == "xla"
    assert common.attention_kernel(common.Config(attention="xla")) == "xla"
    model = common.make_model(common.Config(attention="xla"))
    assert model.attend.keywords == {"implementation": "xla"}


@pytest.mark.parametrize(
    "rules, fc1_shard, collective",
    [
        ("dp", (64, 256), ("all-reduce", ALL)),
        ("fsdp", (64 // 8, 256), ("all-gather", ALL)),
        ("hsdp", (64 // 4, 256), ("all-gather", MODEL_GROUPS)),
        ("tp", (64, 256 // 4), ("all-reduce", MODEL_GROUPS)),
        ("fsdp_tp", (64 // 2, 256 // 4), ("all-reduce", MODEL_GROUPS)),
    ],
)
def test_logical_rules_decide_the_layout(rules, fc1_shard, collective):
    result = run(f"logical_{rules}")
    assert shard_shapes(result)["block_0/mlp/fc1/kernel"] == fc1_shard
    ops = collectives(result.compiled)
    op, groups = collective
    assert groups in ops[op], f"{op} over {groups} not in {ops.keys()}"
    if rules == "dp":
        assert "all-gather" not in ops
    if rules in ("fsdp", "fsdp_tp", "hsdp"):
        total, per_device = state_bytes(result.state)
        print(f"\nlogical {rules}: {per_device / total * DEVICES:.3f} x total/8 bytes on device 0")
    if rules == "hsdp":  # shards of 4 within the 'model' groups, replicated across 'data'
        assert abs(per_device / total * 4 - 1) <= 0.05 and DATA_GROUPS in ops["all-reduce"]


# ----------------------------------------------------------------------------------------------
# Several processes: 2 processes x 4 devices, joined by JAX's distributed runtime (gloo on CPU)
# ----------------------------------------------------------------------------------------------


# Each script with its default flags; with -m full, the pipeline's other schedules too.
SEVERAL = list(DEFAULTS.values()) + ["pipeline_gpipe", "pipeline_zero-bubble", "pipeline_interleaved"]


@pytest.mark.parametrize("name", matrix(SEVERAL, list(DEFAULTS.values())))
def test_two_processes_match_one(name, tmp_path):
    """Each script from the command line, copied alone into a folder, as 2 processes x 4
    devices: the same losses as 1 process x 8. The run stops after the warmup steps, whose
    learning rates do not depend on --steps, so they compare with the 20-step run."""
    metrics = tmp_path / "metrics.jsonl"
    steps = SMALL["warmup_steps"]
    module, strategy_flags = STRATEGIES[name]
    script = module.__name__
    flags = as_flags({**SMALL, **strategy_flags, "steps": steps, "log_every": 1, "metrics_file": metrics})
    with cluster(script, tmp_path, flags) as procs:
        logs = wait_ok(procs, tmp_path)
    assert f"step {steps}/{steps}" in logs[0] and "step " not in logs[1]  # only process 0 reports
    assert f"in {PROCESSES} process(es)" in logs[0]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records[:-1]] == list(range(1, steps + 1)) and "summary" in records[-1]
    assert {"loss", "tokens_per_sec"} <= set(records[0])
    one_process = run(name).losses[:steps]
    diff = max(abs(r["loss"] - ref) / ref for r, ref in zip(records[:-1], one_process, strict=True))
    print(f"\n{name}: 2 processes x 4 devices vs 1 x 8: loss {diff:.1e}")
    assert diff <= RTOL
