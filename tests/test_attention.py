"""Attention split over devices, beside the scripts' runs: the causal load balance of
context_parallel.py's pieces, each split's bfloat16 error against JAX's own attention, and the
kernel --attention picks on this machine."""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import common
import context_parallel
from tests.harness import matrix


def test_causal_attention_work_is_balanced():
    """Each device holds a piece of the sequence and its mirror, so under the causal mask every
    device attends to as many (query piece, key piece) blocks; contiguous pieces would not."""
    for devices in (4, 8):
        balanced = context_parallel.attention_work(devices)
        contiguous = context_parallel.attention_work(devices, balanced=False)
        print(
            f"\ncontext={devices}: blocks per device {balanced}; contiguous pieces would give "
            f"{contiguous}"
        )
        assert balanced == [2 * devices + 1] * devices  # the docstring's counts
        assert contiguous == [4 * c + 3 for c in range(devices)]
        order = context_parallel.balanced_order(4 * devices, devices)  # pieces of 2 positions
        assert sorted(order) == list(range(4 * devices)) and list(order[:4]) == [
            0,
            1,
            4 * devices - 2,
            4 * devices - 1,
        ]


SPLITS = {
    "ring": context_parallel.ring_attention,
    "all-gather": context_parallel.all_gather_attention,
    "ulysses": functools.partial(
        context_parallel.ulysses_attention, attend=common.causal_attention
    ),
}


@pytest.mark.parametrize("split", matrix(list(SPLITS), ["ring"]))
def test_attention_split_in_bfloat16_is_as_accurate_as_jax(split):
    """Each split of attention in bfloat16 (context=8, 1,024 positions, 16 heads) errs no more
    than 1.2 x as much as jax.nn.dot_product_attention in bfloat16, in its output and in the
    gradients of q, k and v: all compute the scores and the softmax in float32. (The reference is
    float32: its own error, about 1e-7, is nothing beside bfloat16's, about 1e-3. Ulysses runs
    JAX's attention on 16 / 8 heads per call: with one head per call, JAX's own errs 1.4 x more
    in its gradients on XLA:CPU, hence 16 heads.)"""
    length, devices = 1024, 8
    # Auto axes: shard_map places the arrays, made on one device, as its in_specs say
    mesh = jax.make_mesh((devices,), ("context",), axis_types=(jax.sharding.AxisType.Auto,))
    order = context_parallel.balanced_order(length, devices)
    back = np.argsort(order)
    q, k, v, cotangent = (
        jnp.asarray(np.random.default_rng(i).standard_normal((2, length, 16, 32)), jnp.bfloat16)
        for i in range(4)
    )

    def split_attention(q, k, v):
        spec = P(None, "context")
        attend = jax.shard_map(SPLITS[split], mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
        return attend(q[:, order], k[:, order], v[:, order])[:, back]

    def out_and_grads(attend, dtype):
        out, vjp = jax.vjp(jax.jit(attend), *(x.astype(dtype) for x in (q, k, v)))
        return [out, *vjp(cotangent.astype(dtype))]

    exact = out_and_grads(common.causal_attention, jnp.float32)

    def errors(attend, dtype=jnp.bfloat16):
        got = out_and_grads(attend, dtype)
        return [
            float(jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(b))
            for a, b in zip(got, exact, strict=True)
        ]

    split_errors, jax_errors = errors(split_attention), errors(common.causal_attention)
    print(
        f"\nbfloat16, relative to float32 (output, dq, dk, dv): {split} {split_errors}, JAX's "
        f"{jax_errors}; {split} in float32 {errors(split_attention, jnp.float32)}"
    )
    assert all(r <= 1.2 * j for r, j in zip(split_errors, jax_errors, strict=True))
    assert max(errors(split_attention, jnp.float32)) < 1e-5  # and in float32, the same numbers


def test_attention_kernel_on_this_machine(monkeypatch):
    """--attention auto is XLA's kernel on a CPU (cuDNN's needs an NVIDIA GPU and bfloat16); an
    explicit kernel is passed through. On a TPU auto is splash where its blocks of 128 tokens
    divide the sequence (tests/test_tpu.py compiles it)."""
    assert jax.default_backend() == "cpu"
    assert common.attention_kernel(common.Config(dtype="bfloat16")) == "xla"
    assert common.attention_kernel(common.Config(attention="xla")) == "xla"
    model = common.make_model(common.Config(attention="xla"))
    assert model.hooks.attend.args[0].keywords == {"implementation": "xla"}
    tpu = types.SimpleNamespace(platform="tpu", device_kind="TPU v5 lite")
    monkeypatch.setattr(jax, "devices", lambda: [tpu])
    kernel = {n: common.attention_kernel(common.Config(seq_len=n)) for n in (64, 128, 1024)}
    assert kernel == {64: "xla", 128: "splash", 1024: "splash"}
    assert common.attention_kernel(common.Config(seq_len=128, attention="xla")) == "xla"
