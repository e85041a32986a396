"""The lesson's pieces against definitions written here, not read from common.py: what AdamW
decays, the learning rate's schedule, clipping, what --remat saves, the held-out split, what
--dtype bfloat16 computes in.

The equivalence tests run the same common.py on one device and on eight, so a wrong piece of the
lesson is wrong on both sides and passes them. (The mixture of experts' routing against its own
reference: tests/test_experts.py.)"""

import dataclasses
import functools
import itertools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import common
from tests.harness import MOE, SMALL

# By the rule the --weight-decay flag states: kernels and embeddings decay; norms, biases and a
# mixture's balance bias do not. Every parameter of a one-block model, by name.
BLOCK = ("attn/qkv/kernel", "attn/out/kernel", "mlp/fc1/kernel", "mlp/fc2/kernel")
DECAYED = {
    "gpt": {f"block_0/{p}" for p in BLOCK}
    | {"embed/token/embedding", "embed/position/embedding", "head/out/kernel"},
    "llama": {f"block_0/{p}/kernel" for p in ("q", "kv", "o", "gate", "up", "down")}
    | {"embed/embed/token/embedding", "head/head/out/kernel"},  # its pieces: embed, blocks, head
}
DECAYED["moe"] = DECAYED["gpt"] | {
    "block_0/mlp/router/kernel",
    "block_0/mlp/shared/fc1/kernel",
    "block_0/mlp/shared/fc2/kernel",
}
NORMS = {f"{p}/{w}" for p in ("block_0/ln1", "block_0/ln2", "head/ln_f") for w in ("scale", "bias")}
KEPT = {
    "gpt": NORMS
    | {f"block_0/{p}/bias" for p in ("attn/out", "mlp/fc1", "mlp/fc2")}
    | {"block_0/attn/query_bias"},
    "llama": {"block_0/attn_norm/scale", "block_0/mlp_norm/scale", "head/head/norm/scale"},
}
KEPT["moe"] = KEPT["gpt"] | {
    "block_0/mlp/router_bias",
    "block_0/mlp/shared/fc1/bias",
    "block_0/mlp/shared/fc2/bias",
}
MODELS = {"gpt": {}, "moe": MOE, "llama": {"model": "tests.llama"}}


def names(tree) -> dict:
    return {
        jax.tree_util.keystr(path, simple=True, separator="/"): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }


@pytest.mark.parametrize("model", MODELS)
def test_adamw_decays_the_kernels_and_embeddings_only(model):
    """Two steps on a zero gradient: Adam's part of the update is 0, so a parameter moves only by
    its decay, p (1 - lr wd), at the second step's learning rate (the first's is 0)."""
    config = common.Config(**{**SMALL, "layers": 1, **MODELS[model]})
    state = common.create_state(config, common.make_model(config))
    before = names(state.params)
    assert set(before) == DECAYED[model] | KEPT[model]
    zero = jax.tree.map(jnp.zeros_like, state.params)
    two_steps = jax.jit(lambda s: s.apply_gradients(grads=zero).apply_gradients(grads=zero))
    after = names(two_steps(state).params)
    lr = config.lr / config.warmup_steps  # step 1 of the warm-up
    for name, value in before.items():
        decayed = value * (1 - lr * config.weight_decay) if name in DECAYED[model] else value
        np.testing.assert_allclose(after[name], decayed, rtol=1e-6, err_msg=name)
        assert (after[name] != value).any() == (name in DECAYED[model]), name


# Where a run starts, as GPT-2 states it (Radford et al. 2019; nanoGPT): every weight matrix
# and embedding drawn from a normal of standard deviation 0.02, those that write into the
# residual stream (attention's output, the MLP's second layer; an expert's too) 0.02 / sqrt(2 x
# layers); biases 0, norms' scales 1; each drawn on its own. First match wins.
START = (
    (r"/(ln1|ln2|ln_f)/scale$", "ones"),
    (r"/bias$|/router_bias$|/query_bias$", "zeros"),
    (r"/(attn/out|fc2)/kernel$", "residual"),
    (r"/(kernel|embedding)$", "normal"),
)
STARTS = {
    "gpt": {},
    "scanned": {"scan_layers": True},
    "tied": {"tie_embeddings": True},
    "moe": MOE,
    "grouped-query": {"kv_heads": 2, "mlp_dim": 96},
}


