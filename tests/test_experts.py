"""The mixture of experts itself (common.MoeMlp): dropless grouping and the grouped matmul,
dispatch and combine, capacity and dropped tokens, shared experts, the load-balancing loss, what
routing costs, and routing shown in the log and the metrics file.
(test_equivalence.py proves every strategy trains it as one device does.)"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import common
from tools import hlo
from tests.harness import MOE, SMALL, TINY, run_script
from dev import routing_cost


def functional(make):
    """The NNX module make() builds as a function of its parameters (nested dicts) and input,
    and those."""
    with nnx.use_eager_sharding(False):  # no mesh here
        graphdef, params, rest = nnx.split(make(), nnx.Param, ...)
    return lambda params, x: nnx.merge(graphdef, params, rest)(x), nnx.to_pure_dict(params)


def mixture(capacity_factor, same_experts=False, hooks=None, **flags):
    """A MoeMlp and the dense Mlp of one config as functions, their parameters, activations."""
    flags = {**SMALL, **MOE, "shared_experts": 0, "router_bias_rate": 0, **flags}
    flags["capacity_factor"] = capacity_factor
    config = common.Config(**flags)
    x = jax.random.normal(jax.random.key(1), (4, config.seq_len, config.d_model))
    moe, moe_params = functional(
        lambda: common.MoeMlp(config, hooks or common.Hooks(), rngs=nnx.Rngs(2))
    )
    mlp, mlp_params = functional(lambda: common.Mlp(config, rngs=nnx.Rngs(3)))
    if same_experts:  # every expert a copy of the dense MLP
        for layer in ("fc1", "fc2"):
            for name, value in mlp_params[layer].items():
                moe_params[layer][name] = jnp.broadcast_to(value, (config.experts, *value.shape))
    return config, moe, moe_params, mlp, mlp_params, x


def test_experts_that_are_one_mlp_give_that_mlp():
    """Each token's outputs are weighted by its top-k gates, which sum to 1: with every expert the
    same MLP and no token dropped, the mixture is that MLP, whatever the router says."""
    config, moe, moe_params, mlp, mlp_params, x = mixture(0, same_experts=True)
    out, stats = moe(moe_params, x)
    np.testing.assert_allclose(out, mlp(mlp_params, x), rtol=1e-5, atol=1e-6)
    assert float(stats["dropped_tokens"]) == 0
    assert float(stats["expert_tokens"].sum()) == x.shape[0] * x.shape[1] * config.top_k


def test_dropless_is_the_capacity_path_with_room_for_every_token():
    """Grouped by expert (sort, grouped matmul, back to their places), every token reaches its
    experts: the outputs, the routing counts and every gradient those of one-hot dispatch with a
    capacity of the whole sequence (--capacity-factor E / k), within float32 rounding."""
    _, dropless, params, *_, x = mixture(0)
    config, full, *_ = mixture(MOE["experts"] / MOE["top_k"])
    assert common.capacity(config, config.seq_len) == config.seq_len

    def outputs(moe, params):
        out, stats = moe(params, x)
        return jnp.sum(out * jnp.cos(x)) + stats["aux_loss_sum"], (out, stats)

    (_, (out, stats)), grads = jax.value_and_grad(outputs, argnums=1, has_aux=True)(
        dropless, params
    )
    (_, (out_full, stats_full)), grads_full = jax.value_and_grad(outputs, argnums=1, has_aux=True)(
        full, params
    )
    np.testing.assert_allclose(out, out_full, rtol=0, atol=1e-6 * float(jnp.abs(out_full).max()))
    assert float(stats["dropped_tokens"]) == 0 == float(stats_full["dropped_tokens"])
    np.testing.assert_array_equal(stats["expert_tokens"], stats_full["expert_tokens"])
    np.testing.assert_allclose(stats["aux_loss_sum"], stats_full["aux_loss_sum"], rtol=1e-6)
    for path, g in jax.tree_util.tree_leaves_with_path(grads_full):
        mine = grads
        for key in path:
            mine = mine[key.key]
        scale = float(jnp.abs(g).max())
        assert scale > 0 and float(jnp.abs(mine - g).max()) <= 1e-5 * scale, path


def test_a_choice_of_another_devices_expert_is_skipped():
    """common.grouped_by_expert runs one part of the experts (expert_parallel.py: a device's
    own): the parts' outputs add up to all the experts' at once."""
    config, moe, params, *_, x = mixture(0)
    expert = jax.random.randint(jax.random.key(5), (*x.shape[:2], 2), 0, config.experts)
    gate = jax.random.uniform(jax.random.key(6), expert.shape)

    def part(shard, shards):  # the experts of one part, as a device holds them
        here = config.experts // shards
        mine = {
            name: jax.tree.map(lambda p: p[shard * here : (shard + 1) * here], params[name])
            for name in ("fc1", "fc2")
        }
        experts = common.build(common.MoeMlp, config, common.Hooks(), jax.random.key(0))
        nnx.update(experts, {**params, **mine})
        return common.grouped_by_expert(
            experts.fc1, experts.fc2, config.experts, x, expert, gate, shard, shards
        )

    whole = part(0, 1)
    parts = sum(part(shard, 4) for shard in range(4))
    assert float(jnp.abs(whole).max()) > 0
    np.testing.assert_allclose(parts, whole, rtol=0, atol=1e-6 * float(jnp.abs(whole).max()))


def test_shared_experts_take_every_token():
    """--shared-experts N: one MLP N times as wide as an expert beside the routed ones, its
    output added to theirs whatever the router says."""
    config, moe, params, *_, x = mixture(0, shared_experts=2)
    assert params["shared"]["fc1"]["kernel"].shape == (config.d_model, 2 * 4 * config.d_model)
    out, _ = moe(params, x)
    routed_config, routed, *_ = mixture(0)
    routed_params = {name: value for name, value in params.items() if name != "shared"}
    routed_out, _ = routed(routed_params, x)
    shared_mlp, _ = functional(lambda: common.Mlp(config, 2, rngs=nnx.Rngs(0)))
    shared = shared_mlp(params["shared"], x)
    assert float(jnp.abs(shared).max()) > 0
    np.testing.assert_allclose(out, routed_out + shared, rtol=1e-6, atol=1e-7)
    # No dropout of their own, one shared expert or more: the mixture's follows their sum
    for count in (1, 2):
        dropping = common.Config(**{**SMALL, **MOE, "shared_experts": count, "dropout": 0.5})
        made = common.build(common.MoeMlp, dropping, common.Hooks(), jax.random.key(0))
        assert made.shared.dropout.rate == 0 and made.dropout.rate == 0.5


def test_dropless_routing_grows_with_the_tokens_and_capacity_with_their_square():
    """Routing alone (the experts skipped), forward and backward, compiled: 4 x the tokens
    costs dropless routing about 4 x the temporaries and FLOPs (a sort, gathers), and one-hot
    dispatch about 16 x (its buffers are length x capacity, the capacity a share of the
    length). dev/routing_cost.py prints the figures."""
    short, long = (
        {factor: routing_cost.cost(length, factor, routing_only=True) for factor in (0.0, 2.0)}
        for length in (256, 1024)
    )
    print(f"\nrouting alone (temporaries, FLOPs): 256 tokens {short}, 1024 tokens {long}")
    for measure in (0, 1):
        assert long[0.0][measure] <= 5 * short[0.0][measure]
        assert long[2.0][measure] >= 12 * short[2.0][measure]
        assert long[0.0][measure] * 10 <= long[2.0][measure]


def test_the_bias_chooses_and_the_probabilities_weigh():
    """--router-bias-rate: the bias is added to the router's probabilities only to choose the
    experts. A bias of 10 on expert 0 makes it every token's first choice, while its gate stays
    its probability, renormalised over the two chosen, as without a bias."""
    config, moe, params, *_, x = mixture(0, router_bias_rate=0.001)
    assert params["router_bias"].shape == (config.experts,)
    params["router_bias"] = params["router_bias"].at[0].set(10.0)
    _, stats = moe(params, x)
    assert float(stats["expert_tokens"][0]) == x.shape[0] * x.shape[1]  # every token's
    probs = jax.nn.softmax(x @ params["router"]["kernel"])
    first = probs[..., 0]
    second = jnp.max(probs[..., 1:], -1)
    gates = {}

    def record(mixture, x, expert, gate):
        gates["expert"], gates["gate"] = expert, gate
        return mixture(x, expert, gate)

    _, recording, *_ = mixture(0, router_bias_rate=0.001, hooks=common.Hooks(dropless=record))
    recording(params, x)
    assert (gates["expert"][..., 0] == 0).all()
    np.testing.assert_allclose(gates["gate"][..., 0], first / (first + second), rtol=1e-5)


def test_the_bias_moves_against_each_experts_excess_load():
    """After a step the bias is -rate x sign(the expert's tokens - its fair share): down for an
    expert that got more, up for one that got less (DeepSeek-V3). Its entry in the gradient is
    that excess as a share of the tokens, left out of the gradient's norm; it has no Adam
    moments."""
    flags = {**SMALL, **MOE, "layers": 1, "router_bias_rate": 0.01, "clip_norm": 0.05}
    config = common.Config(**flags)
    state = common.create_state(config, common.make_model(config))
    batch = common.load_dataset(config).batch(0, 0, config.batch_size)
    accumulate = jax.jit(
        common.accumulate_gradients, static_argnums=3
    )  # compiled: seconds, not tens
    grads, metrics = accumulate(state, batch, state.rng, 1)
    tokens = config.batch_size * config.seq_len
    fair = tokens * config.top_k / config.experts
    excess = np.asarray(metrics["expert_tokens"]) - fair
    assert (excess != 0).any()
    entry = grads["block_0"]["mlp"]["router_bias"]
    np.testing.assert_allclose(entry, excess / config.top_k / tokens, rtol=1e-6)
    norm = optax.tree.norm(common.learned(grads))
    assert float(norm) < float(optax.tree.norm(grads))  # the entry is not in the norm
    assert float(norm) > config.clip_norm  # clipped: the bias's step does not shrink with it
    after = jax.jit(
        lambda state: state.apply_gradients(grads=common.clip(grads, norm, config.clip_norm))
    )(state)
    np.testing.assert_array_equal(
        after.params["block_0"]["mlp"]["router_bias"], -0.01 * np.sign(excess)
    )
    adam_leaves = [
        path
        for path, _ in jax.tree_util.tree_leaves_with_path(after.opt_state)
        if "router_bias" in jax.tree_util.keystr(path)
    ]
    assert adam_leaves == []
    # The bias's rule keeps no state, as in the checkpoints of every version before (one
    # optax.EmptyState): a chain of two (scale_by_sign, scale) could not restore them.
    assert after.opt_state.inner_states["balance"].inner_state == optax.EmptyState()


def test_capacity_drops_the_later_tokens_and_counts_them():
    """An expert takes at most `capacity` tokens of a sequence; the choices past it are dropped,
    counted, and every other choice is kept. Dropless, the same tokens keep them all."""
    config, moe, params, *_, x = mixture(0.5)
    assert common.capacity(config, config.seq_len) == 4  # 0.5 x 32 tokens x 2 choices / 8 experts
    _, stats = moe(params, x)
    per_expert, dropped = np.asarray(stats["expert_tokens"]), float(stats["dropped_tokens"])
    assert (per_expert <= x.shape[0] * 4).all() and dropped > 0
    assert per_expert.sum() + dropped == x.shape[0] * config.seq_len * config.top_k
    _, unlimited, *_ = mixture(0)
    _, stats = unlimited(params, x)
    assert float(stats["dropped_tokens"]) == 0


def test_capacity_routing_is_gshards_order():
    """With a capacity, each expert takes a sequence's choices in GShard's order, every token's
    first choice (along the sequence) before any token's second, and drops the choices past its
    capacity. The mixture's output and drops against that order written as a plain loop, each
    kept choice through its expert's MLP token by token, weighted by its renormalised gate."""
    config, moe, params, *_, x = mixture(0.5)
    room, (rows, length, _) = common.capacity(config, config.seq_len), x.shape
    out, stats = moe(params, x)
    probs = np.asarray(jax.nn.softmax(x @ params["router"]["kernel"]))
    chosen = np.argsort(-probs, axis=-1)[..., : config.top_k]
    gates = np.take_along_axis(probs, chosen, -1)
    gates /= gates.sum(-1, keepdims=True)
    fc1, fc2 = params["fc1"], params["fc2"]
    expected, dropped = np.zeros(x.shape, np.float32), 0
    for r in range(rows):
        taken = [0] * config.experts
        for choice in range(config.top_k):  # first choices first, then second ones
            for t in range(length):
                e = chosen[r, t, choice]
                if taken[e] == room:
                    dropped += 1
                    continue
                taken[e] += 1
                h = jax.nn.gelu(x[r, t] @ fc1["kernel"][e] + fc1["bias"][e])
                expected[r, t] += gates[r, t, choice] * (h @ fc2["kernel"][e] + fc2["bias"][e])
    assert 0 < dropped == float(stats["dropped_tokens"])
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-5 * float(np.abs(expected).max()))


