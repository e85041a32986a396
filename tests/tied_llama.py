"""tests/llama.py with its output head tied to the token embedding, as Gemma's is: the head
multiplies by the embedding's table (nn.Embed.attend) instead of a kernel of its own. TIED says
so: the head's token/embedding is the embedding's, stored once, its gradient the sum of both
uses. Train it with any script: python fsdp.py --model tests/tied_llama.py
"""

import flax.linen as nn
import jax.numpy as jnp

import common
from tests.llama import Block, Embed, RMSNorm, _init  # noqa: F401 (Block and Embed: the model's)

TIED = ("token/embedding",)  # the head's parameters that are the embedding's


class Head(common.Piece):
    @nn.compact
    def __call__(self, x, deterministic):
        c = self.config
        table = nn.Embed(
            c.vocab_size,
            c.d_model,
            embedding_init=_init(("vocab", "embed")),
            dtype=c.dtype,
            name="token",  # the path of Embed's table: token/embedding
        )
        return table.attend(RMSNorm(name="norm")(x)).astype(jnp.float32)