def draws(params, scanned) -> dict:
    """{path: values} of every parameter; a scanned model's blocks one by one, as unscanned."""
    found = names(params)
    if scanned:
        for path in [p for p in found if p.startswith("blocks/")]:
            for i, layer in enumerate(found.pop(path)):
                found[path.replace("blocks/", f"block_{i}/")] = layer
    return found


@pytest.mark.parametrize("model", STARTS)
def test_the_run_starts_where_gpt2_says(model):
    """Every initial parameter against START: a normal's mean, standard deviation and share
    within one deviation (0.683; a uniform has 0.577) within 5 standard errors of the stated
    ones; constants exact. Each an independent draw: no two parameters, blocks or experts
    correlated beyond 5 standard errors (the same key drawn twice gives the same numbers,
    whatever the shape). Another --seed starts elsewhere."""
    config = common.Config(**{**SMALL, "layers": 3, "seed": 7, **STARTS[model]})
    state = common.create_state(config, common.make_model(config))
    params = draws(state.params, config.scan_layers)
    residual = 0.02 / math.sqrt(2 * config.layers)
    normals = {}
    for path, x in params.items():
        kind = next(kind for pattern, kind in START if re.search(pattern, "/" + path))
        if kind in ("ones", "zeros"):
            assert (x == (kind == "ones")).all(), path
            continue
        sigma, n = (residual if kind == "residual" else 0.02), x.size
        assert abs(x.mean()) <= 5 * sigma / math.sqrt(n), (path, x.mean())
        assert abs(x.std() / sigma - 1) <= 5 / math.sqrt(2 * n), (path, x.std(), sigma)
        within = (abs(x) < sigma).mean()
        assert abs(within - 0.6827) <= 5 * math.sqrt(0.6827 * 0.3173 / n), (path, within)
        # an expert's kernel is one draw per expert, as a block is one per block
        pieces = x if path.startswith("block") and "mlp/fc" in path and x.ndim == 3 else [x]
        for i, piece in enumerate(pieces):
            normals[f"{path}[{i}]"] = piece.ravel() / sigma
    pairs = itertools.combinations(normals.items(), 2)
    for (a, x), (b, y) in pairs:
        n = min(x.size, y.size)
        assert abs(x[:n] @ y[:n]) / n <= 5 / math.sqrt(n), f"{a} and {b} are not independent"
    seed = dataclasses.replace(config, seed=8)
    other = draws(common.create_state(seed, common.make_model(seed)).params, config.scan_layers)
    assert not any(
        (other[path.split("[")[0]] == params[path.split("[")[0]]).all() for path in normals
    )


def learning_rate(step, lr, warmup, steps):
    """The schedule --lr states: 0 to lr linearly over the warm-up, then down a half cosine to a
    tenth of lr at step --steps, and a tenth after it."""
    if step < warmup:
        return lr * step / warmup
    floor = lr / 10
    progress = min(step - warmup, steps - warmup) / (steps - warmup)
    return floor + (lr - floor) * (1 + math.cos(math.pi * progress)) / 2


def test_the_learning_rate_warms_up_then_falls_along_a_cosine_to_a_tenth():
    """The optimizer's own learning rate at every step (a decayed parameter of 1 with a zero
    gradient moves by lr x weight decay) against the formula."""
    config = common.Config(**SMALL)
    tx, params = common.make_optimizer(config), {"kernel": jnp.ones(())}
    opt_state, zero, rates = tx.init(params), {"kernel": jnp.zeros(())}, []
    for _ in range(config.steps + 3):
        updates, opt_state = tx.update(zero, opt_state, params)
        rates.append(-float(updates["kernel"]) / config.weight_decay)
    expected = [
        learning_rate(step, config.lr, config.warmup_steps, config.steps)
        for step in range(config.steps + 3)
    ]
    np.testing.assert_allclose(rates, expected, rtol=1e-5, atol=1e-9)
    assert rates[config.warmup_steps] == pytest.approx(config.lr)