def test_the_router_computes_in_float32_under_bfloat16():
    """Which experts a token goes to must not hang on bfloat16's rounding: the router's logits
    are float32, its input's bfloat16 values times its float32 kernel."""
    config, moe, params, *_, x = mixture(0, dtype="bfloat16")
    x = x.astype(jnp.bfloat16)
    router = common.build(common.MoeMlp, config, common.Hooks(), jax.random.key(0)).router
    nnx.update(router, params["router"])
    logits = router(x)
    assert logits.dtype == jnp.float32
    exact = np.asarray(x, np.float64) @ np.asarray(params["router"]["kernel"], np.float64)
    np.testing.assert_allclose(logits, exact, rtol=0, atol=1e-5 * np.abs(exact).max())


@pytest.mark.parametrize("even", [True, False])
def test_load_balancing_loss_is_one_when_even(even):
    """Switch's loss, E x sum of (share of choices) x (mean probability), per sequence: 1 for a
    router that gives every expert the same probability; about E/2 for one that sends every
    token first to expert 0 (half the choices, probability near 1)."""
    config, moe, params, *_, x = mixture(0, router_aux_weight=1.0)
    x = jnp.abs(x)  # positive, so that a router column of ones prefers its expert for every token
    params["router"]["kernel"] = jnp.zeros_like(params["router"]["kernel"])
    if not even:
        params["router"]["kernel"] = params["router"]["kernel"].at[:, 0].set(1.0)
    _, stats = moe(params, x)
    balance = float(stats["aux_loss_sum"]) / (x.shape[0] * x.shape[1])  # per token, weight 1
    assert balance == pytest.approx(1.0 if even else config.experts / 2, rel=1e-3)


