"""tests/minigpt_as_written.py, a GPT as the Flax NNX documentation writes its miniGPT example,
with the changes the scripts' model contract asks for: built as Model(config, hooks, rngs=rngs)
from the scripts' flags (sizes, --dropout), positions from hooks.positions (which
context_parallel.py replaces), the rest as written. The scripts route
nnx.MultiHeadAttention's causal attention through hooks.attend and find the blocks in their
nnx.Sequential; they lay out its activations (its own layout calls, out_sharding and reshard, would
not run inside shard_map). Train it with any script: python fsdp.py --model tests/minigpt.py"""

from flax import nnx
from jax.sharding import PartitionSpec as P

vocab_size = 256
num_transformer_blocks = 2
maxlen = 32
embed_dim = 64
num_heads = 4
feed_forward_dim = 256


class TransformerBlock(nnx.Module):
    def __init__(
        self, embed_dim: int, num_heads: int, ff_dim: int, *, rngs: nnx.Rngs, rate: float = 0.1
    ):
        self.mha = nnx.MultiHeadAttention(
            num_heads=num_heads,
            in_features=embed_dim,
            kernel_metadata={"out_sharding": P(None, "model")},
            bias_metadata={"out_sharding": P("model")},
            rngs=rngs,
        )
        self.dropout1 = nnx.Dropout(rate=rate, rngs=rngs)
        self.layer_norm1 = nnx.LayerNorm(
            epsilon=1e-6,
            num_features=embed_dim,
            scale_metadata={"out_sharding": P("model")},
            bias_metadata={"out_sharding": P("model")},
            rngs=rngs,
        )
        self.mlp = nnx.Sequential(
            nnx.Linear(
                in_features=embed_dim,
                out_features=ff_dim,
                kernel_metadata={"out_sharding": P(None, "model")},
                bias_metadata={"out_sharding": P("model")},
                rngs=rngs,
            ),
            nnx.relu,
            nnx.Linear(
                in_features=ff_dim,
                out_features=embed_dim,
                kernel_metadata={"out_sharding": P(None, "model")},
                bias_metadata={"out_sharding": P("model")},
                rngs=rngs,
            ),
            nnx.Dropout(rate=rate, rngs=rngs),
        )
        self.layer_norm2 = nnx.LayerNorm(
            epsilon=1e-6,
            num_features=embed_dim,
            scale_metadata={"out_sharding": P("model")},
            bias_metadata={"out_sharding": P("model")},
            rngs=rngs,
        )

    def __call__(self, inputs):
        attention_output = self.mha(inputs_q=inputs, is_causal=True, decode=False)
        attention_output = self.dropout1(attention_output)
        out1 = self.layer_norm1(inputs + attention_output)
        ffn_output = self.mlp(out1)
        return self.layer_norm2(out1 + ffn_output)


class TokenAndPositionEmbedding(nnx.Module):
    def __init__(
        self,
        maxlen: int,
        vocab_size: int,
        embed_dim: int,
        hooks,
        *,
        rngs: nnx.Rngs,
    ):
        self.hooks = hooks
        self.token_emb = nnx.Embed(
            num_embeddings=vocab_size,
            features=embed_dim,
            rngs=rngs,
        )
        self.pos_emb = nnx.Embed(
            num_embeddings=maxlen,
            features=embed_dim,
            rngs=rngs,
        )

    def __call__(self, x):
        positions = self.hooks.positions(x.shape[1])[None, :]
        position_embedding = self.pos_emb(positions)
        token_embedding = self.token_emb(x)
        return token_embedding + position_embedding


class MiniGPT(nnx.Module):
    def __init__(
        self,
        maxlen: int,
        vocab_size: int,
        embed_dim: int,
        num_heads: int,
        feed_forward_dim: int,
        num_transformer_blocks: int,
        hooks,
        rate: float,
        rngs: nnx.Rngs,
    ):
        self.embedding_layer = TokenAndPositionEmbedding(
            maxlen,
            vocab_size,
            embed_dim,
            hooks,
            rngs=rngs,
        )
        self.transformer_blocks = nnx.Sequential(
            *[
                TransformerBlock(
                    embed_dim,
                    num_heads,
                    feed_forward_dim,
                    rngs=rngs,
                    rate=rate,
                )
                for _ in range(num_transformer_blocks)
            ]
        )
        self.output_layer = nnx.Linear(
            in_features=embed_dim,
            out_features=vocab_size,
            kernel_metadata={"out_sharding": P(None, "model")},
            bias_metadata={"out_sharding": P("model")},
            rngs=rngs,
        )

    def __call__(self, inputs):
        x = self.embedding_layer(inputs)
        x = self.transformer_blocks(x)
        return self.output_layer(x)


def Model(c, hooks, *, rngs):  # c: the scripts' flags
    sizes = c.seq_len, c.vocab_size, c.d_model, c.heads, c.mlp_dim or 4 * c.d_model, c.layers
    return MiniGPT(*sizes, hooks, c.dropout, rngs=rngs)
