"""The kernels a TPU run uses in place of XLA's (Pallas's), laid out per device: what
--attention splash runs, and dropless experts' grouped matmul on a TPU. On a CPU they are
interpreted, which is how the tests prove them."""

import functools
import math

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.experimental.pallas.ops.tpu.megablox import gmm
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks


def splash_attention(q, k, v):
    """causal_attention by Pallas's splash kernel on each device's rows and heads: in a
    shard_map of the axes the compiler partitions, laid as the queries are (their type, or the
    rules', or without rules Megatron's); in a shard_map's body, as the device's own."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:  # one device, or jax.pmap's
        return _splash(q, k, v)
    if not (axes := {*mesh.explicit_axes, *mesh.auto_axes}):
        return _unchecked(_splash)(q, k, v)
    if mesh.explicit_axes:
        spec = jax.typeof(q).sharding.spec
    else:
        spec = nn.logical_to_mesh_axes(("batch", "length", "act_heads", None))
    if not any(spec):  # no rules name them (pjit_tp.py): Megatron's, where the sizes divide
        fits = lambda a, *n: a in axes and all(x % mesh.shape[a] == 0 for x in n)  # noqa: E731
        rows, heads = fits("data", q.shape[0]), fits("model", q.shape[2], k.shape[2])
        spec = jax.P("data" if rows else None, None, "model" if heads else None, None)
    run = jax.shard_map(
        _splash, in_specs=(spec,) * 3, out_specs=spec, axis_names=axes, check_vma=False
    )
    return run(q, k, v)


def _unchecked(f):
    """f in a shard_map's body, where a Pallas kernel states no varying axes (JAX 0.10, 0.12):
    run unchecked, its output varying as its inputs together do; the gradient of an input that
    varies along fewer axes summed over the others, as JAX's own broadcast would be. Its
    backward runs f again."""
    run = functools.partial(
        jax.shard_map, in_specs=jax.P(), out_specs=jax.P(), axis_names=set(), check_vma=False
    )
    varying = lambda x: jax.typeof(x).manual_axis_type.varying  # noqa: E731

    def as_varying(x, axes):
        return jax.lax.pcast(x, tuple(axes - varying(x)), to="varying")

    @jax.custom_vjp
    def unchecked(*args):  # computed here (x * 1), each is typed as f's output is: unvarying
        out = run(lambda *a: f(*(x * 1 for x in a)))(*args)
        return as_varying(out, set().union(*map(varying, args)))

    def backward(args, grad):
        real = [jnp.issubdtype(a.dtype, jnp.inexact) for a in args]  # the others get no gradient

        def pulled(*a):
            def of_reals(*reals):
                it = iter(reals)
                return f(*(next(it) if r else x * 1 for x, r in zip(a[:-1], real, strict=True)))

            reals = (x * 1 for x, r in zip(a[:-1], real, strict=True) if r)
            return jax.vjp(of_reals, *reals)[1](a[-1] * 1)

        axes, grads = set().union(*map(varying, args)), iter(run(pulled)(*args, grad))
        sums = [tuple(axes - varying(a)) for a in args]
        return tuple(
            jax.lax.psum(as_varying(next(grads), axes), s) if r else None
            for r, s in zip(real, sums, strict=True)
        )

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


def grouped_matmul(x, kernel, group_sizes, dimensions=None):
    """jax.lax.ragged_dot_general of dropless routing (common.GROUPED: x [rows, slots, in], each
    row's slots grouped by expert, group_sizes [rows, experts]) by megablox's gmm, one for all
    the rows: in a shard_map's body, as the device's own (_unchecked); under the compiler's axes
    in a shard_map over them, each device its share of the rows (split over the batch's axes,
    then each other axis that divides them) and every expert's kernel whole."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:  # one device, or jax.pmap's
        return _gmm(x, kernel, group_sizes)
    if not (axes := {*mesh.explicit_axes, *mesh.auto_axes}):
        return _unchecked(_gmm)(x, kernel, group_sizes)
    laid = jax.typeof(x).sharding.spec if mesh.explicit_axes else nn.logical_to_mesh_axes(["batch"])
    batch = laid[0] if isinstance(laid[0], tuple) else (laid[0],)
    rows = ()
    for axis in dict.fromkeys((*batch, *mesh.axis_names)):
        if axis in axes and x.shape[0] % math.prod(mesh.shape[a] for a in (*rows, axis)) == 0:
            rows += (axis,)
    spec = jax.P(rows)
    if mesh.explicit_axes:  # explicit mode moves nothing unasked
        x, kernel, group_sizes = (
            jax.sharding.reshard(*a) for a in ((x, spec), (kernel, jax.P()), (group_sizes, spec))
        )
    run = jax.shard_map(
        _gmm, in_specs=(spec, jax.P(), spec), out_specs=spec, axis_names=axes, check_vma=False
    )
    y = run(x, kernel, group_sizes)
    return jax.sharding.reshard(y, jax.P(*laid[:-1])) if mesh.explicit_axes else y


def _gmm(x, kernel, group_sizes):
    """gmm on the rows' slots together, sorted by expert, padded to its tiles: the slots past
    the groups, which gmm skips and leaves unwritten, come out zero, as do their gradients."""
    (rows, slots, d), out = x.shape, kernel.shape[2]
    ends = jnp.cumsum(group_sizes, -1)[:, None]  # each slot's expert; past the groups, the last
    expert = (jnp.arange(slots)[None, :, None] >= ends).sum(-1).reshape(-1)
    order = jnp.argsort(expert, stable=True) if rows > 1 else slice(None)  # one row: sorted
    # Tiles as large as a v5e's VMEM takes in float32: x is read once per tile of the output's
    # columns, each expert's kernel once per tile of rows (tiles of 128: 2.6 x the bytes)
    tm = 512 if rows * slots > 256 else 128
    tiling, room = (tm, min(512, d), min(1024, out)), rows * slots + -rows * slots % tm
    sizes = group_sizes.sum(0)
    filled = (jnp.arange(room) < sizes.sum())[:, None]
    x = jnp.where(filled, jnp.pad(x.reshape(-1, d)[order], ((0, room - rows * slots), (0, 0))), 0)
    interpret = jax.devices()[0].platform != "tpu"
    y = gmm(x, kernel, sizes, x.dtype, tiling, interpret=interpret)
    y = jnp.where(filled, y, 0)[: rows * slots]
    return (y[jnp.argsort(order)] if rows > 1 else y).reshape(rows, slots, out)