def test_routing_is_in_the_log_and_the_metrics(tmp_path):
    """Each log line and metrics record says how the tokens were routed: the load-balancing
    loss, the fewest and most tokens an expert got in a block, the share dropped."""
    done = run_script(
        "expert_parallel",
        tmp_path,
        *TINY,
        "--capacity-factor",
        "0.5",
        "--metrics-file",
        "m.jsonl",
        "--eval-every",
        "0",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "mesh data=2,expert=4, experts split over 'expert'" in done.stdout
    lines = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert lines and all(
        " | aux " in line and "expert tokens " in line and "% dropped" in line for line in lines
    )
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()][:-1]
    for record in records:
        assert (
            record["expert_tokens_min"] <= record["expert_tokens_max"]
            and 0 < record["dropped_share"] < 1
        )
        assert record["aux_loss"] > 0


def test_a_token_costs_its_top_k_experts():
    """The cost report counts the FLOPs of the experts a token goes to, not of all of them: each
    expert is as big as the dense MLP, so a mixture costs top-k - 1 MLPs, its shared experts and
    a router more."""
    dense, moe = common.Config(**SMALL), common.Config(**{**SMALL, **MOE})
    d, flops = SMALL["d_model"], {}
    for name, config in (("dense", dense), ("moe", moe)):
        params = jax.eval_shape(
            lambda config=config: common.init_params(common.make_model(config), jax.random.key(0))
        )
        flops[name] = hlo.flops_per_token(config, params)
    mlp = d * 4 * d + 4 * d + 4 * d * d + d
    assert flops["moe"] - flops["dense"] == 6 * SMALL["layers"] * (
        (MOE["top_k"] - 1 + MOE["shared_experts"]) * mlp + (d + 1) * MOE["experts"]
    )  # the router's kernel, and its balance bias (an add, counted as the other biases are)


