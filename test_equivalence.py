"""Every strategy computes what one device computes, and really shards what it claims
(tests/sharding.py's check_real, on every run compared).

On 8 emulated CPU devices (conftest.py), float32 and dropout 0, each script and each logical
rules preset trains a small model for 20 steps and is compared with a single-device
reference: plain jax.jit on one device, the same model, data, optimizer and seed. Then the
final state's shardings and the collectives in the compiled step show that the work was
really split the way the script says, so a script that silently ran on one device could not
pass. Last, each script runs as 2 processes of 4 devices and matches 1 process of 8.

Everything else (the cost report, the data, the command line, checkpoints, faults, the
documentation) is tested in tests/, one file per concern; tests/harness.py runs the scripts.
"""

import dataclasses
import functools
import json
import math
import os
import re
import typing

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import safetensors.numpy
from flax.traverse_util import unflatten_dict
from jax.sharding import PartitionSpec as P

import common
from tools import check, hlo
import expert_parallel
import fsdp
import logical_pjit
import pipeline
import pjit_tp
import pmap_dp
from tests.harness import (
    ALL,
    DATA_GROUPS,
    DEFAULTS,
    DEVICES,
    EVAL,
    LLAMA_SPECS,
    MODEL_GROUPS,
    PROCESSES,
    RTOL,
    SMALL,
    STRATEGIES,
    as_flags,
    cluster,
    collectives,
    matrix,
    model_flags,
    MOE,
    record_flags,
    replica_groups,
    run,
    run_uncached,
    shard_shapes,
    state_bytes,
    wait_ok,
)
from tests.sharding import check_layout, check_real, covers, device_groups, mesh_of, pairs_of
from tests.sharding import ragged_all_to_all


class Reference(typing.NamedTuple):
    losses: list  # every step's mean loss
    grad_norms: list  # every step's global gradient norm, before clipping
    state: common.TrainState  # the final state
    conditioned: dict  # per parameter element: were its Adam steps insensitive to rounding?
    router: list  # a mixture of experts' routing, every step (common.routing)
    initial: dict  # the parameters before the first step, as numpy arrays
    eval_loss: float | None  # the held-out loss of the last evaluation, None if none was due


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
# What the elements left out may be, at most, of the model, of each parameter and of each row of
# one (its slices along the first axis). Measured on every reference below (AMD EPYC, JAX 0.10.2):
# 0.04% (a mixture of experts) to 0.59% (16 layers) of the model; 7.8% of a parameter (5 of the
# 64 of a late block's query bias, 8 layers), 2.0% of a kernel (8 layers); 12.5% of a row (1 of 8
# router weights of an input unit; of a wider row, 7.8%: 15 of a qkv row's 192, 16 layers).
ILL_CONDITIONED_SHARE = 0.01
ILL_CONDITIONED_PER_PARAMETER = 0.1
ILL_CONDITIONED_PER_ROW = 0.25
# The left-out elements are still compared, loosely: no element may differ by more than this
# share of its parameter's largest magnitude. Measured in float32: at most 1.3e-3, the rarely
# seen tokens of --vocab-size 4096 (8.7e-5 without them); bfloat16 below.
LARGEST_DIFFERENCE = 1e-2


def is_adam(x):
    return isinstance(x, optax.ScaleByAdamState)


def one_device(config):
    """The reference's initial state and its step: plain jax.jit on one device, which also says of
    each parameter element whether its Adam steps stayed insensitive to rounding (CONDITIONED)."""
    state = jax.jit(functools.partial(common.create_state, config, common.make_model(config)))()
    if config.init_from:  # a file's parameters (tools/export.py's), read whole by another reader
        saved = safetensors.numpy.load_file(config.init_from).items()
        state = state.replace(params=unflatten_dict({tuple(k.split("/")): v for k, v in saved}))

    @jax.jit
    def train_step(state, batch, conditioned):
        grads, metrics = common.accumulate_gradients(
            state, batch, jax.random.fold_in(state.rng, state.step), config.microbatches
        )
        norm = optax.tree.norm(common.learned(grads))
        state = state.apply_gradients(grads=common.clip(grads, norm, config.clip_norm))
        (adam,) = [
            s
            for s in jax.tree.leaves(state.opt_state, is_leaf=is_adam)
            if isinstance(s, optax.ScaleByAdamState)
        ]
        v = jax.tree.leaves(optax.tree.bias_correction(adam.nu, common.ADAM["b2"], adam.count))
        typical = jnp.sqrt(sum(x.sum() for x in v) / sum(x.size for x in v))
        v = jax.tree.unflatten(jax.tree.structure(adam.nu), v)
        # A balance bias (--router-bias-rate) has no moments: its steps are exact, compare all
        v = jax.tree.map(
            lambda v, p: jnp.full(p.shape, jnp.inf) if isinstance(v, optax.MaskedNode) else v,
            v,
            state.params,
            is_leaf=lambda x: isinstance(x, optax.MaskedNode),
        )
        conditioned = jax.tree.map(
            lambda c, g, v: c & ((g == 0) | (jnp.sqrt(v) >= CONDITIONED * typical)),
            conditioned,
            grads,
            v,
        )
        return state, {**metrics, "grad_norm": norm}, conditioned

    return state, train_step


@functools.cache
def reference(**overrides):
    """The same training, with no parallelism at all: plain jax.jit on one device."""
    config = common.Config(**{**SMALL, **EVAL, **overrides})
    dataset = common.load_dataset(config)
    state, train_step = one_device(config)

    @jax.jit
    def held_out(state, batch):  # the summed losses of a batch
        return common.token_losses(state.params, state.apply_fn, batch)[0].sum()

    losses, grad_norms, router, eval_loss = [], [], [], None
    initial = jax.tree.map(np.asarray, state.params)
    conditioned = jax.tree.map(lambda p: jnp.ones(p.shape, bool), state.params)
    for step in range(config.steps):
        state, metrics, conditioned = train_step(
            state, dataset.batch(step, 0, config.batch_size), conditioned
        )
        losses.append(float(metrics["loss_sum"]) / float(metrics["tokens"]))
        grad_norms.append(float(metrics["grad_norm"]))
        if config.experts:
            router.append(common.routing(metrics, config.layers))
        if config.eval_every and (step + 1) % config.eval_every == 0:
            # The held-out split's batches 0 .. --eval-batches - 1, whole, straight from the data
            eval_loss = sum(
                float(held_out(state, dataset.batch(i, 0, config.batch_size, "eval")))
                for i in range(config.eval_batches)
            ) / (config.eval_batches * config.batch_size * config.seq_len)
    assert len(jax.tree.leaves(state.params)[0].devices()) == 1
    return Reference(
        losses, grad_norms, state, jax.tree.map(np.asarray, conditioned), router, initial, eval_loss
    )


def global_params(name, state):
    """The parameters as plain global numpy arrays, whatever the strategy's layout."""
    params = common.unbox(state.params)  # fsdp.py's nnx.Param boxes hold global arrays
    if name.startswith("pipeline"):  # its blocks stacked, each stage holding its own
        kind, blocks = name.split()[0][9:], jax.tree.leaves(params["blocks"])[0]
        stages = blocks.sharding.mesh.shape["stage"] if kind == "zbv" else 1  # zbv's V
        order = pipeline.layer_order(kind, blocks.shape[0] * blocks.shape[1], stages)
        params = pipeline.unstack_blocks(params, order)
    if name.split()[0] == "pmap_dp":  # one stacked copy per device: check they agree, keep one
        for leaf in jax.tree.leaves(params):
            copies = np.asarray(leaf)
            assert copies.shape[0] == DEVICES and (copies == copies[0]).all()
        params = jax.tree.map(lambda x: x[0], params)
    return jax.tree.map(np.asarray, params)


def relative(mine, ref):
    """The largest difference between two lists of numbers, relative to the reference's."""
    return max(abs(a - b) / abs(b) for a, b in zip(mine, ref, strict=True))


