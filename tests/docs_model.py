"""tests/docs_model_as_written.py, the decoder as the Flax NNX guides write one, with the
changes the scripts' model contract asks for: built as Model(config, hooks, rngs=rngs) from
the scripts' flags, attention through hooks.attend and positions from hooks.positions (which
context_parallel.py replaces). The scripts cut it at its blocks (common.cut_at_blocks). Train it
with any script: python fsdp.py --model tests/docs_model.py --kv-heads 2"""

import dataclasses

import jax.numpy as jnp
from flax import nnx


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256
    dim: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    num_layers: int = 2
    hidden_dim: int = 172
    dtype: str = "float32"


def rope(x, positions, base=10_000.0):
    """Rotary position embedding of x [batch, length, heads, head_dim] at `positions`."""
    half = x.shape[-1] // 2
    angles = positions[:, None] * base ** (-jnp.arange(half) / half)  # [length, half]
    sin, cos = jnp.sin(angles)[:, None], jnp.cos(angles)[:, None]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def linear(cfg, din, dout, names, rngs):
    init = nnx.with_partitioning(nnx.initializers.normal(0.02), names)
    return nnx.Linear(din, dout, use_bias=False, kernel_init=init, dtype=cfg.dtype, rngs=rngs)


def rms_norm(cfg, rngs):
    init = nnx.with_partitioning(nnx.initializers.ones_init(), ("norm",))
    return nnx.RMSNorm(cfg.dim, scale_init=init, dtype=cfg.dtype, rngs=rngs)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, hooks, *, rngs: nnx.Rngs):
        self.hooks = hooks
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.dim // cfg.num_heads
        kv_dim = cfg.num_kv_heads * self.head_dim
        self.q_proj = linear(cfg, cfg.dim, cfg.dim, ("embed", "heads"), rngs)
        self.k_proj = linear(cfg, cfg.dim, kv_dim, ("embed", "kv_heads"), rngs)
        self.v_proj = linear(cfg, cfg.dim, kv_dim, ("embed", "kv_heads"), rngs)
        self.o_proj = linear(cfg, cfg.dim, cfg.dim, ("heads", "embed"), rngs)

    def __call__(self, x):
        batch, length, _ = x.shape
        q = self.q_proj(x).reshape(batch, length, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(batch, length, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(batch, length, self.num_kv_heads, self.head_dim)
        positions = self.hooks.positions(length)
        q, k = rope(q, positions), rope(k, positions)
        out = self.hooks.attend(q, k, v)
        return self.o_proj(out.reshape(batch, length, -1))


class Mlp(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.gate_proj = linear(cfg, cfg.dim, cfg.hidden_dim, ("embed", "mlp"), rngs)
        self.up_proj = linear(cfg, cfg.dim, cfg.hidden_dim, ("embed", "mlp"), rngs)
        self.down_proj = linear(cfg, cfg.hidden_dim, cfg.dim, ("mlp", "embed"), rngs)

    def __call__(self, x):
        return self.down_proj(nnx.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, hooks, *, rngs: nnx.Rngs):
        self.attn_norm, self.mlp_norm = rms_norm(cfg, rngs), rms_norm(cfg, rngs)
        self.attn = Attention(cfg, hooks, rngs=rngs)
        self.mlp = Mlp(cfg, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Model(nnx.Module):
    def __init__(self, c, hooks, *, rngs: nnx.Rngs):  # c: the scripts' flags
        heads, kv_heads, hidden = c.heads, c.kv_heads or c.heads, c.mlp_dim or 4 * c.d_model
        cfg = ModelConfig(c.vocab_size, c.d_model, heads, kv_heads, c.layers, hidden, c.dtype)
        init = nnx.with_partitioning(nnx.initializers.normal(0.02), ("vocab", "embed"))
        self.embed = nnx.Embed(cfg.vocab_size, cfg.dim, embedding_init=init, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, hooks, rngs=rngs) for _ in range(cfg.num_layers)])
        self.norm = rms_norm(cfg, rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.embed.attend(self.norm(x))  # the head tied to the embedding
