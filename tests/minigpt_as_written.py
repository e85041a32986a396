"""A small GPT written as the Flax NNX documentation writes its miniGPT example, for no project in
particular: learned token and position embeddings, nnx.MultiHeadAttention with a causal mask, an
MLP in nnx.Sequential, LayerNorm after each residual sum, the blocks in nnx.Sequential, an output
nnx.Linear of its own, the parameters annotated with the mesh axes they are split over (as the
docs do: the embeddings not), the layouts of the token lookup and of the logits stated with
out_sharding and reshard, its sizes module constants. It runs under a mesh with a 'model' axis.
tests/minigpt.py is this file with the changes the scripts' contract asks for
(tests/test_your_model.py counts them)."""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P
from jax.sharding import reshard

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
        *,
        rngs: nnx.Rngs,
    ):
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
        positions = jnp.arange(0, x.shape[1])[None, :]
        position_embedding = self.pos_emb(positions)
        token_embedding = self.token_emb(x, out_sharding=jax.typeof(x).sharding)
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
        rngs: nnx.Rngs,
    ):
        self.embedding_layer = TokenAndPositionEmbedding(
            maxlen,
            vocab_size,
            embed_dim,
            rngs=rngs,
        )
        self.transformer_blocks = nnx.Sequential(
            *[
                TransformerBlock(
                    embed_dim,
                    num_heads,
                    feed_forward_dim,
                    rngs=rngs,
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
        return reshard(self.output_layer(x), jax.typeof(inputs).sharding)


def create_model(rngs):
    return MiniGPT(
        maxlen,
        vocab_size,
        embed_dim,
        num_heads,
        feed_forward_dim,
        num_transformer_blocks=num_transformer_blocks,
        rngs=rngs,
    )