def compare(
    name,
    result,
    ref,
    flags=None,
    rtol=(RTOL, RTOL, RTOL),
    routing=True,
    against_update=False,
    largest=None,
    real=True,
):
    """Per-step losses and gradient norms, the held-out loss and final parameters, against the
    reference, all relative: the difference over the reference's value, and for each parameter
    ||mine - ref|| / ||ref|| over its elements whose Adam steps were well conditioned (see
    CONDITIONED); `against_update`: over the training's own update of it, ||ref - initial||.
    Every element, the ill-conditioned too, within `largest` of the parameter's largest value.
    Then that the run was the strategy it claims (check_real, unless `real` is False): its layout
    and collectives. `name` is a strategy (tests/harness.py's STRATEGIES) and `flags` what the
    run added to it."""
    flags = flags or {}
    label = " ".join([name, *as_flags(flags)])
    if name in STRATEGIES:  # (dev/three_ways.py's manual_fsdp_tp is no script)
        record_flags(STRATEGIES[name][0], result.config)
    loss_diff, norm_diff = (
        relative(result.losses, ref.losses),
        relative(result.grad_norms, ref.grad_norms),
    )
    # The held-out loss, as the run's summary reports it, within the training losses' tolerance:
    # every script evaluates the whole held-out batches (not one device's rows, not the
    # training split), as the reference reads them from the data itself.
    evaluated = result.summary.get("eval_loss") is not None and ref.eval_loss is not None
    eval_diff = evaluated and relative([result.summary["eval_loss"]], [ref.eval_loss])
    mine, theirs = global_params(name, result.state), global_params("reference", ref.state)
    assert jax.tree.structure(mine) == jax.tree.structure(theirs)
    leaves = jax.tree_util.tree_leaves_with_path(theirs)
    quads = zip(
        leaves,
        jax.tree.leaves(mine),
        jax.tree.leaves(ref.conditioned),
        jax.tree.leaves(ref.initial),
        strict=True,
    )
    param_diff, abs_diff, left_out, noise = 0.0, 0.0, 0, []
    for (path, b), a, keep, initial in quads:
        where = f"{label}: {jax.tree_util.keystr(path, simple=True, separator='/')}"
        if common.is_balance(path):
            # A balance bias (--router-bias-rate) steps by +-rate on the sign of its experts'
            # excess load: with the routing the same, bit for bit the same. Where routing is not
            # compared (bfloat16, whose near-tied router scores may pick another expert), one
            # flipped choice can flip an expert's step: measured 29% of the update apart
            # (pipeline_interleaved), the other parameters at most 16%. It is left out there.
            assert not routing or np.array_equal(a, b), f"{where}: {a} != {b}"
            continue
        excluded = ~keep
        if not keep.any():  # its gradient rounding alone: a parameter the loss ignores
            noise.append(where.split(": ")[1])
            left_out += excluded.sum()
            continue
        # The elements left out must stay few: in every parameter, and in every row of one
        # (a token's embedding, an input unit's weights), so that no part of the model escapes.
        assert excluded.mean() <= ILL_CONDITIONED_PER_PARAMETER, (
            f"{where}: {excluded.mean():.1%} left out"
        )
        if keep.ndim >= 2:
            rows = excluded.reshape(keep.shape[0], -1).mean(1)
            assert rows.max() <= ILL_CONDITIONED_PER_ROW, (
                f"{where}: {rows.max():.1%} of row {rows.argmax()} left out"
            )
        scale = np.linalg.norm((b - initial)[keep]) if against_update else np.linalg.norm(b[keep])
        param_diff = max(param_diff, np.linalg.norm((a - b)[keep]) / scale)
        # Every element, the ill-conditioned too, within LARGEST_DIFFERENCE of the parameter's
        # largest.
        abs_diff = max(abs_diff, np.abs(a - b).max() / np.abs(b).max())
        left_out += excluded.sum()
    left_out /= sum(x.size for x in jax.tree.leaves(theirs))
    what = "update" if against_update else "parameters"
    held_out = f", held-out loss {eval_diff:.1e}" if evaluated else ""
    print(
        f"\n{label}: loss {loss_diff:.1e}{held_out}, gradient norm {norm_diff:.1e}, {what} "
        f"{param_diff:.1e} "
        f"(largest |difference| {abs_diff:.1e} of the parameter's largest; {left_out:.2%} of "
        "elements ill-conditioned, left out)" + f"; no gradient but rounding: {noise}" * bool(noise)
    )
    # A parameter the loss does not depend on, its every gradient rounding: nnx.MultiHeadAttention's
    # key biases (softmax adds the same q.b to each of a query's scores). Adam turns such noise
    # into steps of the learning rate's size on one device and another, so it cannot be compared;
    # the loss, which it does not change, is. Nothing else may be such.
    assert all(re.search(r"/key/bias$", path) for path in noise), noise
    record_parity(name, flags, (loss_diff, norm_diff, param_diff, abs_diff), rtol, what)
    assert loss_diff <= rtol[0] and norm_diff <= rtol[1] and param_diff <= rtol[2]
    assert not evaluated or eval_diff <= rtol[0], f"{label}: held-out loss {eval_diff:.1e}"
    assert left_out <= ILL_CONDITIONED_SHARE and abs_diff <= (largest or LARGEST_DIFFERENCE)
    if routing:
        compare_routing(label, result.router, ref.router)
    if real:
        check_real(name, flags, result)


def record_parity(name, flags, measured, bounds, what):
    """For dev/parity.py, which writes dev/parity.md from what the tests measure: with
    PARITY_RECORD set, one JSON line per comparison appended to that file (one per test worker):
    the loss's, gradient norm's and parameters' relative differences, and the largest element's."""
    path = os.environ.get("PARITY_RECORD")
    if not path or name not in STRATEGIES:  # dev/three_ways.py's manual_fsdp_tp: not a script
        return
    test = os.environ["PYTEST_CURRENT_TEST"].split("::")[-1].split("[")[0].split(" ")[0]
    record = {"test": test, "strategy": name, "flags": flags, "measured": measured}
    record.update(bounds=bounds, against=what, experts=bool(model_flags(name).get("experts")))
    record.update(order=list(STRATEGIES).index(name))
    with open(f"{path}.{os.environ.get('PYTEST_XDIST_WORKER', 'main')}", "a") as file:
        file.write(json.dumps(record, default=float) + "\n")


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
    assert [[step[key] for key in counts] for step in mine] == [
        [step[key] for key in counts] for step in ref
    ]
    aux_diff = relative([step["aux_loss"] for step in mine], [step["aux_loss"] for step in ref])
    print(f"{name}: routing the same at every step, load-balancing loss {aux_diff:.1e}")
    assert aux_diff <= RTOL


# Every strategy in every `pytest`, but for explicit_sharding.py's presets other than its
# default (the same layouts as logical_pjit.py's, which run here) and expert_parallel.py's second
# mesh (expert=8, its code the same as expert=4's): the rest with -m full.
EVERY_LAYOUT = [n for n in STRATEGIES if not n.startswith("explicit_") and n != "expert_parallel_8"]
EVERY_LAYOUT += [DEFAULTS["explicit_sharding"]]


@pytest.mark.parametrize("name", matrix(list(STRATEGIES), EVERY_LAYOUT))
def test_matches_single_device_reference(name):
    compare(name, run(name), reference(**model_flags(name)))
    assert run(name).losses[-1] < run(name).losses[0] - 1  # and it learned something
    assert run(name).summary["eval_loss"] is not None  # and evaluated, as compared above


# The strategies of any model
DENSE = [name for name in STRATEGIES if not name.startswith("expert")]


# Every pytest: the scripts whose own code the mixture reaches (its statistics summed over a
# pipeline's stages, its whole sequence gathered from context_parallel.py's pieces);
# expert_parallel.py trains it in every test. -m full: all (the experts split over 'model' by
# the logical rules among them).
@pytest.mark.parametrize("name", matrix(DENSE, ["pipeline_1f1b", "context_parallel"]))
def test_a_mixture_of_experts_matches(name):
    """Every other strategy trains the mixture of experts too (its expert weights split as any
    parameter of theirs), and routes it as one device does."""
    compare(name, run(name, **MOE), reference(**MOE, **model_flags(name)), MOE)


# Dropless experts by megablox's grouped matmul, the kernel a TPU runs (common.py's, interpreted
# here): every pytest in expert_parallel.py's shard_map body, each device its own experts, with
# its ragged exchange (test_the_tpus_ragged_all_to_all_matches); -m full every strategy.
GMM = ["expert_parallel", "expert_parallel_8", "pmap_dp", "shardmap_dp", "fsdp", "pipeline_1f1b"]
GMM += ["context_parallel", "pjit_tp", "logical_fsdp_tp", "explicit_fsdp_tp", "explicit_tp_sp"]


@pytest.mark.parametrize("name", matrix(GMM, []))
def test_the_tpus_grouped_matmul_matches(name, monkeypatch):
    """Each strategy with the grouped matmul a TPU runs, against one device with XLA's."""
    ref = reference(**{**MOE, **model_flags(name)})
    monkeypatch.setattr(common, "grouped_matmul", lambda: common.megablox_matmul)
    compare(name, run_uncached(name, **MOE), ref, MOE)


@pytest.mark.parametrize(
    "name", matrix(["expert_parallel", "expert_parallel_8"], ["expert_parallel"])
)
def test_the_tpus_ragged_all_to_all_matches(name, monkeypatch):
    """expert_parallel.py's dropless exchange on a TPU, each choice sent to its expert's device
    alone (a ragged all-to-all each way, by its definition: tests/sharding.py), with the TPU's
    grouped matmul and splash attention in shard_map's body, against one device."""
    ref = reference(**{**ON_TPU, "attention": "xla", **model_flags(name)})
    monkeypatch.setattr(expert_parallel, "ragged_all_to_all", lambda: ragged_all_to_all)
    monkeypatch.setattr(common, "grouped_matmul", lambda: common.megablox_matmul)
    compare(name, run_uncached(name, **ON_TPU), ref, ON_TPU)


# -m full (33 s): every pytest checks the suggestions' text (tests/test_your_model.py) and trains
# tests/llama.py under pjit_tp.py's table against one device (test_the_sequence_splits_...).
@pytest.mark.full
def test_pjit_tp_s_suggested_entries_train_a_new_model_and_match(monkeypatch):
    """pjit_tp.py names every parameter its table misses, and tools/check.py the entries their
    logical names suggest (tests/test_your_model.py checks the messages); pasted, they train
    tests/llama.py as one device does."""
    llama = {"model": "tests.llama"}
    missing, whole = check.suggested_entries(pjit_tp.Config(**{**SMALL, **llama}))
    assert not whole  # every axis its names split, split evenly
    assert len(missing) == 9  # 7 per block, taken together, and the final norm
    entries = tuple((pattern, eval(spec, {"P": P})) for pattern, (*_, spec) in missing.items())
    monkeypatch.setattr(pjit_tp, "PARAM_SPECS", entries + pjit_tp.PARAM_SPECS)
    compare("pjit_tp", run_uncached("pjit_tp", **llama), reference(**llama), llama)


