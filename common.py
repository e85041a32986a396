"""What the strategy scripts share, never a strategy: the lesson (the training's flags, the
model's contract, the GPT and its mixture of experts, the data, the TrainState, loss and
accumulation), the cost report (what the compiled step holds and sends), the harness (the run's
flags, devices and processes, checkpoints, logging)."""

import argparse
import contextlib
import dataclasses
import functools
import importlib.util
import itertools
import json
import math
import os
import re
import signal
import sys
import time
import traceback
import typing
import zlib
from collections.abc import Callable
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import safetensors
from flax import nnx
from flax.linen import logical_to_mesh_axes
from flax.linen import with_logical_constraint as constrain  # rules' layout; none: x
from flax.training import train_state
from flax.traverse_util import flatten_dict, unflatten_dict
from jax.tree_util import tree_leaves_with_path
from jax.experimental import mesh_utils, multihost_utils
from jax.experimental.pallas.ops.tpu.megablox import gmm
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
from orbax.checkpoint import v1 as ocp

BYTES = 256  # the vocabulary of byte-level text
ATTENTION = ("auto", "xla", "cudnn", "splash")  # auto: splash on a TPU, cudnn on a GPU, else xla
DTYPES = ("float32", "bfloat16")
MAX_VOCAB = 2**20  # larger ones take minutes to set up, and gigabytes, before anything is checked


class ConfigError(ValueError):
    """A bad flag. The command line reports it as one line and exit status 2."""


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def require(ok, name, message):
    """Raise ConfigError for flag --name unless ok."""
    if not ok:
        raise ConfigError(f"{flag(name)} {message}")


# ----------------------------------------------------------------------------------------------
# Training config: the model's, the data's and the optimizer's flags
# ----------------------------------------------------------------------------------------------


def arg(default, help, **argparse_kwargs):
    """A config field that is also a command-line flag: its default and its --help text."""
    return dataclasses.field(default=default, metadata={"help": help, **argparse_kwargs})


@dataclasses.dataclass(frozen=True)
class TrainingConfig:
    """The flags of what is trained: the model, the data, the optimizer (Config adds the run's)."""

    steps: int = arg(200, "optimizer steps to run", min=1)
    batch_size: int = arg(32, "global batch: sequences per step, over all devices", min=1)
    seq_len: int = arg(64, "tokens per training sequence (the context length)", min=1)
    layers: int = arg(4, "transformer blocks", min=1)
    d_model: int = arg(128, "model width", min=1)
    heads: int = arg(4, "attention heads (must divide --d-model)", min=1)
    kv_heads: int = arg(0, "key-value heads, each shared by a group of heads; 0: --heads", min=0)
    mlp_dim: int = arg(0, "the MLP's hidden units (an expert's too); 0: 4 x --d-model", min=0)
    dropout: float = arg(0.1, "dropout rate; 0 makes every strategy compute alike", min=0)
    lr: float = arg(3e-3, "peak learning rate: linear warmup, then cosine decay to a tenth")
    warmup_steps: int = arg(30, "learning-rate warmup steps", min=0)
    weight_decay: float = arg(0.1, "AdamW weight decay (kernels and embeddings only)", min=0)
    clip_norm: float = arg(1.0, "clip the gradient to this global norm (0: never)", min=0)
    seed: int = arg(0, "seed of the parameters, the dropout masks and the batches", min=0)
    dtype: str = arg("float32", "compute dtype; parameters stay float32", choices=DTYPES)
    attention: str = arg("auto", "auto: splash on TPU, cudnn on GPU, else xla", choices=ATTENTION)
    vocab_size: int = arg(256, "tokens: 50304 as GPT-2; text is read as bytes: 256", min=8)
    model: str = arg("gpt", "gpt, or a file or module of yours defining Model (docs/your_model.md)")
    tie_embeddings: bool = arg(False, "the GPT's head reads the token embedding's table")
    experts: int = arg(0, "mixture of experts: expert MLPs per block and a router", min=0)
    top_k: int = arg(2, "with --experts: the experts each token goes to")
    capacity_factor: float = arg(0.0, "with --experts: slots over fair share (0: dropless)", min=0)
    shared_experts: int = arg(0, "with --experts: expert MLPs every token goes through", min=0)
    router_aux_weight: float = arg(0.01, "with --experts: load-balancing loss weight", min=0)
    router_bias_rate: float = arg(0.0, "with --experts: balance bias moved this much a step", min=0)
    microbatches: int = arg(1, "gradient accumulation: sequential micro-batches per step", min=1)
    scan_layers: bool = arg(False, "run the blocks with lax.scan: one compiled block")
    remat: bool = arg(False, "recompute each block's activations in the backward pass")
    dataset: str = arg("synthetic", "synthetic, input.txt, or your loader: my_data.py[:load]")
    data_dir: str | None = arg(None, "your loader's folder (tests/token_data.py, tfds_text.py)")


# What a checkpoint records of the flags: those that change what the weights mean cannot change
# on resume; those that change the rest of the trajectory can, and the run says so. The others
# (the strategy, its mesh, the devices and processes, logging) may change freely.
SHAPE_FLAGS = "layers d_model heads kv_heads mlp_dim seq_len vocab_size scan_layers experts"
SHAPE_FLAGS = (*SHAPE_FLAGS.split(), "shared_experts", "tie_embeddings")
TRAJECTORY_FLAGS = tuple(
    "steps batch_size lr warmup_steps weight_decay clip_norm seed dropout dtype microbatches "
    "dataset top_k capacity_factor router_aux_weight router_bias_rate".split()
)


def check_ranges(c: TrainingConfig):
    """Raise ConfigError naming the first flag out of its range (its `min`, float32's)."""
    for field in dataclasses.fields(c):
        value, low, eg = getattr(c, field.name), field.metadata.get("min"), field.default
        if isinstance(value, float):  # the run computes in float32, where 1e39 is infinite
            finite = math.isfinite(value) and abs(value) <= float(np.finfo(np.float32).max)
            require(finite, field.name, f"must be a finite float32, e.g. {flag(field.name)} {eg}")
        at_least = f"must be at least {low}, e.g. {flag(field.name)} {eg}"
        require(low is None or value >= low, field.name, at_least)


# ----------------------------------------------------------------------------------------------
# Model. The scripts train any model, the GPT-2-style decoder below or yours (--model;
# tools/check.py checks it on shapes alone; docs/your_model.md). Its contract, in Flax NNX:
#   1. An nnx.Module made by Model(config, hooks, rngs=rngs), whose model(tokens [batch, length])
#      is float32 logits [batch, length, --vocab-size]; config is the flags (what it ignores
#      stops the run); its blocks in self.blocks (or its one list, nnx.List or nnx.Sequential
#      of --layers), each activations -> activations alike, or (them, a dict of float32 sums
#      for the metrics, 'aux_loss_sum' joining the loss). The scripts cut it there.
#   2. Parameters name their axes, nnx.with_partitioning(init, names) (logical names, or the
#      mesh axes they are split over, P(None, "model")), for the scripts that lay them out by name.
#   3. Attention goes through hooks.attend(q, k, v) (nnx.MultiHeadAttention's causal attention
#      does), positions come from hooks.positions(length), a mixture of experts reaches them
#      through hooks.to_experts or .dropless; activations carry logical constraints, no layout
#      of their own (reshard, out_sharding): the scripts lay them out.
#   4. No state but parameters and nnx.Dropout's, off when `deterministic`.
# ----------------------------------------------------------------------------------------------


def _init(names, scale=1.0):
    return nnx.with_partitioning(nnx.initializers.normal(0.02 * scale), names)


def _linear(config, features_in, features, names, rngs, scale=1.0, use_bias=True):
    """A Linear layer computing in --dtype; `names` are the logical axes of its kernel."""
    return nnx.Linear(
        features_in,
        features,
        use_bias=use_bias,
        kernel_init=_init(names, scale),
        bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), names[-1:]),
        dtype=config.dtype,
        rngs=rngs,
    )


def _embed(c, count, names, rngs):
    return nnx.Embed(count, c.d_model, embedding_init=_init(names), dtype=c.dtype, rngs=rngs)


def _layer_norm(c, rngs):
    named = dict(scale_init=nnx.initializers.ones, bias_init=nnx.initializers.zeros)
    named = {k: nnx.with_partitioning(init, ("norm",)) for k, init in named.items()}
    return nnx.LayerNorm(c.d_model, epsilon=1e-5, dtype=c.dtype, rngs=rngs, **named)  # GPT-2's


def _whole_sequence(x):
    """x [batch, length, features] whole along the sequence: sequence parallelism gathers it."""
    return constrain(x, ("batch", None, "act_embed"))


def _residual_scale(config):
    # GPT-2 scales the init of projections into the residual stream by 1/sqrt(2 * layers).
    return 1 / math.sqrt(2 * config.layers)


def causal_attention(q, k, v, implementation="xla"):
    """Each position's softmax attention (in float32) to itself and those before."""
    if implementation == "splash":  # a TPU's kernel (Pallas's, below)
        return splash_attention(q, k, v)
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)


@dataclasses.dataclass(frozen=True)
class Hooks:
    """What a strategy may replace inside a model (context_parallel.py, expert_parallel.py)."""

    attend: Callable = causal_attention  # q, k, v -> causal attention's output
    positions: Callable = jnp.arange  # this device's token count -> their positions
    # (the experts, slots [experts, rows, room, d]) -> out; expert_parallel.py: an all-to-all
    to_experts: Callable = lambda experts, x: experts(x)
    # (the experts, x, expert, gate [rows, length, k]) -> out; the same, dropless
    dropless: Callable = lambda mixture, x, expert, gate: mixture(x, expert, gate)
    whole_sequence: Callable = lambda x: x  # of this device's tokens -> the sequences'


