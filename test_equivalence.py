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

import flax.linen as nn
import jax
import numpy as np
import pytest

import common
import fsdp
from tests.harness import (
    ALL, DATA_GROUPS, DEFAULTS, DEVICES, MODEL_GROUPS, PROCESSES, RTOL, SMALL, STRATEGIES,
    as_flags, cluster, collectives, once_more_after_runtime_abort, replica_groups, run, shard_shapes, state_bytes,
    wait_ok,
)  # fmt: skip


@functools.cache
def reference(**overrides):
    """The same training, with no parallelism at all: plain jax.jit on one device."""
    config = common.Config(**{**SMALL, **overrides})
    dataset = common.load_dataset(config)
    state = jax.jit(functools.partial(common.create_state, config, common.GPT(config)))()

    @jax.jit
    def train_step(state, batch):
        grads, metrics = common.accumulate_gradients(
            state, batch, jax.random.fold_in(state.rng, state.step), config.microbatches
        )
        return state.apply_gradients(grads=grads), metrics

    losses = []
    for step in range(config.steps):
        state, metrics = train_step(state, dataset.batch(step, 0, config.batch_size))
        losses.append(float(metrics["loss_sum"]) / float(metrics["tokens"]))
    assert len(jax.tree.leaves(state.params)[0].devices()) == 1
    return losses, state


def global_params(name, state):
    """The parameters as plain global numpy arrays, whatever the strategy's layout."""
    params = nn.unbox(state.params)  # fsdp.py's nn.Partitioned boxes hold global arrays
    if name == "pmap_dp":  # one stacked copy per device: check they agree, keep one
        for leaf in jax.tree.leaves(params):
            copies = np.asarray(leaf)
            assert copies.shape[0] == DEVICES and (copies == copies[0]).all()
        params = jax.tree.map(lambda x: x[0], params)
    return jax.tree.map(np.asarray, params)


def compare(name, result, ref_losses, ref_state):
    """Per-step losses and final parameters against the reference, both relative: the loss
    difference over the reference loss, and for each parameter ||mine - ref|| / ||ref||."""
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(result.losses, ref_losses, strict=True))
    mine, ref = global_params(name, result.state), global_params("reference", ref_state)
    assert jax.tree.structure(mine) == jax.tree.structure(ref)
    pairs = list(zip(jax.tree.leaves(mine), jax.tree.leaves(ref), strict=True))
    param_diff = max(np.linalg.norm(a - b) / np.linalg.norm(b) for a, b in pairs)
    abs_diff = max(np.abs(a - b).max() for a, b in pairs)
    print(f"\n{name}: loss {loss_diff:.1e}, parameters {param_diff:.1e} (largest |difference| {abs_diff:.1e})")
    assert loss_diff <= RTOL
    assert param_diff <= RTOL


@pytest.mark.parametrize("name", STRATEGIES)
def test_matches_single_device_reference(name):
    compare(name, run(name), *reference())
    assert run(name).losses[-1] < run(name).losses[0] - 1  # and it learned something


@pytest.mark.parametrize("name", DEFAULTS.values())
def test_microbatches_match(name):
    result = run(name, microbatches=4, batch_size=32)
    compare(f"{name} --microbatches 4", result, *reference(batch_size=32))


@pytest.mark.parametrize("name", ["fsdp", "pjit_tp", "logical_fsdp_tp"])  # the scripts that handle scanning
def test_scanned_layers_match(name):
    result = run(name, scan_layers=True)
    compare(f"{name} --scan-layers", result, reference()[0], reference(scan_layers=True)[1])


def test_remat_matches():
    for name in ("shardmap_dp", "fsdp", "logical_fsdp_tp"):
        compare(f"{name} --remat", run(name, remat=True), *reference())


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


def test_fsdp_gathers_again_for_the_backward_pass():
    """Each sharded matmul kernel is all-gathered for the forward pass and again for the
    backward (its input gradient needs it), rather than kept alive in between. Every other
    parameter only once: the backward pass of an embedding, a bias or a LayerNorm does not need
    the parameter itself. Counted in the program JAX hands to XLA: XLA's CPU compiler merges
    the two gathers of an unscanned block (see fsdp.gather_before_use)."""
    config = fsdp.Config(**SMALL)
    mesh, state = fsdp.make_mesh(config), run("fsdp").state
    spec = fsdp.mesh_specs(state)
    step_fn = jax.jit(
        jax.shard_map(
            functools.partial(fsdp.train_step, microbatches=1),
            mesh=mesh,
            in_specs=(spec, fsdp.BATCH_SPEC),
            out_specs=(spec, fsdp.P()),
        )
    )
    batch = fsdp.device_batch(common.load_dataset(config).batch(0, 0, config.batch_size), mesh)
    leaves = jax.tree_util.tree_leaves_with_path(state.params, is_leaf=fsdp.is_sharded)
    sharded = [jax.tree_util.keystr(path) for path, p in leaves if fsdp.is_sharded(p)]
    kernels = [name for name in sharded if name.endswith("['kernel']")]
    assert len(kernels) == 4 * SMALL["layers"] + 1  # qkv, out, fc1, fc2 in every block; the head
    gathers = primitive_count(jax.make_jaxpr(step_fn)(state, batch).jaxpr, "all_gather")
    print(f"\nfsdp: {gathers} all-gathers for {len(sharded)} sharded parameters, {len(kernels)} of them kernels")
    assert gathers == len(sharded) + len(kernels)