# Grouped-query attention: 4 query heads share 2 key-value heads, and an MLP of 96 hidden units
# (not 4 x --d-model). Every pytest: tensor parallelism, which splits whole groups (model=2, the
# 2 key-value heads' divisor), and the ring. -m full: every strategy (Ulysses among them, fewer
# key-value heads than its 4 devices: repeated for each query head before its all-to-alls).
GQA = {"heads": 8, "kv_heads": 2, "mlp_dim": 96}


@pytest.mark.parametrize("name", matrix(list(STRATEGIES), ["pjit_tp", "context_parallel"]))
def test_grouped_query_attention_matches(name):
    boxes = dict(common.logical_names(common.Config(**{**SMALL, **GQA})))
    assert boxes["block_0/attn/qkv/kernel"].value.shape == (64, (8 + 2 * 2) * 8)  # q, k, v
    assert boxes["block_0/mlp/fc1/kernel"].value.shape == (64, 96)
    compare(name, run_uncached(name, **GQA), reference(**GQA, **model_flags(name)), GQA)


# --attention splash (Pallas's kernel, interpreted on the CPU) at 128 tokens, a block: -m full
# every strategy but the ring's and the all-gather's attention, which compute their own; every
# pytest each layout a script gives it, with the grouped matmul (below).
SPLASH = {"attention": "splash", "seq_len": 128}
SPLASHED = [name for name in STRATEGIES if name not in ("context_parallel", "context_all_gather")]


@pytest.mark.parametrize("name", matrix(SPLASHED, []))
def test_splash_attention_matches(name):
    """Each strategy with the splash kernel against one device with XLA's attention."""
    xla = {**SPLASH, "attention": "xla"}
    compare(name, run_uncached(name, **SPLASH), reference(**xla, **model_flags(name)), SPLASH)


# Both TPU kernels at once, 3 steps: Megatron's layout (pjit_tp.py), the rules' (logical_pjit.py),
# the types' (explicit_sharding.py) and Ulysses'; a shard_map's body in expert_parallel.py's
# (test_the_tpus_ragged_all_to_all_matches). The layers scanned: each kernel interpreted once in
# the program, not once a layer (its compile 31 -> 20 s), each layer's inputs laid out alike.
ON_TPU = {**SPLASH, **MOE, "steps": 3, "eval_every": 0, "scan_layers": True}  # one compile
LAYOUTS = ["pjit_tp", "logical_fsdp_tp", "explicit_fsdp_tp", "context_ulysses"]  # -m full: the
# logical one, explicit_fsdp_tp's layout by the same rules


@pytest.mark.parametrize("name", matrix(LAYOUTS, [s for s in LAYOUTS if s != "logical_fsdp_tp"]))
def test_the_tpus_kernels_match_in_each_layout(name, monkeypatch):
    """Splash attention and megablox's grouped matmul, each device given its pieces as the
    script lays them out, against one device with XLA's attention and ragged_dot."""
    ref = reference(**{**ON_TPU, "attention": "xla"})
    monkeypatch.setattr(common, "grouped_matmul", lambda: common.megablox_matmul)
    compare(name, run_uncached(name, **ON_TPU), ref, ON_TPU)


# Flags that one function of common.py reads meet in one run (dev/flags.py finds the pairs in
# the code): the mixture's options with grouped-query heads, a vocabulary, a tied head and the
# optimizer's settings; remat under the scanned layer loop.
MEET = dict(experts=4, top_k=1, shared_experts=1, router_aux_weight=0.02, router_bias_rate=1e-3)
MEET |= dict(mlp_dim=96, heads=8, kv_heads=2, vocab_size=512, tie_embeddings=True, seed=1)
MEET |= dict(lr=2e-3, weight_decay=0.05, remat=True, scan_layers=True, attention="xla")


def test_flags_that_meet_in_one_function_match_together():
    """Each pair of those flags set together, in a data-parallel step, against one device."""
    compare("shardmap_dp", run_uncached("shardmap_dp", **MEET), reference(**MEET), MEET)


# Every pytest: FSDP's gathers per piece of a linen model (its hooks under context parallelism:
# -m full; the GPT's, grouped-query, above); the blocks of tests/tied_llama.py train under
# pipeline.py (test_a_tied_head_matches), and pjit_tp.py's suggested entries (above).
@pytest.mark.parametrize("name", matrix(DENSE, ["fsdp"]))
def test_a_model_the_scripts_do_not_know_matches(name, monkeypatch):
    """tests/llama.py (RMSNorm, rotary positions, SwiGLU, no biases, untied head, grouped-query
    attention) through every script and preset, against one device training it."""
    monkeypatch.setattr(pjit_tp, "PARAM_SPECS", LLAMA_SPECS + pjit_tp.PARAM_SPECS)
    llama = {"model": "tests.llama"}
    compare(name, run_uncached(name, **llama), reference(**llama, **model_flags(name)), llama)


TIED = {"gpt": {"tie_embeddings": True}, "llama": {"model": "tests.tied_llama"}}


# Every pytest puts tying through the code it reaches: the tied GPT gathered once per use
# (fsdp.py) and given its input whole along the sequence (explicit_sharding.py --rules tp_sp),
# the tied Llama on the pipeline's first and last stages (the split along the vocabulary:
# test_vocabulary_is_split_over_model). -m full: both models under every strategy
# (explicit_sharding.py's wrapped tables among them).
# Models that lay out no activation by name (tests/nnx_llama.py, tests/tied_llama.py, the docs'
# model): sequence parallelism by table or by rules refuses them (test_command_line)
NO_SEQUENCE_NAMES = ("pjit_tp_sp", "logical_tp_sp")
ANY_MODEL = [name for name in DENSE if name not in NO_SEQUENCE_NAMES]  # the strategies they take
TIED_CASES = [(name, "gpt") for name in STRATEGIES] + [(name, "llama") for name in ANY_MODEL]
TIED_DEFAULT = [("fsdp", "gpt"), ("pipeline_1f1b", "llama"), ("explicit_tp_sp", "gpt")]


@pytest.mark.parametrize("name, model", matrix(TIED_CASES, TIED_DEFAULT))
def test_a_tied_head_matches(name, model, monkeypatch):
    """A head that reads the embedding's table (--tie-embeddings; tests/tied_llama.py): one
    parameter, its gradient the sum of both uses, held by the first and last stages of a
    pipeline, gathered once per use by FSDP, split along the vocabulary once by tensor
    parallelism; every script and preset against one device."""
    monkeypatch.setattr(pjit_tp, "PARAM_SPECS", LLAMA_SPECS + pjit_tp.PARAM_SPECS)
    flags = TIED[model]
    compare(name, run(name, **flags), reference(**flags, **model_flags(name)), flags)


# -m full: its blocks and embedding train under pipeline.py in every pytest, in tests/tied_llama.py
@pytest.mark.parametrize("name", matrix(ANY_MODEL, []))
def test_an_nnx_model_matches(name, monkeypatch):
    """tests/nnx_llama.py, the Llama written as three Flax NNX pieces (their axis names read from
    nnx.with_partitioning), through every script and preset, against one device training it."""
    monkeypatch.setattr(pjit_tp, "PARAM_SPECS", LLAMA_SPECS + pjit_tp.PARAM_SPECS)
    flags = {"model": "tests.nnx_llama"}
    compare(name, run_uncached(name, **flags), reference(**flags, **model_flags(name)), flags)


# tests/docs_model.py: a model written whole as the Flax guides write one (a list of blocks,
# GQA, a tied head), 11 lines from tests/docs_model_as_written.py. -m full: every script and
# preset (the cut, common.cut_at_blocks, is the same for every script: tests/minigpt.py's below).
# It lays out no activation by name (ANY_MODEL).
DOCS = {"model": "tests.docs_model", "kv_heads": 2}


@pytest.mark.parametrize("name", matrix(ANY_MODEL, []))
def test_a_model_written_whole_matches(name, monkeypatch):
    """tests/docs_model.py, cut at its blocks (common.cut_at_blocks), through every script and
    preset (pjit_tp.py with the entries it suggests), against one device training it."""
    missing, _ = check.suggested_entries(pjit_tp.Config(**{**SMALL, **DOCS}))
    entries = tuple((pattern, eval(spec, {"P": P})) for pattern, (*_, spec) in missing.items())
    monkeypatch.setattr(pjit_tp, "PARAM_SPECS", entries + pjit_tp.PARAM_SPECS)
    compare(name, run_uncached(name, **DOCS), reference(**DOCS, **model_flags(name)), DOCS)


# tests/minigpt.py: the GPT the Flax NNX docs publish (nnx.MultiHeadAttention, nnx.Sequential of
# blocks and of the MLP, post-LayerNorm, learned positions, parameters annotated with mesh axes,
# P(None, 'model')), 12 lines from tests/minigpt_as_written.py. Every pytest: the explicit types
# (nnx.LinearGeneral's kernels in the matmul hook, its mesh axes, its cut nnx.Sequential);
# -m full: every script and preset but the three that split the sequence over 'model', which it
# splits its features over (one line refuses them: test_command_line).
def test_dropless_trains_as_a_capacity_with_room_for_every_token():
    """Dropless routing (grouped by expert) against one-hot dispatch into a capacity of the whole
    sequence (--capacity-factor E / k), both on one device: no token dropped by either, the same
    losses, gradient norms and routing at every step."""
    full = {**MOE, "capacity_factor": MOE["experts"] / MOE["top_k"]}
    dropless, capacity = reference(**MOE), reference(**full)
    losses, norms = (
        relative(dropless.losses, capacity.losses),
        relative(dropless.grad_norms, capacity.grad_norms),
    )
    print(f"\ndropless against a full capacity: loss {losses:.1e}, gradient norm {norms:.1e}")
    assert losses <= 1e-6 and norms <= 1e-6
    assert all(step["dropped_share"] == 0 for step in capacity.router)
    compare_routing("dropless", dropless.router, capacity.router)


