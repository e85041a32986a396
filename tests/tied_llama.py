"""tests/nnx_llama.py with its output head tied to the token embedding, as Gemma's is: the head
multiplies by the embedding's table (nnx.Embed.attend) instead of a kernel of its own. TIED says
so: the head's token/embedding is the embedding's, stored once, its gradient the sum of both
uses. Train it with any script: python fsdp.py --model tests/tied_llama.py
"""

import jax.numpy as jnp
from flax import nnx

from tests.nnx_llama import Block, Embed, RMSNorm, _init  # noqa: F401 (Block, Embed: the model's)

TIED = ("token/embedding",)  # the head's parameters that are the embedding's


class Head(nnx.Module):
    def __init__(self, config, hooks, *, rngs):
        self.norm = RMSNorm(config.d_model, rngs)
        self.token = nnx.Embed(  # at the path of Embed's table: token/embedding
            config.vocab_size,
            config.d_model,
            embedding_init=_init(("vocab", "embed")),
            dtype=config.dtype,
            rngs=rngs,
        )

    def __call__(self, x):
        return self.token.attend(self.norm(x)).astype(jnp.float32)
