"""tests/nnx_llama.py with its output head tied to the token embedding, as Gemma's is: the head
multiplies by the embedding's table (nnx.Embed.attend) instead of a kernel of its own, stored
once, its gradient the sum of both uses. Train it with any script:
python fsdp.py --model tests/tied_llama.py
"""

import jax.numpy as jnp

from tests import nnx_llama


class Model(nnx_llama.Model):
    def __init__(self, config, hooks, *, rngs):
        super().__init__(config, hooks, rngs=rngs)
        del self.out  # the head reads the token embedding's table instead

    def __call__(self, tokens):
        x = self.dropout(self.token(tokens))
        for block in self.blocks:
            x = block(x)
        return self.token.attend(self.norm(x)).astype(jnp.float32)