# -m full (21 s): every pytest routes with capacity through expert_parallel.py's all-to-alls
# (test_expert_parallel_splits_experts_and_sends_tokens_to_them) and by GShard's order
# (tests/test_experts.py).
@pytest.mark.parametrize("name", matrix(["expert_parallel", "context_parallel"], []))
def test_the_same_tokens_are_dropped(name):
    """With capacity for half the tokens, about half the choices are dropped: the same ones as on
    one device, where each device holds some of a sequence's tokens (context_parallel.py) or
    sends them to other devices' experts (expert_parallel.py). Switch's routing (one expert a
    token, its weight the router's probability), 4 experts, a balance loss of 0.05."""
    flags = {**MOE, "capacity_factor": 0.5, "steps": 10}
    flags.update(experts=4, top_k=1, router_aux_weight=0.05)
    ref = reference(**flags)
    assert min(step["dropped_share"] for step in ref.router) > 0.3
    mesh = {"mesh": "data=2,expert=4"} if name == "expert_parallel" else {}  # auto's, given
    compare(name, run(name, **flags, **mesh), ref, {**flags, **mesh})


# Micro-batches are common.accumulate_gradients in every script but pipeline.py (its schedule,
# which every pipeline run compared with one device runs): one script per way of splitting the
# rows (by hand in shard_map, by the compiler's shardings, in the types, whose gradients stay
# unreduced through the loop); the others, and every explicit preset, with -m full.
MICRO = ["shardmap_dp", "pjit_tp", "explicit_tp"]
EXPLICIT = [name for name in STRATEGIES if name.startswith("explicit_")]


@pytest.mark.parametrize(
    "name", matrix(list(dict.fromkeys([*DEFAULTS.values(), *EXPLICIT])), MICRO)
)
def test_microbatches_match(name):
    flags = {"microbatches": 4, "batch_size": 32}
    compare(name, run(name, **flags), reference(batch_size=32, **model_flags(name)), flags)


# The scripts that handle scanning (every pytest: fsdp.py, which keeps the stacked axis whole)
SCANNING = ["fsdp", "pjit_tp", "logical_fsdp_tp"]


@pytest.mark.parametrize("name", matrix([*SCANNING, "explicit_fsdp_tp"], SCANNING[:1]))
def test_scanned_layers_match(name):
    result = run(name, scan_layers=True)
    scanned = reference(scan_layers=True)
    scanned = reference()._replace(
        state=scanned.state, conditioned=scanned.conditioned, initial=scanned.initial
    )
    compare(name, result, scanned, {"scan_layers": True})


@pytest.mark.parametrize("name", matrix(["fsdp", "shardmap_dp", "logical_fsdp_tp"], ["fsdp"]))
def test_remat_matches(name):
    compare(name, run(name, remat=True), reference(), {"remat": True})


# Every pytest: the norm added up by hand from a split gradient (fsdp.py), and whole on every
# device (shardmap_dp.py). Every run compared with one device compares its gradient norm at every
# step, so the other scripts' norms are held there; what clipping adds is common.clip, the same
# in all. -m full: every strategy. Each over 2 micro-batches: the norm is of their sum.
CLIPPED = ["shardmap_dp", "fsdp"]


@pytest.mark.parametrize("name", matrix(list(STRATEGIES), CLIPPED))
def test_clipping_matches(name):
    """Clipping by the global norm, with a threshold so low that it binds on every step: the
    norm is over the whole model, whatever piece of the gradient each device holds."""
    ref = reference(clip_norm=0.05, steps=10, **model_flags(name))
    assert min(ref.grad_norms) > 0.05  # it clips every step
    clip = {"clip_norm": 0.05, "steps": 10, "microbatches": 2}  # the norm of the summed gradient
    compare(name, run(name, **clip), ref, clip)