def test_pjit_tp_splits_blocks_over_model():
    result = run("pjit_tp")
    shapes, d = shard_shapes(result), SMALL["d_model"]
    for layer in range(SMALL["layers"]):
        block = f"block_{layer}"
        assert shapes[f"{block}/attn/qkv/kernel"] == (d, 3 * d // 4)
        assert shapes[f"{block}/attn/out/kernel"] == (d // 4, d)
        assert shapes[f"{block}/mlp/fc1/kernel"] == (d, 4 * d // 4)
        assert shapes[f"{block}/mlp/fc2/kernel"] == (4 * d // 4, d)
    assert shapes["embed/token/embedding"] == (common.VOCAB_SIZE, d)  # replicated
    ops = collectives(result.compiled)
    assert MODEL_GROUPS in ops["all-reduce"]  # the partial sums of the row-parallel matmuls
    assert DATA_GROUPS in ops["all-reduce"]  # the data-parallel gradient reduction


@pytest.mark.parametrize("name", ["pjit_tp", "logical_tp"])
def test_tensor_parallelism_is_megatron(name):
    """Per block, two all-reduces of an activation over 'model' forward (after attn/out and
    fc2) and two backward (the input gradients of qkv and fc1); no weight is all-gathered; the
    only other collective is the data-parallel gradient all-reduce."""
    summary = run(name).summary
    activation = SMALL["batch_size"] // 2 * SMALL["seq_len"] * SMALL["d_model"] * 4  # float32, data=2
    by_group = {}
    for c in common.hlo_collectives(run(name).compiled.as_text()):
        groups = frozenset(replica_groups(c["line"]) or ())
        by_group.setdefault((c["op"], groups), []).append(c["bytes"] * c["runs"])
    model_reduces = by_group.pop(("all-reduce", frozenset(MODEL_GROUPS)))
    gradient_reduces = by_group.pop(("all-reduce", frozenset(DATA_GROUPS)))
    print(f"\n{name}: {len(model_reduces)} activation all-reduces over model, {len(gradient_reduces)} over data")
    assert model_reduces == [activation] * 4 * SMALL["layers"]
    assert len(gradient_reduces) >= 1 and not by_group, by_group
    assert summary["collectives"]["all-gather"]["bytes"] < 0.1 * summary["param_bytes"]


@pytest.mark.parametrize(
    "rules, fc1_shard, collective",
    [
        ("dp", (64, 256), ("all-reduce", ALL)),
        ("fsdp", (64 // 8, 256), ("all-gather", ALL)),
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
    if rules in ("fsdp", "fsdp_tp"):
        total, per_device = state_bytes(result.state)
        print(f"\nlogical {rules}: {per_device / total * DEVICES:.3f} x total/8 bytes on device 0")


# ----------------------------------------------------------------------------------------------
# Several processes: 2 processes x 4 devices, joined by JAX's distributed runtime (gloo on CPU)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("script", DEFAULTS)
@once_more_after_runtime_abort
def test_two_processes_match_one(script, tmp_path):
    """Each script from the command line, copied alone into a folder, as 2 processes x 4
    devices: the same losses as 1 process x 8. The run stops after the warmup steps, whose
    learning rates do not depend on --steps, so they compare with the 20-step run."""
    metrics = tmp_path / "metrics.jsonl"
    steps = SMALL["warmup_steps"]
    flags = as_flags({**SMALL, "steps": steps, "log_every": 1, "metrics_file": metrics})
    with cluster(script, tmp_path, flags) as procs:
        logs = wait_ok(procs, tmp_path)
    assert f"step {steps}/{steps}" in logs[0] and "step " not in logs[1]  # only process 0 reports
    assert f"in {PROCESSES} process(es)" in logs[0]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records[:-1]] == list(range(1, steps + 1)) and "summary" in records[-1]
    assert {"loss", "tokens_per_sec"} <= set(records[0])
    one_process = run(DEFAULTS[script]).losses[:steps]
    diff = max(abs(r["loss"] - ref) / ref for r, ref in zip(records[:-1], one_process, strict=True))
    print(f"\n{script}: 2 processes x 4 devices vs 1 x 8: loss {diff:.1e}")
    assert diff <= RTOL