@pytest.mark.parametrize("bound", [0.5, 1.0, 2.0, 0.0], ids=["above", "at", "below", "off"])
def test_clipping_scales_down_to_the_bound_and_never_up(bound):
    """clip(g, ||g||, c) is g x min(1, c / ||g||): gradients above the bound come out with norm
    c, the others as they are; c = 0 never clips."""
    grads = {"a": jnp.array([3.0, 0.0]), "b": {"c": jnp.array([[4.0]])}}  # global norm 5
    norm = optax.tree.norm(grads)
    max_norm = 5.0 * bound
    clipped = common.clip(grads, norm, max_norm)
    scale = min(1.0, max_norm / 5.0) if max_norm else 1.0
    for got, g in zip(jax.tree.leaves(clipped), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(got, g * scale, rtol=1e-6)
    assert float(optax.tree.norm(clipped)) == pytest.approx(min(5.0, max_norm or 5.0), rel=1e-6)


@functools.cache
def temporaries(**flags) -> int:
    """The compiled single-device step's temporaries (XLA's memory analysis), in bytes."""
    config = common.Config(**{**SMALL, "layers": 4, **flags})
    state = jax.eval_shape(
        functools.partial(common.create_state, config, common.make_model(config))
    )

    def step(state, batch):
        grads, metrics = common.accumulate_gradients(state, batch, state.rng, 1)
        return state.apply_gradients(grads=grads), metrics

    batch = jax.ShapeDtypeStruct((config.batch_size, config.seq_len + 1), jnp.int32)
    compiled = jax.jit(step).lower(state, batch).compile(common.CPU_COMPILER_OPTIONS)
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("scanned", [False, True], ids=["unscanned", "scanned"])
def test_remat_lowers_the_temporaries_with_or_without_scanned_layers(scanned):
    """--remat keeps each block's input only, and the backward pass runs the block again: the
    compiled step's temporaries fall, whether the blocks run one by one or under nn.scan
    (--scan-layers). Measured (4 blocks): 16.8 -> 5.4 MB unscanned (0.32), 22.8 -> 3.9 MB
    scanned (0.17); scanned alone holds more than unscanned (1.36 x: the scan keeps every
    block's residuals stacked), and with --remat less."""
    kept = temporaries(scan_layers=scanned)
    remat = temporaries(scan_layers=scanned, remat=True)
    print(f"\n--remat, scanned={scanned}: {kept:,} -> {remat:,} bytes ({remat / kept:.2f})")
    assert remat < 0.5 * kept
    if scanned:
        assert remat < temporaries(remat=True)


def rows(batches) -> set:
    return {tuple(row) for batch in batches for row in np.asarray(batch).tolist()}


def test_the_held_out_batches_are_the_held_out_splits_and_never_trained_on(tmp_path):
    """What the runs evaluate (common.eval_batches) is the dataset's 'eval' split, batch by
    batch, and shares no sequence with the batches of the training: for the synthetic source
    (its own random streams) and a text file (its last tenth, here bytes that the first nine
    tenths never hold)."""
    text = tmp_path / "input.txt"
    text.write_bytes(bytes(range(97, 123)) * 900 + bytes(range(48, 58)) * 260)  # a-z; then 0-9
    for dataset in ("synthetic", str(text)):
        config = common.Config(**{**SMALL, "dataset": dataset, "eval_batches": 3})
        data = common.load_dataset(config)
        held_out = common.eval_batches(data, config)
        assert len(held_out) == 3
        for i, batch in enumerate(held_out):
            np.testing.assert_array_equal(batch, data.batch(i, 0, config.batch_size, "eval"))
        trained = rows(data.batch(step, 0, config.batch_size) for step in range(config.steps))
        assert not rows(held_out) & trained, dataset
    assert set(np.unique(np.concatenate(held_out))) <= set(range(48, 58))


def equations(jaxpr):
    """Every equation of a jaxpr, those of the jaxprs inside it (jit, remat, custom rules) too."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else [param]:
                sub = getattr(sub, "jaxpr", sub)  # a closed jaxpr's own
                if hasattr(sub, "eqns"):
                    yield from equations(sub)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_bfloat16_runs_every_matmul_in_bfloat16(tie):
    """--dtype bfloat16: every matmul of the model's forward pass (the dense layers, attention's
    scores and sums, the head) takes bfloat16 operands, while the parameters stay float32. (A
    mixture's router is float32 on purpose: tests/test_experts.py.)"""
    config = common.Config(**{**SMALL, "dtype": "bfloat16", "tie_embeddings": tie})
    model = common.make_model(config)
    params = common.init_params(model, jax.random.key(0))
    tokens = jnp.zeros((2, config.seq_len), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda p: model(p, tokens))(params)
    dots = [e for e in equations(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
    types = [tuple(str(v.aval.dtype) for v in e.invars) for e in dots]
    # Per block: qkv, the scores, the weighted sum, out, fc1, fc2; and the head
    assert len(dots) == 6 * config.layers + 1, types
    assert all(t == ("bfloat16", "bfloat16") for t in types), types
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(common.unbox(params)))


def reference_attention(q, k, v):
    """Causal softmax attention in float32, written here: each query head reads the key-value
    head of its group."""
    groups = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(x.astype(jnp.float32), groups, axis=2) for x in (k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k) / math.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones(scores.shape[-2:], bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v).astype(q.dtype)


@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_splash_attention_is_causal_softmax_attention(dtype, tolerance):
    """--attention splash (Pallas's kernel, interpreted on the CPU) against the definition:
    outputs and the three gradients, 4 query heads on 2 key-value heads, 1,024 tokens in 2 x 2
    blocks (bfloat16: within its 8 bits of mantissa)."""
    shapes = [(1, 1024, 4, 16), (1, 1024, 2, 16), (1, 1024, 2, 16)]
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, s, dtype) for key, s in zip(keys, shapes, strict=True))
    splash = functools.partial(common.causal_attention, implementation="splash")
    for attend in (splash, reference_attention):
        assert attend(q, k, v).shape == q.shape
    loss = lambda f: lambda *x: (f(*x).astype(jnp.float32) ** 2).sum()  # noqa: E731
    got, want = (
        jax.jit(jax.value_and_grad(loss(f), (0, 1, 2))) for f in (splash, reference_attention)
    )
    (value, grads), (expected, expected_grads) = got(q, k, v), want(q, k, v)
    np.testing.assert_allclose(value, expected, rtol=tolerance)
    for g, e in zip(grads, expected_grads, strict=True):
        scale = float(jnp.abs(e.astype(jnp.float32)).max())
        np.testing.assert_allclose(
            g.astype(np.float32), e.astype(np.float32), atol=tolerance * scale
        )


