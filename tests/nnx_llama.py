"""tests/llama.py written in Flax NNX: the same decoder, as a user of NNX writes it.

One nnx.Module, Model(config, hooks, rngs=rngs), called as model(tokens), its blocks in
self.blocks; every parameter names its axes with nnx.with_partitioning, which the scripts read
as logical names; attention goes through hooks.attend(q, k, v) and positions come from
hooks.positions(length). Nothing else is asked. Train it with any script:
python fsdp.py --model tests/nnx_llama.py
"""

import jax
import jax.numpy as jnp
from flax import nnx

from tests.llama import GROUP, rotary  # plain jax: rotary positions, the grouping


def _init(names, scale=1.0):
    return nnx.with_partitioning(nnx.initializers.normal(0.02 * scale), names)


def _dense(config, features_in, features, names, rngs, scale=1.0):
    return nnx.Linear(
        features_in,
        features,
        use_bias=False,
        kernel_init=_init(names, scale),
        dtype=config.dtype,
        rngs=rngs,
    )


class RMSNorm(nnx.Module):
    def __init__(self, features, rngs):
        self.scale = nnx.Param(
            nnx.initializers.ones(rngs.params(), (features,)), out_sharding=("norm",)
        )

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32**2, axis=-1, keepdims=True) + 1e-6)
        return (normed * self.scale[...]).astype(x.dtype)


class Block(nnx.Module):
    def __init__(self, config, hooks, *, rngs):
        c, self.hooks = config, hooks
        self.heads, self.head_dim = c.heads, c.d_model // c.heads
        kv_width, residual = 2 * (c.heads // GROUP) * self.head_dim, (2 * c.layers) ** -0.5
        hidden = 8 * c.d_model // 3 // 16 * 16 or 16  # SwiGLU's usual width: 2/3 of 4 x d_model
        self.attn_norm = RMSNorm(c.d_model, rngs)
        self.q = _dense(c, c.d_model, c.d_model, ("embed", "heads"), rngs)
        self.kv = _dense(c, c.d_model, kv_width, ("embed", "kv_heads"), rngs)
        self.o = _dense(c, c.d_model, c.d_model, ("heads", "embed"), rngs, residual)
        self.mlp_norm = RMSNorm(c.d_model, rngs)
        self.gate = _dense(c, c.d_model, hidden, ("embed", "mlp"), rngs)
        self.up = _dense(c, c.d_model, hidden, ("embed", "mlp"), rngs)
        self.down = _dense(c, hidden, c.d_model, ("mlp", "embed"), rngs, residual)
        self.dropout = nnx.Dropout(c.dropout, rngs=rngs)

    def __call__(self, x):
        h = self.attn_norm(x)
        q = self.q(h).reshape(*h.shape[:-1], self.heads, self.head_dim)
        kv = self.kv(h).reshape(*h.shape[:-1], self.heads // GROUP, 2, self.head_dim)
        k, v = kv[..., 0, :], kv[..., 1, :]
        positions = self.hooks.positions(x.shape[1])
        q, k = rotary(q, positions), rotary(k, positions)
        k, v = (jnp.repeat(t, GROUP, axis=2) for t in (k, v))  # each key/value head to its group
        attended = self.hooks.attend(q, k, v).reshape(x.shape)
        x = x + self.dropout(self.o(attended))
        h = self.mlp_norm(x)
        gated = nnx.silu(self.gate(h)) * self.up(h)
        return x + self.dropout(self.down(gated))


class Model(nnx.Module):
    def __init__(self, config, hooks, *, rngs):
        self.token = nnx.Embed(
            config.vocab_size,
            config.d_model,
            embedding_init=_init(("vocab", "embed")),
            dtype=config.dtype,
            rngs=rngs,
        )
        self.dropout = nnx.Dropout(config.dropout, rngs=rngs)
        self.blocks = nnx.List([Block(config, hooks, rngs=rngs) for _ in range(config.layers)])
        self.norm = RMSNorm(config.d_model, rngs)
        self.out = _dense(config, config.d_model, config.vocab_size, ("embed", "vocab"), rngs)

    def __call__(self, tokens):
        x = self.dropout(self.token(tokens))
        for block in self.blocks:
            x = block(x)
        return self.out(self.norm(x)).astype(jnp.float32)