@pytest.mark.parametrize(
    "name, tied",
    matrix(
        [("pjit_tp", False), ("logical_tp", False), ("pjit_tp", True), ("logical_tp", True)],
        [("pjit_tp", True)],
    ),
)
def test_vocabulary_is_split_over_model(name, tied):
    """The token embedding and the head split along the vocabulary, a quarter per 'model'
    device; the loss needs no all-gather of logits-sized arrays. Tied (--tie-embeddings), one
    table split once, which the head reads as it is: still no gather of it nor of the logits."""
    flags = {"vocab_size": 4096, "tie_embeddings": True} if tied else {"vocab_size": 4096}
    result, d = run(name, **flags), SMALL["d_model"]
    shapes = shard_shapes(result)
    assert shapes["embed/token/embedding"] == (4096 // 4, d)
    assert shapes.get("head/out/kernel") == (None if tied else (d, 4096 // 4))
    quarter_logits = SMALL["batch_size"] // 2 * SMALL["seq_len"] * 4096 // 4 * 4  # float32, data=2
    gathers = [
        c["bytes"]
        for c in hlo.hlo_collectives(result.compiled.as_text())
        if c["op"] == "all-gather"
    ]
    print(
        f"\n{name} --vocab-size 4096: all-gathers {gathers} bytes; a device's logits "
        f"{quarter_logits:,} bytes"
    )
    assert all(size < quarter_logits / 4 for size in gathers)
    compare(name, result, reference(**flags), flags)


# The schedules on deeper pipelines (all run on data=4,stage=2 above): --mesh, --layers. Every
# pytest runs them with -m full (8 stages too). Interleaved: two
# groups of layers per stage, so twice the layers.
PIPELINES = [("gpipe", "data=2,stage=4", 4), ("1f1b", "data=1,stage=8", 8)]
PIPELINES += [("interleaved", "data=2,stage=4", 8), ("zero-bubble", "data=2,stage=4", 4)]
PIPELINES += [("zero-bubble", "data=1,stage=8", 8), ("interleaved", "data=1,stage=8", 16)]
PIPELINES += [("zbv", "data=2,stage=4", 8), ("zbv", "data=1,stage=8", 16)]


@pytest.mark.parametrize(
    "schedule, mesh, layers",
    matrix(PIPELINES, []),
    ids=[f"{s}-{m}" for s, m, _ in PIPELINES],
)
def test_pipeline_matches(schedule, mesh, layers):
    flags = {"mesh": mesh, "layers": layers, "microbatches": 8}
    result = run(f"pipeline_{schedule}", **flags)
    compare(f"pipeline_{schedule}", result, reference(layers=layers), flags)


@pytest.mark.parametrize("schedule", matrix(list(pipeline.SCHEDULES), ["zero-bubble"]))
def test_pipeline_matches_without_remat(schedule):
    """--no-remat: each backward runs from what its forward kept (zero-bubble's W from what B
    left in the same slot), not the stage again."""
    result = run(f"pipeline_{schedule}", remat=False, layers=4)
    compare(f"pipeline_{schedule}", result, reference(layers=4), {"remat": False, "layers": 4})


# -m full: a mesh given by hand where 'auto' gives another (data=2,model=4 on 8 devices), and
# more groups of layers per stage than interleaving's default 2 (auto: data=4,stage=2)
GIVEN = {
    "pjit_tp": {"mesh": "data=4,model=2"},
    "logical_fsdp_tp": {"mesh": "data=4,model=2"},
    "explicit_fsdp_tp": {"mesh": "data=4,model=2"},
    "pipeline_interleaved": {"virtual_stages": 4, "layers": 8},
}


@pytest.mark.full
@pytest.mark.parametrize("name", list(GIVEN))
def test_a_layout_given_by_hand_matches(name):
    flags = GIVEN[name]
    compare(name, run(name, **flags), reference(layers=flags.get("layers", SMALL["layers"])), flags)


@pytest.mark.full
def test_context_parallel_matches_on_eight():
    flags = {"mesh": "data=1,context=8"}
    compare("context_parallel", run("context_parallel", **flags), reference(), flags)


# The ways of splitting the sequence (docs/long_sequences.md): Megatron's sequence parallelism
# by table, by rules and in the types, and context parallelism's all-gather and Ulysses (the
# ring, context_parallel.py's default, is every other test's). Each trains the mixture of
# experts and tests/llama.py with micro-batches and clipping that binds, and runs in bfloat16.
OTHER_MODELS = {"moe": MOE, "llama": {"model": "tests.llama"}}
LONG = ["context_all_gather", "context_ulysses", "pjit_tp_sp", "logical_tp_sp", "explicit_tp_sp"]
LONG_FLAGS = {"microbatches": 2, "clip_norm": 0.05, "steps": 10}


# Every pytest: the mixture through Ulysses' all-to-alls, tests/llama.py through the table's
# sequence parallelism. -m full: both models through every split.
@pytest.mark.parametrize(
    "name, model",
    matrix(
        [(name, model) for name in LONG for model in OTHER_MODELS],
        [("pjit_tp_sp", "llama")],
    ),
)
def test_the_sequence_splits_train_every_model(name, model, monkeypatch):
    monkeypatch.setattr(pjit_tp, "PARAM_SPECS", LLAMA_SPECS + pjit_tp.PARAM_SPECS)
    flags = {**OTHER_MODELS[model], **LONG_FLAGS}
    ref = reference(**flags)
    assert min(ref.grad_norms) > flags["clip_norm"]  # it clips every step
    compare(name, run_uncached(name, **flags), ref, flags)


@pytest.mark.parametrize("model", matrix(list(OTHER_MODELS), ["llama"]))
def test_zero_bubble_trains_every_model(model, monkeypatch):
    """Zero-bubble's B keeps every dense layer's input and output gradient and its W makes the
    kernels' gradients from them (keep_dense): the MoE (whose experts' weights get theirs in B)
    and tests/llama.py (its own dense layers) train as on one device."""
    flags = OTHER_MODELS[model]
    ref = reference(**flags)
    compare("pipeline_zero-bubble", run_uncached("pipeline_zero-bubble", **flags), ref, flags)


@pytest.mark.parametrize("name", matrix(LONG, ["context_ulysses"]))
def test_the_sequence_splits_match_in_bfloat16(name):
    bfloat16_matches(name, run(name, **BF16), {})


# --dtype bfloat16: activations and matmuls in bfloat16; parameters, Adam's moments, the loss,
# softmax statistics and the router in float32. Two bfloat16 runs of the same step that sum in
# another order differ by bfloat16's rounding (8 bits: 4e-3 per value), far above float32's, so
# the bounds are bfloat16's, and the parameters are compared against the training's update of
# them (final minus initial): a run that never updated a parameter would be 100% off. Measured
# over 5 steps on all 17 strategies (AMD EPYC, JAX 0.10.2), the largest differences from the
# bfloat16 reference: loss 1.7e-5, gradient norm 3.6e-3, update 2.9e-2 (pipeline interleaved on
# its 4 layers; the others 2.5e-2), an element 7.9e-2 of its parameter's largest. The reference
# itself with --microbatches 2 (the same sums, in another order) differs from it by 1.6e-5,
# 1.3e-3, 2.8e-2 and 5.1e-2, and the float32 reference by 2.3e-5, 2.5e-3, 2.1e-2 and 7.4e-2. Each
# bound is about twice the largest of these. A strategy off by a constant factor in its gradient
# (a sum where a mean belongs) would be 100% off in the norm. A mixture of experts (chosen by
# --experts, the flag that makes one) moves more: a token whose two best experts' router scores
# tie to within bfloat16's rounding may go to the other one. Measured the same way
# (expert_parallel on both meshes): 6.6e-5, 1.9e-3, 8.4e-2 and 0.28; the reference with
# --microbatches 2 6.6e-5, 2.5e-3, 9.0e-2 and 0.28, and float32 1.1e-4, 4.3e-3, 0.15 and 0.48.
# Through every other strategy (the parity matrix, dev/parity.md) the mixture of experts moves
# further where its experts' matmuls are split over 'model' (logical_tp and logical_fsdp_tp:
# 5.6e-5, 8.8e-3, 0.17 and 0.64) and on the interleaved pipeline's 4 layers (gradient norm
# 1.0e-2): the bounds were about 1.5 times those. The tests' mixture now also has a shared
# expert and a balance bias, whose +-0.001 steps follow the sign of each expert's excess load:
# a choice flipped by bfloat16's rounding can flip a step, which changes later routing. Measured
# through every strategy: loss 2.8e-4 (pjit_tp), gradient norm 9.3e-3 (logical_hsdp), update
# 0.23 (explicit_fsdp_tp), so the bounds are about twice those, still far below a run that never
# updated a parameter (1.0) or a gradient off by a constant factor.
# And it is bfloat16: over these 5 steps the gradient norm is 1.2e-4 (logical_hsdp) to 5.9e-3
# (the MoE) from float32's, measured on all 82 bfloat16 runs of `pytest -m ""` (AMD EPYC, JAX
# 0.10.2), where two float32 runs agree to 1e-6: BF16_FROM_FLOAT32 is between. (That a part of
# the model computes in float32 is not visible there, a norm averages rounding over the model:
# tests/test_lesson.py checks every matmul's operands.)
BF16 = {"dtype": "bfloat16", "steps": 5}
BF16_RTOL = (5e-5, 6e-3, 6e-2)  # loss, gradient norm, parameters (against their update)
BF16_MOE_RTOL = (6e-4, 2e-2, 0.5)
BF16_LARGEST, BF16_MOE_LARGEST = 0.15, 0.9  # any element, of its parameter's largest value
BF16_FROM_FLOAT32 = 1e-5


# Every pytest: by hand and by the compiler; in stages, along the sequence and the mixture of
# experts through expert_parallel.py with -m full (the sequence's splits in bfloat16 in every
# pytest: test_the_sequence_splits_match_in_bfloat16).
@pytest.mark.parametrize("name", matrix(list(STRATEGIES), ["shardmap_dp", "pjit_tp"]))
def test_bfloat16_matches(name):
    """Every strategy in bfloat16 against one device in bfloat16. A mixture of experts' routing
    is not compared token for token: in bfloat16 two experts' router scores can tie to within
    the rounding, and which of them wins may differ (the losses still agree). It is bfloat16:
    the compiled step holds bfloat16 values, and the run is as far from float32 as bfloat16's
    rounding puts it (were --dtype ignored, both sides would run in float32 and agree to 1e-6)."""
    bfloat16_matches(name, run(name, **BF16), {})


# -m full: the flags the compute type meets in one function (dev/flags.py): the attention and the
# heads it runs at, the experts' kernels, the log's printing
MEET_BF16 = dict(attention="xla", heads=8, kv_heads=2, experts=4, top_k=1)


@pytest.mark.full
def test_flags_that_meet_the_compute_type_match_together(tmp_path):
    flags = {**MEET_BF16, "metrics_file": str(tmp_path / "metrics.jsonl")}
    bfloat16_matches("shardmap_dp", run_uncached("shardmap_dp", **BF16, **flags), flags)


# The other models of the parity matrix (dev/parity.md) in bfloat16, through every script and
# preset that trains any model: the mixture of experts and tests/llama.py (OTHER_MODELS).


@pytest.mark.full
@pytest.mark.parametrize("model", OTHER_MODELS)
@pytest.mark.parametrize("name", DENSE)
def test_bfloat16_matches_for_the_other_models(name, model, monkeypatch):
    monkeypatch.setattr(pjit_tp, "PARAM_SPECS", LLAMA_SPECS + pjit_tp.PARAM_SPECS)
    flags = OTHER_MODELS[model]
    bfloat16_matches(name, run_uncached(name, **BF16, **flags), flags)


def bfloat16_matches(name, result, flags):
    flags = {**BF16, **model_flags(name), **flags}
    ref = reference(**flags)
    moe = bool(flags.get("experts"))
    rtol, largest = (BF16_MOE_RTOL, BF16_MOE_LARGEST) if moe else (BF16_RTOL, BF16_LARGEST)
    run_flags = {key: value for key, value in flags.items() if key not in model_flags(name)}
    compare(name, result, ref, run_flags, rtol, routing=False, against_update=True, largest=largest)
    # The parameters stay float32
    assert jax.tree.leaves(result.state.params)[0].dtype == jnp.float32
    assert "bf16[" in result.compiled.as_text()
    # float32's first 5 steps: those of the 20-step reference (the warmup's learning rates do not
    # depend on --steps).
    float32 = reference(**{key: value for key, value in flags.items() if key not in BF16})
    off = relative(result.grad_norms, float32.grad_norms[: BF16["steps"]])
    print(f"{name} --dtype bfloat16: gradient norm {off:.1e} from float32's")
    assert off >= BF16_FROM_FLOAT32


# ----------------------------------------------------------------------------------------------
# What each strategy means, written here from its definition, not read from the script: how many
# pieces each kind of parameter is cut into (over which mesh axes), and the collectives its step
# must hold. check_real holds a run to what its script states; this holds the script's statement
# to what the strategy is, so a preset that states the wrong layout cannot pass by agreeing with
# itself.
# ----------------------------------------------------------------------------------------------

# Megatron's kernels: the weights with an axis of heads, MLP units or the vocabulary
KERNELS = re.compile(
    r"attn/(qkv|out)/kernel|attn/query_bias|mlp/fc1/(kernel|bias)|mlp/fc2/kernel|token/embedding|"
    r"head/out/kernel"
)
EXPERTS = re.compile(r"mlp/fc[12]/")  # a mixture's routed experts (not mlp/shared/)


class Meant(typing.NamedTuple):
    kernels: tuple = ()  # the mesh axes Megatron's kernels are split over
    rest: tuple = ()  # and every other parameter
    experts: tuple = ()  # a mixture's routed experts, if not as the rest
    needs: tuple = ()  # (collective, the mesh axes its device groups span)


def fsdp_over(*axes, needs=()):
    return Meant(axes, axes, needs=(("all-gather", axes), *needs))


TP = Meant(("model",), needs=(("all-reduce", ("model",)), ("all-reduce", ("data",))))
TP_SP = TP._replace(needs=(*TP.needs, ("all-gather", ("model",))))
PRESETS = {  # logical_pjit.py's and explicit_sharding.py's, on data=2,model=4
    "dp": Meant(needs=(("all-reduce", ("data", "model")),)),
    "fsdp": fsdp_over("data", "model"),
    "hsdp": fsdp_over("model", needs=(("all-reduce", ("data",)),)),  # shards of 4, 2 replicas
    "tp": TP,
    "tp_sp": TP_SP,
    "fsdp_tp": Meant(("data", "model"), ("data",), needs=(("all-gather", ("data",)), *TP.needs)),
}
PIPELINE = Meant(("stage",), ("stage",), needs=(("collective-permute", ("stage",)),))
CONTEXT = Meant(needs=(("all-reduce", ("data", "context")),))
EXPERT = Meant(
    experts=("expert",), needs=(("all-gather", ("expert",)), ("reduce-scatter", ("expert",)))
)
MEANT = {
    "pmap_dp": Meant(needs=(("all-reduce", ("devices",)),)),
    "shardmap_dp": Meant(needs=(("all-reduce", ("data",)),)),
    "fsdp": fsdp_over("data", needs=(("reduce-scatter", ("data",)),)),
    "hsdp": fsdp_over("data", needs=(("reduce-scatter", ("data",)), ("all-reduce", ("replica",)))),
    "pjit_tp": TP,
    "pjit_tp_sp": TP_SP,
    **{
        f"{script}_{rules}": meant
        for script in ("logical", "explicit")
        for rules, meant in PRESETS.items()
    },
    **{f"pipeline_{schedule}": PIPELINE for schedule in pipeline.SCHEDULES},
    "context_parallel": CONTEXT._replace(
        needs=(*CONTEXT.needs, ("collective-permute", ("context",)))
    ),
    "context_all_gather": CONTEXT._replace(needs=(*CONTEXT.needs, ("all-gather", ("context",)))),
    "context_ulysses": CONTEXT._replace(needs=(*CONTEXT.needs, ("all-to-all", ("context",)))),
    "expert_parallel": EXPERT._replace(needs=(*EXPERT.needs, ("all-reduce", ("data",)))),
    "expert_parallel_8": EXPERT,
}
# FSDP may leave parameters too small to split whole (norms, biases): at most this much more
# state per device than the formula. Measured: 1.000 (fsdp.py), 1.060 (the presets' fsdp: the
# norms whole), 1.026 (hsdp), 1.021 (fsdp_tp); every other strategy exactly its formula.
WHOLE_SMALL_PARAMETERS = 1.10


def meant_pieces(meant, path, mesh):
    """How many pieces the strategy cuts the parameter at `path` into."""
    if meant.experts and EXPERTS.search(path):
        axes = meant.experts
    else:
        axes = meant.kernels if KERNELS.search(path) else meant.rest
    return math.prod(mesh.shape[axis] for axis in axes)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_preset_is_what_its_strategy_means(name):
    """Every strategy and preset, on its default model: the state on a device is the strategy's
    formula (a data-parallel copy whole; FSDP 1/N of everything; tensor parallelism Megatron's
    kernels 1/M and the rest whole; FSDP+TP the kernels 1/(D M) and the rest 1/D; the pipeline
    1/S; expert parallelism the experts 1/E'), and its step holds the collectives the strategy
    needs, each over the devices of its mesh axes."""
    module, meant = STRATEGIES[name][0], MEANT[name]
    # The runs test_equivalence.py trains anyway; one step of the presets only -m full trains
    result = run(name) if name in EVERY_LAYOUT else run(name, steps=1, eval_every=0)
    state, mesh = result.state, mesh_of(module, result.state)
    params = {
        jax.tree_util.keystr(path, simple=True, separator="/"): leaf
        for path, leaf in jax.tree_util.tree_leaves_with_path(common.unbox(state.params))
    }
    expected = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(
        common.unbox((state.params, state.opt_state))
    ):
        where = jax.tree_util.keystr(path, simple=True, separator="/")
        of = [p for p in params if where.endswith(p) and params[p].shape == leaf.shape]
        copies = DEVICES if module is pmap_dp else 1  # pmap's state: a copy per device, stacked
        pieces = meant_pieces(meant, max(of, key=len), mesh) if of else 1
        expected += leaf.nbytes // copies / pieces
    _, per_device = state_bytes(state)
    print(f"\n{name}: {per_device:,} state bytes per device, {per_device / expected:.3f} x formula")
    assert expected <= per_device <= WHOLE_SMALL_PARAMETERS * expected
    found = [(c["op"], c["line"]) for c in hlo.hlo_collectives(result.compiled.as_text())]
    for op, axes in meant.needs:
        groups = device_groups(mesh, axes)
        assert any(
            o == op
            and (
                all(any(set(pair) <= g for g in groups) for pair in pairs_of(line))
                if op == "collective-permute"
                else covers({frozenset(g) for g in replica_groups(line) or ()}, groups)
            )
            for o, line in found
        ), f"{name}: no {op} over {axes}"


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
        value = leaf.get_value() if fsdp.is_sharded(leaf) else leaf
        if value.size >= config.min_shard_size:
            assert fsdp.is_sharded(leaf), name
            axis = leaf.out_sharding.index("data")
            expected = (
                value.shape[:axis] + (value.shape[axis] // DEVICES,) + value.shape[axis + 1 :]
            )
            assert value.addressable_data(0).shape == expected, name
            sharded += 1
        else:
            assert value.sharding.is_fully_replicated, name
    assert sharded >= 6 * SMALL["layers"]  # every kernel of every block, at least
    leaves = jax.tree.leaves((result.state.params, result.state.opt_state), is_leaf=fsdp.is_sharded)
    expected = sum(
        x.get_value().nbytes // DEVICES if fsdp.is_sharded(x) else x.nbytes for x in leaves
    )
    total, per_device = state_bytes(result.state)
    print(
        f"\nfsdp: {per_device} of {total} state bytes on device 0 "
        f"({per_device / total * DEVICES:.3f} x total/8)"
    )
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
    """By default a block's parameters are all-gathered for the forward pass and again for the
    backward, which computes from them again all but the matmuls' outputs (dots_saveable): every
    parameter but fc2's bias (nothing computed again reads it), float32 and bfloat16 alike; the
    embedding's and the head's once. --keep-gathered: every parameter once a step, for two
    micro-batches, under --remat and a clipping threshold that binds. In the program JAX hands
    to XLA and in the compiled step (common.CPU_COMPILER_OPTIONS keeps XLA:CPU from merging the
    two gathers); both train as one device does."""
    flags = dict(keep_gathered=True, microbatches=2, remat=True, clip_norm=0.05) if keep else {}
    config, result = fsdp.Config(**{**SMALL, **flags}), run("fsdp", **flags)
    mesh, state = fsdp.make_mesh(config), result.state
    spec = fsdp.mesh_specs(state)
    step_fn = jax.jit(
        jax.shard_map(
            functools.partial(fsdp.train_step, config=config),
            mesh=mesh,
            in_specs=(spec, fsdp.batch_spec(mesh)),
            out_specs=(spec, fsdp.P()),
        )
    )
    batch = fsdp.device_batch(common.load_dataset(config).batch(0, 0, config.batch_size), mesh)
    leaves = jax.tree_util.tree_leaves_with_path(state.params, is_leaf=fsdp.is_sharded)
    sharded = {
        jax.tree_util.keystr(path): p.get_value().nbytes for path, p in leaves if fsdp.is_sharded(p)
    }
    kernels = {name: size for name, size in sharded.items() if name.endswith("['kernel']")}
    assert len(kernels) == 4 * SMALL["layers"] + 1  # qkv, out, fc1, fc2 in every block; the head
    gathers = primitive_count(jax.make_jaxpr(step_fn)(state, batch).jaxpr, "all_gather")
    gathered = result.summary["collectives"]["all-gather"]["bytes"]
    print(
        f"\nfsdp, keep gathered {keep}: {gathers} all-gathers for {len(sharded)} sharded "
        f"parameters, {len(kernels)} of them kernels; compiled: {gathered:,} bytes, "
        f"{gathered / sum(sharded.values()):.2f} x the parameters"
    )
    residual = re.compile(r"\['fc2'\]\['bias'\]$")
    again = {n: size for n, size in sharded.items() if "block_" in n and not residual.search(n)}
    assert gathers == len(sharded) + (0 if keep else len(again))
    assert gathered == sum(sharded.values()) + (0 if keep else sum(again.values()))
    bf16 = dataclasses.replace(config, dtype="bfloat16")
    shapes = fsdp.init_state(bf16, mesh, shapes_only=True)
    step_bf16 = jax.shard_map(
        functools.partial(fsdp.train_step, config=bf16),
        mesh=mesh,
        in_specs=(fsdp.mesh_specs(shapes), fsdp.batch_spec(mesh)),
        out_specs=(fsdp.mesh_specs(shapes), fsdp.P()),
    )
    assert primitive_count(jax.make_jaxpr(step_bf16)(shapes, batch).jaxpr, "all_gather") == gathers
    ref = reference(clip_norm=flags.get("clip_norm", 1.0))
    assert not keep or min(ref.grad_norms) > flags["clip_norm"]  # it clips every step
    compare("fsdp", result, ref, flags)


# Every pytest: FSDP; -m full: HSDP, whose whole parameters are averaged across the replicas too
@pytest.mark.parametrize("name", matrix(["fsdp", "hsdp"], ["fsdp"]))
def test_parameters_below_min_shard_size_stay_whole_and_match(name):
    """--min-shard-size 100: the norms' scales and biases and the biases of 64 values are whole
    on every device, their gradients averaged as data parallelism does; the rest split."""
    flags = {"min_shard_size": 100}
    result = run(name, **flags)
    boxes = jax.tree_util.tree_leaves_with_path(result.state.params, is_leaf=fsdp.is_sharded)
    whole = [jax.tree_util.keystr(p) for p, box in boxes if not fsdp.is_sharded(box)]
    sizes = [(box.get_value() if fsdp.is_sharded(box) else box).size for _, box in boxes]
    assert all(fsdp.is_sharded(b) == (n >= 100) for (_, b), n in zip(boxes, sizes, strict=True))
    assert len(whole) == 7 * SMALL["layers"] + 2, whole  # per block 2 norms and 3 biases; ln_f
    compare(name, result, reference(), flags)


def test_a_parameter_no_stage_count_divides_stays_whole_and_matches():
    """A model 63 wide on 2 stages: the final norm's scale and bias (63 values) cannot be split
    over 'stage', so every device holds them whole, and their gradient, made on the last stage
    only, is summed over the stages (pipeline.py's scatter_embed_and_head) rather than
    reduce-scattered."""
    flags = {"d_model": 63, "heads": 7}
    result = run("pipeline_1f1b", **flags)
    shapes = shard_shapes(result)
    assert shapes["head/ln_f/scale"] == shapes["head/ln_f/bias"] == (63,)
    assert shapes["embed/position/embedding"] == (SMALL["seq_len"] // 2, 63)  # split over 'stage'
    compare("pipeline_1f1b", result, reference(**flags), flags)


def test_fsdp_gathers_a_tied_table_for_each_use():
    """--tie-embeddings: the one table is gathered for the lookup, and for the head as its
    kernel was (once: the head's backward pass follows its forward); no other copy of it is
    stored or gathered."""
    result = run("fsdp", tie_embeddings=True)
    leaves = jax.tree_util.tree_leaves_with_path(result.state.params, is_leaf=fsdp.is_sharded)
    sharded = {
        jax.tree_util.keystr(path, simple=True, separator="/"): p.get_value().nbytes
        for path, p in leaves
        if fsdp.is_sharded(p)
    }
    residual = re.compile(r"fc2/bias$")  # what a block gathers again: as above
    again = sum(size for n, size in sharded.items() if "block_" in n and not residual.search(n))
    table = sharded["embed/token/embedding"]
    assert not any(name.startswith("head/") and "token" in name for name in sharded)
    gathered = result.summary["collectives"]["all-gather"]["bytes"]
    assert gathered == sum(sharded.values()) + again + table, (gathered, table)
    compare("fsdp", result, reference(tie_embeddings=True), {"tie_embeddings": True})


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


@pytest.mark.parametrize(
    "name, expert, capacity_factor",
    matrix(
        [("expert_parallel", 4, 0.0), ("expert_parallel_8", 8, 0.0), ("expert_parallel", 4, 2.0)],
        [("expert_parallel", 4, 0.0), ("expert_parallel_8", 8, 0.0)],
    ),
)
def test_expert_parallel_splits_experts_and_sends_tokens_to_them(name, expert, capacity_factor):
    """Each device holds experts/E' whole experts (and their Adam moments), everything else
    whole. Dropless, per block: an all-gather over 'expert' of the group's tokens, E' x rows x
    length x d_model x 4 bytes (and of their choices and gates, rows x length x k each), and a
    reduce-scatter of their outputs as big; backward, the reverse. With a capacity, four
    all-to-alls over 'expert' (tokens there and back, forward and backward), each carrying a
    device's slots: experts x rows x capacity x d_model x 4 bytes. Of each, (E' - 1) / E'
    leaves the device; nothing else moves but the reductions."""
    result = run(name, capacity_factor=capacity_factor) if capacity_factor else run(name)
    shapes, d, experts = shard_shapes(result), SMALL["d_model"], MOE["experts"]
    for layer in range(SMALL["layers"]):
        mlp = f"block_{layer}/mlp"
        assert shapes[f"{mlp}/fc1/kernel"] == (experts // expert, d, 4 * d)
        assert shapes[f"{mlp}/fc2/kernel"] == (experts // expert, 4 * d, d)
        assert shapes[f"{mlp}/router/kernel"] == (d, experts)  # replicated
        assert shapes[f"block_{layer}/attn/qkv/kernel"] == (d, 3 * d)
    total, per_device = state_bytes(result.state)
    expert_bytes = sum(
        x.nbytes
        for path, x in jax.tree_util.tree_leaves_with_path(
            (result.state.params, result.state.opt_state)
        )
        if "['mlp']['fc" in jax.tree_util.keystr(path)  # the routed experts' (not 'shared')
    )
    assert per_device == (total - expert_bytes) + expert_bytes // expert  # the layout's prediction
    config = common.Config(**{**SMALL, **MOE, "capacity_factor": capacity_factor})
    rows, length, layers = SMALL["batch_size"] // DEVICES, SMALL["seq_len"], SMALL["layers"]
    found = [c for c in hlo.hlo_collectives(result.compiled.as_text()) if c["op"] != "all-reduce"]
    if capacity_factor:
        carried = {experts * rows * common.capacity(config, length) * d * 4: 4 * layers}
        ops = {"all-to-all"}
    else:
        tokens, choices = expert * rows * length * d * 4, expert * rows * length * MOE["top_k"] * 4
        # all-gathers: tokens, choices, gates, and the outputs' gradient; reduce-scatters: the
        # outputs, and the gradients of the tokens and the gates
        carried = {tokens: 4 * layers, choices: 3 * layers}
        ops = {"all-gather", "reduce-scatter"}
    assert {op["op"] for op in found} == ops
    assert {size: sum(c["bytes"] == size for c in found) for size in carried} == carried
    assert len(found) == sum(carried.values())
    groups = {tuple(row) for row in np.arange(DEVICES).reshape(DEVICES // expert, expert).tolist()}
    assert all(replica_groups(c["line"]) == groups for c in found)
    print(
        f"\n{name} --capacity-factor {capacity_factor}: per step "
        + ", ".join(f"{n} {'/'.join(sorted(ops))} of {size:,} bytes" for size, n in carried.items())
        + f", (E' - 1) / E' of each leaving the device; state {per_device:,} of {total:,} bytes "
        "per device"
    )


@pytest.mark.parametrize("name", ["pjit_tp", "logical_tp"])
def test_tensor_parallelism_is_megatron(name):
    """Per block, two all-reduces of an activation over 'model' forward (after attn/out and
    fc2) and two backward (the input gradients of qkv and fc1); with the vocabulary split, one
    after the embedding lookup (each device looks up its part of the vocabulary) and one of the
    head's input gradient; no weight is all-gathered; the only other collective is the
    data-parallel gradient all-reduce."""
    summary = run(name).summary
    # Float32, data=2
    activation = SMALL["batch_size"] // 2 * SMALL["seq_len"] * SMALL["d_model"] * 4
    by_group = {}
    for c in hlo.hlo_collectives(run(name).compiled.as_text()):
        groups = frozenset(replica_groups(c["line"]) or ())
        by_group.setdefault((c["op"], groups), []).append(c["bytes"] * c["runs"])
    model_reduces = by_group.pop(("all-reduce", frozenset(MODEL_GROUPS)))
    gradient_reduces = by_group.pop(("all-reduce", frozenset(DATA_GROUPS)))
    # Besides the activations, small ones: the loss's per-position maxima and sums over the split
    # vocabulary, and the clipping norm's partial sums; XLA may fuse one into an activation's.
    per_position = SMALL["batch_size"] // 2 * SMALL["seq_len"] * 4
    activations = [size for size in model_reduces if size >= activation]
    print(
        f"\n{name}: {len(activations)} activation all-reduces over model, {len(gradient_reduces)} "
        "over data"
    )
    assert len(activations) == 4 * SMALL["layers"] + 2
    assert all(size - activation <= per_position + 64 for size in activations)
    assert all(size <= per_position for size in model_reduces if size < activation)
    assert len(gradient_reduces) >= 1 and not by_group, by_group
    assert summary["collectives"]["all-gather"]["bytes"] < 0.1 * summary["param_bytes"]


def users_shapes(hlo, name):
    """The result shapes of the instructions that use %name (through a tuple's elements too)."""
    shapes = []
    for line in hlo.splitlines():
        used = re.match(r"\s*(?:ROOT )?%(\S+) = (\S+) (\S+)\(.*%" + re.escape(name) + r"[,)]", line)
        if used and used.group(1) != name:
            target, shape, op = used.groups()
            if op == "get-tuple-element":
                shapes += users_shapes(hlo, target)
            else:
                shapes.append(shape.split("{")[0])
    return shapes


@pytest.mark.parametrize("name", ["pjit_tp_sp", "logical_tp_sp", "explicit_tp_sp"])
def test_sequence_parallelism_splits_the_residual_stream(name):
    """Megatron's sequence parallelism: per block, each norm's output gathered along the sequence
    over 'model' (an all-gather) before the column-parallel matmul, forward and its gradient
    backward, 2 (2 x layers + 1) in all with the head's; each row-parallel matmul's partial sums
    (4 x layers + 2 as in tensor parallelism, the embedding's and the head's input gradient's
    included) added up into sequence pieces: a reduce-scatter, which XLA:CPU writes as an
    all-reduce that every use reads a piece of. The same bytes move as without it, and the
    temporaries per device fall: the residual stream, the norms and dropout hold 1/model of the
    sequence."""
    result, plain = run(name), run(name.removesuffix("_sp"))
    text, model = result.compiled.as_text(), 4
    rows, length, width = SMALL["batch_size"] // 2, SMALL["seq_len"], SMALL["d_model"]
    activation, piece = rows * length * width * 4, f"f32[{rows},{length // model},{width}]"
    gathers, reduces = [], []
    for c in hlo.hlo_collectives(text):
        groups = frozenset(replica_groups(c["line"]) or ())
        if groups == frozenset(MODEL_GROUPS) and c["bytes"] >= activation:
            name_ = re.match(r"\s*(?:ROOT )?%(\S+) =", c["line"]).group(1)
            (gathers if c["op"] == "all-gather" else reduces).append((c, name_))
    assert len(gathers) == 2 * (2 * SMALL["layers"] + 1)
    assert all(c["bytes"] == activation and "dimensions={1}" in c["line"] for c, _ in gathers)
    assert len(reduces) == 4 * SMALL["layers"] + 2, [c["op"] for c, _ in reduces]
    # Each all-reduce's result read in sequence pieces: a reduce-scatter. (explicit_sharding.py
    # gathers the head's input whole, before its norm, for any contraction making the logits, a
    # tied table's too: the head's input gradient is the one all-reduce read whole there.)
    whole = [
        instruction
        for c, instruction in reduces
        if c["op"] == "all-reduce" and piece not in users_shapes(text, instruction)
    ]
    assert len(whole) <= name.startswith("explicit"), whole
    # Tensor parallelism alone gathers no activation: it all-reduces them whole
    assert not [
        c
        for c in hlo.hlo_collectives(plain.compiled.as_text())
        if c["op"] == "all-gather" and c["bytes"] >= activation
    ]
    temporaries = result.summary["compiled_temp_bytes"], plain.summary["compiled_temp_bytes"]
    print(f"\n{name}: temporaries {temporaries[0]:,} B per device, {temporaries[1]:,} without")
    assert temporaries[0] < 0.8 * temporaries[1]


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


@pytest.mark.parametrize(
    "schedule, layers", matrix([("1f1b", 4), ("interleaved", 8)], [("1f1b", 4)])
)
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
                model_layer = functools.reduce(
                    lambda t, k: t[k.key], path, layer[f"block_{v * 4 + stage}"]
                )
                assert np.array_equal(shard.data[v, 0], model_layer)
    for leaf in jax.tree.leaves(result.state.opt_state[0].mu["blocks"]):
        assert leaf.addressable_data(0).shape[:2] == (groups, 1)
    # The embedding and the head, and their moments, split over 'stage' too: a quarter each.
    moments = result.state.opt_state[0]
    for tree in (result.state.params, moments.mu, moments.nu):
        for leaf in jax.tree.leaves({k: v for k, v in tree.items() if k != "blocks"}):
            assert leaf.addressable_data(0).size * 4 == leaf.size
    # Gathered whole for the step, their gradients reduce-scattered
    ops = collectives(result.compiled)
    assert MODEL_GROUPS in ops["all-gather"] and MODEL_GROUPS in ops["reduce-scatter"]
    neighbours = {(s, s + 1) for s in (0, 1, 2, 4, 5, 6)} | (
        {(3, 0), (7, 4)} if groups > 1 else set()
    )
    pairs = set()
    for c in hlo.hlo_collectives(result.compiled.as_text()):
        if c["op"] == "collective-permute":
            pairs |= {
                tuple(map(int, p))
                for p in re.findall(r"\{(\d+),(\d+)\}", c["line"].split("source_target_pairs=")[1])
            }
    assert pairs == neighbours | {(b, a) for a, b in neighbours}  # forward and backward
    assert DATA_GROUPS in collectives(result.compiled)["all-reduce"]


@pytest.mark.parametrize(
    "mesh, context",
    matrix([("data=2,context=4", 4), ("data=1,context=8", 8)], [("data=2,context=4", 4)]),
)
def test_ring_attention_passes_keys_and_values_around_the_ring(mesh, context):
    """Per layer, N - 1 hops of a key block and a value block forward, and of their gradients
    backward, each one device's piece of the sequence; nothing gathers a whole sequence's keys
    or values. Each hop sends to the next device of the same 'data' row of the mesh."""
    result = run("context_parallel", mesh=mesh)
    block = (
        SMALL["batch_size"]
        // (DEVICES // context)
        * SMALL["seq_len"]
        // context
        * SMALL["d_model"]
        * 4
    )
    permutes = [
        c for c in hlo.hlo_collectives(result.compiled.as_text()) if c["op"] == "collective-permute"
    ]
    hops = sum(c["runs"] for c in permutes)
    print(
        f"\n{mesh}: {hops} collective-permutes of {block:,} bytes per step ({SMALL['layers']} "
        "layers)"
    )
    assert hops == SMALL["layers"] * 2 * 2 * (context - 1) and {c["bytes"] for c in permutes} == {
        block
    }
    ring = {
        (row + d, row + (d + 1) % context)
        for row in range(0, DEVICES, context)
        for d in range(context)
    }
    for c in permutes:
        pairs = {
            tuple(map(int, p))
            for p in re.findall(r"\{(\d+),(\d+)\}", c["line"].split("source_target_pairs=")[1])
        }
        # Forward, or the gradients' way back
        assert pairs == ring or pairs == {(b, a) for a, b in ring}
    gathers = [
        c["bytes"]
        for c in hlo.hlo_collectives(result.compiled.as_text())
        if c["op"] == "all-gather"
    ]
    assert all(size < block for size in gathers)


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
def test_one_layout_written_by_hand_matches():
    """FSDP+TP by hand (dev/three_ways.py's manual_step: shard_map, Megatron's operators and
    FSDP's gathers written out) trains what one device trains, in the layout logical_pjit.py's
    fsdp_tp states, with the collectives that layout predicts and no other: per micro-batch an
    all-gather over 'data' of each of the P parameters split over 'data' and a reduce-scatter of
    its gradient; per block 2 all-reduces over 'model' forward (the partial sums after attn/out
    and fc2) and 2 backward (the input gradients of qkv and fc1), plus 1 after the embedding
    lookup and 1 of the head's input gradient: 4 x layers + 2; 1 all-gather over 'model' of the
    logits. (The other two ways, logical_fsdp_tp and explicit_fsdp_tp, are strategies above.)"""
    from dev import three_ways

    config = logical_pjit.Config(**{**SMALL, "rules": "fsdp_tp"})
    result = three_ways.main(config)
    compare("manual_fsdp_tp", result, reference(), real=False)
    check_layout(logical_pjit, config, result.state)
    found = {}
    for c in hlo.hlo_collectives(result.compiled.as_text()):
        groups = replica_groups(c["line"])
        axis = {frozenset(MODEL_GROUPS): "model", frozenset(DATA_GROUPS): "data"}.get(
            frozenset(groups or ()), "all"
        )
        found[(c["op"], axis)] = found.get((c["op"], axis), 0) + c["runs"]
    split = sum(
        bool(three_ways.split_over(s, "data")) for s in three_ways.param_specs(config).values()
    )
    assert found.pop(("all-gather", "data")) == found.pop(("reduce-scatter", "data")) == split
    assert found.pop(("all-reduce", "model")) == 4 * config.layers + 2
    assert found.pop(("all-gather", "model")) == 1
    # Left: the all-reduces of the replicated parameters' gradients, the norm and the metrics
    assert {op for op, _ in found} == {"all-reduce"}, found


SEVERAL = list(DEFAULTS.values()) + [f"pipeline_{s}" for s in pipeline.SCHEDULES if s != "1f1b"]
SEVERAL += LONG


# Every pytest: shard_map's rows (pipeline.py's and a sequence's pieces the same); fsdp.py's
# resume on two processes in tests/test_checkpoints.py. -m full: every script (pmap's stack and
# the compiler's shardings among them).
TWO_PROCESSES = ["shardmap_dp"]


@pytest.mark.parametrize("name", matrix(SEVERAL, TWO_PROCESSES))
def test_two_processes_match_one(name, tmp_path):
    """Each script from the command line, copied alone into a folder, as 2 processes x 4
    devices (told the coordinator's address, or, shardmap_dp.py's, finding it as a SLURM job's
    processes do): the same losses as 1 process x 8. The run stops after the warmup steps, whose
    learning rates do not depend on --steps, so they compare with the 20-step run."""
    metrics = tmp_path / "metrics.jsonl"
    steps = SMALL["warmup_steps"]
    module, strategy_flags = STRATEGIES[name]
    script = module.__name__
    flags = as_flags(
        {**SMALL, **strategy_flags, "steps": steps, "log_every": 1, "metrics_file": metrics}
    )
    # shardmap_dp.py's processes find each other as a SLURM job's do (--distributed)
    with cluster(script, tmp_path, flags, slurm=name == "shardmap_dp") as procs:
        logs = wait_ok(procs, tmp_path)
    record_flags(module, None, argv=procs[1].args[2:])  # process 1's: its --process-id, ...
    assert f"step {steps}/{steps}" in logs[0] and "step " not in logs[1]  # only process 0 reports
    assert f"in {PROCESSES} process(es)" in logs[0]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records[:-1]] == list(range(1, steps + 1)) and "summary" in records[
        -1
    ]
    assert {"loss", "tokens_per_sec"} <= set(records[0])
    one_process = run(name)
    diff = relative([r["loss"] for r in records[:-1]], one_process.losses[:steps])
    norm_diff = relative([r["grad_norm"] for r in records[:-1]], one_process.grad_norms[:steps])
    print(
        f"\n{name}: 2 processes x 4 devices vs 1 x 8: loss {diff:.1e}, gradient norm "
        f"{norm_diff:.1e}"
    )
    assert diff <= RTOL and norm_diff <= RTOL
