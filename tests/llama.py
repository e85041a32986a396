"""A Llama-style decoder: a model the scripts were not written for, to prove them on.

It differs from common.py's GPT where real models differ: RMSNorm without biases, rotary
position embeddings in place of a learned table, a SwiGLU MLP, no biases anywhere, an untied
head, and grouped-query attention (two query heads share each key/value head). It keeps the
model contract of common.py and nothing more: one NNX Model of linen layers (each brought in
through flax.nnx.bridge at the end of this file), its blocks in self.blocks, logical axis names
on every parameter, attention through self.attend and positions through self.positions. Train
it with any script: python fsdp.py --model tests/llama.py
"""

import typing

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx import bridge

import common


GROUP = 2  # query heads per key/value head


def _init(names, scale=1.0):
    return nn.with_logical_partitioning(nn.initializers.normal(0.02 * scale), names)


def _dense(config, features, names, name, scale=1.0):
    return nn.Dense(
        features, use_bias=False, kernel_init=_init(names, scale), dtype=config.dtype, name=name
    )


class RMSNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        scale = self.param(
            "scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)), (x.shape[-1],)
        )
        x32 = x.astype(jnp.float32)
        return (
            x32 * jax.lax.rsqrt(jnp.mean(x32**2, axis=-1, keepdims=True) + 1e-6) * scale
        ).astype(x.dtype)


def rotary(x, positions):
    """Rotate each pair of a head's features by an angle proportional to the token's position.
    x: [batch, length, heads, head_dim]; positions: [length]."""
    half = x.shape[-1] // 2
    angles = positions[:, None] / 10_000 ** (jnp.arange(half) / half)  # [length, half]
    sin, cos = jnp.sin(angles)[:, None, :], jnp.cos(angles)[:, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


# The activations' logical names, as common.py's GPT gives them, so that rules splitting the
# sequence (pjit_tp.py --sequence-parallel, --rules tp_sp) split the residual stream and gather
# a norm's output for the matmuls after it; without such rules they change nothing.
def residual_stream(x):
    return nn.with_logical_constraint(x, ("batch", "length", "act_embed"))


def whole_sequence(x):
    return nn.with_logical_constraint(x, ("batch", None, "act_embed"))


class Piece(nn.Module):
    """A linen piece, built as Piece(config, hooks): the hooks' attend and positions at hand."""

    config: typing.Any
    hooks: typing.Any
    attend = property(lambda self: self.hooks.attend)
    positions = property(lambda self: self.hooks.positions)


class LinenEmbed(Piece):
    @nn.compact
    def __call__(self, tokens, deterministic):
        c = self.config
        x = nn.Embed(
            c.vocab_size,
            c.d_model,
            embedding_init=_init(("vocab", "embed")),
            dtype=c.dtype,
            name="token",
        )
        x = nn.Dropout(c.dropout)(whole_sequence(x(tokens)), deterministic=deterministic)
        return residual_stream(x)


class LinenBlock(Piece):
    @nn.compact
    def __call__(self, x, deterministic):
        c = self.config
        head_dim, kv_heads, residual = (
            c.d_model // c.heads,
            c.heads // GROUP,
            (2 * c.layers) ** -0.5,
        )
        h = whole_sequence(RMSNorm(name="attn_norm")(x))
        q = _dense(c, c.d_model, ("embed", "heads"), "q")(h).reshape(
            *h.shape[:-1], c.heads, head_dim
        )
        kv = _dense(c, 2 * kv_heads * head_dim, ("embed", "kv_heads"), "kv")(h)
        k, v = jnp.split(kv.reshape(*h.shape[:-1], kv_heads, 2, head_dim), 2, axis=-2)
        positions = self.positions(x.shape[1])
        q, k = rotary(q, positions), rotary(k.squeeze(-2), positions)
        # Each key/value head to its group
        k, v = (jnp.repeat(t, GROUP, axis=2) for t in (k, v.squeeze(-2)))
        attended = self.attend(q, k, v).reshape(*x.shape[:-1], c.d_model)
        x = x + nn.Dropout(c.dropout)(
            _dense(c, c.d_model, ("heads", "embed"), "o", residual)(attended), deterministic
        )
        x = residual_stream(x)
        h = whole_sequence(RMSNorm(name="mlp_norm")(x))
        hidden = 8 * c.d_model // 3 // 16 * 16 or 16  # SwiGLU's usual width: 2/3 of 4 x d_model
        gated = nn.silu(_dense(c, hidden, ("embed", "mlp"), "gate")(h)) * _dense(
            c, hidden, ("embed", "mlp"), "up"
        )(h)
        x = x + nn.Dropout(c.dropout)(
            _dense(c, c.d_model, ("mlp", "embed"), "down", residual)(gated), deterministic
        )
        return residual_stream(x)


class LinenHead(Piece):
    @nn.compact
    def __call__(self, x, deterministic):
        logits = _dense(self.config, self.config.vocab_size, ("embed", "vocab"), "out")(
            whole_sequence(RMSNorm(name="norm")(x))
        )
        return logits.astype(jnp.float32)


# The scripts take an NNX model (common.py's contract): each linen piece comes in through
# flax.nnx.bridge, made on zeros, called as piece(x), its dropout off when `deterministic` is set.
class Bridged(bridge.ToNNX):
    to_nnx__deterministic = True  # to_nnx__: not one of linen's variables
    deterministic = property(
        lambda self: self.to_nnx__deterministic,
        lambda self, value: setattr(self, "to_nnx__deterministic", value),
    )

    def __init__(self, config, hooks, *, rngs):
        super().__init__(self.linen(config, common.Hooks()), rngs=rngs)  # a strategy's: later
        shape = (1, config.seq_len) + (() if self.linen is LinenEmbed else (config.d_model,))
        self.lazy_init(jnp.zeros(shape, jnp.int32 if len(shape) == 2 else config.dtype))
        self.to_nnx__module = self.linen(config, hooks)
        for _, param in nnx.to_flat_state(nnx.state(self, nnx.Param)):  # no linen box: read,
            param.del_metadata("linen_meta_type")  # one constrains it to its names' layout

    def __call__(self, x):
        return super().__call__(x, self.deterministic)


class Embed(Bridged):
    linen = LinenEmbed


class Block(Bridged):
    linen = LinenBlock


class Head(Bridged):
    linen = LinenHead


class Model(nnx.Module):
    def __init__(self, config, hooks, *, rngs):
        self.embed = Embed(config, hooks, rngs=rngs)
        self.blocks = nnx.List([Block(config, hooks, rngs=rngs) for _ in range(config.layers)])
        self.head = Head(config, hooks, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)