def test_one_expert_per_token_still_teaches_the_router():
    """--top-k 1: the gate is the chosen expert's probability itself (Switch). Renormalised over
    one choice it would be 1 whatever the router says, and the router's gradient from the task
    would be rounding (1.7e-8 measured before); now it is of the order of the experts'."""

    def gradient_norms(top_k):
        _, moe, params, *_, x = mixture(0, top_k=top_k, router_aux_weight=0.0)
        target = jax.random.normal(jax.random.key(4), x.shape)

        def task_loss(params):
            out, _ = moe(params, x)
            return jnp.mean((out - target) ** 2)

        g = jax.grad(task_loss)(params)
        return [float(jnp.linalg.norm(g[name]["kernel"])) for name in ("router", "fc1")]

    grads = {top_k: gradient_norms(top_k) for top_k in (1, 2)}
    print(f"\nrouter and fc1 gradient norms: top-1 {grads[1]}, top-2 {grads[2]}")
    for router, experts in grads.values():
        assert router > 1e-3 * experts  # rounding would be ~1e-7 of it


def test_megablox_on_several_rows_is_each_rows_ragged_dot():
    """Several rows' slots, each row grouped by expert, slots to spare: megablox's one grouped
    matmul for them all (the slots sorted by expert) is XLA's ragged_dot of each row."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(3, 8, 16)), jnp.float32)
    kernel = jnp.asarray(rng.normal(size=(4, 16, 24)), jnp.float32)
    sizes = jnp.array([[2, 0, 3, 1], [1, 1, 1, 1], [0, 4, 0, 4]], jnp.int32)  # 6, 4, 8 of 8
    rows = [jax.lax.ragged_dot(x[r], kernel, sizes[r]) for r in range(3)]
    np.testing.assert_allclose(common.megablox_matmul(x, kernel, sizes), jnp.stack(rows), 1e-5)


def test_the_grouped_matmul_is_megablox_on_a_tpu_only(monkeypatch):
    """XLA's ragged_dot here; megablox's kernel where the first device is a TPU."""
    assert common.grouped_matmul() is jax.lax.ragged_dot_general
    monkeypatch.setattr(jax, "devices", lambda *_: [type("TPU", (), {"platform": "tpu"})()])
    assert common.grouped_matmul() is common.megablox_matmul
