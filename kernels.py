"""The kernels a TPU run uses in place of XLA's (Pallas's), laid out per device: what
--attention splash runs. On a CPU they are interpreted, which is how the tests prove them."""

import functools
import math

import jax
from flax import linen as nn
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks


def splash_attention(q, k, v):
    """causal_attention by Pallas's splash kernel on each device's rows and heads: in a
    shard_map of the axes the compiler partitions, laid as the queries are (their type, or the
    rules'); in a shard_map's body, as the device's own (_unchecked)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:  # one device, or jax.pmap's
        return _splash(q, k, v)
    if not (axes := {*mesh.explicit_axes, *mesh.auto_axes}):
        return _unchecked(_splash)(q, k, v)
    if mesh.explicit_axes:
        spec = jax.typeof(q).sharding.spec
    else:
        spec = nn.logical_to_mesh_axes(("batch", "length", "act_heads", None))
    run = jax.shard_map(
        _splash, in_specs=(spec,) * 3, out_specs=spec, axis_names=axes, check_vma=False
    )
    return run(q, k, v)


def _unchecked(f):
    """f in a shard_map's body, where a Pallas kernel states no varying axes (JAX 0.10, 0.12):
    run unchecked, its output and gradients vary as its inputs do; its backward runs f again."""
    run = functools.partial(
        jax.shard_map, in_specs=jax.P(), out_specs=jax.P(), axis_names=set(), check_vma=False
    )

    def vary(x, like):  # as `like` varies
        axes = jax.typeof(like).manual_axis_type.varying - jax.typeof(x).manual_axis_type.varying
        return jax.lax.pcast(x, tuple(axes), to="varying")

    @jax.custom_vjp
    def unchecked(*args):
        return vary(run(f)(*args), args[0])

    def backward(args, grad):
        def pulled(*a):  # computed here (x * 1), each is typed as f's output is: unvarying
            return jax.vjp(f, *(x * 1 for x in a[:-1]))[1](a[-1] * 1)

        grads = run(pulled)(*args, grad)
        return tuple(vary(g, a) for g, a in zip(grads, args, strict=True))

    unchecked.defvjp(lambda *args: (unchecked(*args), args), backward)
    return unchecked


def _splash(q, k, v):
    """Splash attention on whole arrays, blocks of up to 512 tokens never holding the scores
    whole: compiled on a TPU, interpreted elsewhere; each key-value head with its group."""
    (b, s, h, d), kv = q.shape, k.shape[2]
    blocks = splash.BlockSizes(*[min(512, s)] * 8)  # of the forward, the dq and the dk/dv passes
    causal = masks.MultiHeadMask([masks.CausalMask((s, s))] * (h // kv))
    interpret = jax.devices()[0].platform != "tpu"
    kernel = splash.make_splash_mqa_single_device(causal, block_sizes=blocks, interpret=interpret)
    groups = (q / math.sqrt(d)).reshape(b, s, kv, h // kv, d).transpose(0, 2, 3, 1, 4)
    out = jax.vmap(jax.vmap(kernel))(groups, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3))
    return out.transpose(0, 3, 1, 2, 4).reshape(b, s, h, d)