class Attention(nnx.Module):
    def __init__(self, config: TrainingConfig, hooks: Hooks, *, rngs: nnx.Rngs):
        c, self.attend = config, hooks.attend
        self.heads, self.kv_heads = c.heads, c.kv_heads or c.heads
        # One matmul makes every query, key and value, group by group: a key-value head and the
        # query heads that share it ([kv heads, heads / kv heads + 2, head_dim]). Split into equal
        # parts (tensor parallelism), each device gets whole groups. GPT-2's bias, for queries only:
        # a key bias adds the same q.b to a query's scores, which softmax ignores, and a value bias
        # passes through attention's weights (their sum is 1) into the out layer's bias.
        width = (c.heads + 2 * self.kv_heads) * (c.d_model // c.heads)
        self.qkv = _linear(c, c.d_model, width, ("embed", "heads"), rngs, use_bias=False)
        zeros = nnx.with_partitioning(nnx.initializers.zeros, ("heads",))
        self.query_bias = nnx.Param(zeros(rngs.params(), (c.d_model,)))
        self.out = _linear(c, c.d_model, c.d_model, ("heads", "embed"), rngs, _residual_scale(c))
        self.dropout = nnx.Dropout(c.dropout, rngs=rngs)

    def __call__(self, x):
        group = self.heads // self.kv_heads
        qkv = self.qkv(x).reshape(*x.shape[:-1], self.kv_heads, group + 2, -1)
        q, k, v = jnp.split(qkv, [group, group + 1], axis=-2)
        q = q + self.query_bias[...].reshape(q.shape[-3:]).astype(q.dtype)
        q, k, v = q.reshape(*x.shape[:-1], self.heads, -1), k.squeeze(-2), v.squeeze(-2)
        heads = ("batch", "length", "act_heads", None)
        q, k, v = (constrain(t, heads) for t in (q, k, v))
        x = constrain(self.attend(q, k, v), heads)
        return self.dropout(self.out(x.reshape(*x.shape[:-2], -1)))


class Mlp(nnx.Module):
    def __init__(self, config: TrainingConfig, shared: int = 0, *, rngs: nnx.Rngs):
        c, units = config, max(1, shared) * (config.mlp_dim or 4 * config.d_model)
        self.fc1 = _linear(c, c.d_model, units, ("embed", "mlp"), rngs)
        self.fc2 = _linear(c, units, c.d_model, ("mlp", "embed"), rngs, _residual_scale(c))
        self.dropout = nnx.Dropout(0 if shared else c.dropout, rngs=rngs)  # shared: the MoE's

    def __call__(self, x):
        h = constrain(nnx.gelu(self.fc1(x)), ("batch", "length", "act_mlp"))
        return self.dropout(self.fc2(h))


class Block(nnx.Module):
    def __init__(self, config: TrainingConfig, hooks: Hooks, *, rngs: nnx.Rngs):
        self.ln1, self.ln2 = _layer_norm(config, rngs), _layer_norm(config, rngs)
        self.attn = Attention(config, hooks, rngs=rngs)
        self.mlp = MoeMlp(config, hooks, rngs=rngs) if config.experts else Mlp(config, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(_whole_sequence(self.ln1(x)))
        h = self.mlp(_whole_sequence(self.ln2(x)))
        h, stats = h if isinstance(h, tuple) else (h, None)  # a mixture's sums
        return constrain(x + h, ("batch", "length", "act_embed")), stats


class GPT(nnx.Module):
    """GPT-2's decoder: token and position embeddings, the blocks, a final norm and the head (with
    --tie-embeddings the token embedding's table)."""

    def __init__(self, config: TrainingConfig, hooks: Hooks, *, rngs: nnx.Rngs):
        c, self.hooks = config, hooks
        self.token = _embed(c, c.vocab_size, ("vocab", "embed"), rngs)
        self.position = _embed(c, c.seq_len, ("pos", "embed"), rngs)
        self.dropout = nnx.Dropout(c.dropout, rngs=rngs)
        self.blocks = nnx.List([Block(c, hooks, rngs=rngs) for _ in range(c.layers)])
        self.ln_f = _layer_norm(c, rngs)
        if not c.tie_embeddings:
            self.out = _linear(c, c.d_model, c.vocab_size, ("embed", "vocab"), rngs, use_bias=False)

    def __call__(self, tokens):
        x = _whole_sequence(self.token(tokens))  # the lookup's partial sums (a split vocabulary)
        x = x + self.position(self.hooks.positions(tokens.shape[1]))
        x = self.dropout(constrain(x, ("batch", "length", "act_embed")))
        for block in self.blocks:
            x = block(x)
            x = x[0] if isinstance(x, tuple) else x  # less a mixture's sums (the scripts add them)
        x = _whole_sequence(self.ln_f(x))
        if hasattr(self, "out"):
            logits = self.out(x)
        else:  # x @ table.T as one contraction: nnx.Embed.attend's transposed copy would be kept
            # for the backward pass under fsdp.py's remat, which gathers the table again
            logits = jnp.einsum("...d,vd->...v", x, self.token.embedding[...].astype(x.dtype))
        return constrain(logits.astype(jnp.float32), ("batch", "length", "act_vocab"))


def build(piece_class, config, hooks, rng):
    """A piece, its parameters made from rng (eager sharding off: the scripts lay them out); an
    nnx.MultiHeadAttention in it attends through hooks.attend."""
    with nnx.use_eager_sharding(False):
        piece = piece_class(config, hooks, rngs=nnx.Rngs(params=rng, dropout=0))
    for _, layer in nnx.iter_modules(piece):
        if isinstance(layer, nnx.MultiHeadAttention):
            layer.attention_fn = functools.partial(_by_hook, hooks.attend, layer.attention_fn)
    return piece


def _by_hook(attend, attention_fn, q, k, v, mask=None, is_causal=False, **options):
    """nnx.MultiHeadAttention's attention, through hooks.attend where it is causal attention;
    any other (a mask, dropout of the weights) its own, which context_parallel.py refuses."""
    if is_causal and mask is None and not options.get("dropout_rate") and not options["module"]:
        return attend(q, k, v)
    return attention_fn(q, k, v, mask=mask, is_causal=is_causal, **options)


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity, for jax.checkpoint
class PieceDef:
    """A piece as nnx.split gives it, on shapes: graph, parameters (names too), dropout streams;
    a half of a model written whole also holds the other half's parameters (`unread`)."""

    name: str  # embed, block or head
    graphdef: Any
    params: Any
    streams: Any
    unread: dict = dataclasses.field(default_factory=dict)  # path: shape, zeros when merged

    @classmethod
    def of(cls, name, piece_class, config, hooks):
        built = lambda: build(piece_class, config, hooks, jax.random.key(0))  # noqa: E731
        return cls(name, *jax.eval_shape(lambda: nnx.split(built(), nnx.Param, ...)))


def seeded(streams, rng):
    """Dropout streams' state, each its own key from rng (nnx.reseed, as data; none: a stand-in)."""
    count = itertools.count()

    def seed(s):  # a stream's key, or its count
        if not jax.dtypes.issubdtype(s.dtype, jax.dtypes.prng_key):
            return jnp.zeros(s.shape, s.dtype)
        return jax.random.key(0) if rng is None else jax.random.fold_in(rng, next(count))

    return jax.tree.map(seed, streams)


def run_piece(piece: PieceDef, params, x, rng=None, edit=lambda module: module):
    """A piece on x given its parameters (a dict, nnx.State's pure form), dropout with a key (rng),
    none without; edit(module) may change it or return what runs in its place. A block's output
    comes with its sums (None if it returns none)."""
    if piece.unread:  # a half of a model written whole: the other half's parameters, never read
        zeros = {path: jnp.zeros(s.shape, s.dtype) for path, s in piece.unread.items()}
        params = params if isinstance(params, dict) else nnx.to_pure_dict(params)
        params = unflatten_dict({**flatten_dict(params), **zeros})
    module = nnx.merge(piece.graphdef, params, seeded(piece.streams, rng))
    module.set_attributes(deterministic=rng is None, raise_if_not_found=False)  # no key: no drop
    out = edit(module)(x)
    return (out, None) if piece.name == "block" and not isinstance(out, tuple) else out


def cut_at_blocks(make) -> dict:
    """A model, Model(config, hooks, rngs=rngs) (a class or a function), cut at its blocks into
    pieces, each built as piece(config, hooks, rngs=rngs): the embedding runs it to its first
    block, the head from its last on (_top), a block is its first."""

    def top(config, hooks, *, rngs):  # the model less its blocks, each a piece of its own
        model = make(config, hooks, rngs=rngs)
        name = blocks_at(model, config.layers)
        delattr(model, name)
        object.__setattr__(model, "__class__", _top(type(model), name))
        return model

    def block(config, hooks, *, rngs):
        model = make(config, hooks, rngs=rngs)
        return _modules(getattr(model, blocks_at(model, config.layers)))[0]

    return {"embed": top, "block": block, "head": top}


def blocks_at(model, layers: int) -> str:
    """Where a whole model keeps its blocks: self.blocks, or else its one list, nnx.List or
    nnx.Sequential of --layers modules."""
    found = [k for k, v in vars(model).items() if len(_modules(v)) == layers and k[0] != "_"]
    name = "blocks" if "blocks" in found else found[0] if len(found) == 1 else None
    kept = f"keeps {' and '.join(found)}" if found else f"keeps no list of {layers} modules"
    eg = "e.g. self.blocks = nnx.List([Block(...) for _ in range(config.layers)])"
    require(name, "model", f"{type(model).__name__} {kept}: keep the blocks in self.blocks, {eg}")
    return name


def _modules(value) -> list:
    """The modules a list, nnx.List or nnx.Sequential holds, in order (none of anything else)."""
    value = value.layers if isinstance(value, nnx.Sequential) else value
    listed = isinstance(value, list | tuple | nnx.List)
    return list(value) if listed and all(isinstance(m, nnx.Module) for m in value) else []


class _Blocks(list):
    """The blocks' stand-in, iterated (for block in self.blocks) or called (nnx.Sequential)."""

    def __call__(self, x, *args, **kwargs):
        return self[0](x)


_blocks_p = jax.extend.core.Primitive("blocks")  # where a model's blocks run, in its jaxpr
_blocks_p.def_abstract_eval(lambda *args: args[-1])  # typed as the activations given, if any


class _Reached(BaseException):  # not an Exception: a model's own `except Exception` lets it by
    """The activations a model gives its first block."""


def _reached(x):
    raise _Reached(x)


@functools.cache  # one class per model's: equal graphs, equal classes
def _top(model_class, name):
    class Top(model_class):  # the model less its blocks
        def __call__(self, x):  # tokens: what its first block gets; activations: from the last
            if x.ndim == 2:  # run to its first block, the rest never traced
                setattr(self, name, _Blocks([_reached]))
                try:
                    model_class.__call__(self, x)
                except _Reached as reached:
                    return reached.args[0]
                finally:
                    delattr(self, name)
            closed, leaves = cut(self, jax.ShapeDtypeStruct(x.shape[:2], jnp.int32), x)
            after = halves(closed, len(leaves))[0]
            return jax.extend.core.jaxpr_as_fun(after)(*leaves, x)[0]

    Top.__name__ = Top.__qualname__ = model_class.__name__  # what errors name: the user's class
    Top.blocks_at = name
    return Top


def cut(top, tokens, *x):
    """A model less its blocks as a jaxpr on `tokens` (or their shape), a marker (_blocks_p) where
    its blocks run, typed as x if given; and its state's leaves, its first inputs."""
    graphdef, params, rest = nnx.split(top, nnx.Param, ...)
    params, model_class = nnx.to_pure_dict(params), type(top).__mro__[1]

    def whole(params, rest, tokens, *x):
        model = nnx.merge(graphdef, params, rest)
        setattr(model, type(top).blocks_at, _Blocks([lambda y: _blocks_p.bind(y, *x)]))
        return model_class.__call__(model, tokens)

    return jax.make_jaxpr(whole)(params, rest, tokens, *x), jax.tree.leaves((params, rest))


def halves(closed, leaves: int):
    """A cut jaxpr's part after its blocks (its first `leaves` inputs, the state's, and the
    blocks' output -> its own outputs); and the indices of the state's leaves read before the
    blocks and after them. An effect (a debug callback) goes with the values it reads."""
    jaxpr = closed.jaxpr
    named = lambda vs: {v for v in vs if isinstance(v, jax.extend.core.Var)}  # noqa: E731 (no literals)
    marks = [e for e in jaxpr.eqns if e.primitive is _blocks_p]
    require(len(marks) == 1, "model", f"runs its blocks {len(marks)} times a call, not once")
    (mark,), state, later = marks, jaxpr.invars[:leaves], set(marks[0].outvars)
    for e in jaxpr.eqns:  # the values the blocks' output reaches
        later |= set(e.outvars) if later & named(e.invars) else set()

    def needs(outs, after):  # the equations that make `outs`, and the values they read
        needed, kept = named(outs), []
        for e in reversed(jaxpr.eqns):
            effect = e.effects and bool(later & named(e.invars)) == after
            if e is not mark and (needed & set(e.outvars) or effect):
                kept.append(e)
                needed |= named(e.invars)
        return kept[::-1], needed

    (_, before), (eqns, after) = needs(mark.invars[:1], False), needs(jaxpr.outvars, True)
    tokens = "reads its tokens after its blocks: give them to a block"
    require(not after & set(jaxpr.invars[leaves:]), "model", tokens)
    part = jaxpr.replace(invars=[*state, *mark.outvars], outvars=jaxpr.outvars, eqns=eqns)
    reads = [{i for i, v in enumerate(state) if v in needed} for needed in (before, after)]
    return jax.extend.core.ClosedJaxpr(part, closed.consts), *reads


@dataclasses.dataclass(frozen=True)
class Model:
    """The model as one function of the parameters (apply_fn), cut at its blocks into pieces
    (the embedding, a block, the head), each run through `wrap`."""

    config: TrainingConfig
    make: Callable = GPT  # Model(config, hooks, rngs=rngs)
    wrap: Callable[[Callable], Callable] | None = None  # run_piece -> the same, wrapped
    hooks: Hooks = Hooks()

    @functools.cached_property
    def pieces(self) -> dict:
        return cut_at_blocks(self.make)

    @functools.cached_property
    def defs(self) -> dict:
        """Each piece on shapes; the embedding and the head, halves of one module, each hold the
        parameters that half reads (the embedding also those neither does)."""
        c, hooks = self.config, self.hooks  # the head is the embedding's module: built once
        defs = {name: PieceDef.of(name, self.pieces[name], c, hooks) for name in ("embed", "block")}
        top, tokens = defs["embed"], jax.ShapeDtypeStruct((1, c.seq_len), jnp.int32)
        plain = PieceDef.of("embed", self.pieces["embed"], c, Hooks())  # outside any mesh
        closed, leaves = cut(nnx.merge(plain.graphdef, plain.params, plain.streams), tokens)
        shapes = flatten_dict(params := nnx.to_pure_dict(top.params))
        paths = [tuple(k.key for k in path) for path, _ in tree_leaves_with_path(params)]
        reads = halves(closed, len(leaves))[1:]
        before, after = ({paths[i] for i in part if i < len(paths)} for part in reads)
        kept = {"embed": set(paths) - (after - before), "head": after}

        def half(name):
            state = [(p, v) for p, v in nnx.to_flat_state(top.params) if p in kept[name]]
            unread = {p: x for p, x in shapes.items() if p not in kept[name]}
            state = nnx.from_flat_state(state)
            return dataclasses.replace(top, name=name, params=state, unread=unread)

        return {**defs, "embed": half("embed"), "head": half("head")}

    @functools.cached_property
    def tied(self) -> tuple:
        """The paths of the head's parameters that the embedding holds: read by both halves."""
        held = {n: flatten_dict(nnx.to_pure_dict(self.defs[n].params)) for n in ("embed", "head")}
        return tuple("/".join(map(str, p)) for p in held["head"] if p in held["embed"])

    def __call__(self, params, tokens, rng=None):
        c, defs, run = self.config, self.defs, self.wrap(run_piece) if self.wrap else run_piece
        rng = rng if c.dropout else None  # no dropout: no key to draw from
        key = lambda i: None if rng is None else jax.random.fold_in(rng, i)  # noqa: E731
        x = run(defs["embed"], params["embed"], tokens, key(0))
        block = functools.partial(run, defs["block"])
        if c.remat:  # keep only each block's input; the backward pass runs the block again
            block = jax.checkpoint(block)
        if c.scan_layers:  # one block compiled, run over the blocks' stacked parameters
            step = lambda x, layer: block(layer[0], x, key(layer[1] + 1))  # noqa: E731
            x, stats = jax.lax.scan(step, x, (params["blocks"], jnp.arange(c.layers)))
            stats = jax.tree.map(lambda s: s.sum(0), stats)
        else:
            stats = None
            for i in range(c.layers):
                x, more = block(params[f"block_{i}"], x, key(i + 1))
                stats = more if stats is None else jax.tree.map(jnp.add, stats, more)
        head = params["head"]
        if self.tied:  # the embedding's tables, read by the head as its own
            # A barrier ties it to the head's input, so the compiler cannot merge the head's use
            # with the lookup's: under fsdp.py each use gathers the table, not one kept all step.
            embedding, x = jax.lax.optimization_barrier((params["embed"], x))
            head = with_tied(head, embedding, self.tied)
        return run(defs["head"], head, x, key(c.layers + 1)), stats or {}


def with_tied(head_params, embed_params, tied):
    """The head's parameters with those it ties: their gradient the sum of both uses."""
    head, embed = (flatten_dict(p, sep="/") for p in (head_params, embed_params))
    return unflatten_dict({**head, **{path: embed[path] for path in tied}}, sep="/")


def init_params(model: Model, rng):
    """The parameters as nested dicts (nnx.State's pure form), each piece's from its own key."""
    c, keys = model.config, jax.random.split(rng, model.config.layers + 2)

    def made(name, key):  # built with the default hooks; the parameters the piece holds
        piece = build(model.pieces[name], c, Hooks(), key)
        made = flatten_dict(nnx.to_pure_dict(nnx.state(piece, nnx.Param)))
        held = flatten_dict(nnx.to_pure_dict(model.defs[name].params))
        tied = model.tied if name == "head" else ()  # the embedding holds those
        kept = (p for p in made if p in held and "/".join(map(str, p)) not in tied)
        return unflatten_dict({p: made[p] for p in kept})

    params = {"embed": made("embed", keys[0])}
    blocks = jax.vmap(lambda key: made("block", key))(keys[1:-1])  # built once
    unstacked = {f"block_{i}": jax.tree.map(lambda b, i=i: b[i], blocks) for i in range(c.layers)}
    params.update({"blocks": blocks} if c.scan_layers else unstacked)  # scanned: [layers, ...]
    params["head"] = made("head", keys[-1])
    return params


# ----------------------------------------------------------------------------------------------
# Train state, optimizer, clipping, loss and gradient accumulation
# ----------------------------------------------------------------------------------------------


# Plain pytrees that jit and shard_map take (an nnx.Optimizer they would split and merge): the
# parameters as nested dicts (nnx.State's pure form, named by path), the Model as apply_fn.
class TrainState(train_state.TrainState):
    rng: jax.Array  # base dropout key; step k uses fold_in(rng, k), so no key is ever carried


def _leaf_name(path) -> str:
    return [k.key for k in path if isinstance(k, jax.tree_util.DictKey)][-1]


def decay_mask(params):
    """Weight decay for kernels and embeddings; never for LayerNorm parameters or biases."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: _leaf_name(path) in ("kernel", "embedding"), params
    )


ADAM = {"b1": 0.9, "b2": 0.95, "eps": 1e-8}  # AdamW's moment decays and its denominator's epsilon


# Cached: the optimizer is in the TrainState's tree structure, where an abstract state's must fit.
@functools.cache
def make_optimizer(config: TrainingConfig):
    """AdamW, warmed up linearly, then down a cosine to a tenth; elementwise (fsdp.py's shards)."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.lr,
        warmup_steps=config.warmup_steps,
        decay_steps=max(config.steps, config.warmup_steps + 1),
        end_value=config.lr / 10,
    )
    adamw = optax.adamw(schedule, **ADAM, weight_decay=config.weight_decay, mask=decay_mask)
    if not config.router_bias_rate:
        return adamw
    rate = config.router_bias_rate  # a mixture's balance bias moves by it, against its entry's sign
    balance = optax.stateless_with_tree_map(lambda load, _: -rate * jnp.sign(load))
    return optax.multi_transform({"learned": adamw, "balance": balance}, balance_labels)


def is_balance(path) -> bool:
    return _leaf_name(path) == "router_bias"


def balance_labels(params):
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "balance" if is_balance(path) else "learned", params
    )


def learned(grads):
    """The gradient of what the loss teaches, for its norm: all but the balance bias (load_of)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, g: jnp.zeros_like(g) if is_balance(path) else g, grads
    )


def create_state(config: TrainingConfig, model: Model, hold: Callable = lambda p: p) -> TrainState:
    """The initial TrainState, its parameters as `hold` makes them (fsdp.py boxes its shards)."""
    init_rng, dropout_rng = jax.random.split(jax.random.key(config.seed))
    params, tx = hold(init_params(model, init_rng)), make_optimizer(config)
    return TrainState.create(apply_fn=model, params=params, tx=tx, rng=dropout_rng)


def unbox(tree):
    """The arrays of a tree some of whose leaves are boxed in nnx.Variables (fsdp.py's shards)."""
    is_box = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    return jax.tree.map(lambda x: x.get_value() if is_box(x) else x, tree, is_leaf=is_box)


def named(config: TrainingConfig) -> Callable:
    """create_state's `hold`: each parameter an nnx.Param, its out_sharding its axes' names."""
    names = dict(logical_names(config))

    def box(path, x):
        path = jax.tree_util.keystr(path, simple=True, separator="/")
        return nnx.Param(x, out_sharding=names[path].names, eager_sharding=False)

    return lambda params: jax.tree_util.tree_map_with_path(box, params)


def model_shapes(config: TrainingConfig):
    """The abstract initial TrainState (shapes and dtypes only): the model's full size."""
    return jax.eval_shape(lambda: create_state(config, make_model(config)))


def global_norm(grads, split, axis):
    """The gradient's norm over the whole model, for clipping. Each device holds a piece of each
    gradient `split` marks, so their sums of squares are added up over `axis` (an all-reduce of
    one number); the others are whole on every device."""
    leaves = zip(jax.tree.leaves(grads), jax.tree.leaves(split), strict=True)
    squares = [(jnp.sum(jnp.square(g)), piece) for g, piece in leaves]
    pieces = sum((x for x, piece in squares if piece), jnp.zeros(()))
    whole = sum((x for x, piece in squares if not piece), jnp.zeros(()))
    return jnp.sqrt(jax.lax.psum(pieces, axis) + whole)


def clip(grads, norm, max_norm: float):
    """optax.clip_by_global_norm (0: never) with the norm the script's, knowing its pieces."""
    if not max_norm:
        return grads
    return jax.tree.map(
        lambda g: jnp.where(norm < max_norm, g, (g / norm * max_norm).astype(g.dtype)), grads
    )


def cross_entropy(logits, labels):
    """-log softmax(logits)[label], the label's by a one-hot product: a split vocabulary sums."""
    one_hot = jax.nn.one_hot(labels, logits.shape[-1], dtype=logits.dtype)
    label_logits = jnp.sum(logits * one_hot, axis=-1)
    return jax.nn.logsumexp(logits, axis=-1) - label_logits


def token_losses(params, apply_fn, tokens, rng=None):
    """Next-token cross-entropy at every position and the blocks' sums; dropout given a key."""
    inputs, labels = (
        (tokens[:, 0], tokens[:, 1]) if tokens.ndim == 3 else (tokens[:, :-1], tokens[:, 1:])
    )
    logits, stats = apply_fn(params, inputs, rng)
    return cross_entropy(logits, labels), stats


def summed(losses, stats):
    # (sum, count) rather than a mean, so that metrics add up across devices and micro-batches;
    # the blocks' stats are sums already.
    return {"loss_sum": losses.sum(), "tokens": jnp.int32(losses.size), **stats}


def loss_fn(params, apply_fn, tokens, rng, pieces=1):
    """The mean next-token cross-entropy and blocks' auxiliary loss, over `pieces`; the metrics."""
    losses, stats = token_losses(params, apply_fn, tokens, rng)
    loss = losses.mean()
    if "aux_loss_sum" in stats:
        loss = loss + stats["aux_loss_sum"] / losses.size
    return loss / pieces, summed(losses, stats)


def eval_metrics(state: TrainState, tokens):
    """Summed held-out losses of a batch: no dropout, no gradient."""
    losses, _ = token_losses(state.params, state.apply_fn, tokens)
    return summed(losses, {})


def accumulate_gradients(state: TrainState, batch, rng, microbatches: int):
    """Gradient of the mean loss and summed metrics, `microbatches` pieces one after another
    (lax.scan); piece i takes rows i, i + m, ..., which every device holding the batch has."""
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def piece_grads(tokens, i):  # of the piece's 1/m share of the loss: gradients only add up
        key = jax.random.fold_in(rng, i)
        (_, metrics), grads = grad_fn(state.params, state.apply_fn, tokens, key, microbatches)
        return grads, metrics

    if microbatches == 1:
        return piece_grads(batch, 0)
    pieces = batch.reshape(-1, microbatches, *batch.shape[1:]).swapaxes(0, 1)

    def add_piece(total, piece_and_index):
        return jax.tree.map(jnp.add, total, piece_grads(*piece_and_index)), None

    total, _ = jax.lax.scan(
        add_piece, piece_grads(pieces[0], 0), (pieces[1:], jnp.arange(1, microbatches))
    )
    return total


# ----------------------------------------------------------------------------------------------
# A mixture of experts: a router sends each token to some of the expert MLPs
# ----------------------------------------------------------------------------------------------


def capacity(config: TrainingConfig, length: int) -> int:
    """Slots per expert per sequence: --capacity-factor times its fair share, at most the length."""
    fair = length * config.top_k / config.experts
    return min(length, math.ceil(config.capacity_factor * fair))


# The grouped matmul of dropless routing: x [rows, slots, in], each row's slots sorted by expert,
# times kernel [experts, in, out], row r's first group_sizes[r, 0] slots by expert 0's, and so on;
# slots past the groups come out zero.
GROUPED = jax.lax.RaggedDotDimensionNumbers((((2,), (1,)), ((), ())), (1,), (0,))


def grouped_matmul() -> Callable:
    """XLA's grouped matmul, or on a TPU, whose compiler refuses it, megablox's (below)."""
    if jax.devices()[0].platform == "tpu":
        return megablox_matmul
    return jax.lax.ragged_dot_general


class ExpertDense(nnx.Module):
    """A Linear layer per expert: slots [experts, ..., in] -> [experts, ..., features], or given
    group_sizes (dropless), x [rows, slots, in] grouped by expert -> one grouped matmul."""

    def __init__(self, config, features_in, features, names, scale=1.0, *, rngs: nnx.Rngs):
        shape, self.dtype = (config.experts, features_in, features), config.dtype
        kernel = nnx.initializers.normal(0.02 * scale)(rngs.params(), shape)
        self.kernel = nnx.Param(kernel, out_sharding=("expert", *names))
        self.bias = nnx.Param(jnp.zeros(shape[::2]), out_sharding=("expert", names[-1]))
        self.dot_general = jax.lax.dot_general  # as nnx.Linear's, which a script may replace
        self.ragged_dot = grouped_matmul()  # the same for groups

    def __call__(self, x, group_sizes=None):
        # As many experts as it holds: all, or a device's own (expert_parallel.py)
        x, kernel, bias = (t.astype(self.dtype) for t in (x, self.kernel[...], self.bias[...]))
        if group_sizes is not None:  # each slot's expert's bias, by where the groups end
            ends = jnp.cumsum(group_sizes, -1)[:, None]  # past them, none: a bias of 0
            owner = (jnp.arange(x.shape[1])[None, :, None] >= ends).sum(-1)
            biases = jax.nn.one_hot(owner, bias.shape[0], dtype=x.dtype) @ bias
            return self.ragged_dot(x, kernel, group_sizes, GROUPED) + biases
        # Each expert's x [..., in] times its kernel [in, features]: the experts' axis a batch axis.
        y = self.dot_general(x, kernel, (((x.ndim - 1,), (1,)), ((0,), (0,))))
        return y + bias.reshape(bias.shape[0], *[1] * (x.ndim - 2), -1)


def places_in_queue(choices):
    """Each one-hot choice's place in its expert's queue: first choices first, then seconds."""
    rows, length, k, experts = choices.shape
    queue = choices.swapaxes(1, 2).reshape(rows, k * length, experts)  # first choices first
    places = (jnp.cumsum(queue, axis=1) - 1).reshape(rows, k, length, experts).swapaxes(1, 2)
    return jnp.sum(places * choices, -1).astype(jnp.int32)


def grouped_by_expert(fc1, fc2, experts, x, expert, gate, shard=0, shards=1):
    """Dropless: each token through its experts (part `shard` of `shards` of them here), sorted
    by expert so that each expert's tokens sit side by side: two grouped matmuls, no slot empty.
    A device's own rows (no axes the compiler splits) are sorted together, as one. They run
    again in the backward pass, k copies of each token and their hidden not kept for it, and in k
    passes of a row's length: the hidden held at once is the dense MLP's."""

    @jax.checkpoint
    def through_experts(x, expert, gate):
        shape, mesh = x.shape, jax.sharding.get_abstract_mesh()
        if not (mesh.explicit_axes or mesh.auto_axes):
            x, expert, gate = (t.reshape(1, -1, *t.shape[2:]) for t in (x, expert, gate))
        rows, length, k = expert.shape
        here = experts // shards
        expert = expert - shard * here  # numbered from 0 among those here
        elsewhere = (expert < 0) | (expert >= here)
        key = jnp.where(elsewhere, here, expert).reshape(rows, length * k)
        order = jnp.argsort(key, axis=-1, stable=True)  # each row's choices, grouped by expert
        group_sizes = jax.nn.one_hot(key, here, dtype=jnp.int32).sum(1)  # [rows, experts]
        slots = jnp.take_along_axis(x, order[..., None] // k, axis=1)  # [rows, length x k, d]
        ends = jnp.cumsum(group_sizes, -1) - length * jnp.arange(k)[:, None, None]
        sizes = jnp.clip(ends, 0, length) - jnp.clip(ends - group_sizes, 0, length)  # a pass's
        expert_mlp = jax.checkpoint(lambda s, n: fc2(jax.nn.gelu(fc1(s, n)), n))
        out = [expert_mlp(slots[:, p * length : (p + 1) * length], sizes[p]) for p in range(k)]
        out = jnp.concatenate(out, axis=1)
        back = jnp.take_along_axis(out, jnp.argsort(order, axis=-1)[..., None], axis=1)
        weights = jnp.where(elsewhere, 0, gate).astype(back.dtype)
        out = jnp.einsum("blkd,blk->bld", back.reshape(rows, length, k, -1), weights)
        return out.reshape(shape)

    return through_experts(x, expert, gate)


@jax.custom_vjp
def load_of(bias, load):
    """Balance without a loss (DeepSeek-V3): 0 added to the loss, its derivative for the bias
    `load`, each expert's excess tokens; the optimizer moves the bias against its sign."""
    return jnp.zeros((), load.dtype)


load_of.defvjp(
    lambda bias, load: (load_of(bias, load), load),  # forward: keep load for the backward
    lambda load, scale: (scale * load, jnp.zeros_like(load)),  # the bias's entry: load
)


class MoeMlp(nnx.Module):
    """--experts MLPs, each token through its --top-k weighted by its router's probabilities (and
    --shared-experts): dropless (grouped_by_expert), or one-hot into `capacity` slots (GShard)."""

    def __init__(self, config: TrainingConfig, hooks: Hooks, *, rngs: nnx.Rngs):
        c, self.config, self.hooks = config, config, hooks
        # The router works in float32: which expert a token goes to must not hang on rounding.
        init = _init(("embed", None))
        self.router = nnx.Linear(
            c.d_model, c.experts, use_bias=False, dtype=jnp.float32, kernel_init=init, rngs=rngs
        )
        if c.router_bias_rate:  # a balance bias (load_of) chooses the experts, but weighs none
            self.router_bias = nnx.Param(jnp.zeros(c.experts), out_sharding=(None,))
        units = c.mlp_dim or 4 * c.d_model  # each expert as wide as the dense MLP
        self.fc1 = ExpertDense(c, c.d_model, units, ("embed", "mlp"), rngs=rngs)
        scale = _residual_scale(c)
        self.fc2 = ExpertDense(c, units, c.d_model, ("mlp", "embed"), scale, rngs=rngs)
        if c.shared_experts:  # every token's: one MLP as wide as all of them (DeepSeek-V2)
            self.shared = Mlp(c, c.shared_experts, rngs=rngs)
        self.dropout = nnx.Dropout(c.dropout, rngs=rngs)

    def __call__(self, x):
        c = self.config
        rows, length, _ = x.shape
        probs = jax.nn.softmax(self.router(x.astype(jnp.float32)))  # [rows, length, experts]
        scores = probs + self.router_bias[...] if c.router_bias_rate else probs
        expert = jax.lax.top_k(scores, c.top_k)[1]  # [rows, length, k]
        chosen = jax.nn.one_hot(expert, c.experts)  # [rows, length, k, experts]
        gate = (chosen * probs[:, :, None]).sum(-1)  # their weights: their probabilities
        if c.top_k > 1:  # renormalised over the k (Mixtral); one expert's, as Switch, is not:
            gate = gate / gate.sum(-1, keepdims=True)  # 1 always, the router would not learn
        if c.capacity_factor:
            out, per_expert = self.with_capacity(x, chosen, gate)
        else:
            mixture = functools.partial(grouped_by_expert, self.fc1, self.fc2, c.experts)
            out = self.hooks.dropless(mixture, x, expert, gate)
            per_expert = chosen.sum((0, 1, 2))
        if c.shared_experts:
            out = out + self.shared(x)
        # Load balance (Switch Transformer, eq. 4, per sequence): experts x sum over experts of
        # (share of the sequence's choices it got) x (its mean router probability); 1 when even.
        # Counted once per token, so that it adds up like the cross-entropy.
        pieces = self.hooks.whole_sequence(chosen.sum((1, 2))[:, None])  # [rows, pieces, experts]
        whole = length * pieces.shape[1]  # the sequences' length
        share = pieces.sum(1) / (whole * c.top_k)
        mean_probs = self.hooks.whole_sequence(probs.sum(1)[:, None]).sum(1) / whole
        balance = c.experts * jnp.sum(share * mean_probs, -1)
        aux_loss_sum = c.router_aux_weight * length * balance.sum()
        if c.router_bias_rate:  # the bias's entry in the gradient: its experts' excess load
            load = chosen.sum((0, 1, 2)) / c.top_k - rows * length / c.experts
            aux_loss_sum = aux_loss_sum + load_of(self.router_bias[...], load)
        dropped = rows * length * c.top_k - per_expert.sum()
        stats = dict(aux_loss_sum=aux_loss_sum, expert_tokens=per_expert, dropped_tokens=dropped)
        return self.dropout(out), stats

    def with_capacity(self, x, chosen, gate):
        """The tokens each expert has room for, through it (dispatch, combine); the tokens taken."""
        # Every token's choices of the whole sequence, in sequence order: where this device's
        # tokens are in it (positions), and the others' from them (whole_sequence).
        mine = self.hooks.positions(x.shape[1])
        everyone = self.hooks.whole_sequence(mine[None])[0]
        gathered = self.hooks.whole_sequence(chosen)
        choices = jnp.zeros_like(gathered).at[:, everyone].set(gathered)
        place = places_in_queue(choices)[:, mine]  # this device's tokens' places
        # Places past the capacity are dropped: one_hot gives them no slot at all.
        slot = jax.nn.one_hot(place, capacity(self.config, choices.shape[1]))  # [.., k, slots]
        dispatch = jnp.einsum("blke,blks->bles", chosen, slot)
        combine = jnp.einsum("blke,blks->bles", chosen * gate[..., None], slot)
        tokens = jnp.einsum("bles,bld->ebsd", dispatch.astype(x.dtype), x)
        out = self.hooks.to_experts(lambda t: self.fc2(jax.nn.gelu(self.fc1(t))), tokens)
        return jnp.einsum("ebsd,bles->bld", out, combine.astype(out.dtype)), dispatch.sum((0, 1, 3))


def host_value(x) -> float:
    """A metric as a Python number, from one replica: it was summed over devices in the step."""
    return float(np.asarray(x.addressable_data(0)).ravel()[0])


def routing(metrics, layers: int) -> dict:
    """A step's routing: balance loss per token, fewest and most tokens of an expert, dropped."""
    per_expert = np.asarray(metrics["expert_tokens"].addressable_data(0))
    per_expert = per_expert.reshape(-1, per_expert.shape[-1])[0] / layers
    dropped = host_value(metrics["dropped_tokens"])
    return {
        "aux_loss": host_value(metrics["aux_loss_sum"]) / host_value(metrics["tokens"]),
        "expert_tokens_min": float(per_expert.min()),
        "expert_tokens_max": float(per_expert.max()),
        "dropped_share": dropped / (dropped + float(per_expert.sum()) * layers),
    }


# ----------------------------------------------------------------------------------------------
# A TPU's kernels (Pallas's), laid out per device: what --attention splash runs, and dropless
# experts' grouped matmul on a TPU. Interpreted on a CPU, which is how the tests prove them.
# ----------------------------------------------------------------------------------------------


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
        spec = logical_to_mesh_axes(("batch", "length", "act_heads", None))
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


def megablox_matmul(x, kernel, group_sizes, dimensions=None):
    """jax.lax.ragged_dot_general of dropless routing (GROUPED: x [rows, slots, in], each
    row's slots grouped by expert, group_sizes [rows, experts]) by megablox's gmm, one for all
    the rows: in a shard_map's body, as the device's own (_unchecked); under the compiler's axes
    in a shard_map over them, each device its share of the rows (split over the batch's axes,
    then each other axis that divides them) and every expert's kernel whole."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:  # one device, or jax.pmap's
        return _gmm(x, kernel, group_sizes)
    if not (axes := {*mesh.explicit_axes, *mesh.auto_axes}):
        return _unchecked(_gmm)(x, kernel, group_sizes)
    laid = jax.typeof(x).sharding.spec if mesh.explicit_axes else logical_to_mesh_axes(["batch"])
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
    # columns, each expert's kernel once per tile of rows (tiles of 128: 2.6 x the bytes). The
    # features padded to 128s: the backward pass swaps the tiles of k and n, and a TPU's tile is
    # the whole axis or 128s (a width of 64 did not compile).
    tm, k, n = 512 if rows * slots > 256 else 128, d + -d % 128, out + -out % 128
    tiling, room = (tm, min(512, k), min(1024, n)), rows * slots + -rows * slots % tm
    sizes = group_sizes.sum(0)
    filled = (jnp.arange(room) < sizes.sum())[:, None]
    x = jnp.pad(x.reshape(-1, d)[order], ((0, room - rows * slots), (0, k - d)))
    kernel = jnp.pad(kernel, ((0, 0), (0, k - d), (0, n - out)))
    interpret = jax.devices()[0].platform != "tpu"
    y = gmm(jnp.where(filled, x, 0), kernel, sizes, x.dtype, tiling, interpret=interpret)
    y = jnp.where(filled, y, 0)[: rows * slots, :out]
    return (y[jnp.argsort(order)] if rows > 1 else y).reshape(rows, slots, out)


# ----------------------------------------------------------------------------------------------
# Data: batch k depends only on (seed, k), so any devices, processes or resumed run see the same
# tokens. A dataset has describe(), loss_floor (None if unknown) and batch(step, start, stop,
# split): rows [start, stop) of global batch `step`, int32 tokens [rows, seq_len + 1].
# ----------------------------------------------------------------------------------------------


SPLITS = {"train": 0, "eval": 1}  # each split draws from its own random streams


class SyntheticData:
    """A sparse random Markov chain, fixed by its own seed, `branching` successors per token; its
    entropy rate sum_s pi(s) H(next | s) the best loss (sequences start from pi)."""

    def __init__(self, seed: int, seq_len: int, vocab=256, branching=4, source_seed=1234):
        self.seed, self.seq_len, self.vocab = seed, seq_len, vocab
        rng = np.random.default_rng(source_seed)
        # Token s can always go to following[s], the next on a random cycle through all tokens:
        # every token is reachable from every other, so the chain has one stationary pi.
        cycle = rng.permutation(vocab)
        following = np.empty(vocab, np.int64)
        following[cycle] = np.roll(cycle, -1)
        small = vocab <= 2048  # a dense transition matrix fits: the exact construction
        self.successors = np.empty((vocab, branching), np.int64)
        if small:
            for s in range(vocab):
                others = np.delete(np.arange(vocab), following[s])
                chosen = rng.choice(others, branching - 1, replace=False)
                self.successors[s] = [following[s], *chosen]
        else:  # the same distribution, drawn for all tokens at once
            self.successors[:, 0] = following
            while True:
                others = rng.integers(0, vocab - 1, size=(vocab, branching - 1))
                others += others >= following[:, None]  # skip following[s]
                if (np.diff(np.sort(others, axis=1), axis=1) != 0).all():  # none twice in a row
                    break
            self.successors[:, 1:] = others
        probs = rng.dirichlet(np.ones(branching), size=vocab)
        self.cumulative = np.cumsum(probs, axis=1)
        if small:  # pi: the left eigenvector of the transition matrix with eigenvalue 1
            transition = np.zeros((vocab, vocab))
            np.put_along_axis(transition, self.successors, probs, axis=1)
            eigenvalues, eigenvectors = np.linalg.eig(transition.T)
            pi = np.real(eigenvectors[:, np.argmin(np.abs(eigenvalues - 1))])
        else:  # the same by power iteration on the sparse chain (made lazy, so it converges)
            pi = np.full(vocab, 1 / vocab)
            for _ in range(100_000):
                moved = np.bincount(self.successors.ravel(), (pi[:, None] * probs).ravel(), vocab)
                pi, change = (pi + moved) / 2, np.abs(moved - pi).sum()
                if change < 1e-12:
                    break
        self.stationary = np.cumsum(pi / pi.sum())
        self.walk_tables = None  # the chain on the host's CPU device, for _markov_walk
        self.loss_floor = float(-(pi / pi.sum()) @ np.sum(probs * np.log(probs), axis=1))

    def describe(self) -> str:
        return f"synthetic Markov source, loss floor {self.loss_floor:.4f} (its entropy rate)"

    def batch(self, step: int, start: int, stop: int, split: str = "train") -> np.ndarray:
        """Rows [start, stop) of batch `step` of a split: int32 [rows, seq_len + 1]."""
        # One generator per (seed, split, step, row): any slice of a batch can be made on its own.
        # Uniforms u = k / 2**53 from integers k < 2**53 (numpy's Generator.random() exactly).
        streams = [np.random.PCG64((self.seed, SPLITS[split], step, r)) for r in range(start, stop)]
        k = np.stack([s.random_raw(self.seq_len + 1) >> 11 for s in streams]).astype(np.int64)
        first = np.minimum(np.searchsorted(self.stationary, k[:, 0] * 2.0**-53), self.vocab - 1)
        # Then token t + 1 is successors[s, j] for the first j with u[t + 1] <= cumulative[s, j]:
        # compiled (9.3 -> 0.6 ms), in exact integers halved into 32 bits, numpy's bit for bit.
        if self.walk_tables is None:  # made here, not in __init__: devices may not be started then
            bounds = np.floor(self.cumulative * 2.0**53).astype(np.int64)
            tables = (*_halves(bounds), self.successors.astype(np.int32))
            self.walk_tables = jax.device_put(tables, jax.local_devices(backend="cpu")[0])
        walked = _markov_walk(first.astype(np.int32), *_halves(k[:, 1:].T), *self.walk_tables)
        return np.concatenate([first[:, None], np.asarray(walked).T], axis=1).astype(np.int32)


def _halves(k):
    return (k >> 32).astype(np.int32), (k & 0xFFFFFFFF).astype(np.uint32)


@jax.jit
def _markov_walk(first, k_high, k_low, bound_high, bound_low, successors):
    """SyntheticData's walk: tokens [positions, rows] after `first` [rows]."""

    def next_token(token, k):
        high, low = k[0][:, None], k[1][:, None]
        above = (high > bound_high[token]) | (
            (high == bound_high[token]) & (low > bound_low[token])
        )
        choice = jnp.minimum(above.sum(axis=1), successors.shape[1] - 1)  # [rows]
        token = jnp.take_along_axis(successors[token], choice[:, None], axis=1)[:, 0]
        return token, token

    return jax.lax.scan(next_token, first, (k_high, k_low), unroll=4)[1]


class TextFile:
    """Text as bytes (vocabulary 256), like nanoGPT's shakespeare_char: 90% to train on."""

    loss_floor = None  # unknown for real text

    def __init__(self, config: TrainingConfig, splits: dict | None = None, about: str = ""):
        self.seed, self.seq_len, path = config.seed, config.seq_len, config.dataset
        bytes_only = f"must be {BYTES} for text (bytes), e.g. --vocab-size {BYTES}"
        require(config.vocab_size == BYTES, "vocab_size", bytes_only)
        if splits is None:
            neither = "is neither 'synthetic', a file nor a loader (tests/tfds_text.py:tiny_text)"
            require(os.path.isfile(path), "dataset", f"{path} {neither}, e.g. --dataset synthetic")
            data = np.fromfile(path, np.uint8)
            splits = {"train": data[: len(data) * 9 // 10], "eval": data[len(data) * 9 // 10 :]}
            about = f"{path} as bytes, {len(data):,} of them, the last tenth held out"
        self.splits = {k: np.frombuffer(v, np.uint8) for k, v in splits.items()}
        shortest, self.about = min(map(len, self.splits.values())), about
        too_short = f"is too short: its held-out split has {shortest} bytes, not --seq-len + 1"
        require(shortest > self.seq_len, "dataset", f"{path} {too_short}, e.g. --seq-len 8")

    def describe(self) -> str:
        return self.about

    def batch(self, step: int, start: int, stop: int, split: str = "train") -> np.ndarray:
        """Rows [start, stop) of batch `step` of a split: int32 [rows, seq_len + 1]."""
        text, rows = self.splits[split], []
        for row in range(start, stop):
            rng = np.random.default_rng((self.seed, SPLITS[split], step, row))
            place = rng.integers(len(text) - self.seq_len)
            rows.append(text[place : place + self.seq_len + 1])
        return np.stack(rows).astype(np.int32)


def process_rows(batch_size: int, process: int, processes: int) -> range:
    """The rows of the global batch one process builds: an equal contiguous share."""
    rows = batch_size // processes
    return range(process * rows, (process + 1) * rows)


def host_batch(dataset, config: TrainingConfig, step: int, split: str = "train") -> np.ndarray:
    """This process's share of a global batch; no process builds the whole batch."""
    rows = process_rows(config.batch_size, jax.process_index(), jax.process_count())
    return dataset.batch(step, rows.start, rows.stop, split)


# ----------------------------------------------------------------------------------------------
# The model and the dataset a flag names
# ----------------------------------------------------------------------------------------------


def model_class(config: TrainingConfig) -> Callable:
    """The model --model names: the GPT, or the Model of a file or module of yours."""
    if (name := config.model) == "gpt":  # the one built in
        return GPT
    make, eg = getattr(model_module(name), "Model", None), "e.g. --model gpt"
    require(callable(make), "model", f"{name} defines no Model(config, hooks, rngs=rngs), {eg}")
    linen = "linen's through nnx.bridge, as tests/llama.py"
    module = not isinstance(make, type) or issubclass(make, nnx.Module)
    require(module, "model", f"{name}: Model is no nnx.Module ({linen})")
    return make


@functools.cache
def model_module(name: str):
    """The file or module of yours --model names, imported once."""
    return import_yours(name, "model")


def import_yours(name: str, flag_name: str):
    """The Python file (my_model.py) or module (my_project.model) a flag names."""
    folder = f"{name} is a folder, e.g. {flag(flag_name)} {os.path.join(name, flag_name)}.py"
    require(not os.path.isdir(name), flag_name, folder)
    try:
        if not name.endswith(".py"):
            return importlib.import_module(name)
        spec = importlib.util.spec_from_file_location(os.path.basename(name)[:-3], name)
        module = sys.modules.setdefault(spec.name, importlib.util.module_from_spec(spec))
        spec.loader.exec_module(module)
        return module
    except Exception as error:  # not found, a syntax error, anything the file raises
        where = f"line {error.lineno}: " if isinstance(error, SyntaxError) else ""
        why = f"{where}{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
        eg = "e.g. --model gpt" if flag_name == "model" else "e.g. --dataset synthetic"
        raise ConfigError(f"{flag(flag_name)} {name} cannot be imported ({why}), {eg}") from None


def attention_kernel(config: TrainingConfig) -> str:
    """--attention as causal_attention's implementation: 'auto' is the chip's fused kernel where
    it runs (splash on a TPU, for blocks of 128 tokens; cuDNN's on a GPU), else XLA's."""
    splash = jax.devices()[0].platform == "tpu" and config.seq_len % 128 == 0
    auto = "splash" if splash else "xla" if why_not_cudnn(config) else "cudnn"
    return auto if config.attention == "auto" else config.attention


def computes(config: TrainingConfig) -> str:
    """The dtype and the attention a run computes with (under auto, why not a fused kernel)."""
    kernel, platform = attention_kernel(config), jax.devices()[0].platform
    if config.attention != "auto" or kernel != "xla":
        return f"{config.dtype} compute, {kernel} attention"
    why = {"tpu": "splash takes --seq-len in 128s", "gpu": f"cudnn {why_not_cudnn(config)}"}
    why = why.get(platform, "splash needs a TPU, cudnn a GPU")
    return f"{config.dtype} compute, xla attention (auto: {why})"


def why_not_cudnn(config: TrainingConfig) -> str | None:
    """Why cuDNN's fused attention cannot run this model here, or None."""
    kind, head_dim = jax.devices()[0].device_kind, config.d_model // max(1, config.heads)
    if "nvidia" not in kind.lower():
        return f"needs an NVIDIA GPU, not {kind}: e.g. --attention auto"
    if config.dtype != "bfloat16":
        return "computes in bfloat16 only, e.g. --dtype bfloat16"
    if head_dim % 8 or head_dim > 128:
        return f"takes heads of 8 to 128 units in 8s, e.g. --heads {max(1, config.d_model // 64)}"
    return None


@functools.cache  # one per config, wrap and hooks: a state on shapes must match the real one's
def make_model(config: TrainingConfig, wrap: Callable | None = None, hooks=Hooks()) -> Model:
    """The model --model names (the TrainState's apply_fn), each piece run through `wrap`."""
    attend = hooks.attend
    if attend is causal_attention:
        attend = functools.partial(causal_attention, implementation=attention_kernel(config))
    hooks = dataclasses.replace(hooks, attend=functools.partial(as_flagged, attend, config))
    return Model(config, model_class(config), wrap, hooks)


def as_flagged(attend, config: TrainingConfig, q, k, v):
    """hooks.attend, once what the model gives it is what the flags say: a model that ignores
    --heads, --kv-heads or --dtype would train another model in silence."""
    for name, given, flagged, what in (
        ("heads", q.shape[-2], config.heads, "heads"),
        ("kv_heads", k.shape[-2], config.kv_heads or config.heads, "key-value heads"),
        ("dtype", q.dtype, jnp.dtype(config.dtype), "queries"),
    ):
        eg = f"build it from config.{name}, e.g. {flag(name)} {given}"
        require(given == flagged, name, f"{flagged}: the model attends with {given} {what}: {eg}")
    return attend(q, k, v)


def check_honoured(config: TrainingConfig):
    """Raise ConfigError naming a flag the model is built without: a size its parameters do not
    change with, or a --dropout none of its nnx.Dropout layers drops. (The GPT keeps them all.)"""
    if config.model == "gpt":
        return
    try:
        defs = make_model(config).defs
    except ConfigError:
        raise
    except Exception as error:  # its own code, or a piece built otherwise than the contract says
        failed = f"--model {config.model} fails when built ({one_line(error)})"
        built = "it is built as Model(config, hooks, rngs=rngs), e.g. --model gpt"
        raise ConfigError(f"{model_line(config, error, 'when built') or failed}: {built}") from None
    shapes = lambda c: jax.eval_shape(lambda: init_params(make_model(c), jax.random.key(0)))  # noqa: E731
    for name in ("experts", "shared_experts", "mlp_dim"):  # e.g. the GPT's mixture, or none
        value, unset = getattr(config, name), dataclasses.replace(config, **{name: 0})
        same = f"{value}: the model's parameters are the same without it: build it from"
        eg = f"config.{name}, e.g. " + ("--mlp-dim 0" if name == "mlp_dim" else "--model gpt")
        require(not value or shapes(config) != shapes(unset), name, f"{same} {eg}")
    whole = lambda d: unflatten_dict({**flatten_dict(nnx.to_pure_dict(d.params)), **d.unread})  # noqa: E731
    merged = [nnx.merge(d.graphdef, whole(d), d.streams) for d in defs.values()]
    layers = [m for piece in merged for _, m in nnx.iter_modules(piece)]
    rate = max((m.rate for m in layers if isinstance(m, nnx.Dropout)), default=config.dropout)
    eg = f"{config.dropout}: the model's nnx.Dropout layers drop {rate}: build them from"
    require(rate == config.dropout, "dropout", f"{eg} config.dropout, e.g. --dropout {rate}")


def splits_sequence(config: TrainingConfig, rules) -> bool:
    """Whether --model's blocks lay their activations out by logical name (constrain, as the
    GPT's do) so that `rules` split them along the sequence: sequence parallelism by rules."""
    defs, tokens = make_model(config).defs, jax.ShapeDtypeStruct((1, config.seq_len), jnp.int32)
    x = jax.eval_shape(lambda p: run_piece(defs["embed"], p, tokens), defs["embed"].params)
    names, sequence = tuple({*dict(rules).values()}), dict(rules)["length"]
    mesh = jax.sharding.Mesh(np.reshape(jax.devices()[:1], (1,) * len(names)), names)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        run = jax.make_jaxpr(lambda p, x: run_piece(defs["block"], p, x))
        jaxpr = run(defs["block"].params, x).jaxpr
    laid = [e for e in _equations(jaxpr) if e.primitive.name == "sharding_constraint"]
    specs = [e.params["sharding"].spec for e in laid]
    return any(len(spec) > 1 and spec[1] == sequence for spec in specs)


def _equations(jaxpr):
    """Every equation of a jaxpr and of the jaxprs inside it."""
    for equation in jaxpr.eqns:
        yield equation
        for param in equation.params.values():
            for inner in param if isinstance(param, tuple | list) else [param]:
                inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's Jaxpr
                if hasattr(inner, "eqns"):
                    yield from _equations(inner)


class Axes(typing.NamedTuple):
    value: Any  # the parameter's shape and dtype
    names: tuple  # its axes' logical names (None: unnamed)
    declared: bool = True  # whether the model names them (all None if not)


@functools.cache  # one per config: the scripts' checks read it several times
def logical_names(config: TrainingConfig) -> list:
    """(path, Axes) of every parameter as the state holds it: blocks scanned on a 'layers' axis."""
    model, found = make_model(config), []
    names = {
        (piece, *map(str, path)): v.get_metadata().get("out_sharding")
        for piece, made in model.defs.items()
        for path, v in nnx.to_flat_state(made.params)
    }
    shapes = jax.eval_shape(lambda: init_params(model, jax.random.key(0)))
    for path, x in flatten_dict(shapes).items():
        scanned = path[0] == "blocks"  # [layers, ...]
        piece = "block" if path[0].startswith("block") else path[0]
        declared = names[piece, *map(str, path[1:])]  # an nnx.List's or Sequential's keys: ints
        unnamed = (None,) * (x.ndim - scanned - len(declared or ()))  # a short spec: whole there
        axes = ("layers",) * scanned + tuple(declared or ()) + unnamed
        found.append(("/".join(map(str, path)), Axes(x, axes, declared is not None or not x.ndim)))
    return found


def names_mesh_axes(config: TrainingConfig, axes) -> bool:
    """Whether --model names the mesh axes its parameters are split over, as the Flax docs
    annotate them (P(None, 'model')): the ones it leaves unnamed are whole, as Flax places them."""
    return any(set(box.names) & set(axes) for _, box in logical_names(config))


def is_yours(dataset: str) -> bool:
    """--dataset names a loader of your own: a Python file, or module:function."""
    return dataset.endswith(".py") or ":" in dataset


@functools.cache  # one dataset per config: setup() opens it to check it, main() reads it
def load_dataset(config: TrainingConfig):
    """The dataset --dataset names: synthetic, a text file or what your load() returns."""
    name = config.dataset
    if name == "synthetic":
        return SyntheticData(config.seed, config.seq_len, config.vocab_size)
    if is_yours(name):
        module, _, function = name.partition(":")
        make = getattr(import_yours(module, "dataset"), function or "load", None)
        eg = "e.g. --dataset synthetic"
        require(callable(make), "dataset", f"{module} has no {function or 'load'}(config), {eg}")
        return make(config)
    return TextFile(config)


def eval_batches(dataset, config: TrainingConfig) -> list:
    """This process's share of the held-out batches, the same ones at every evaluation."""
    count = config.eval_batches if config.eval_every else 0
    return [host_batch(dataset, config, i, "eval") for i in range(count)]


def train_batches(dataset, config: TrainingConfig, start: int):
    """(step, this process's rows of its batch, the seconds they took), each made while the
    devices run the step before."""
    for step in range(start, config.steps):
        began = time.perf_counter()
        rows = host_batch(dataset, config, step)
        yield step, rows, time.perf_counter() - began


def make_mesh(shape: dict, kind=jax.sharding.AxisType.Explicit) -> jax.sharding.Mesh:
    """jax.make_mesh; an axis no product of a torus's sides (v5p's 4x4x4: 2, 8) laid across them."""
    devices = mesh_utils.create_device_mesh(tuple(shape.values()), allow_split_physical_axes=True)
    return jax.sharding.Mesh(devices, tuple(shape), axis_types=(kind,) * len(shape))


def batch_shape(config: TrainingConfig, sharding) -> jax.ShapeDtypeStruct:
    """The global batch's shape, laid out by `sharding`: what the step is compiled for."""
    shape = (config.batch_size, config.seq_len + 1)
    return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)


def check_training(c: TrainingConfig):
    """Raise ConfigError naming the first bad flag of the training's."""
    check_ranges(c)
    require(c.lr > 0, "lr", "must be positive, e.g. --lr 3e-3")
    require(c.dropout < 1, "dropout", "must be below 1, e.g. --dropout 0.1")
    for name in "top_k capacity_factor shared_experts router_aux_weight router_bias_rate".split():
        given = getattr(c, name) != TrainingConfig.__dataclass_fields__[name].default
        require(c.experts or not given, name, "needs --experts, e.g. --experts 8")
    top_k = f"must be from 1 to --experts {c.experts}, e.g. --top-k {min(2, c.experts)}"
    require(not c.experts or 1 <= c.top_k <= c.experts, "top_k", top_k)
    most = f"must be at most {MAX_VOCAB:,}, e.g. --vocab-size 50304"
    require(c.vocab_size <= MAX_VOCAB, "vocab_size", most)
    if c.attention == "cudnn" and (problem := why_not_cudnn(c)):
        require(False, "attention", f"cudnn {problem}")
    blocks = f"splash takes blocks of 128 tokens, e.g. --seq-len {max(1, c.seq_len // 128) * 128}"
    require(c.attention != "splash" or c.seq_len % 128 == 0, "attention", blocks)
    heads = f"must divide --d-model {c.d_model}, e.g. --heads {math.gcd(c.d_model, 4)}"
    require(c.d_model % c.heads == 0, "heads", heads)
    groups = f"must divide --heads {c.heads}, e.g. --kv-heads {math.gcd(c.heads, 2)}"
    require(c.heads % (c.kv_heads or c.heads) == 0, "kv_heads", groups)
    tied = "is the GPT's: a model of yours ties its head itself, e.g. --model gpt"
    require(not c.tie_embeddings or c.model == "gpt", "tie_embeddings", tied)


# ----------------------------------------------------------------------------------------------
# What a run costs, measured from the real arrays and the compiled step
# ----------------------------------------------------------------------------------------------


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_CALLS = re.compile(r"\b(?:body|condition|calls|to_apply|branch_computations)=\{?%([\w.\-]+)")


def _shape_bytes(text: str) -> int:
    """The bytes of an HLO shape: f32[64,128] 32768, (bf16[2], pred[]) 5."""
    found = re.findall(r"\b(pred|[a-z]+\d+[a-z0-9]*)\[([\d,]*)\]", text)
    bits = lambda dtype: 8 if dtype == "pred" else int(re.search(r"\d+", dtype)[0])  # noqa: E731
    return sum(math.prod(map(int, filter(None, d.split(",")))) * bits(t) // 8 for t, d in found)


def _closing(text: str, start: int) -> int:
    """The index just past the bracket that closes the one at text[start]."""
    depths = itertools.accumulate((c == "(") - (c == ")") for c in text[start:])
    return start + 1 + next(i for i, depth in enumerate(depths) if depth == 0)


def hlo_program(hlo_text: str):
    """HLO text as ({computation: [(name, opcode, operands, attributes, line)]}, {name: shape},
    the entry computation)."""
    computations, shapes, entry, current = {}, {}, None, None
    for line in hlo_text.splitlines():
        if not line.startswith((" ", "}")) and line.endswith("{") and "%" in line:
            current = line.split("%")[1].split(" ")[0]
            computations[current], entry = [], current if line.startswith("ENTRY") else entry
        elif current and (instruction := re.match(r"\s*(?:ROOT )?%(\S+) = (.*)$", line)):
            name, rest = instruction.groups()
            end = _closing(rest, 0) if rest.startswith("(") else rest.index(" ")
            shapes[name], rest = rest[:end], rest[end:].lstrip()
            opcode, operands_end = rest[: rest.index("(")], _closing(rest, rest.index("("))
            operands = re.findall(r"%([\w.\-]+)", rest[len(opcode) : operands_end])
            computations[current].append((name, opcode, operands, rest[operands_end:], line))
    return computations, shapes, entry


def trips(attributes: str, computations: dict) -> int:
    """A while loop's trip count: XLA's, or its condition's `i < N` (TPU programs state none)."""
    if known := re.search(r'"known_trip_count":\{"n":"(\d+)"', attributes):
        return int(known[1])
    condition = computations[re.search(r"\bcondition=%([\w.\-]+)", attributes)[1]]
    _, opcode, operands, rest, _ = condition[-1]  # its ROOT
    bound = {name: line for name, op, *_, line in condition if op == "constant"}
    below = opcode == "compare" and "direction=LT" in rest and bound.get(operands[-1], "")
    return int(re.search(r"constant\((\d+)\)", below)[1]) if below else 1


def collective_ops(hlo_text: str) -> list:
    """Every collective of one step of a compiled program: op, runs (a loop's, once a trip),
    bytes per device (the larger of its operands and its result) and its HLO line."""
    computations, shapes, entry = hlo_program(hlo_text)
    callers = {}
    for caller, instructions in computations.items():
        for _, opcode, _, attributes, _ in instructions:
            n = trips(attributes, computations) if opcode == "while" else 1  # body, condition
            for callee in _CALLS.findall(attributes):
                callers.setdefault(callee, []).append((caller, n))
    # TPU's async collectives repeat the op where they end and in what overlaps them: not counted
    repeats = {c for c, ops in computations.items() if "AsyncCollectiveDone" in str(ops)}

    @functools.cache
    def runs(computation):
        if computation == entry or computation in repeats:
            return int(computation == entry)
        return sum(runs(caller) * n for caller, n in callers.get(computation, ()))

    found = []
    for computation, instructions in computations.items():
        for name, opcode, operands, _, line in instructions:
            op = opcode.removesuffix("-start")  # async pairs: count the start, not the done
            if computation.startswith("all-reduce-scatter"):  # TPU's reduce-scatter
                op = op.replace("all-reduce", "reduce-scatter")
            if ragged := op == "ragged-all-to-all":  # the smaller of its rows and its room: a
                op, operands = "all-to-all", operands[:1]  # device's choices, routed evenly
            fused = computation.startswith("async_collective_fusion")  # its start counted
            if op in COLLECTIVES and runs(computation) and not fused:
                operand_bytes = sum(_shape_bytes(shapes.get(o, "")) for o in operands)
                # An async start's result holds its operands, the outputs and its context (u32[]s)
                start, result = opcode.endswith("-start"), _shape_bytes(shapes[name])
                result -= start * (operand_bytes + 4 * shapes[name].count("u32[]"))
                size = (min if ragged else max)(operand_bytes, result)
                found.append(dict(op=op, runs=runs(computation), bytes=size, line=line))
    return found


def collectives(hlo_text: str) -> dict:
    """A device's collectives in one step, by kind: how many and their bytes (collective_ops;
    tools/hlo.py adds what a ring sends and the FLOPs)."""
    counted = {op: {"count": 0, "bytes": 0} for op in COLLECTIVES}
    for c in collective_ops(hlo_text):
        counted[c["op"]]["count"] += c["runs"]
        counted[c["op"]]["bytes"] += c["runs"] * c["bytes"]
    return counted


def bytes_on_device(x, device) -> int:
    """The bytes of array x stored on one device."""
    return sum(shard.data.nbytes for shard in x.addressable_shards if shard.device == device)


def cost_report(config: TrainingConfig, state, compiled, compile_seconds: float) -> dict:
    """What the strategy costs, from the real arrays (state bytes on this process's first
    device) and the compiled step (memory, collectives); before the first step donates them."""
    device, full, memory = jax.local_devices()[0], model_shapes(config), compiled.memory_analysis()
    leaves = jax.tree.leaves(unbox((state.params, state.opt_state)))
    params, full_state = unbox(full.params), unbox((full.params, full.opt_state))
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))  # noqa: E731
    return {
        "param_count": sum(x.size for x in jax.tree.leaves(params)),
        "param_bytes": nbytes(params),
        "state_bytes_total": nbytes(full_state),
        "state_bytes_per_device": sum(bytes_on_device(x, device) for x in leaves),
        "compile_seconds": compile_seconds,
        "compiled_argument_bytes": getattr(memory, "argument_size_in_bytes", None),
        "compiled_temp_bytes": getattr(memory, "temp_size_in_bytes", None),
        "collectives": collectives(compiled.as_text()),
    }


def report_lines(summary: dict) -> str:
    """The end-of-run report, for people; --metrics-file has the same numbers for programs."""
    _megabytes = lambda n: "n/a" if n is None else f"{n / 1e6:.2f} MB"  # noqa: E731
    per_device, total = summary["state_bytes_per_device"], summary["state_bytes_total"]
    kinds = summary["collectives"].items()
    used = [f"{op} {c['count']} ({_megabytes(c['bytes'])})" for op, c in kinds if c["count"]]
    return (
        f"state: {_megabytes(per_device)} per device of {_megabytes(total)} "
        f"({per_device * summary['devices'] / total:.2f} x total/devices) | compiled step: "
        f"arguments {_megabytes(summary['compiled_argument_bytes'])}, temporaries "
        f"{_megabytes(summary['compiled_temp_bytes'])}\ncollectives per step and device: "
        f"{', '.join(used) or 'none'}"
    )


# ==============================================================================================
# THE HARNESS: what a run needs around the lesson, the same for every script. Libraries keep the
# guarantees: argparse the command line, jax.distributed the processes, Orbax the checkpoints.
# ==============================================================================================


@dataclasses.dataclass(frozen=True)
class Config(TrainingConfig):
    """Every flag of every script: the training's and the run's; a script adds its strategy's."""

    eval_every: int = arg(100, "evaluate on held-out batches every this many steps", min=0)
    eval_batches: int = arg(8, "held-out batches per evaluation, the same ones each time", min=1)
    checkpoint_dir: str | None = arg(None, "save checkpoints here; resume from the newest found")
    init_from: str | None = arg(
        None, "with no checkpoint to resume, start from a checkpoint's or .safetensors' weights"
    )
    checkpoint_every: int = arg(100, "steps between checkpoints; the last step saves too", min=1)
    keep: int = arg(3, "how many of the newest checkpoints to keep", min=1)
    log_every: int = arg(25, "print and record metrics every this many steps", min=1)
    metrics_file: str | None = arg(None, "write JSON Lines metrics here: logged steps, a summary")
    cpu_devices: int = arg(8, "emulated CPU devices per process, without a GPU or TPU", min=1)
    coordinator_address: str | None = arg(None, "several processes: host:port of process 0")
    num_processes: int = arg(1, "several processes: how many, with --coordinator-address", min=1)
    process_id: int = arg(0, "several processes: this one's index, from 0", min=0)
    distributed: bool = arg(False, "let jax.distributed find the cluster (TPU pod, SLURM)")
    heartbeat_timeout: int = arg(60, "several processes: seconds until one counts as dead", min=1)

    def batch_shards(self) -> int:
        """How many ways the global batch is split; scripts with a mesh override this."""
        return jax.device_count()

    def validate(self):
        """Raise ConfigError naming the first bad flag; a script adds its flags' checks."""
        check_flags(self)
        model_class(self)  # a --model that cannot be loaded is bad input too
        check_honoured(self)


def check_flags(c: Config):
    """Raise ConfigError naming the first bad flag of the shared ones."""
    check_training(c)
    shards = c.batch_shards() * c.microbatches
    rows = f"{c.batch_shards()} batch shards x {c.microbatches} micro-batches"
    eg = f"e.g. --batch-size {max(1, c.batch_size // shards) * shards}"
    require(c.batch_size % shards == 0, "batch_size", f"must be divisible by {rows}, {eg}")
    file = c.metrics_file
    regular = not file or not os.path.exists(file) or os.path.isfile(file)
    require(regular, "metrics_file", f"{file} is not a file, e.g. --metrics-file runs/m.jsonl")


def mesh_shape(text: str, axes: tuple, auto: dict) -> dict:
    """--mesh 'data=2,model=4' -> {'data': 2, 'model': 4}, in the order of `axes`; 'auto': auto."""
    auto = {axis: auto.get(axis, 1) for axis in axes}
    eg = "e.g. --mesh " + ",".join(f"{a}={n}" for a, n in auto.items() if n > 1 or a == "data")
    if text == "auto":
        return auto
    try:
        pairs = [(name.strip(), int(n)) for name, n in (i.split("=") for i in text.split(","))]
    except ValueError:
        raise ConfigError(f"--mesh {text} is not axis=size pairs, {eg}") from None
    shape, devices = dict(pairs), math.prod(n for _, n in pairs)
    require(len(shape) == len(pairs), "mesh", f"{text} names an axis twice, {eg}")
    only = f"may name only the axes {' and '.join(axes)}"
    require(set(shape) <= set(axes), "mesh", f"{text} {only}, {eg}")
    require(min(shape.values()) > 0, "mesh", f"{text} has an axis of size < 1, {eg}")
    n = jax.device_count()
    require(devices == n, "mesh", f"{text} has {devices} devices, not {n}; {eg}")
    return {axis: shape.get(axis, 1) for axis in axes}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of argparse's usage block
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass  # the script's docstring as written, then every flag with its default


def parse_config(config_class=Config, doc: str | None = None, argv: list | None = None) -> Config:
    """The command line, made from the Config's fields; main() checks the values (setup)."""
    parser = _Parser(description=doc, formatter_class=_Help)
    for field in dataclasses.fields(config_class):
        options = {k: v for k, v in field.metadata.items() if k != "min"}
        hint = typing.get_type_hints(config_class)[field.name]
        kind = next(t for t in typing.get_args(hint) or [hint] if t is not type(None))
        how = {"action": argparse.BooleanOptionalAction} if kind is bool else {"type": kind}
        if kind is not bool and "choices" not in options:  # a switch takes none (Python 3.14)
            how["metavar"] = kind.__name__.upper()
        parser.add_argument(flag(field.name), default=field.default, **options, **how)
    return config_class(**vars(parser.parse_args(argv)))


def exit_bad_input(message: str):
    """One line on stderr, exit status 2: argparse's convention for bad input."""
    print(f"{os.path.basename(sys.argv[0])}: error: {message} (see --help)", file=sys.stderr)
    raise SystemExit(2)


# ----------------------------------------------------------------------------------------------
# Devices and processes
# ----------------------------------------------------------------------------------------------


def setup(config: Config):
    """Start JAX, then check the flags, dataset and checkpoints: bad input is one line, exit 2."""
    try:
        check_ranges(config)
        start_devices(config)
        if jax.process_count() > 1:
            same_start_everywhere(config)
        config.validate()
        for name in ("checkpoint_dir", "metrics_file"):
            path = getattr(config, name)
            folder = path if name == "checkpoint_dir" else os.path.dirname(path or "")
            try:
                if folder and "://" not in folder:  # a remote folder (gs://...) is Orbax's
                    os.makedirs(folder, exist_ok=True)
            except OSError as error:
                eg = f"e.g. {flag(name)} runs/x"
                require(False, name, f"{path} cannot be written ({error.strerror}), {eg}")
        load_dataset(config)  # a dataset that cannot be read is bad input too
        check_checkpoint(config)  # and so is a checkpoint folder of another model
    except ConfigError as error:
        exit_bad_input(str(error))


def start_devices(config: Config):
    """Emulated CPU devices (harmless on GPU and TPU hosts), then the other processes."""
    flags = os.environ.get("XLA_FLAGS", "")
    # XLA:CPU aborts a run whose emulated device is 40 s late to a collective, which a busy
    # laptop's can be: allow a day (only the CPU backend reads these)
    for name, seconds in (("terminate", 24 * 3600), ("warn_stuck", 600)):
        name = f"--xla_cpu_collective_call_{name}_timeout_seconds"
        flags += f" {name}={seconds}" * (name not in flags)
    os.environ["XLA_FLAGS"] = flags.strip()  # read as JAX starts a backend
    # XLA:CPU's threads: with fewer than 2 a device a collective can hang (dev/cpu_deadlock.py)
    os.environ.setdefault("PJRT_NPROC", str(max(os.cpu_count() or 1, 2 * config.cpu_devices)))
    with contextlib.suppress(RuntimeError):  # JAX already started (tests call main() often)
        jax.config.update("jax_num_cpu_devices", config.cpu_devices)
    address, processes, index = config.coordinator_address, config.num_processes, config.process_id
    told = address or (processes, index) != (1, 0)  # a cluster given by hand
    itself = "finds the cluster itself: give no --coordinator-address, e.g. --no-distributed"
    require(not (config.distributed and told), "distributed", itself)  # else ignored
    alone = "and --process-id need --coordinator-address, e.g. --coordinator-address host:1234"
    require(address or config.distributed or not told, "num_processes", alone)
    if (address or config.distributed) and not jax.distributed.is_initialized():
        host, _, port = (address or ":0").rpartition(":")
        ok = config.distributed or host and port.isdigit()
        eg = "e.g. --coordinator-address 10.0.0.1:1234"
        require(ok, "coordinator_address", f"is not host:port, {eg}")
        require(index < processes, "process_id", "must be < --num-processes, e.g. --process-id 0")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU processes: TCP
        cluster = () if config.distributed else (address, processes, index)
        seconds = config.heartbeat_timeout  # to join, then to notice a dead process and stop
        timeouts = dict.fromkeys(["initialization_timeout", "heartbeat_timeout_seconds"], seconds)
        jax.distributed.initialize(*cluster, **timeouts, shutdown_timeout_seconds=seconds)


def same_start_everywhere(config: Config):
    """Raise ConfigError on every process unless all have as many devices and the same flags."""
    counts = [sum(d.process_index == p for d in jax.devices()) for p in range(jax.process_count())]
    require(len(set(counts)) == 1, "cpu_devices", f"gives the processes {counts} devices")
    fields = [f.name for f in dataclasses.fields(config) if f.name != "process_id"]
    flags = {f: np.uint32(zlib.crc32(repr(getattr(config, f)).encode())) for f in fields}
    for name, values in multihost_utils.process_allgather(flags).items():
        require(len(set(np.asarray(values).tolist())) == 1, name, "differs between processes")


def is_main_process() -> bool:
    return jax.process_index() == 0


def log_print(text: str):
    if is_main_process():
        print(text, flush=True)


# ----------------------------------------------------------------------------------------------
# Checkpoints: Orbax's, in one layout for every script, so that any script resumes any other's
# ----------------------------------------------------------------------------------------------


class StopSignals:
    """Ctrl-C, and SIGTERM (a preemption), ask the run to finish its step, save and stop; with
    several processes, JAX's preemption service says at which step, the same on every one."""

    def __init__(self):
        self.stopping = False
        handled = [signal.SIGINT] + [signal.SIGTERM] * (jax.process_count() == 1)
        self.handlers = {s: signal.signal(s, self.stop) for s in handled}

    def stop(self, signum, frame):
        self.stopping = True
        self.close()  # a second one is Python's own
        name = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
        print(f"{name}: the run will finish its step, save and stop", flush=True)
        if jax.process_count() > 1:  # tell the other processes, through the preemption service
            os.kill(os.getpid(), signal.SIGTERM)

    def requested(self, step: int) -> bool:
        """Whether the run stops after step `step`."""
        if jax.process_count() > 1:
            return multihost_utils.reached_preemption_sync_point(step + 1)
        return self.stopping

    def close(self):
        for signum, handler in self.handlers.items():
            signal.signal(signum, handler)


def log_due(config: Config, step: int) -> bool:
    """Whether the run prints step `step`: every --log-every steps and the last."""
    return (step + 1) % config.log_every == 0 or step + 1 == config.steps


def eval_due(config: Config, step: int) -> bool:
    """Whether the run evaluates after step `step`: every --eval-every steps (0: never)."""
    return bool(config.eval_every) and (step + 1) % config.eval_every == 0


def not_saved(what: str) -> str:
    """Why the loop stops, saving nothing, when `what` (a loss, the state) is not finite."""
    why = "a token id past --vocab-size (tools/check.py --dataset) or too high an --lr?"
    return f"stopped: {what} is not finite; not saved ({why})"


def finite(tree) -> bool:
    """Whether every float in a tree of global arrays is (the same answer on every process)."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    return not leaves or host_value(_finite(leaves)) == 1


_finite = jax.jit(lambda leaves: jnp.all(jnp.stack([jnp.isfinite(x).all() for x in leaves])))


class Checkpoints:
    """Orbax's Checkpointer and its policies: a save every --checkpoint-every steps, at the last
    and when the run stops early, the newest --keep kept; a save that fails raises Orbax's error
    at the next. The layout is the TrainState as global arrays (to_saved, from_saved): any
    script resumes any other's."""

    def __init__(self, config: Config, to_saved=lambda s: s, from_saved=lambda saved, s: saved):
        self.config, self.to_saved, self.from_saved = config, to_saved, from_saved
        self.checkpointer = self.saving = None
        if config.checkpoint_dir:
            when = ocp.training.save_decision_policies
            every, last = when.FixedIntervalPolicy(config.checkpoint_every), [config.steps]
            self.checkpointer = ocp.training.Checkpointer(
                os.path.abspath(config.checkpoint_dir),
                save_decision_policy=when.AnySavePolicy(
                    [every, when.SpecificStepsPolicy(last), when.PreemptionCheckpointingPolicy()]
                ),
                preservation_policy=ocp.training.preservation_policies.LatestN(config.keep),
                cleanup_tmp_directories=True,
            )

    def restore(self, state):
        """The newest checkpoint, laid out like `state`, and its step; with none, `state` with
        --init-from's parameters (a checkpoint folder's newest, or a file's), and 0."""
        latest, init = self.checkpointer and self.checkpointer.latest, self.config.init_from
        if not (latest or init):
            return state, 0
        mine, folder = self.to_saved(state), self.config.checkpoint_dir  # read laid out as mine
        try:
            if latest:
                saved = self.checkpointer.load(latest.step, mine)
            else:  # a fresh optimizer, at step 0
                saved = mine.replace(params=read_params(init, mine.params))
            problem = None if finite(saved) else "it holds non-finite values"
        except Exception as error:  # Orbax's errors have no common type
            problem = one_line(error)
        at = f"--checkpoint-dir {folder}: step {latest.step}" if latest else f"--init-from {init}"
        if problem:
            aside = "; move it out of the folder to resume from the one before" if latest else ""
            exit_bad_input(f"{at} is unreadable ({problem}){aside}")
        ignored = f", not --init-from {init}" if latest and init else ""
        resumed = latest and f"resumed from the checkpoint of step {latest.step} in {folder}"
        log_print((resumed or f"started from the parameters in {init}") + ignored)
        return self.from_saved(saved, state), latest.step if latest else 0

    def due(self, step: int, stopping: bool) -> bool:
        """Whether the state after step `step` is saved: a policy says so or the run stops."""
        return bool(self.checkpointer) and (stopping or self.checkpointer.should_save(step + 1))

    def save(self, step: int, state, stopping: bool = False):
        """Save the state after step `step` in the background, with the flags it was made by."""
        flags = {"flags": {n: getattr(self.config, n) for n in SHAPE_FLAGS + TRAJECTORY_FLAGS}}
        self.wait()  # for the save before
        args = step + 1, self.to_saved(state)
        self.saving = self.checkpointer.save_async(*args, force=True, custom_metadata=flags)
        if stopping:
            log_print(f"stopped: saved the checkpoint of step {step + 1}")

    def wait(self):
        """Wait for the last save: Orbax raises its error, or frees its thread and open files."""
        saving, self.saving = self.saving, None
        if saving:
            saving.result()

    def close(self):
        """Wait for the saves still being written."""
        if self.checkpointer:
            self.checkpointer.close()
            self.wait()


def read_params(path: str, like):
    """Parameters laid out as `like`, each device reading its shards: a checkpoint folder's
    newest, or a .safetensors file's, each named by its path (block_0/attn/qkv/kernel)."""
    if not path.endswith(".safetensors"):
        options = ocp.Context()
        options.pytree.loading.partial_load = True  # not the optimizer's state
        with ocp.training.Checkpointer(os.path.abspath(path)) as saved, options:
            return saved.load(saved.latest.step, {"params": like})["params"]
    with safetensors.safe_open(path, "numpy") as file:

        def read(path, x):
            name = jax.tree_util.keystr(path, simple=True, separator="/")
            part = file.get_slice(name)
            if tuple(part.get_shape()) != x.shape:
                raise ValueError(f"{name} is {tuple(part.get_shape())}, the flags make {x.shape}")
            return jax.make_array_from_callback(
                x.shape, x.sharding, lambda i: part[i].astype(x.dtype)
            )

        return jax.tree_util.tree_map_with_path(read, like)


def one_line(error: Exception) -> str:
    """The first line of the root of an error chain (Orbax's and TensorStore's are long)."""
    while (error.__cause__ or error.__context__) is not None:
        error = error.__cause__ or error.__context__
    text = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {text if len(text) < 200 else '...' + text[-150:]}"


def check_checkpoint(config: Config):
    """Refuse a --checkpoint-dir or --init-from of another model; say which flags changed since
    the checkpoint resumed was saved."""
    folder, init, eg = config.checkpoint_dir, config.init_from, "e.g. --checkpoint-dir runs/new"
    ours = []
    if folder and "://" not in folder and os.path.isdir(folder):
        numbered = sorted((n for n in os.listdir(folder) if n.isdigit()), key=int)
        ours = [n for n in numbered if os.path.exists(f"{folder}/{n}/_CHECKPOINT_METADATA")]
        theirs = f"{folder} holds folders named {', '.join(numbered)} that are not checkpoints"
        require(ours or not numbered, "checkpoint_dir", f"{theirs}, {eg}")
    if not (ours or init):
        return
    missing = f"{init} does not exist, e.g. --init-from runs/first"
    require(ours or "://" in init or os.path.exists(init), "init_from", missing)
    where = f"the checkpoint of step {ours[-1]} in {folder}" if ours else f"--init-from {init}"
    flags = recorded_flags(folder if ours else init)
    for name in SHAPE_FLAGS:
        here, there = getattr(config, name), flags.get(name, getattr(config, name))
        eg = flag(name) if isinstance(there, bool) else f"{flag(name)} {there}"
        eg = eg.replace("--", "--no-") if there is False else eg  # a switch's
        require(here == there, name, f"{here} differs from {there} in {where}, e.g. {eg}")
    now = {name: getattr(config, name) for name in TRAJECTORY_FLAGS}
    changed = [f"{flag(n)} {flags[n]} -> {v}" for n, v in now.items() if flags.get(n, v) != v]
    if ours and changed:
        log_print(f"resuming with changed flags: {', '.join(changed)}")


def recorded_flags(path: str) -> dict:
    """The flags a folder's newest checkpoint or a .safetensors file was made by; {} if it records
    none or cannot be read (restore() says why)."""
    with contextlib.suppress(Exception):
        if path.endswith(".safetensors"):
            with safetensors.safe_open(path, "numpy") as file:
                return json.loads(file.metadata()["flags"])
        with ocp.training.Checkpointer(os.path.abspath(path)) as saved:
            return saved.metadata(saved.latest.step).custom_metadata["flags"]
    return {}


# ----------------------------------------------------------------------------------------------
# Compilation, logging and the result a script returns
# ----------------------------------------------------------------------------------------------


# XLA:CPU in JAX 0.10 drops jax.checkpoint's barriers early and CSE merges the recomputation back:
# --remat kept every activation (32.3 MB of temporaries, 10.5 without). JAX 0.12's CPU keeps them.
CPU_COMPILER_OPTIONS = {"xla_disable_hlo_passes": "cse_barrier_expander"}


def compile_step(config: Config, step_fn, *args):
    """Compile for the arguments' shapes and shardings (arrays or ShapeDtypeStructs): a step too
    big for the devices, or a model whose own code fails in it, stops here in one line, before
    anything is allocated. The loop runs this program."""
    start = time.perf_counter()
    cpu = jax.default_backend() == "cpu" and hasattr(step_fn, "trace")  # pmap's take no options
    lowered = lower_step(config, step_fn, *args)
    compiled = lowered.compile(compiler_options=CPU_COMPILER_OPTIONS if cpu else {})
    memory, have = compiled.memory_analysis(), device_memory()
    sizes = ("argument", "output", "temp")
    need = memory and sum(getattr(memory, f"{s}_size_in_bytes") for s in sizes)
    if need and have and need - memory.alias_size_in_bytes > have:
        fix = "lower --batch-size or --seq-len, or add --microbatches or --remat"
        have = f"a {jax.local_devices()[0].platform} device has {have / 1e9:,.1f} GB"
        exit_bad_input(f"the train step needs {need / 1e9:,.1f} GB per device, {have}: {fix}")
    return compiled, time.perf_counter() - start


def lower_step(config: Config, step_fn, *args):
    """The step traced and lowered; a flag the model does not honour, or its own code failing
    in it, one line (exit 2)."""
    try:
        return step_fn.lower(*args)
    except Exception as error:
        line = str(error) if isinstance(error, ConfigError) else model_line(config, error)
        if not line:
            raise
        exit_bad_input(line)


def model_line(config: TrainingConfig, error: Exception, when="in the step") -> str | None:
    """An error raised in --model's own file, as one line naming its line; None if elsewhere."""
    file = config.model != "gpt" and os.path.abspath(model_module(config.model).__file__)
    tb = traceback.extract_tb(error.__traceback__)
    frame = next((f for f in reversed(tb) if os.path.abspath(f.filename) == file), None)
    if frame is None:
        return None
    where = f"--model {config.model}, line {frame.lineno}: {frame.line}"
    why = re.split(r"(?<=\.) ", one_line(error))[0]  # its first sentence
    if re.search(r"reshard|sharding|device_put", frame.line):  # the layout the script makes
        return f"{where} lays out activations itself, which fails here ({why}): remove it"
    return f"{where} fails {when} ({why})"


def device_memory() -> int | None:
    """Bytes a device holds: its limit, or on CPU, the host's available memory over its devices."""
    if limit := (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit"):
        return limit
    with contextlib.suppress(OSError, StopIteration), open("/proc/meminfo") as meminfo:
        kilobytes = next(int(s.split()[1]) for s in meminfo if s.startswith("MemAvailable:"))
        return kilobytes * 1024 // jax.local_device_count()
    return None


def json_line(value) -> str:
    """A record as a line of strict JSON: a non-finite number is null."""
    finite = lambda x: x if not isinstance(x, float) or math.isfinite(x) else None  # noqa: E731
    tree = jax.tree.map(finite, value, is_leaf=lambda x: x is None)
    return json.dumps(tree, allow_nan=False) + "\n"


@dataclasses.dataclass
class Result:
    losses: list  # the mean training loss of every step
    grad_norms: list  # the global gradient norm of every step, before clipping
    state: Any  # the final TrainState, laid out as the strategy keeps it
    summary: dict  # what the last line of --metrics-file holds
    compiled: Any  # the compiled train step
    router: list  # with --experts, every step's routing (routing()); else empty


class Logger:
    """Process 0's output: a line every --log-every steps and a report at the end, each also a
    JSON line of --metrics-file (a resumed run keeps the records of the steps before it)."""

    def __init__(self, config: Config, dataset, layout: str, report: dict, start: int):
        self.config, self.start, self.tokens = config, start, config.batch_size * config.seq_len
        self.losses, self.grad_norms, self.router, self.pending, self.seconds = [], [], [], [], []
        self.waits, self.earlier, self.eval_loss, self.file = [], [], None, None
        device, devices, processes = jax.devices()[0], jax.device_count(), jax.process_count()
        s = self.summary = dict(platform=device.platform, device_kind=device.device_kind)
        s.update(dtype=config.dtype, layout=layout, devices=devices, processes=processes, **report)
        s["loss_floor"] = getattr(dataset, "loss_floor", None)  # None: unknown
        if (path := config.metrics_file) and is_main_process():
            with contextlib.suppress(FileNotFoundError), open(path) as old:
                for line in old if start else ():
                    with contextlib.suppress(ValueError, AttributeError):  # cut short by a crash
                        if json.loads(line).get("step", start + 1) <= start:
                            self.earlier.append(json.loads(line))
            with open(f"{path}.new", "w") as new:  # then put in its place whole
                new.writelines(map(json_line, self.earlier))
            os.replace(f"{path}.new", path)
            self.file = open(path, "a")
        rows, millions = config.batch_size // config.batch_shards(), report["param_count"] / 1e6
        log_print(
            f"{devices} {device.platform} devices in {processes} process(es) | {layout} | "
            f"{millions:.2f}M parameters, {computes(config)}\nbatch {config.batch_size} x "
            f"{config.seq_len} tokens ({rows} per device) | {dataset.describe()}\n"
            f"compiled the train step in {report['compile_seconds']:.1f}s"
        )
        self.last_time = time.perf_counter()

    def print(self, line: str, record: dict):
        """A line on process 0's output (if any), and its record in --metrics-file."""
        if line:
            log_print(line)
        if self.file:
            self.file.write(json_line(record))
            self.file.flush()

    def fetch(self) -> int:
        """The numbers of the steps not yet fetched (waits for them); how many there were."""
        for m in self.pending:
            self.losses.append(host_value(m["loss_sum"]) / host_value(m["tokens"]))
            self.grad_norms.append(host_value(m["grad_norm"]))
            self.router += [routing(m, self.config.layers)] if "expert_tokens" in m else []
        count, self.pending = len(self.pending), []
        return count

    def log(self, step: int, metrics, waited: float):
        """Keep a step's metrics and the seconds its batch took; print them when log_due()."""
        self.pending.append(metrics)
        self.waits.append(waited)
        if not log_due(self.config, step):
            return
        count, now = self.fetch(), time.perf_counter()
        seconds, self.last_time = (now - self.last_time) / count, now
        self.seconds += [seconds] * count
        record = dict(step=step + 1, loss=self.losses[-1], grad_norm=self.grad_norms[-1])
        record.update(step_seconds=seconds, tokens_per_sec=self.tokens / seconds)
        record.update((self.router or [{}])[-1])
        routed = "aux {aux_loss:.4f} | expert tokens {expert_tokens_min:.0f}-"
        routed += "{expert_tokens_max:.0f}, {dropped_share:.1%} dropped | "
        eta, steps = seconds * (self.config.steps - step - 1), self.config.steps
        self.print(
            f"step {step + 1:>{len(str(steps))}}/{steps} | loss {record['loss']:.4f} | grad norm "
            f"{record['grad_norm']:.3f} | {routed.format(**record) if self.router else ''}"
            f"{self.tokens / seconds:,.0f} tokens/s | ETA {eta // 60:.0f}:{eta % 60:02.0f}",
            record,
        )

    def eval(self, step: int, eval_fn, state, batches):
        """Print the mean loss of the held-out batches; its time is left out of the speed."""
        jax.block_until_ready(self.pending)
        began, sums = time.perf_counter(), [eval_fn(state, batch) for batch in batches]
        total = [sum(host_value(m[key]) for m in sums) for key in ("loss_sum", "tokens")]
        self.eval_loss = total[0] / total[1]
        self.last_time += time.perf_counter() - began
        record = {"step": step + 1, "eval_loss": self.eval_loss}
        self.print(f"eval at step {step + 1}: held-out loss {self.eval_loss:.4f}", record)

    def finish(self, state, compiled) -> Result:
        """Print and write the end-of-run report; return it, the final state and compiled step."""
        self.fetch()
        earlier = lambda key: [None] + [r[key] for r in self.earlier if key in r]  # noqa: E731
        median = lambda xs: float(np.median(xs)) if xs else None  # noqa: E731 (not one-off work)
        s, seconds = self.summary, median(self.seconds)
        s.update(steps=self.start + len(self.losses), resumed_from=self.start or None)
        s.update(final_loss=(earlier("loss") + self.losses)[-1], step_seconds=seconds)
        s["eval_loss"] = self.eval_loss if self.eval_loss is not None else earlier("eval_loss")[-1]
        s.update(
            tokens_per_sec=seconds and self.tokens / seconds, data_wait_seconds=median(self.waits)
        )
        if self.losses:  # not when resumed at or after --steps
            floor = f" (floor {s['loss_floor']:.4f})" if s["loss_floor"] else ""
            speed, waited = s["tokens_per_sec"], s["data_wait_seconds"] * 1e3
            log_print(
                f"done: final loss {s['final_loss']:.4f}{floor}, {speed:,.0f} tokens/s, "
                f"{seconds * 1e3:.1f} ms/step, {waited:.2f} ms/step waiting for data"
            )
        self.print(report_lines(s) if self.losses else "", {"summary": s})
        if self.file:
            self.file.close()
        return Result(self.losses, self.grad_norms, state, s, compiled, self.router)