def kernel_specs(kernel, *args):
    """The shard_map a TPU kernel runs in under pjit_tp.py's mesh (data=2, model=4, Auto axes,
    no rules): its arguments' specs (after the constants it closes over), traced, not compiled."""
    auto = (jax.sharding.AxisType.Auto,) * 2
    with jax.set_mesh(jax.make_mesh((2, 4), ("data", "model"), axis_types=auto)):
        jaxpr = jax.make_jaxpr(kernel)(*args)
    specs = next(e for e in jaxpr.eqns if e.primitive.name == "shard_map").params["in_specs"]
    return specs[-len(args) :]


def test_the_kernels_take_each_devices_share():
    """Splash attention each device's rows and heads (Megatron's layout), the grouped matmul
    each its rows over every axis that divides them: never the whole batch on every device,
    which computes the same values at 8 x the work."""
    q = jnp.zeros((16, 128, 4, 16))
    assert kernel_specs(common.splash_attention, q, q, q)[0] == jax.P("data", None, "model", None)
    x, kernel, sizes = jnp.zeros((8, 16, 32)), jnp.zeros((4, 32, 32)), jnp.ones((8, 4), jnp.int32)
    specs = kernel_specs(common.megablox_matmul, x, kernel, sizes)
    assert specs[0] == jax.P(("data", "model")) and specs[1] == jax.P()
