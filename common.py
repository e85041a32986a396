"""What the strategy scripts share, and never a strategy.

The lesson comes first and reads alone: the training's flags (TrainingConfig), the model's
contract and the GPT, the TrainState with its optimizer, clipping, loss and gradient
accumulation, a mixture of experts, the data. These are what every script is built from, and
they call nothing below the PLUMBING banner. Below it, what a real run needs around them: the
run's flags (Config) and the command line's checks, the model and dataset a flag names,
devices and several processes, checkpoints, the cost report and logging. Nothing here decides
how work is split across devices: that is what each script teaches, so it lives in the script.
"""

import argparse
import dataclasses
import functools
import json
import logging
import math
import os
import queue
import re
import signal
import sys
import tempfile
import threading
import time
import traceback
import typing
import warnings
import zlib
from collections.abc import Callable
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from jax.experimental import multihost_utils

BYTES = 256  # the vocabulary of byte-level text
MAX_VOCAB = 2**20  # larger ones take minutes to set up, and gigabytes, before anything is checked


class ConfigError(ValueError):
    """A bad flag. The command line reports it as one line and exit status 2."""


def require(ok, name, message):
    """Raise ConfigError for flag --name unless ok."""
    if not ok:
        raise ConfigError(f"--{name.replace('_', '-')} {message}")


# ----------------------------------------------------------------------------------------------
# Training config: the model's, the data's and the optimizer's flags
# ----------------------------------------------------------------------------------------------


def arg(default, help, **argparse_kwargs):
    """A config field that is also a command-line flag: its default and its --help text."""
    return dataclasses.field(default=default, metadata={"help": help, **argparse_kwargs})


@dataclasses.dataclass(frozen=True)
class TrainingConfig:
    """The flags of what is trained: the model, the data and the optimizer. Every script's
    Config adds the run's (common.Config, below the banner) and its strategy's own."""

    steps: int = arg(200, "optimizer steps to run")
    batch_size: int = arg(32, "global batch: sequences per step, summed over all devices")
    seq_len: int = arg(64, "tokens per training sequence (the context length)")
    layers: int = arg(4, "transformer blocks")
    d_model: int = arg(128, "model width")
    heads: int = arg(4, "attention heads (must divide --d-model)")
    dropout: float = arg(0.1, "dropout rate; 0 makes every strategy compute the same numbers")
    lr: float = arg(3e-3, "peak learning rate: linear warmup, then cosine decay to a tenth")
    warmup_steps: int = arg(30, "learning-rate warmup steps")
    weight_decay: float = arg(0.1, "AdamW weight decay (kernels and embeddings only)")
    clip_norm: float = arg(
        1.0, "scale the gradient down to this global norm when it is larger (0: no clipping)"
    )
    seed: int = arg(0, "seed of the parameters, the dropout masks and the batch sequence")
    dtype: str = arg(
        "float32", "compute dtype; parameters stay float32", choices=("float32", "bfloat16")
    )
    attention: str = arg(
        "auto",
        "the attention kernel: cudnn (fused, on an NVIDIA GPU in bfloat16: memory linear in "
        "--seq-len), xla (the whole score matrix), auto (cudnn where it can run, else xla)",
        choices=("auto", "xla", "cudnn"),
    )
    vocab_size: int = arg(
        256, "tokens of the synthetic source, e.g. 50304 as GPT-2's; text is read as bytes: 256"
    )
    model: str = arg(
        "gpt",
        "the model: gpt, or a Python file or module of your own defining Embed, Block and Head",
    )
    tie_embeddings: bool = arg(
        False,
        "the GPT's head reads the token embedding's table (GPT-2, Gemma): one parameter, its "
        "gradient the sum of both uses (a model of yours says what it ties with TIED)",
    )
    experts: int = arg(
        0,
        "mixture of experts: every block's MLP becomes this many expert MLPs and a router (0: "
        "dense)",
    )
    top_k: int = arg(
        2, "with --experts: the experts each token goes to, their outputs weighted by the router"
    )
    capacity_factor: float = arg(
        0.0,
        "with --experts: an expert takes at most this times its fair share of a sequence's "
        "tokens, and the rest of them skip it (counted as dropped); 0: dropless, every token "
        "reaches its experts, grouped by expert",
    )
    shared_experts: int = arg(
        0, "with --experts: expert MLPs every token goes through, beside the routed ones"
    )
    router_aux_weight: float = arg(
        0.01, "with --experts: weight of the load-balancing loss added to the loss"
    )
    router_bias_rate: float = arg(
        0.0,
        "with --experts: balance without a loss (DeepSeek-V3): a bias per expert, added to the "
        "router's probabilities only to choose the experts, moves by this much after each step, "
        "down for an expert that got more than its share of the step's tokens, up for one that "
        "got less (0: no bias)",
    )
    microbatches: int = arg(1, "gradient accumulation: sequential micro-batches per step")
    scan_layers: bool = arg(False, "run the blocks with nn.scan: one compiled block, not --layers")
    remat: bool = arg(
        False, "recompute each block's activations in the backward pass instead of keeping them"
    )
    dataset: str = arg(
        "synthetic",
        "'synthetic' (embedded, no download), a text file (input.txt, read as bytes), a TFDS "
        "text dataset (e.g. tiny_shakespeare), or your own: a Python file or module:function "
        "whose function load(config) returns it (README: Your own model and data)",
    )


# ----------------------------------------------------------------------------------------------
# Model. The scripts train any model made of three pieces: the GPT-2-style decoder below, or
# your own (--model). What a model must offer, its contract:
#
#   1. Three Flax linen module classes named Embed, Block and Head, each a Piece: built as
#      Piece(config, hooks) (Hooks below), called as piece(x, deterministic).
#        Embed: tokens [batch, length] int32 -> activations [batch, length, features];
#        Block: activations -> (activations of the same shape and dtype, sums), --layers of
#               them in turn ((carry, output): the signature nn.scan iterates). sums is None,
#               or a dict of float32 sums over the block's rows, which add up over blocks,
#               devices and micro-batches into the metrics; 'aux_loss_sum' joins the loss,
#               counted per token (MoeMlp's load balance).
#        Head:  activations -> logits [batch, length, --vocab-size] in float32.
#      Model below puts them together: that is where fsdp.py's gather, --remat and
#      --scan-layers go, and pipeline.py runs the pieces one by one on their stages.
#   2. Every parameter is declared with nn.with_logical_partitioning(init, names): a logical
#      name per axis, e.g. ("embed", "mlp"). fsdp.py keeps them to box its shards,
#      logical_pjit.py maps them onto the mesh; pjit_tp.py names parameters by path instead.
#      (Flax NNX pieces, nnx.Modules built as Piece(config, hooks, rngs=rngs), name them with
#      nnx.with_partitioning and call hooks.attend and hooks.positions: from_nnx.)
#   3. Attention goes through self.attend(q, k, v) (q, k, v [batch, length, heads, head_dim],
#      causal) and token positions come from self.positions(length): the hooks a strategy may
#      replace (context_parallel.py, where each device holds pieces of every sequence, passes
#      ring attention and the positions of its pieces). A mixture of experts reaches its
#      experts through self.to_experts (capacity) or self.dropless, and the routing of
#      the whole sequence through self.whole_sequence (MoeMlp).
#   4. No parameter is shared between pieces (pipeline.py places them on different devices),
#      but the ones the head ties to the embedding: a head parameter at the same path as one of
#      Embed's (e.g. the head's nn.Embed(name="token").attend(x)), named in the model file's
#      TIED = ("token/embedding",), is that one, stored once, in the embedding. Randomness
#      only from Flax's 'dropout' rng (nn.Dropout).
#
# tools/check.py tests all of this on shapes alone, in one line per breach (a run loads a model
# without it; context_parallel.py checks its attention hook itself). Activations carry logical
# constraints (nn.with_logical_constraint), inert unless a script installs rules: ("batch",
# "length", "act_embed") on the residual stream, and whole along the sequence ("batch", None,
# "act_embed") where a norm's output enters a matmul, so that sequence parallelism (pjit_tp.py
# --sequence-parallel) splits the one and gathers the other.
# ----------------------------------------------------------------------------------------------


def _init(names, scale=1.0):
    return nn.with_logical_partitioning(nn.initializers.normal(0.02 * scale), names)


def _zeros(names):
    return nn.with_logical_partitioning(nn.initializers.zeros, names)


def _dense(config, features, names, name, scale=1.0, use_bias=True):
    """A Dense layer computing in --dtype; `names` are the logical axes of its kernel."""
    return nn.Dense(
        features,
        use_bias=use_bias,
        kernel_init=_init(names, scale),
        bias_init=_zeros(names[-1:]),
        dtype=config.dtype,
        name=name,
    )


def _layer_norm(config, name):
    return nn.LayerNorm(
        dtype=config.dtype,
        scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
        bias_init=_zeros(("norm",)),
        name=name,
    )


def _whole_sequence(x):
    """x [batch, length, features] whole along the sequence: a matmul's input, which sequence
    parallelism (rules mapping 'length') gathers here; one device's layout otherwise."""
    return nn.with_logical_constraint(x, ("batch", None, "act_embed"))


def _residual_scale(config):
    # GPT-2 scales the init of projections into the residual stream by 1/sqrt(2 * layers).
    return 1 / math.sqrt(2 * config.layers)


def sequence_positions(length: int):
    """The positions of a sequence's tokens: 0 .. length - 1. (context_parallel.py gives each
    device's piece of a sequence its own.)"""
    return jnp.arange(length)


def causal_attention(q, k, v, implementation="xla"):
    """Softmax attention of each position to itself and those before it. q, k, v: [batch,
    length, heads, head_dim]; the scores and the softmax in float32 whatever the dtype of q.
    `implementation`: jax.nn.dot_product_attention's kernel (--attention picks it). (context_
    parallel.py passes ring attention instead.)"""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)


def this_sequence(x):
    """x: [rows, length, ...], something of each of this device's tokens; the same for every
    token of their sequences. Here they are all here. (context_parallel.py, where each device
    holds pieces of every sequence, passes an all-gather of the pieces.)"""
    return x


def experts_here(experts, x):
    """Run the experts on the tokens dispatched to them, on this device. x: [experts, rows,
    capacity, features], each expert's slots. (expert_parallel.py passes its own: an all-to-all
    to the devices holding the experts, and one back.)"""
    return experts(x)


def dropless_here(mixture, x, expert, gate):
    """Every token through its experts, dropless, on this device: x [rows, length, features],
    expert and gate [rows, length, k], each token's choices and their weights. (expert_
    parallel.py passes its own: the tokens to every device holding experts, and the outputs
    back.)"""
    return mixture(x, expert, gate)


@dataclasses.dataclass(frozen=True)
class Hooks:
    """What a strategy may replace inside a model, in one value; one device's by default. A
    strategy passes Hooks(...) with the fields it replaces (context_parallel.py: attend,
    positions, whole_sequence; expert_parallel.py: to_experts, dropless), and every piece gets
    them."""

    attend: Callable = causal_attention  # q, k, v -> causal attention's output
    positions: Callable = (
        sequence_positions  # the number of this device's tokens -> their positions
    )
    to_experts: Callable = experts_here  # (the experts, their slots) -> their outputs
    dropless: Callable = dropless_here  # (the experts, tokens, choices, gates) -> their outputs
    whole_sequence: Callable = this_sequence  # something of this device's tokens -> the sequences'


class Piece(nn.Module):
    """What each piece of a model is built with (the contract above): the config and the hooks,
    which a piece reaches as self.attend, self.positions, self.to_experts, self.dropless and
    self.whole_sequence."""

    config: TrainingConfig
    hooks: Hooks = Hooks()

    @property
    def attend(self):
        return self.hooks.attend

    @property
    def positions(self):
        return self.hooks.positions

    @property
    def to_experts(self):
        return self.hooks.to_experts

    @property
    def dropless(self):
        return self.hooks.dropless

    @property
    def whole_sequence(self):
        return self.hooks.whole_sequence


class Embed(Piece):
    @nn.compact
    def __call__(self, tokens, deterministic):
        c = self.config
        embed = functools.partial(nn.Embed, features=c.d_model, dtype=c.dtype)
        x = embed(c.vocab_size, embedding_init=_init(("vocab", "embed")), name="token")(tokens)
        x = _whole_sequence(x)  # the lookup's partial sums (a split vocabulary), added up
        positions = self.positions(tokens.shape[1])
        x = x + embed(c.seq_len, embedding_init=_init(("pos", "embed")), name="position")(positions)
        x = nn.with_logical_constraint(x, ("batch", "length", "act_embed"))
        return nn.Dropout(c.dropout)(x, deterministic=deterministic)


class Attention(nn.Module):
    config: TrainingConfig
    attend: Callable = causal_attention

    @nn.compact
    def __call__(self, x, deterministic):
        c = self.config
        # One matmul makes the query, key and value of every head, laid out head by head
        # ([heads, 3, head_dim]), so splitting its outputs into equal contiguous parts (tensor
        # parallelism) gives each device whole heads, and the backward pass sums their input
        # gradients in the matmul before any all-reduce: one activation's worth, not three.
        # No bias: a key bias adds the same q.b to all of a query's scores, which softmax
        # ignores, so its gradient is zero and Adam would only turn rounding noise into updates.
        qkv = _dense(c, 3 * c.d_model, ("embed", "heads"), "qkv", use_bias=False)(x)
        q, k, v = jnp.split(qkv.reshape(*x.shape[:-1], c.heads, 3, -1), 3, axis=-2)
        q, k, v = (
            nn.with_logical_constraint(t.squeeze(-2), ("batch", "length", "act_heads", None))
            for t in (q, k, v)
        )
        x = self.attend(q, k, v)
        x = nn.with_logical_constraint(x, ("batch", "length", "act_heads", None))
        x = _dense(c, c.d_model, ("heads", "embed"), "out", _residual_scale(c))(
            x.reshape(*x.shape[:-2], -1)
        )
        return nn.Dropout(c.dropout)(x, deterministic=deterministic)


class Mlp(nn.Module):
    config: TrainingConfig
    width: int = 1  # hidden units: width x 4 x d_model (MoeMlp's shared experts: one per expert)

    @nn.compact
    def __call__(self, x, deterministic):
        c = self.config
        h = nn.gelu(_dense(c, self.width * 4 * c.d_model, ("embed", "mlp"), "fc1")(x))
        h = nn.with_logical_constraint(h, ("batch", "length", "act_mlp"))
        x = _dense(c, c.d_model, ("mlp", "embed"), "fc2", _residual_scale(c))(h)
        return nn.Dropout(c.dropout)(x, deterministic=deterministic)


class Block(Piece):
    @nn.compact
    def __call__(self, x, deterministic):
        x = x + Attention(self.config, self.attend, name="attn")(
            _whole_sequence(_layer_norm(self.config, "ln1")(x)), deterministic
        )
        h = _whole_sequence(_layer_norm(self.config, "ln2")(x))
        if self.config.experts:
            h, stats = MoeMlp(self.config, self.hooks, name="mlp")(h, deterministic)
        else:
            h, stats = Mlp(self.config, name="mlp")(h, deterministic), None
        x = nn.with_logical_constraint(x + h, ("batch", "length", "act_embed"))
        return x, stats  # (carry, output): the signature nn.scan iterates


class Head(Piece):
    @nn.compact
    def __call__(self, x, deterministic):  # the signature of every piece, so one wrap fits all
        c = self.config
        x = _whole_sequence(_layer_norm(c, "ln_f")(x))
        if c.tie_embeddings:  # the token embedding's table (tied: model_pieces), as the kernel
            table = nn.Embed(
                c.vocab_size, c.d_model, embedding_init=_init(("vocab", "embed")), name="token"
            ).embedding
            # x @ table.T as one contraction (not nn.Embed.attend's transposed copy, which
            # fsdp.py's remat would keep for the backward pass: it gathers the table again)
            logits = jnp.einsum("...d,vd->...v", x, table.astype(c.dtype))
        else:
            logits = _dense(c, c.vocab_size, ("embed", "vocab"), "out", use_bias=False)(x)
        # The loss is computed in float32 whatever the compute dtype.
        return nn.with_logical_constraint(
            logits.astype(jnp.float32), ("batch", "length", "act_vocab")
        )


class Pieces(typing.NamedTuple):
    Embed: type
    Block: type
    Head: type
    tied: tuple = ()  # the head's parameters that are the embedding's: their paths in both


GPT = Pieces(Embed, Block, Head)


def with_tied(head_params, embed_params, tied):
    """The head's parameters and the ones it ties to the embedding's (`tied`, their paths), as
    the embedding holds them: under jax.grad their gradient is the sum of both uses."""
    head_params = flax.core.unfreeze(head_params)
    for path in tied:
        *folders, name = path.split("/")
        source, target = embed_params, head_params
        for folder in folders:
            source, target = source[folder], target.setdefault(folder, {})
        target[name] = source[name]
    return head_params


def without_tied(head_params, tied):
    """The head's parameters less the tied ones, which are stored in the embedding."""

    def prune(tree, prefix):
        kept = {}
        for key, value in tree.items():
            path = f"{prefix}{key}"
            if isinstance(value, dict):
                value = prune(value, path + "/")
                if not value:  # a folder that held only tied parameters
                    continue
            if path not in tied:
                kept[key] = value
        return kept

    return prune(flax.core.unfreeze(head_params), "")


def unwrapped(module_class):
    return module_class  # the default: each piece as it is


class Model(nn.Module):
    """A model's pieces put together: the embedding, --layers blocks, the head. Returns the
    logits and what the blocks report, added up over the blocks ({} for the dense GPT).

    `wrap` is applied to each piece's class before the piece is built; fsdp.py passes one that
    all-gathers a piece's parameters just before it runs. `hooks` go to every piece (Hooks).
    """

    config: TrainingConfig
    pieces: Pieces = GPT
    wrap: Callable[[type], type] = unwrapped
    hooks: Hooks = Hooks()

    @nn.compact
    def __call__(self, tokens, deterministic: bool = True):
        c, (embed, block, head, _), hooks = self.config, self.pieces, self.hooks
        x = self.wrap(embed)(c, hooks, name="embed")(tokens, deterministic)
        block = self.wrap(block)
        if c.remat:  # keep only each block's input; the backward pass runs the block again
            block = nn.remat(block, static_argnums=(2,))
        if c.scan_layers:
            blocks = nn.scan(
                block,
                variable_axes={"params": 0},
                split_rngs={"params": True, "dropout": True},
                in_axes=nn.broadcast,
                length=c.layers,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
            x, stats = blocks(c, hooks, name="blocks")(x, deterministic)
            stats = jax.tree.map(lambda s: s.sum(0), stats)
        else:
            stats = None
            for i in range(c.layers):
                x, more = block(c, hooks, name=f"block_{i}")(x, deterministic)
                stats = more if stats is None else jax.tree.map(jnp.add, stats, more)
        head = self.wrap(head)
        if self.pieces.tied:  # the embedding's tables, read by the head as its own
            # Tied to the head's input by a barrier, so that the compiler cannot merge the head's
            # use with the lookup's: under fsdp.py each use gathers the table (and the backward
            # pass again), rather than one gathered table kept alive through the whole step.
            embedding, x = jax.lax.optimization_barrier((self.variables["params"]["embed"], x))
            head = nn.map_variables(
                head,
                "params",
                trans_in_fn=lambda own: {
                    "params": with_tied(own.get("params", {}), embedding, self.pieces.tied)
                },
                trans_out_fn=lambda own: {
                    "params": without_tied(own.get("params", {}), self.pieces.tied)
                },
                init=self.is_initializing(),
                mutable=self.is_initializing(),
            )
        return head(c, hooks, name="head")(x, deterministic), stats or {}


def init_params(model: Model, rng):
    """The model's parameters, boxed with their logical axis names (nn.LogicallyPartitioned).

    Always initialised block by block, then stacked when --scan-layers is on, so that scanned
    and unscanned runs start from the same numbers.
    """
    config = model.config
    unscanned = Model(dataclasses.replace(config, scan_layers=False), model.pieces)
    params = unscanned.init(rng, jnp.zeros((1, config.seq_len), jnp.int32))["params"]
    if config.scan_layers:
        blocks = [params.pop(f"block_{i}") for i in range(config.layers)]

        def stack(*boxes):
            names = ("layers",) + boxes[0].names
            return boxes[0].replace(value=jnp.stack([b.value for b in boxes]), names=names)

        params["blocks"] = jax.tree.map(
            stack, *blocks, is_leaf=lambda x: isinstance(x, nn.Partitioned)
        )
    return params


# ----------------------------------------------------------------------------------------------
# Train state, optimizer, clipping, loss and gradient accumulation
# ----------------------------------------------------------------------------------------------


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


# Cached, one optimizer per config: the optimizer is part of the TrainState's tree structure,
# and shardings worked out on an abstract state must fit the real state.
@functools.cache
def make_optimizer(config: TrainingConfig):
    """AdamW, its learning rate warmed up linearly and then decayed to a tenth along a cosine.
    AdamW is elementwise, which is what lets fsdp.py update each device's shard on its own."""
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
    # A mixture of experts' balance bias moves by its own rule, with no Adam moments: by the
    # rate, against the sign of its entry (its experts' excess load, load_of).
    balance = optax.GradientTransformation(
        lambda params: optax.EmptyState(),
        lambda load, state, params=None: (
            jax.tree.map(lambda x: -config.router_bias_rate * jnp.sign(x), load),
            state,
        ),
    )
    return optax.multi_transform({"learned": adamw, "balance": balance}, balance_labels)


def is_balance(path) -> bool:
    return _leaf_name(path) == "router_bias"


def balance_labels(params):
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "balance" if is_balance(path) else "learned", params
    )


def learned(grads):
    """The gradient of what is learned from the loss, for its global norm: all of it but a
    mixture's balance bias (--router-bias-rate), whose entry is its experts' load (load_of)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, g: jnp.zeros_like(g) if is_balance(path) else g, grads
    )


def create_state(config: TrainingConfig, model: Model, hold: Callable = nn.unbox) -> TrainState:
    """The initial TrainState. `hold` turns the parameters, boxed with their logical names, into
    what the model and the optimizer hold: plain arrays by default; fsdp.py boxes its shards
    anew, pipeline.py stacks the blocks."""
    init_rng, dropout_rng = jax.random.split(jax.random.key(config.seed))
    return TrainState.create(
        apply_fn=model.apply,
        params=hold(init_params(model, init_rng)),
        tx=make_optimizer(config),
        rng=dropout_rng,
    )


def clip(grads, norm, max_norm: float):
    """Scale the gradient down to max_norm when its global norm is larger (max_norm 0: never),
    as optax.clip_by_global_norm does. The norm is the script's to take: it knows how its
    devices hold the gradient (whole on each, or in pieces whose squares add up across them)."""
    if not max_norm:
        return grads
    return jax.tree.map(
        lambda g: jnp.where(norm < max_norm, g, (g / norm * max_norm).astype(g.dtype)), grads
    )


def cross_entropy(logits, labels):
    """-log softmax(logits)[label] at every position. The label's logit is picked by a product
    with a one-hot vector, not by indexing: where the vocabulary is split over devices
    (pjit_tp.py), each device then reduces its own part of the logits, and only per-position
    partial sums cross devices, never the logits."""
    label_logits = jnp.sum(
        logits * jax.nn.one_hot(labels, logits.shape[-1], dtype=logits.dtype), axis=-1
    )
    return jax.nn.logsumexp(logits, axis=-1) - label_logits


def token_losses(params, apply_fn, tokens, rng=None):
    """Next-token cross-entropy at every position, and the blocks' sums (Model); dropout only
    when given a key. `tokens` is [rows, length + 1], or the inputs and labels already paired,
    [rows, 2, length] (context_parallel.py, which reorders the positions of every sequence)."""
    inputs, labels = (
        (tokens[:, 0], tokens[:, 1]) if tokens.ndim == 3 else (tokens[:, :-1], tokens[:, 1:])
    )
    rngs = None if rng is None else {"dropout": rng}
    logits, stats = apply_fn({"params": params}, inputs, deterministic=rng is None, rngs=rngs)
    return cross_entropy(logits, labels), stats


def summed(losses, stats):
    # (sum, count) rather than a mean, so that metrics add up across devices and micro-batches;
    # the blocks' stats are sums already.
    return {"loss_sum": losses.sum(), "tokens": jnp.int32(losses.size), **stats}


def loss_fn(params, apply_fn, tokens, rng):
    """Mean next-token cross-entropy, plus the auxiliary loss the blocks add (a mixture of
    experts' load balance), and the metrics."""
    losses, stats = token_losses(params, apply_fn, tokens, rng)
    loss = losses.mean()
    if "aux_loss_sum" in stats:
        loss = loss + stats["aux_loss_sum"] / losses.size
    return loss, summed(losses, stats)


def eval_metrics(state: TrainState, tokens):
    """Summed held-out losses of a batch: no dropout, no gradient."""
    losses, _ = token_losses(state.params, state.apply_fn, tokens)
    return summed(losses, {})


def accumulate_gradients(state: TrainState, batch, rng, microbatches: int):
    """Gradient of the mean loss over `batch` and summed metrics, in `microbatches` pieces.

    Pieces run one after another (lax.scan), so activation memory is that of one piece.
    Piece i takes rows i, i + m, i + 2m, ...: a strided split keeps each piece spread over all
    the devices that hold the batch, so no strategy moves data to form it.
    """
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def piece_grads(tokens, i):
        (_, metrics), grads = grad_fn(
            state.params, state.apply_fn, tokens, jax.random.fold_in(rng, i)
        )
        return grads, metrics

    if microbatches == 1:
        return piece_grads(batch, 0)
    pieces = batch.reshape(-1, microbatches, *batch.shape[1:]).swapaxes(0, 1)

    def add_piece(total, piece_and_index):
        return jax.tree.map(jnp.add, total, piece_grads(*piece_and_index)), None

    total, _ = jax.lax.scan(
        add_piece, piece_grads(pieces[0], 0), (pieces[1:], jnp.arange(1, microbatches))
    )
    grads, metrics = total
    return jax.tree.map(lambda g: g / microbatches, grads), metrics


# ----------------------------------------------------------------------------------------------
# A mixture of experts: a router sends each token to some of the expert MLPs
# ----------------------------------------------------------------------------------------------


def capacity(config: TrainingConfig, length: int) -> int:
    """Slots per expert per sequence: --capacity-factor times its fair share of the sequence's
    length x top-k choices, and never more than the length (then no token can be dropped)."""
    fair = length * config.top_k / config.experts
    return min(length, math.ceil(config.capacity_factor * fair))


# The grouped matmul of dropless routing: x [rows, slots, in], each row's slots sorted by expert,
# times kernel [experts, in, out], row r's first group_sizes[r, 0] slots by expert 0's, and so on;
# slots past the groups come out zero.
GROUPED = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((2,), (1,)), ((), ())),
    lhs_ragged_dimensions=(1,),
    rhs_group_dimensions=(0,),
)


class ExpertDense(nn.Module):
    """A Dense layer per expert, side by side. Given slots (capacity): [experts, ..., in] ->
    [experts, ..., features]. Given group_sizes (dropless): x [rows, slots, in], grouped by
    expert as GROUPED says -> [rows, slots, features], one grouped matmul."""

    config: TrainingConfig
    features: int
    names: tuple  # the logical names of one expert's kernel
    scale: float = 1.0
    dot_general: Callable | None = None  # as nn.Dense's: lax.dot_general unless one is given
    ragged_dot: Callable | None = None  # the same for groups: lax.ragged_dot_general

    @nn.compact
    def __call__(self, x, group_sizes=None):
        # As many experts as x (or group_sizes) brings: all of them, or a device's own
        # (expert_parallel.py).
        experts = x.shape[0] if group_sizes is None else group_sizes.shape[-1]
        kernel = self.param(
            "kernel",
            _init(("expert", *self.names), self.scale),
            (experts, x.shape[-1], self.features),
        )
        bias = self.param("bias", _zeros(("expert", self.names[-1])), (experts, self.features))
        x, kernel, bias = nn.dtypes.promote_dtype(x, kernel, bias, dtype=self.config.dtype)
        if group_sizes is not None:
            ragged = self.ragged_dot or jax.lax.ragged_dot_general
            # Each slot's expert's bias, the same way: a slot of ones times the biases.
            ones = jnp.ones((*x.shape[:-1], 1), x.dtype)
            return ragged(x, kernel, group_sizes, GROUPED) + ragged(
                ones, bias[:, None], group_sizes, GROUPED
            )
        # Each expert's x [..., in] times its kernel [in, features]: the experts' axis a batch axis.
        y = (self.dot_general or jax.lax.dot_general)(
            x, kernel, (((x.ndim - 1,), (1,)), ((0,), (0,)))
        )
        return y + bias.reshape(bias.shape[0], *[1] * (x.ndim - 2), -1)


def places_in_queue(choices):
    """Each choice's place in its expert's queue, per sequence: the first choices of the whole
    sequence come first, then the second choices, each in order along the sequence (so a full
    expert drops second choices before first ones, and later tokens before earlier ones).
    choices: [rows, length, k, experts], one-hot; returns [rows, length, k], from 0."""
    rows, length, k, experts = choices.shape
    queue = choices.swapaxes(1, 2).reshape(rows, k * length, experts)  # first choices first
    places = (jnp.cumsum(queue, axis=1) - 1).reshape(rows, k, length, experts).swapaxes(1, 2)
    return jnp.sum(places * choices, -1).astype(jnp.int32)


def grouped_by_expert(fc1, fc2, experts, x, expert, gate, shard=0, shards=1):
    """Dropless: every token of x [rows, length, d] through its experts (expert [rows, length,
    k]), their outputs weighted by gate and summed. Only the experts of `shard`, one of `shards`
    equal parts of the `experts` (expert_parallel.py: a device's own), run here; a choice of
    another part's is skipped. Each row's length x k choices are sorted by expert (argsort), so
    that each expert's tokens sit side by side, its group; the experts run as two grouped
    matmuls (ExpertDense); the outputs go back to their tokens' places. Memory and FLOPs of the
    routing grow as the tokens do: no slot is ever empty."""
    rows, length, k = expert.shape
    experts = experts // shards
    expert = expert - shard * experts  # numbered from 0 among those here
    elsewhere = (expert < 0) | (expert >= experts)
    key = jnp.where(elsewhere, experts, expert).reshape(rows, length * k)
    order = jnp.argsort(key, axis=-1, stable=True)  # each row's choices, grouped by expert
    group_sizes = jax.nn.one_hot(key, experts, dtype=jnp.int32).sum(1)  # [rows, experts]
    slots = jnp.take_along_axis(x, order[..., None] // k, axis=1)  # [rows, length x k, d]
    out = fc2(nn.gelu(fc1(slots, group_sizes)), group_sizes)
    back = jnp.take_along_axis(out, jnp.argsort(order, axis=-1)[..., None], axis=1)
    weights = jnp.where(elsewhere, 0, gate).astype(back.dtype)
    return jnp.einsum("blkd,blk->bld", back.reshape(rows, length, k, -1), weights)


@jax.custom_vjp
def load_of(bias, load):
    """Balance without a loss (DeepSeek-V3), its bias's entry in the gradient: 0, added to the
    loss, whose derivative for the bias is load: the tokens each expert got more than its share
    (fewer: negative), summed over the tokens, so that the loss's mean makes it the share of the
    tokens. Gradients are averaged over micro-batches and devices, so whatever the strategy,
    the bias's entry arrives as the step's excess share of each expert, where the bias is; the
    optimizer moves the bias against its sign (make_optimizer), and it is left out of the
    gradient's norm (learned). The bias gets no other gradient: it only chooses."""
    return jnp.zeros((), load.dtype)


def _load_of_forward(bias, load):
    return load_of(bias, load), load


def _load_of_backward(load, scale):
    return scale * load, jnp.zeros_like(load)


load_of.defvjp(_load_of_forward, _load_of_backward)


class MoeMlp(nn.Module):
    """A mixture of --experts MLPs: a router sends each token to its --top-k experts, whose
    outputs, weighted by the router's probabilities, are summed; --shared-experts more MLPs
    take every token (DeepSeek, Qwen).

    Dropless (--capacity-factor 0, the default): every token reaches all its experts, grouped
    by expert (grouped_by_expert), which `dropless` runs. With a capacity (GShard, Switch):
    routing is decided per whole sequence, so it is the same computation however the batch is
    split: each expert takes at most `capacity` of a sequence's tokens (first choices first,
    then in order), the rest of its tokens skip it, counted as dropped. Tokens reach their
    experts as a fixed-size buffer [experts, rows, capacity, features] (one-hot dispatch, as in
    GShard), which `to_experts` runs. Also returns sums over the rows: the load-balancing loss,
    tokens per expert and tokens dropped (see Block)."""

    config: TrainingConfig
    hooks: Hooks = Hooks()

    @nn.compact
    def __call__(self, x, deterministic):
        c = self.config
        rows, length, _ = x.shape
        # The router works in float32: which expert a token goes to must not hang on rounding.
        router = nn.Dense(
            c.experts,
            use_bias=False,
            dtype=jnp.float32,
            kernel_init=_init(("embed", None)),
            name="router",
        )
        probs = jax.nn.softmax(router(x.astype(jnp.float32)))  # [rows, length, experts]
        scores = probs
        if c.router_bias_rate:  # a balance bias (load_of) chooses the experts, but weighs none
            bias = self.param("router_bias", _zeros((None,)), (c.experts,))
            scores = probs + bias
        expert = jax.lax.top_k(scores, c.top_k)[1]  # [rows, length, k]
        gate = jnp.take_along_axis(probs, expert, -1)  # their weights: their probabilities
        if c.top_k > 1:  # renormalised over the k (Mixtral); one expert's, as Switch, is not:
            gate = gate / gate.sum(-1, keepdims=True)  # 1 always, the router would not learn
        chosen = jax.nn.one_hot(expert, c.experts)  # [rows, length, k, experts]
        fc1 = ExpertDense(c, 4 * c.d_model, ("embed", "mlp"), name="fc1")
        fc2 = ExpertDense(c, c.d_model, ("mlp", "embed"), _residual_scale(c), name="fc2")
        if c.capacity_factor:
            out, per_expert = self.with_capacity(x, chosen, gate, fc1, fc2)
        else:
            mixture = functools.partial(grouped_by_expert, fc1, fc2, c.experts)
            out = self.hooks.dropless(mixture, x, expert, gate)
            per_expert = chosen.sum((0, 1, 2))
        if c.shared_experts:  # every token's: one MLP as wide as all of them (DeepSeek-V2)
            out = out + Mlp(c, c.shared_experts, name="shared")(x, deterministic=True)
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
            aux_loss_sum = aux_loss_sum + load_of(bias, load)
        stats = {
            "aux_loss_sum": aux_loss_sum,
            "expert_tokens": per_expert,
            "dropped_tokens": rows * length * c.top_k - per_expert.sum(),
        }
        return nn.Dropout(c.dropout)(out, deterministic=deterministic), stats

    def with_capacity(self, x, chosen, gate, fc1, fc2):
        """The tokens each expert has room for, through it: one-hot dispatch into its slots and
        combine out of them. Returns the outputs and the tokens each expert took."""
        # Every token's choices of the whole sequence, in sequence order: where this device's
        # tokens are in it (positions), and the others' from them (whole_sequence).
        mine = self.hooks.positions(x.shape[1])
        everyone, gathered = (
            self.hooks.whole_sequence(mine[None])[0],
            self.hooks.whole_sequence(chosen),
        )
        choices = jnp.zeros_like(gathered).at[:, everyone].set(gathered)
        place = places_in_queue(choices)[:, mine]  # this device's tokens' places
        # Places past the capacity are dropped: one_hot gives them no slot at all.
        slot = jax.nn.one_hot(place, capacity(self.config, choices.shape[1]))  # [.., k, slots]
        dispatch = jnp.einsum("blke,blks->bles", chosen, slot)
        combine = jnp.einsum("blke,blks->bles", chosen * gate[..., None], slot)
        tokens = jnp.einsum("bles,bld->ebsd", dispatch.astype(x.dtype), x)
        out = self.hooks.to_experts(lambda t: fc2(nn.gelu(fc1(t))), tokens)
        return jnp.einsum("ebsd,bles->bld", out, combine.astype(out.dtype)), dispatch.sum((0, 1, 3))


# ----------------------------------------------------------------------------------------------
# Data: the global batch of step k depends only on (seed, k), so any number of devices or
# processes, or a resumed run, sees the same tokens. A dataset is an object with describe(),
# loss_floor (None if unknown) and batch(step, start, stop, split), which returns rows [start,
# stop) of global batch `step` as int32 tokens [rows, seq_len + 1], the same rows for the same
# arguments on any process; --dataset names one (load_dataset, below the banner).
# ----------------------------------------------------------------------------------------------


SPLITS = {"train": 0, "eval": 1}  # each split draws from its own random streams


class SyntheticData:
    """A sparse random Markov chain over `vocab` tokens, fixed by its own seed.

    Each token has `branching` possible successors with random probabilities. The best possible
    loss is the chain's entropy rate, sum_s pi(s) H(next | s), which is printed so a run can be
    judged against it. Sequences start from the stationary distribution pi, so every predicted
    position has exactly that expected loss at best.
    """

    def __init__(
        self, seed: int, seq_len: int, vocab: int = 256, branching: int = 4, source_seed: int = 1234
    ):
        self.seed, self.seq_len, self.vocab = seed, seq_len, vocab
        rng = np.random.default_rng(source_seed)
        # Token s can always go to following[s], the next token on one random cycle through all
        # tokens: so every token is reachable from every other, and the chain has one
        # stationary distribution.
        cycle = rng.permutation(vocab)
        following = np.empty(vocab, np.int64)
        following[cycle] = np.roll(cycle, -1)
        small = vocab <= 2048  # a dense transition matrix fits: the exact construction
        self.successors = np.empty((vocab, branching), np.int64)
        if small:
            for s in range(vocab):
                others = np.delete(np.arange(vocab), following[s])
                self.successors[s] = [
                    following[s],
                    *rng.choice(others, branching - 1, replace=False),
                ]
        else:  # the same distribution, drawn for all tokens at once
            self.successors[:, 0] = following
            while True:
                others = rng.integers(0, vocab - 1, size=(vocab, branching - 1))
                others += others >= following[:, None]  # skip following[s]
                if all(len(set(row)) == branching - 1 for row in others):
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
                moved = np.zeros(vocab)
                np.add.at(moved, self.successors, pi[:, None] * probs)
                pi, change = (pi + moved) / 2, np.abs(moved - pi).sum()
                if change < 1e-12:
                    break
        self.stationary = np.cumsum(pi / pi.sum())
        self.walk_tables = None  # the chain on the host's CPU device, for _markov_walk
        self.loss_floor = float(-(pi / pi.sum()) @ np.sum(probs * np.log(probs), axis=1))

    def describe(self) -> str:
        return f"synthetic Markov source, loss floor {self.loss_floor:.4f} (its entropy rate)"

    def batch(self, step: int, start: int, stop: int, split: str = "train") -> np.ndarray:
        """Rows [start, stop) of batch `step` of a split ('train' or 'eval'): int32 [rows, seq_len +
        1]."""
        # One generator per (seed, split, step, row): any slice of a batch can be made on its own.
        # Uniforms u = k / 2**53 from integers k < 2**53 (numpy's Generator.random() exactly).
        k = np.stack(
            [
                np.random.PCG64((self.seed, SPLITS[split], step, row)).random_raw(self.seq_len + 1)
                >> 11
                for row in range(start, stop)
            ]
        ).astype(np.int64)
        first = np.minimum(np.searchsorted(self.stationary, k[:, 0] * 2.0**-53), self.vocab - 1)
        # Then token t + 1 is successors[s, j] for the first j with u[t + 1] <= cumulative[s, j], s
        # token t. The walk is sequential, so it runs as one compiled loop, not a Python one (8 x
        # 1,024 tokens: 9.3 -> 0.6 ms), in exact integers: u > c exactly when k > floor(c * 2**53).
        # Both halved into 32 bits, so JAX needs no 64-bit types: the tokens are numpy's, bit for
        # bit.
        if self.walk_tables is None:  # made here, not in __init__: devices may not be started then
            bounds = np.floor(self.cumulative * 2.0**53).astype(np.int64)
            self.walk_tables = jax.device_put(
                (_high(bounds), _low(bounds), self.successors.astype(np.int32)),
                jax.local_devices(backend="cpu")[0],
            )
        walked = _markov_walk(
            first.astype(np.int32), _high(k[:, 1:].T), _low(k[:, 1:].T), *self.walk_tables
        )
        return np.concatenate([first[:, None], np.asarray(walked).T], axis=1).astype(np.int32)


def _high(k):
    return (k >> 32).astype(np.int32)


def _low(k):
    return (k & 0xFFFFFFFF).astype(np.uint32)


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
    """A local text file read as bytes (vocabulary 256), like nanoGPT's shakespeare_char: its
    first 90% to train on, the rest held out. Each row of a batch is a window of seq_len + 1
    bytes at a place drawn from (seed, split, step, row), as in TextData."""

    loss_floor = None  # unknown for real text

    def __init__(self, config: TrainingConfig):
        self.seed, self.seq_len, path = config.seed, config.seq_len, config.dataset
        require(os.path.isfile(path), "dataset", f"{path} is not a file, e.g. --dataset input.txt")
        data = np.fromfile(path, np.uint8)
        cut = len(data) * 9 // 10
        self.splits = {"train": data[:cut], "eval": data[cut:]}
        shortest = min(len(text) for text in self.splits.values())
        require(
            shortest > self.seq_len,
            "dataset",
            f"{path} is too short: its held-out tenth has {shortest} bytes, fewer than --seq-len + "
            f"1; give a file of at least {10 * (self.seq_len + 1):,} bytes, or a smaller --seq-len",
        )
        self.describe_text = f"{path} as bytes, {len(data):,} of them, the last tenth held out"

    def describe(self) -> str:
        return self.describe_text

    def batch(self, step: int, start: int, stop: int, split: str = "train") -> np.ndarray:
        """Rows [start, stop) of batch `step` of a split ('train' or 'eval'): int32 [rows, seq_len +
        1]."""
        text = self.splits[split]
        places = [
            np.random.default_rng((self.seed, SPLITS[split], step, row)).integers(
                len(text) - self.seq_len
            )
            for row in range(start, stop)
        ]
        return np.stack([text[place : place + self.seq_len + 1] for place in places]).astype(
            np.int32
        )


def process_rows(batch_size: int, process: int, processes: int) -> range:
    """The rows of the global batch that one process builds: an equal contiguous share."""
    rows = batch_size // processes
    return range(process * rows, (process + 1) * rows)


def host_batch(dataset, config: TrainingConfig, step: int, split: str = "train") -> np.ndarray:
    """This process's share of a global batch; no process builds the whole batch."""
    rows = process_rows(config.batch_size, jax.process_index(), jax.process_count())
    return dataset.batch(step, rows.start, rows.stop, split)


# ==============================================================================================
# PLUMBING. Below this line: what a real run needs around the training, the same for every
# script. Nothing here is about the model or the strategy.
# ==============================================================================================


# ----------------------------------------------------------------------------------------------
# Config: the run's flags; the command line and its checks: bad input is one line and exit
# status 2, before any compilation
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config(TrainingConfig):
    """Every flag of every script: the training's (TrainingConfig) and the run's, below; a
    script's Config adds its strategy's."""

    data_dir: str | None = arg(
        None, "where TFDS datasets are stored (default: TFDS's, ~/tensorflow_datasets)"
    )
    text_key: str = arg(
        "text", "the TFDS dataset's text feature, e.g. text for tiny_shakespeare and lm1b"
    )
    tfds_manual_dir: str | None = arg(
        None, "already downloaded source files for preparing a TFDS dataset offline"
    )
    eval_every: int = arg(100, "evaluate on held-out batches every this many steps (0: never)")
    eval_batches: int = arg(8, "held-out batches per evaluation, the same ones every time")
    prefetch: int = arg(
        2, "batches made ahead in a thread while steps run (0: each made when its step comes)"
    )
    checkpoint_dir: str | None = arg(
        None, "save checkpoints here, and resume from the latest one found"
    )
    checkpoint_every: int = arg(
        100, "steps between checkpoints; the last step and SIGTERM always save"
    )
    keep: int = arg(3, "how many of the most recent checkpoints to keep")
    log_every: int = arg(25, "print and record metrics every this many steps")
    metrics_file: str | None = arg(None, "write JSON Lines metrics here: logged steps, a summary")
    show_sharding: bool = arg(
        False, "before training, print every parameter's layout and bytes per device"
    )
    profile: str | None = arg(
        None, "write a jax.profiler trace of a few steps after compilation to this folder"
    )
    cpu_devices: int | None = arg(
        None,
        "emulated CPU devices per process, used when no GPU or TPU is present (default 8, or the "
        "count in XLA_FLAGS' --xla_force_host_platform_device_count)",
    )
    coordinator_address: str | None = arg(
        None,
        "several processes: host:port of process 0, e.g. 10.0.0.1:1234 (all processes give the "
        "same)",
    )
    num_processes: int = arg(1, "several processes: how many, with --coordinator-address")
    process_id: int = arg(0, "several processes: this one's index, 0 to --num-processes - 1")
    distributed: bool = arg(
        False, "start JAX's distributed runtime and let it find the cluster (TPU pod, SLURM)"
    )
    heartbeat_timeout: int = arg(
        60, "several processes: seconds of silence before a process counts as dead"
    )
    debug_nans: bool = arg(
        False, "find the operation that first makes a NaN (JAX re-runs it op by op; slow)"
    )

    def batch_shards(self) -> int:
        """How many ways the global batch is split; scripts with a mesh override this."""
        return jax.device_count()

    def validate(self):
        """Raise ConfigError naming the first bad flag; a script adds its own flags' checks."""
        check_flags(self)
        model_pieces(self)  # a --model that cannot be loaded is bad input too


def check_flags(config: Config):
    """Raise ConfigError naming the first bad flag of the shared ones."""

    def example(name):  # the default is always a valid value
        return f"e.g. --{name.replace('_', '-')} {getattr(Config, name)}"

    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if isinstance(value, float):  # the run computes in float32, where 1e39 is already infinite
            require(
                math.isfinite(value) and abs(value) <= float(np.finfo(np.float32).max),
                field.name,
                f"must be a finite float32 number (at most 3.4e38), {example(field.name)}",
            )
    positive = (
        "steps",
        "batch_size",
        "seq_len",
        "layers",
        "d_model",
        "heads",
        "microbatches",
        "log_every",
        "eval_batches",
        "checkpoint_every",
        "keep",
        "lr",
    )
    for name in positive:
        require(getattr(config, name) > 0, name, f"must be positive, {example(name)}")
    for name in (
        "warmup_steps",
        "seed",
        "eval_every",
        "prefetch",
        "weight_decay",
        "clip_norm",
    ):
        require(getattr(config, name) >= 0, name, f"must be zero or more, {example(name)}")
    require(0 <= config.dropout < 1, "dropout", f"must be in [0, 1), {example('dropout')}")
    for name, eg in (
        ("experts", 8),
        ("capacity_factor", 2),
        ("shared_experts", 1),
        ("router_aux_weight", 0.01),
        ("router_bias_rate", 0.001),
    ):
        require(
            getattr(config, name) >= 0,
            name,
            f"must be zero or more, e.g. --{name.replace('_', '-')} {eg}",
        )
    for name in ("shared_experts", "router_bias_rate"):
        require(
            config.experts or not getattr(config, name),
            name,
            "needs --experts, a mixture of experts, e.g. --experts 8",
        )
    require(
        not config.experts or 1 <= config.top_k <= config.experts,
        "top_k",
        f"must be from 1 to --experts {config.experts}, e.g. --top-k {min(2, config.experts)}",
    )
    require(
        8 <= config.vocab_size <= MAX_VOCAB,
        "vocab_size",
        f"must be from 8 to {MAX_VOCAB:,} (GPT-2's is 50304, the largest in use about 256,000), "
        f"{example('vocab_size')}",
    )
    require(
        config.dataset == "synthetic" or is_yours(config.dataset) or config.vocab_size == BYTES,
        "vocab_size",
        f"must be {BYTES} for text, which is read as bytes, e.g. --vocab-size {BYTES}",
    )
    require(
        config.dtype in ("float32", "bfloat16"),
        "dtype",
        "must be float32 or bfloat16, e.g. --dtype bfloat16",
    )
    if config.attention == "cudnn" and (problem := why_not_cudnn(config)):
        require(False, "attention", f"cudnn {problem}")
    require(
        config.d_model % config.heads == 0,
        "heads",
        f"must divide --d-model {config.d_model}, e.g. --heads {math.gcd(config.d_model, 4)}",
    )
    shards = config.batch_shards() * config.microbatches
    require(
        config.batch_size % shards == 0,
        "batch_size",
        f"must be divisible by {config.batch_shards()} batch shards x {config.microbatches} "
        f"micro-batches, e.g. --batch-size {max(1, config.batch_size // shards) * shards}",
    )
    require(
        (config.num_processes, config.process_id) == (1, 0)
        or config.coordinator_address
        or config.distributed,
        "num_processes",
        "and --process-id need --coordinator-address host:port of process 0, e.g. "
        "--coordinator-address 10.0.0.1:1234",
    )
    require(
        not (config.metrics_file and os.path.isdir(config.metrics_file)),
        "metrics_file",
        f"{config.metrics_file} is a folder; give a file in it, e.g. --metrics-file "
        f"{config.metrics_file}/metrics.jsonl",
    )
    # A device or a pipe would be replaced by a regular file when a resumed run rewrites it
    require(
        not (
            config.metrics_file
            and os.path.exists(config.metrics_file)
            and not os.path.isfile(config.metrics_file)
        ),
        "metrics_file",
        f"{config.metrics_file} is not a regular file; give a file's path, e.g. --metrics-file "
        "runs/metrics.jsonl",
    )
    require(
        not config.tie_embeddings or config.model in MODELS,
        "tie_embeddings",
        f"ties the GPT's head; --model {config.model} says what its head ties in its file, e.g. "
        'TIED = ("token/embedding",)',
    )


def mesh_shape(text: str, axes: tuple, auto: dict) -> dict:
    """--mesh 'data=2,model=4' -> {'data': 2, 'model': 4}, in the order of `axes` (the mesh's,
    outer first). An axis left out has size 1; 'auto' gives `auto`."""
    n = jax.device_count()
    auto = {axis: auto.get(axis, 1) for axis in axes}
    example = "e.g. --mesh " + ",".join(
        f"{axis}={size}" for axis, size in auto.items() if size > 1 or axis == "data"
    )
    if text == "auto":
        return auto
    try:
        pairs = [
            (name.strip(), int(size))
            for name, size in (item.split("=") for item in text.split(","))
        ]
    except ValueError:
        raise ConfigError(f"--mesh {text} is not axis=size pairs, {example}") from None
    shape = dict(pairs)
    require(len(shape) == len(pairs), "mesh", f"{text} names an axis twice, {example}")
    require(
        set(shape) <= set(axes),
        "mesh",
        f"{text} may name only the axes {' and '.join(axes)}, {example}",
    )
    require(min(shape.values()) > 0, "mesh", f"{text} has an axis of size < 1, {example}")
    require(
        math.prod(shape.values()) == n,
        "mesh",
        f"{text} has {math.prod(shape.values())} devices, not {n}; {example}",
    )
    return {axis: shape.get(axis, 1) for axis in axes}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of argparse's usage block
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The script's docstring as written, then every flag with its default, said once."""

    def _get_help_string(self, action):
        return (
            action.help if "(default" in (action.help or "") else super()._get_help_string(action)
        )


_FROM_COMMAND_LINE = False


def parse_config(config_class=Config, doc: str | None = None, argv: list | None = None) -> Config:
    """Build the command line from the Config fields and parse it. A flag argparse cannot read
    exits 2 here; main() checks the values (setup)."""
    global _FROM_COMMAND_LINE
    _FROM_COMMAND_LINE = argv is None  # a script run as a program, not main() called by code
    parser = _Parser(description=doc, formatter_class=_HelpFormatter)
    hints = typing.get_type_hints(config_class)
    for field in dataclasses.fields(config_class):
        flag, kind = "--" + field.name.replace("_", "-"), hints[field.name]
        options = dict(field.metadata)
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **options)
        else:
            kind = next(t for t in typing.get_args(kind) or (kind,) if t is not type(None))
            metavar = None if "choices" in options else kind.__name__.upper()
            parser.add_argument(flag, type=kind, metavar=metavar, **options)
        parser.set_defaults(**{field.name: field.default})
    return config_class(**vars(parser.parse_args(argv)))


# ----------------------------------------------------------------------------------------------
# The model a flag names: --model's pieces, --attention's kernel
# ----------------------------------------------------------------------------------------------


MODELS = {"gpt": GPT}  # --model's built-in names


def model_pieces(config: TrainingConfig) -> Pieces:
    """The pieces --model names, and what the head ties to the embedding: the GPT's table with
    --tie-embeddings, a model of yours what its TIED says."""
    pieces = _model_pieces(config.model)
    return pieces._replace(tied=("token/embedding",)) if config.tie_embeddings else pieces


@functools.cache
def _model_pieces(name: str) -> Pieces:
    """The pieces of a built-in model, a Python file (my_model.py) or an importable module
    (my_project.model) that defines Embed, Block and Head (and TIED, if its head ties)."""
    if name in MODELS:
        return MODELS[name]
    module = import_yours(name, "model", f"built in: {', '.join(MODELS)}")
    missing = [
        piece for piece in Pieces._fields[:3] if not isinstance(getattr(module, piece, None), type)
    ]
    require(
        not missing,
        "model",
        f"{name} defines no {', '.join(missing)}: a model is three Flax modules named Embed, Block "
        "and Head (common.py's model contract; README: Your own model and data)",
    )
    tied = getattr(module, "TIED", ())
    require(
        isinstance(tied, tuple) and all(isinstance(path, str) and path for path in tied),
        "model",
        f"{name}: TIED is {tied!r}; it must be a tuple of the paths of the head's parameters that "
        'are the embedding\'s, e.g. TIED = ("token/embedding",)',
    )
    pieces = Pieces(*(_as_piece(getattr(module, piece)) for piece in Pieces._fields[:3]), tied)
    for piece in pieces[:3]:
        require(
            issubclass(piece, Piece),
            "model",
            f"{name}: {piece.__name__} is not a common.Piece: subclass it, so that it is built as "
            f"{piece.__name__}(config, hooks) (common.py's model contract)",
        )
    return pieces


def _as_piece(module_class: type) -> type:
    """A linen piece as it is; an NNX one (a subclass of nnx.Module) adapted (from_nnx)."""
    nnx = sys.modules.get("flax.nnx")  # imported by a model file that uses it
    return from_nnx(module_class) if nnx and issubclass(module_class, nnx.Module) else module_class


def from_nnx(module_class: type) -> type:
    """A Flax NNX module as a piece: built as module_class(config, hooks, rngs=rngs), called as
    module(x, deterministic), its parameters declared with nnx.with_partitioning(init, names)
    (model_pieces adapts a model file's NNX pieces by itself). Inside, it is a linen Piece that
    stores the module's parameters as linen does, at the same paths, boxed with the names NNX
    gives their axes, so every script trains it as it trains a linen model."""
    from flax import nnx

    def build(config, hooks, rngs):
        with nnx.use_eager_sharding(False):  # no mesh here: the scripts lay the parameters out
            return module_class(config, hooks, rngs=rngs)

    class Adapted(Piece):
        @nn.compact
        def __call__(self, x, deterministic):
            def dropout_key():
                return self.make_rng("dropout") if self.has_rng("dropout") else jax.random.key(0)

            if self.is_initializing():
                rngs = nnx.Rngs(params=self.make_rng("params"), dropout=0)
                module = build(self.config, self.hooks, rngs)
                for name, value in _linen_params(nnx.state(module, nnx.Param)).items():
                    self.put_variable("params", name, value)
            else:  # the module's shapes alone (nothing computed), then the parameters it is given
                graph = []

                def shapes():
                    made = nnx.split(build(self.config, self.hooks, nnx.Rngs(params=0, dropout=0)))
                    graph.append(made[0])
                    return made[1]

                state = jax.eval_shape(shapes)
                module = nnx.merge(graph[0], state)
                params = nn.unbox(flax.core.unfreeze(self.variables.get("params", {})))
                nnx.update(module, nnx.State(params))
            nnx.reseed(module, dropout=dropout_key())
            return module(x, deterministic)

    Adapted.__name__ = Adapted.__qualname__ = module_class.__name__
    Adapted.nnx_module = module_class  # what it adapts: its layers are NNX's, not linen's
    return Adapted


def _linen_params(state) -> dict:
    """An NNX module's parameters as nested dicts, each boxed as nn.LogicallyPartitioned with
    the axis names nnx.with_partitioning gave it (unboxed if it has none)."""
    from flax import nnx

    params = {}
    for path, variable in nnx.to_flat_state(state):
        *folders, name = map(str, path)
        folder = params
        for key in folders:
            folder = folder.setdefault(key, {})
        # 'out_sharding' since Flax 0.12; 'sharding_names' and 'sharding' before
        metadata = variable.get_metadata()
        names = [metadata.get(k) for k in ("out_sharding", "sharding_names", "sharding")]
        names = next((tuple(n) for n in names if n), None)
        value = variable.get_value()
        folder[name] = nn.LogicallyPartitioned(value, names=names) if names else value
    return params


def import_yours(name: str, flag: str, otherwise: str):
    """The Python file (my_model.py) or importable module (my_project.model) a flag names, or
    ConfigError in one line: what is wrong, and where in the user's code an import failed.
    `otherwise`: what else the flag takes, for the messages."""
    import importlib
    import importlib.util

    where = f"--{flag} {name}"
    require(
        not os.path.isdir(name),
        flag,
        f"{name} is a folder: give a Python file in it (--{flag} "
        f"{os.path.join(name, flag + '.py')}) or an importable module (--{flag} package.module)",
    )
    origin = name
    try:
        if name.endswith(".py"):
            require(
                os.path.isfile(name),
                flag,
                f"{name} is not a file; give a Python file or module, or {otherwise}",
            )
            spec = importlib.util.spec_from_file_location(os.path.basename(name)[:-3], name)
            module = importlib.util.module_from_spec(spec)
            sys.modules.setdefault(spec.name, module)
            spec.loader.exec_module(module)
            return module
        require(
            re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", name) is not None,
            flag,
            f"{name} is neither a Python file (.py) nor a module name (package.module); "
            + otherwise,
        )
        found = importlib.util.find_spec(name.split(".")[0])
        origin = getattr(found, "origin", None) or name
        return importlib.import_module(name)
    except ConfigError:
        raise
    except ModuleNotFoundError as error:
        # The user's own module is missing, or a module it imports (netx importing net)
        if error.name == name or name.startswith(f"{error.name}."):
            raise ConfigError(f"{where}: no such Python file or module; {otherwise}") from None
        raise ConfigError(f"{where}: importing it failed: {_failure(error, origin)}") from None
    except Exception as error:  # a syntax error, or anything the file raises as it is imported
        raise ConfigError(f"{where}: importing it failed: {_failure(error, origin)}") from None


def _failure(error: Exception, origin: str) -> str:
    """An import's error in one line: where in the user's code (the deepest line of theirs, or
    the syntax error's), what it is."""
    if isinstance(error, SyntaxError):
        place = f"{error.filename}, line {error.lineno}"
    else:
        frames = traceback.extract_tb(error.__traceback__)
        theirs = [
            f
            for f in frames
            if os.path.dirname(os.path.abspath(f.filename))
            == os.path.dirname(os.path.abspath(origin))
        ] or [f for f in frames if not f.filename.startswith("<")]
        place = f"{theirs[-1].filename}, line {theirs[-1].lineno}" if theirs else origin
    message = (error.msg if isinstance(error, SyntaxError) else str(error)).splitlines()
    return f"{place}: {type(error).__name__}: {message[0] if message else ''}"


def attention_kernel(config: Config) -> str:
    """--attention as jax.nn.dot_product_attention's `implementation`; 'auto' is cuDNN's fused
    kernel, which never builds the [length, length] scores, wherever it can run. (JAX's own
    default is always 'xla'.)"""
    if config.attention != "auto":
        return config.attention
    return "xla" if why_not_cudnn(config) else "cudnn"


def why_not_cudnn(config: Config) -> str | None:
    """Why cuDNN's fused attention cannot run this model here, or None: it runs on NVIDIA GPUs,
    in bfloat16 (or float16), for heads of up to 128 units in steps of 8."""
    kind, head_dim = jax.devices()[0].device_kind, config.d_model // max(1, config.heads)
    if "nvidia" not in kind.lower():
        return f"needs an NVIDIA GPU, not {kind}: e.g. --attention auto"
    if config.dtype != "bfloat16":
        return "computes in bfloat16 only, e.g. --dtype bfloat16"
    if head_dim % 8 or head_dim > 128:
        heads = max(1, config.d_model // 64)
        return f"takes heads of 8 to 128 units in steps of 8, not {head_dim}: e.g. --heads {heads}"
    return None


# Cached, one model per config, wrap and hooks: the TrainState holds the model's apply method in
# its tree structure, and a state worked out on shapes (to compile for) must match the real one.
@functools.cache
def make_model(
    config: Config, wrap: Callable[[type], type] = unwrapped, hooks: Hooks = Hooks()
) -> Model:
    """The model --model names, its pieces wrapped by `wrap`, built with `hooks`; attention, if
    the hooks keep one device's, with --attention's kernel."""
    if hooks.attend is causal_attention:
        hooks = dataclasses.replace(
            hooks,
            attend=functools.partial(causal_attention, implementation=attention_kernel(config)),
        )
    return Model(config, model_pieces(config), wrap, hooks)


def logical_names(config: Config) -> list:
    """(path, box) of every parameter, its box holding the logical names of its axes."""
    boxed = jax.eval_shape(lambda: init_params(make_model(config), jax.random.key(0)))
    leaves = jax.tree_util.tree_leaves_with_path(boxed, is_leaf=_is_boxed)
    return [(jax.tree_util.keystr(path, simple=True, separator="/"), box) for path, box in leaves]


def _is_boxed(x):
    return isinstance(x, nn.meta.AxisMetadata)


# ----------------------------------------------------------------------------------------------
# Devices
# ----------------------------------------------------------------------------------------------


def setup(config: Config):
    """Start JAX on the right devices, then check the flags: bad input exits 2 with one line,
    before anything is compiled. main() calls it first, before touching any device. Several
    processes first check that they were started alike, so that all of them stop together."""
    if _FROM_COMMAND_LINE and threading.current_thread() is threading.main_thread():
        # Ctrl-C before the first step ends the program at once (nothing is trained or saved
        # yet), until Checkpoints takes it over; code that calls main() keeps its own handler.
        # (A KeyboardInterrupt inside JAX's start-up would leave its 60-second TPU-warning timer
        # for the interpreter to wait for.)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        _start_devices(config)
        if jax.process_count() > 1:
            same_start_everywhere(config)
        config.validate()
        prepare_output_folders(config)
        load_dataset(config)  # a dataset that cannot be read is bad input too
        check_checkpoint(config)  # and so is a checkpoint folder of another model
    except ConfigError as error:
        exit_bad_input(str(error))


def exit_bad_input(message: str):
    """One line on stderr, exit status 2: argparse's convention for bad input."""
    print(
        f"{os.path.basename(sys.argv[0])}: error: {message} (see --help)",
        file=sys.stderr,
        flush=True,
    )
    raise SystemExit(2)


# XLA's CPU collectives abort the process (SIGABRT, "Termination timeout ... exceeded") when an
# emulated device's thread reaches a collective this many seconds after the others: 40 by
# default. On a busy or sleeping laptop one thread can be that late while the run is healthy,
# so the scripts allow a day, and a warning after 10 minutes. Only the CPU backend reads these;
# a value already in XLA_FLAGS is kept.
CPU_COLLECTIVE_TIMEOUTS = {
    "xla_cpu_collective_call_terminate_timeout_seconds": 24 * 3600,
    "xla_cpu_collective_call_warn_stuck_timeout_seconds": 600,
}


def cpu_client_threads(devices: int) -> int:
    """Threads for XLA's CPU client, which runs every emulated device's share of a program on
    one pool of max(cores, devices) threads: on 2 cores with 4 devices, exactly 4. A program
    with collectives holds a thread per device until every device has joined; launching the
    next program holds one per device as well, blocked once a device has 32 programs in
    flight. With both, N launches and N - 1 devices waiting in the collective can hold 2N - 1
    threads, the last device never gets one, and the run hangs for good in its collective,
    deaf to Ctrl-C (tools/cpu_deadlock.py: 8 devices hang with 15 threads, never with 16).
    So: at least 2 x devices. (XLA reads this number from the PJRT_NPROC variable.)"""
    return max(os.cpu_count() or 1, 2 * devices)


def _start_devices(config: Config):
    """Set up the CPU backend's devices, join the other processes, and start the backend."""
    flags = os.environ.get("XLA_FLAGS", "")
    for name, seconds in CPU_COLLECTIVE_TIMEOUTS.items():
        if f"--{name}=" not in flags:
            flags = f"{flags} --{name}={seconds}".strip()
    os.environ["XLA_FLAGS"] = flags  # read when JAX starts its first backend
    forced = re.search(r"--xla_force_host_platform_device_count=(\d+)", flags)
    count = (
        config.cpu_devices
        if config.cpu_devices is not None
        else int(forced.group(1))
        if forced
        else 8
    )
    require(count > 0, "cpu_devices", "must be positive, e.g. --cpu-devices 8")
    if forced and config.cpu_devices is not None and int(forced.group(1)) != count:
        print(
            f"--cpu-devices {count} overrides XLA_FLAGS' "
            f"--xla_force_host_platform_device_count={forced.group(1)}",
            file=sys.stderr,
        )
    if "PJRT_NPROC" not in os.environ:  # a value of the user's is kept
        # Read when JAX starts the CPU backend
        os.environ["PJRT_NPROC"] = str(cpu_client_threads(count))
    try:
        # Only affects the CPU backend, so it is harmless on GPU/TPU hosts, whose real devices
        # are used unchanged. It must run before JAX starts a backend.
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:  # JAX already started in this process (tests call main() repeatedly)
        if jax.default_backend() == "cpu" and jax.local_device_count() != count:
            raise ConfigError(
                f"--cpu-devices {count}: this process already started JAX with "
                f"{jax.local_device_count()} CPU devices"
            ) from None
    jax.config.update("jax_debug_nans", config.debug_nans)
    if (config.coordinator_address or config.distributed) and not jax.distributed.is_initialized():
        _start_distributed(config)


def prepare_output_folders(config: Config):
    """Create the folders of --metrics-file and --checkpoint-dir, and check that they take files."""
    outputs = [
        ("checkpoint_dir", config.checkpoint_dir, config.checkpoint_dir, "runs/ckpt"),
        ("profile", config.profile, config.profile, "runs/profile"),
    ]
    if is_main_process():  # only process 0 writes the metrics
        folder = os.path.dirname(config.metrics_file or "") or "."
        outputs.append(("metrics_file", config.metrics_file, folder, "runs/metrics.jsonl"))
    for name, path, folder, example in outputs:
        if not path or "://" in path:  # a remote folder (gs://...) is Orbax's to reach
            continue
        try:
            os.makedirs(folder, exist_ok=True)
            with tempfile.TemporaryFile(dir=folder):
                pass
        except OSError as error:
            reason = f"{error.strerror}: {error.filename}" if error.filename else error.strerror
            require(
                False,
                name,
                f"{path} cannot be written ({reason}); give a folder you can write, e.g. "
                f"--{name.replace('_', '-')} {example}",
            )


def _start_distributed(config: Config):
    """Join the other processes. Every process runs the same program on its own devices; jit,
    shard_map and pmap collectives then span all of them."""
    if config.distributed:  # JAX reads the cluster from its environment (Cloud TPU, SLURM, ...)
        require(
            not config.coordinator_address,
            "distributed",
            "and --coordinator-address exclude each other: give one",
        )
        address, processes, process_id = None, None, None
    else:
        host, _, port = config.coordinator_address.rpartition(":")
        require(
            host and port.isdigit(),
            "coordinator_address",
            "must be host:port, e.g. --coordinator-address 10.0.0.1:1234",
        )
        require(
            config.num_processes > 0, "num_processes", "must be positive, e.g. --num-processes 2"
        )
        require(
            0 <= config.process_id < config.num_processes,
            "process_id",
            f"must be in 0..{config.num_processes - 1}, e.g. --process-id 0",
        )
        address, processes, process_id = (
            config.coordinator_address,
            config.num_processes,
            config.process_id,
        )
    require(
        config.heartbeat_timeout > 0,
        "heartbeat_timeout",
        "must be positive, e.g. --heartbeat-timeout 60",
    )
    # CPU processes exchange collectives through gloo (TCP); GPUs and TPUs use their own links.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        address,
        processes,
        process_id,
        initialization_timeout=config.heartbeat_timeout,  # for every process to join
        # If a process dies, the runtime stops the others once its heartbeats are missing for
        # this long (or at once if it was process 0); a process that exits on an error waits
        # at most this long for the others at shutdown. Either way, no process hangs.
        heartbeat_timeout_seconds=config.heartbeat_timeout,
        shutdown_timeout_seconds=config.heartbeat_timeout,
    )


def same_start_everywhere(config: Config):
    """Raise ConfigError, on every process, unless all have as many devices and the same flags
    but --process-id (their hashes gathered over the devices)."""
    counts = [sum(d.process_index == p for d in jax.devices()) for p in range(jax.process_count())]
    require(
        len(set(counts)) == 1,
        "cpu_devices",
        f"gives the processes {', '.join(map(str, counts))} devices: give each as many",
    )
    flags = {
        f.name: np.uint32(zlib.crc32(repr(getattr(config, f.name)).encode()))
        for f in dataclasses.fields(config)
        if f.name != "process_id"
    }
    for name, values in multihost_utils.process_allgather(flags).items():
        require(len(set(np.asarray(values).tolist())) == 1, name, "differs between processes")


def is_main_process() -> bool:
    return jax.process_index() == 0


# ----------------------------------------------------------------------------------------------
# Data: the dataset --dataset names (TFDS prepared on first use), batches made ahead
# ----------------------------------------------------------------------------------------------


def is_yours(dataset: str) -> bool:
    """--dataset names a loader of your own: a Python file, or module:function."""
    return dataset.endswith(".py") or ":" in dataset


def is_text_file(dataset: str) -> bool:
    return dataset.endswith(".txt") or os.sep in dataset or os.path.isfile(dataset)


# A dataset is an object with describe(), loss_floor (None if unknown) and batch(step, start,
# stop, split), which returns rows [start, stop) of global batch `step` as int32 tokens [rows,
# seq_len + 1], the same rows for the same arguments on any process. Your own comes in as
# --dataset my_data.py (or my_project.data:function): its function `load` (or the one named)
# takes the config and returns one.
@functools.cache  # one dataset per config: setup() opens it to check it, main() reads it
def load_dataset(config: Config):
    if config.dataset == "synthetic":
        return SyntheticData(config.seed, config.seq_len, config.vocab_size)
    if is_yours(config.dataset):
        return your_dataset(config)
    if is_text_file(config.dataset):
        return TextFile(config)
    return TextData(config, _tfds_builder(config))


def your_dataset(config: Config):
    """--dataset my_data.py or my_project.data:function: the dataset your function makes from the
    config, checked on one batch of each split (its rows' shape, dtype and tokens)."""
    name, _, function = config.dataset.partition(":")
    otherwise = "'synthetic', a text file or a TFDS dataset"
    module = import_yours(name, "dataset", otherwise)
    make = getattr(module, function or "load", None)
    require(
        callable(make),
        "dataset",
        f"{config.dataset}: {name} defines no function {function or 'load'}(config) returning "
        "the dataset (README: Your own model and data)",
    )
    origin = getattr(module, "__file__", None) or name

    def call(what, function, *args):  # the user's code: its failure in one line, theirs
        try:
            return function(*args)
        except ConfigError:
            raise
        except Exception as error:
            raise ConfigError(
                f"--dataset {config.dataset}: {what} failed: {_failure(error, origin)}"
            ) from None

    dataset = call(f"{make.__name__}(config)", make, config)
    for method in ("batch", "describe"):
        require(
            callable(getattr(dataset, method, None)),
            "dataset",
            f"{config.dataset}: what {make.__name__}(config) returns has no {method}(): a dataset "
            "has batch(step, start, stop, split) and describe() (README: Your own model and data)",
        )
    rows = min(2, config.batch_size)
    for split in SPLITS:
        tokens = np.asarray(
            call(f"batch(0, 0, {rows}, '{split}')", dataset.batch, 0, 0, rows, split)
        )
        wanted = (rows, config.seq_len + 1)
        require(
            tokens.shape == wanted and tokens.dtype == np.int32,
            "dataset",
            f"{config.dataset}: batch(0, 0, {rows}, '{split}') returns {tokens.dtype}"
            f"{list(tokens.shape)}; it must return int32 tokens {list(wanted)} (rows, --seq-len "
            "+ 1)",
        )
        require(
            tokens.min() >= 0 and tokens.max() < config.vocab_size,
            "dataset",
            f"{config.dataset}: batch(0, 0, {rows}, '{split}') has tokens from {tokens.min()} to "
            f"{tokens.max()}, outside 0 .. --vocab-size {config.vocab_size} - 1, e.g. --vocab-size "
            f"{max(int(tokens.max()) + 1, 1)}",
        )
    return dataset


class TextData:
    """A TFDS dataset's text feature, read as raw bytes: vocabulary 256, nothing to download.

    Read through tfds.data_source (array_record files, random access, no TensorFlow). Each row
    of a batch is a window of seq_len + 1 bytes at a place drawn from (seed, split, step, row),
    so a run is reproducible, a resumed run sees the same data and each process reads only
    its own rows. Records shorter than a window continue into the next ones, after a newline.
    """

    loss_floor = None  # unknown for real text

    def __init__(self, config: Config, builder):
        import tensorflow_datasets as tfds

        self.seed, self.seq_len, self.key, self.cache = (
            config.seed,
            config.seq_len,
            config.text_key,
            {},
        )
        eval_split = "validation" if "validation" in builder.info.splits else "test"
        self.splits = {"train": "train", "eval": eval_split}
        self.sources = {
            split: tfds.data_source(
                config.dataset, split=name, data_dir=config.data_dir, download=False
            )
            for split, name in self.splits.items()
        }
        for split, source in self.sources.items():  # padding alone teaches nothing: refuse it
            require(
                any(len(self.text(split, record)) for record in range(len(source))),
                "dataset",
                f"{config.dataset} has no text in '{self.key}' of its '{self.splits[split]}' "
                "split: every record is empty; give a dataset with text, or its text feature with "
                "--text-key",
            )
        self.describe_text = (
            f"TFDS {builder.info.full_name} '{self.key}' as bytes, held out: '{eval_split}'"
        )

    def describe(self) -> str:
        return self.describe_text

    def text(self, split: str, record: int) -> bytes:
        if (split, record) not in self.cache:
            if len(self.cache) > 256:
                self.cache.clear()
            self.cache[split, record] = self.sources[split][record][self.key]
        return self.cache[split, record]

    def batch(self, step: int, start: int, stop: int, split: str = "train") -> np.ndarray:
        """Rows [start, stop) of batch `step` of a split ('train' or 'eval'): int32 [rows, seq_len +
        1]."""
        rows = []
        for row in range(start, stop):
            rng = np.random.default_rng((self.seed, SPLITS[split], step, row))
            record = int(rng.integers(len(self.sources[split])))
            text = self.text(split, record)
            offset = int(rng.integers(max(1, len(text) - self.seq_len)))
            window = text[offset : offset + self.seq_len + 1]
            while len(window) < self.seq_len + 1:
                record = (record + 1) % len(self.sources[split])
                window += b"\n" + self.text(split, record)
            rows.append(np.frombuffer(window[: self.seq_len + 1], np.uint8))
        return np.stack(rows).astype(np.int32)


class _DropTfdsWarnings(logging.Filter):
    # e.g. "Variant folder ... has no dataset_info.json" for a dataset not prepared
    def filter(self, record):
        return "/tensorflow_datasets/" not in record.pathname or record.levelno >= logging.ERROR


def _tfds_builder(config: Config):
    """The TFDS builder of --dataset, prepared (downloaded and converted) on first use."""
    import tensorflow_datasets as tfds

    absl_logger = logging.getLogger("absl")
    # The checks below say it better
    if not any(isinstance(f, _DropTfdsWarnings) for f in absl_logger.filters):
        absl_logger.addFilter(_DropTfdsWarnings())

    try:
        builder = tfds.builder(config.dataset, data_dir=config.data_dir, file_format="array_record")
    except tfds.core.registered.DatasetNotFoundError:
        where = f" nor prepared in --data-dir {config.data_dir}" if config.data_dir else ""
        raise ConfigError(
            f"--dataset {config.dataset} is neither 'synthetic' nor a TFDS dataset{where}; e.g. "
            "--dataset tiny_shakespeare"
        ) from None
    if not builder.is_prepared():
        _prepare(config, builder)
    if builder.info.file_format.value != "array_record":
        raise ConfigError(
            f"--dataset {config.dataset} is prepared as {builder.info.file_format.value} in "
            f"{builder.data_dir}; random access needs array_record: prepare it again in another "
            "--data-dir"
        )
    features = builder.info.features
    require(
        config.text_key in features and isinstance(features[config.text_key], tfds.features.Text),
        "text_key",
        f"{config.text_key} is not a text feature of {config.dataset}; it has "
        f"{', '.join(features)}",
    )
    require(
        "train" in builder.info.splits,
        "dataset",
        f"{config.dataset} has no train split, e.g. --dataset tiny_shakespeare",
    )
    return builder


def _prepare(config: Config, builder):
    """Download and convert a TFDS dataset, from --tfds-manual-dir when given. A failure is one
    line saying what to do."""
    import tensorflow_datasets as tfds

    how = (
        "prepare it where the internet is reachable (run this command there once, with the same "
        "--data-dir) or pass the downloaded files with --tfds-manual-dir"
    )
    wanted = {
        info.filename or url.rsplit("/", 1)[-1]: url
        for url, info in (builder.url_infos or {}).items()
    }
    if config.tfds_manual_dir:
        missing = [
            name
            for name in wanted
            if not os.path.exists(os.path.join(config.tfds_manual_dir, name))
        ]
        require(
            not missing or len(missing) < len(wanted),
            "tfds_manual_dir",
            f"{config.tfds_manual_dir} holds no {', '.join(missing)}: {config.dataset} is prepared "
            f"from {', '.join(wanted[name] for name in missing)}; download it into that folder",
        )
    try:  # TFDS's catalogue builders read and write through TensorFlow; reading later does not
        import tensorflow  # noqa: F401
    except ImportError:
        raise ConfigError(
            f"--dataset {config.dataset} is not prepared, and preparing it needs TensorFlow: pip "
            f'install "{TENSORFLOW}" (only for this; training reads the prepared files without '
            "it), or prepare it elsewhere and pass its --data-dir"
        ) from None
    if is_main_process():
        print(f"preparing TFDS {config.dataset} in {builder.data_dir} (first use only)", flush=True)
    try:
        _hide_gpus_from_tensorflow()
        builder.download_and_prepare(
            download_config=tfds.download.DownloadConfig(manual_dir=config.tfds_manual_dir)
        )
    except Exception as error:  # no network, a bad manual file, ...
        reason = " ".join(str(error).split()) or type(error).__name__
        raise ConfigError(
            f"--dataset {config.dataset} is not prepared and preparing it failed ({reason}); {how}"
        ) from None


TENSORFLOW = "tensorflow-cpu==2.21.0"  # tested with the other pins; not in requirements.txt


def _hide_gpus_from_tensorflow():
    # Preparing some catalogue datasets imports TensorFlow, which must leave the GPUs to JAX.
    import tensorflow as tf

    tf.config.set_visible_devices([], "GPU")


def eval_batches(dataset, config: Config) -> list:
    """This process's share of the held-out batches: the same ones at every evaluation; none
    when the run never evaluates."""
    if not config.eval_every:
        return []
    return [host_batch(dataset, config, i, "eval") for i in range(config.eval_batches)]


def train_batches(dataset, config: Config, start: int, log: "Logger"):
    """(step, this process's share of batch `step`) for the steps from `start` to --steps, made
    --prefetch batches ahead in a thread while the steps run, so the loop does not wait for the
    host (a batch depends only on its step: which thread makes it changes nothing). The time the
    loop still waits for each batch goes into log.data_seconds."""
    steps = range(start, config.steps)
    if not config.prefetch:
        made = ((step, host_batch(dataset, config, step)) for step in steps)
    else:
        ready, stopped = queue.Queue(config.prefetch), threading.Event()

        def make():
            for step in steps:
                try:
                    item = (step, host_batch(dataset, config, step))
                # Raised in the loop instead, where the run handles it
                except BaseException as error:
                    item = (step, error)
                while not stopped.is_set():
                    try:
                        ready.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stopped.is_set() or isinstance(item[1], BaseException):
                    return

        thread = threading.Thread(target=make, name="prefetch", daemon=True)
        thread.start()
        made = (ready.get() for _ in steps)
    try:
        while True:
            began = time.perf_counter()
            step, rows = next(made, (None, None))
            if step is None:
                return
            log.data_seconds.append(time.perf_counter() - began)
            if isinstance(rows, BaseException):
                raise rows
            yield step, rows
    finally:  # the loop ended, or stopped early (Ctrl-C, an error): the thread stops too
        if config.prefetch:
            stopped.set()
            thread.join(timeout=10)  # at most one batch being made, unless reading it hangs


def batch_shape(config: Config, sharding) -> jax.ShapeDtypeStruct:
    """The global batch's shape, laid out by `sharding`, without building it: what the train
    step is compiled for before any data exists."""
    return jax.ShapeDtypeStruct(
        (config.batch_size, config.seq_len + 1), jnp.int32, sharding=sharding
    )


# ----------------------------------------------------------------------------------------------
# Checkpoints: one layout for every script, so that any script resumes any other's run
# ----------------------------------------------------------------------------------------------


# What a checkpoint records of the run's flags. Flags that change what the saved weights mean
# cannot change on resume; flags that change the rest of the trajectory can, and the run says
# so. Every other flag (the strategy, its mesh, the devices and processes, logging, how often
# to save) may change freely: a checkpoint holds global arrays, whatever wrote them.
SHAPE_FLAGS = (
    "layers",
    "d_model",
    "heads",
    "seq_len",
    "vocab_size",
    "scan_layers",
    "experts",
    "shared_experts",
    "tie_embeddings",
)


TRAJECTORY_FLAGS = (
    "steps",
    "batch_size",
    "lr",
    "warmup_steps",
    "weight_decay",
    "clip_norm",
    "seed",
    "dropout",
    "dtype",
    "microbatches",
    "dataset",
    "text_key",
    "top_k",
    "capacity_factor",
    "router_aux_weight",
    "router_bias_rate",
)


def saved_as_is(state):
    return state  # the default: the state is already in the checkpoint layout


def restored_as_is(saved, state):
    return saved


class Checkpoints:
    """Orbax checkpoints (its V1 training API) in one layout that every script reads and writes,
    and the signals that stop a run cleanly.

    The layout is the TrainState as global arrays: parameters, optimizer state, step and rng.
    A script whose state differs passes `to_saved` and `from_saved`: pmap_dp.py keeps one copy
    per device, fsdp.py boxes its shards in nn.Partitioned. Restoring targets the arrays of the
    freshly initialised state, so every process reads only its own shards, straight into the
    script's layout, and no device ever holds a full copy it would not hold anyway. The data
    position is not saved: each batch follows from its step. A save is complete or absent: a
    process killed while saving leaves only a temporary folder, which is never read. Each
    checkpoint also records the run's flags (SHAPE_FLAGS, TRAJECTORY_FLAGS).

    Ctrl-C (SIGINT) and SIGTERM, what a TPU VM receives before maintenance, let the current step
    finish, save it and stop the run; a second one is Python's own (KeyboardInterrupt).
    """

    def __init__(
        self,
        config: Config,
        to_saved: Callable = saved_as_is,
        from_saved: Callable = restored_as_is,
    ):
        self.config, self.to_saved, self.from_saved = config, to_saved, from_saved
        # Saving: (step, Orbax's response) of the save under way
        self.checkpointer, self.saving = (None, None)
        self.failed = False
        self.stop_signal = None
        # With several processes, JAX's preemption service owns SIGTERM: it tells every process
        # at which step to stop, so that all of them save the same one.
        handled = (signal.SIGINT, signal.SIGTERM) if jax.process_count() == 1 else (signal.SIGINT,)
        self.previous_handlers = {s: signal.signal(s, self._on_signal) for s in handled}
        if not config.checkpoint_dir:
            return
        from orbax.checkpoint import v1 as ocp

        _quiet_orbax()
        self.checkpointer = ocp.training.Checkpointer(
            os.path.abspath(config.checkpoint_dir),
            preservation_policy=ocp.training.preservation_policies.LatestN(config.keep),
            cleanup_tmp_directories=True,
        )

    def _on_signal(self, signum, frame):
        name = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
        self.stop_signal = signum
        for handled, handler in self.previous_handlers.items():  # a second one: Python's own
            signal.signal(handled, handler)
        what = (
            "save and stop" if self.checkpointer else "stop (no --checkpoint-dir: nothing is saved)"
        )
        print(f"{name}: the run will finish its step, {what}", flush=True)
        if jax.process_count() > 1:  # tell the other processes, through JAX's preemption service
            os.kill(os.getpid(), signal.SIGTERM)

    def restore(self, state):
        """The state of the newest readable checkpoint, laid out like `state`, and its step (0
        if there is none). A checkpoint that cannot be read is moved aside, never deleted."""
        if self.checkpointer is None or not self.checkpointer.checkpoints:
            return state, 0
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
            self.to_saved(state),
        )
        failures = []
        for step in sorted((c.step for c in self.checkpointer.checkpoints), reverse=True):
            try:
                saved, error = self.checkpointer.load(step, target), None
                # Saved by an older version, or damaged in a way Orbax cannot see
                if not all_finite(saved):
                    saved, error = None, ValueError("it holds non-finite values")
            except Exception as exception:  # Orbax's errors have no common type
                saved, error = None, exception
            if all_processes_agree(error is None):
                done = " (--steps reached: nothing to train)" if step >= self.config.steps else ""
                log_print(
                    f"resumed from the checkpoint of step {step} in "
                    f"{self.config.checkpoint_dir}{done}"
                )
                return self.from_saved(saved, state), step
            failures.append(f"{step}: {_checkpoint_problem(error)}")
            self._set_aside(step, failures[-1])
        exit_bad_input(
            f"--checkpoint-dir {self.config.checkpoint_dir} holds no readable checkpoint "
            f"({'; '.join(failures)}); give another folder, e.g. --checkpoint-dir runs/new"
        )

    def _set_aside(self, step: int, problem: str):
        """Move an unreadable checkpoint out of Orbax's way, to `STEP.unreadable`: left in place,
        it would count as the newest checkpoint, and Orbax would delete good ones to keep it."""
        folder = os.path.join(os.path.abspath(self.config.checkpoint_dir), str(step))
        aside = f"{folder}.unreadable"
        if is_main_process():
            suffix = 1
            while os.path.exists(aside):
                suffix, aside = suffix + 1, f"{folder}.unreadable{suffix + 1}"
            os.rename(folder, aside)
            print(
                f"the checkpoint of step {problem}; moved it to {aside} and tried the one before",
                flush=True,
            )
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"set aside checkpoint {step}")
        self.checkpointer.reload()

    def save(self, step: int, state, log) -> bool:
        """After step `step` (from 0): save every --checkpoint-every steps, after the last step and
        when asked to stop. Returns True when asked to stop: the run should stop now."""
        done = step + 1
        stop = self.stop_signal is not None
        if jax.process_count() > 1:  # every process stops at the same step, the one they agree on
            stop = multihost_utils.reached_preemption_sync_point(done)
        self._check_last_save(wait=False)
        if self.checkpointer and (
            stop or done % self.config.checkpoint_every == 0 or done == self.config.steps
        ):
            log.losses.fetch()  # stops at a non-finite loss
            # An update can overflow while the loss before it did not
            if not all_finite(self.to_saved(state)):
                saved = checkpoint_steps(self.config.checkpoint_dir)
                kept = (
                    f"the newest checkpoint is of step {saved[0]}"
                    if saved
                    else "no checkpoint was saved"
                )
                raise SystemExit(
                    f"stopped: the state after step {done} holds non-finite values (the loss "
                    f"before it was {log.losses.values[-1]:.4f}); it was not saved, {kept}; try a "
                    "lower --lr or --clip-norm"
                )
            self._check_last_save(wait=True)
            flags = {name: getattr(self.config, name) for name in SHAPE_FLAGS + TRAJECTORY_FLAGS}
            try:  # the schedule is ours: force
                response = self.checkpointer.save_async(
                    done, self.to_saved(state), force=True, custom_metadata={"flags": flags}
                )
            except Exception as error:
                self._fail(done, error)
            self.saving = (done, response)
        if stop:
            saved = (
                f"saved the checkpoint of step {done}"
                if self.checkpointer
                else f"at step {done}, nothing saved"
            )
            log.print(f"stopped: {saved}")
        return stop

    def _check_last_save(self, wait: bool):
        """Stop the run with one line if the save under way failed (a full disk, say)."""
        if self.saving is None:
            return
        step, response = self.saving
        try:
            response.result(timeout=None if wait else 0)
        except TimeoutError:
            return  # still being written
        except Exception as error:
            self._fail(step, error)
        self.saving = None

    def _fail(self, step: int, error: Exception):
        self.saving, self.failed = None, True
        raise SystemExit(
            f"error: could not save the checkpoint of step {step} in {self.config.checkpoint_dir} "
            f"({_checkpoint_problem(error)}); the checkpoints before it are intact"
        ) from None

    def close(self):
        """Wait for the saves still being written; give the signals back."""
        for signum, handler in self.previous_handlers.items():
            signal.signal(signum, handler)
        if not self.checkpointer:
            return
        try:
            self._check_last_save(wait=True)
        finally:
            try:
                self.checkpointer.close()  # re-raises the error of a failed save, reported already
            except Exception as error:
                if not self.failed:
                    self._fail(self.config.steps, error)


def _checkpoint_problem(error: Exception) -> str:
    """One line saying what is wrong with a checkpoint, from the root of Orbax's error chain."""
    while (error.__cause__ or error.__context__) is not None:
        error = error.__cause__ or error.__context__
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    known = {  # the first that the message contains
        "No space left": "the disk is full",
        "File too large": "a file grew larger than the file system allows",
        "Failed writing": "a write failed",
        "NOT_FOUND": "a file of it is missing",
        "OUT_OF_RANGE": "a file of it is cut short",
        "DATA_LOSS": "a file of it is corrupt",
        "not found in the checkpoint": "it holds no saved state",
    }
    for key, meaning in known.items():
        if key in text:
            detail = re.search(r'"([^"]*/[^"]*)"', text)  # the file, when the message names one
            return f"{meaning}{f' ({detail.group(1)})' if detail else ''}"
    if text == "it holds non-finite values":
        return text
    if isinstance(error, json.JSONDecodeError):
        return f"its metadata is not valid JSON ({error})"
    return f"{type(error).__name__}: {text[:160]}"


class _DropOrbaxLogs(logging.Filter):
    def filter(self, record):
        return "/orbax/" not in record.pathname and "orbax" not in record.getMessage()


def _quiet_orbax():
    """Orbax logs each error of a failed save or load at length (tracebacks, TensorStore specs;
    thousands of lines), from its own threads. The checkpoint code reports those errors itself,
    in one line, so Orbax's logs and the stray errors of its abandoned coroutines are dropped."""
    for name in ("absl", "asyncio"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropOrbaxLogs) for f in logger.filters):
            logger.addFilter(_DropOrbaxLogs())
    warnings.filterwarnings("ignore", r"coroutine '.*' was never awaited", RuntimeWarning)
    if getattr(sys.unraisablehook, "drops_orbax", False):
        return
    default_hook = sys.unraisablehook

    def unraisable_hook(unraisable):
        where = (
            "".join(traceback.format_tb(unraisable.exc_traceback))
            if unraisable.exc_traceback
            else ""
        )
        if "/orbax/" not in where and "Event loop is closed" not in str(unraisable.exc_value):
            default_hook(unraisable)

    unraisable_hook.drops_orbax = True
    sys.unraisablehook = unraisable_hook


@jax.jit
def _all_finite(leaves):
    return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in leaves]))


def all_finite(tree) -> bool:
    """Whether every floating-point value of a tree of (global) arrays is finite."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    return not leaves or host_value(_all_finite(leaves)) == 1


def all_processes_agree(ok: bool) -> bool:
    """True when `ok` is true on every process."""
    if jax.process_count() == 1:
        return ok
    return bool(multihost_utils.process_allgather(np.array(ok)).all())


def log_print(text: str):
    if is_main_process():
        print(text, flush=True)


def checkpoint_steps(folder: str) -> list:
    """The steps of the checkpoints in a folder (its sub-folders named by a number), newest
    first."""
    names = os.listdir(folder) if os.path.isdir(folder) else []
    return sorted(
        (int(n) for n in names if n.isdigit() and os.path.isdir(os.path.join(folder, n))),
        reverse=True,
    )


def check_checkpoint(config: Config):
    """Before anything is compiled: check that --checkpoint-dir is a checkpoint folder, and that
    its newest readable checkpoint is of this model. Say which flags of the trajectory
    changed since it was saved."""
    folder = config.checkpoint_dir
    if not folder or "://" in folder:
        return
    steps = checkpoint_steps(folder)
    if not steps:
        return
    if not any(
        os.path.exists(os.path.join(folder, str(step), "_CHECKPOINT_METADATA")) for step in steps
    ):
        raise ConfigError(
            f"--checkpoint-dir {folder} holds folders named {', '.join(map(str, sorted(steps)))} "
            "that are not checkpoints; give an empty or new folder, e.g. --checkpoint-dir runs/new"
        )
    from orbax.checkpoint import v1 as ocp

    _quiet_orbax()
    with ocp.training.Checkpointer(os.path.abspath(folder)) as checkpointer:
        for step in steps:
            try:
                metadata = checkpointer.metadata(step)
                saved = metadata.metadata["params"]
            except Exception:  # unreadable: restore() says so and moves it aside
                continue
            flags = (metadata.custom_metadata or {}).get("flags", {})
            _compare_with_checkpoint(config, step, flags, saved)
            return


def _compare_with_checkpoint(config: Config, step: int, flags: dict, saved_params):
    where = f"the checkpoint of step {step} in {config.checkpoint_dir}"
    for name in SHAPE_FLAGS:
        if name in flags and flags[name] != getattr(config, name):
            require(
                False,
                name,
                f"{getattr(config, name)} differs from {flags[name]} in {where}, which changes "
                f"what its weights mean; resume with --{name.replace('_', '-')} {flags[name]} or "
                "give another --checkpoint-dir",
            )
    expected = jax.eval_shape(lambda: nn.unbox(init_params(make_model(config), jax.random.key(0))))

    def shapes(tree):
        return {
            jax.tree_util.keystr(path, simple=True, separator="/"): tuple(leaf.shape)
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
        }

    saved, expected = shapes(saved_params), shapes(expected)
    for name in sorted(saved.keys() | expected.keys()):
        if saved.get(name) != expected.get(name):
            raise ConfigError(
                f"--checkpoint-dir {config.checkpoint_dir} holds another model: {name} is "
                f"{saved.get(name, 'absent')} there but {expected.get(name, 'absent')} here (check "
                "--layers, --d-model, --heads, --seq-len, --scan-layers, --experts, "
                "--shared-experts, --router-bias-rate)"
            )
    changed = [
        f"--{name.replace('_', '-')} {flags[name]} -> {getattr(config, name)}"
        for name in TRAJECTORY_FLAGS
        if name in flags and flags[name] != getattr(config, name)
    ]
    if changed:
        log_print(f"resuming with changed flags: {', '.join(changed)}")


# ----------------------------------------------------------------------------------------------
# What a run costs, measured from the real arrays and the compiled step
# ----------------------------------------------------------------------------------------------


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


# Dense bf16 peak FLOP/s of one device, by jax.Device.device_kind; the first match wins.
PEAK_FLOPS = (
    ("TPU v5 lite", 197e12),  # v5e
    ("TPU v5", 459e12),  # v5p
    ("TPU v6 lite", 918e12),  # v6e
    ("TPU v4", 275e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM
    ("H200", 989e12),
    ("A100", 312e12),
)


def model_shapes(config: Config):
    """The abstract initial TrainState (shapes and dtypes only): the model's full size."""
    return jax.eval_shape(lambda: create_state(config, make_model(config)))


def flops_per_token(config: Config, params) -> int:
    """Training FLOPs per token: 6 per matmul parameter (forward 2, backward 4) plus the
    attention scores and their use, 6 * 2 * layers * seq_len * d_model (PaLM, appendix B,
    which takes the attention's width to be d_model). Embedding tables (nn.Embed's parameter
    'embedding', whatever the model) are lookups, not matmuls, so they are left out; of a
    mixture of experts' weights (an axis named 'expert') a token uses its top-k experts'."""
    leaves = jax.tree_util.tree_leaves_with_path(params)
    tables = sum(x.size for path, x in leaves if getattr(path[-1], "key", None) == "embedding")
    # A table the head ties is also its matmul's kernel
    tied = [f"embed/{path}" for path in model_pieces(config).tied]
    tables -= sum(box.value.size for path, box in logical_names(config) if path in tied)
    experts = sum(box.value.size for _, box in logical_names(config) if "expert" in box.names)
    unused = experts - experts * config.top_k // config.experts if experts else 0
    matmul_params = sum(x.size for _, x in leaves) - tables - unused
    return 6 * matmul_params + 12 * config.layers * config.seq_len * config.d_model


def peak_flops() -> float | None:
    kind = jax.devices()[0].device_kind
    return next((peak for name, peak in PEAK_FLOPS if name.lower() in kind.lower()), None)


def nbytes(x) -> int:
    return x.size * x.dtype.itemsize  # also for abstract arrays (jax.ShapeDtypeStruct)


def bytes_on_device(x, device) -> int:
    """The bytes of array x stored on one device."""
    return sum(shard.data.nbytes for shard in x.addressable_shards if shard.device == device)


_ARRAY = re.compile(r"\b(pred|[a-z]+\d+[a-z0-9]*)\[([\d,]*)\]")  # f32[64,128], bf16[], pred[8]


_CALLS = re.compile(r"\b(body|condition|calls|to_apply|branch_computations)=\{?%([\w.\-]+)")


def _shape_bytes(text: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(text):
        bits = 8 if dtype == "pred" else int(re.search(r"\d+", dtype).group())
        total += math.prod(int(d) for d in dims.split(",") if d) * bits // 8
    return total


def _closing(text: str, start: int) -> int:
    """The index just past the bracket that closes the one at text[start]."""
    depth = 0
    for i in range(start, len(text)):
        depth += text[i] == "("
        depth -= text[i] == ")"
        if depth == 0:
            return i + 1
    raise ValueError(text)


def _hlo_program(hlo_text: str):
    """A compiled HLO module read into ({computation: [(name, opcode, operands, attributes,
    line)]}, {instruction: its result's shape, as text}, the entry computation's name)."""
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


def hlo_flops(hlo_text: str) -> float:
    """The FLOPs of the matmuls of one run of a compiled HLO module, per device: 2 x the
    multiply-adds of every dot, a while loop's body times its known trip count (--microbatches,
    --scan-layers, a pipeline's ticks), a conditional's costliest branch (so an upper bound
    where its branches differ: the pipeline's ticks, ring attention's skipped blocks). XLA's
    own cost analysis counts a loop's body once, whatever its trip count."""
    computations, shapes, entry = _hlo_program(hlo_text)

    def dims(name):
        return [int(d) for d in _ARRAY.search(shapes[name]).group(2).split(",") if d]

    @functools.cache
    def flops(computation):
        total = 0
        for name, opcode, operands, attributes, _ in computations.get(computation, ()):
            if opcode == "dot":
                contracted = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", attributes)
                lhs = dims(operands[0])
                k = math.prod(lhs[int(i)] for i in contracted.group(1).split(",") if i)
                total += 2 * math.prod(dims(name)) * k
            elif opcode == "while":
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', attributes)
                body = re.search(r"\bbody=%([\w.\-]+)", attributes).group(1)
                total += (int(trips.group(1)) if trips else 1) * flops(body)
            elif opcode == "conditional":
                listed = re.search(r"branch_computations=\{([^}]*)\}", attributes)
                branches = re.findall(
                    r"%([\w.\-]+)" if listed else r"(?:true|false)_computation=%([\w.\-]+)",
                    listed.group(1) if listed else attributes,
                )
                total += max(flops(branch) for branch in branches)
            else:
                total += sum(map(flops, re.findall(r"\bcalls=%([\w.\-]+)", attributes)))
        return total

    return float(flops(entry))


def hlo_collectives(hlo_text: str) -> list:
    """Every collective of a compiled HLO module, as dicts: op, runs (per step: an op in a
    while loop, from --scan-layers or --microbatches, runs once per iteration), bytes (per
    device, the larger of its operands and its result) and its HLO line."""
    computations, shapes, entry = _hlo_program(hlo_text)
    sizes = {name: _shape_bytes(shape) for name, shape in shapes.items()}
    devices = max(  # (pmap's programs are replicas, jit's partitions)
        int(n) for n in re.findall(r"(?:num_partitions|replica_count)=(\d+)", hlo_text) or [1]
    )
    callers = {}
    for caller, instructions in computations.items():
        for *_, attributes, _ in instructions:
            trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', attributes)
            for key, callee in _CALLS.findall(attributes):
                loop = trips and key in ("body", "condition")
                callers.setdefault(callee, []).append((caller, int(trips.group(1)) if loop else 1))

    @functools.cache
    def runs(computation):
        if computation == entry:
            return 1
        return sum(runs(caller) * times for caller, times in callers.get(computation, ()))

    found = []
    for computation, instructions in computations.items():
        for name, opcode, operands, _, line in instructions:
            op = opcode.removesuffix("-start")  # async pairs: count the start, not the done
            if op in COLLECTIVES and runs(computation):
                operand_bytes = sum(sizes.get(o, 0) for o in operands)
                # An async start's result holds its operands too, then the outputs.
                result_bytes = sizes[name] - (operand_bytes if opcode.endswith("-start") else 0)
                found.append(
                    {
                        "op": op,
                        "runs": runs(computation),
                        "bytes": max(operand_bytes, result_bytes),
                        "group": group_size(line, devices),
                        "line": line,
                    }
                )
    return found


# What each device sends for a collective of `n` devices over a ring (NCCL's and most TPU
# collectives' algorithm for large buffers), as a share of the op's whole buffer (its larger
# side): an all-gather passes on N - 1 of the N pieces, a reduce-scatter likewise; an all-reduce
# is both, 2 (N - 1) / N; an all-to-all keeps 1 / N and sends the rest; a collective-permute
# sends its whole buffer once.
WIRE = {
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: (n - 1) / n,
    "all-to-all": lambda n: (n - 1) / n,
    "collective-permute": lambda n: 1.0,
}


def group_size(line: str, devices: int) -> int:
    """How many devices take part in each group of one collective's HLO line (all of them
    when it names no groups)."""
    if iota := re.search(r"replica_groups=\[\d+,(\d+)\]<=", line):
        return int(iota.group(1))
    if mesh := re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", line):
        sizes = dict((a, int(n)) for a, n in re.findall(r"'(\w+)'=(\d+)", mesh.group(1)))
        return math.prod(sizes[a] for a in re.findall(r"'(\w+)'", mesh.group(2)))
    if listed := re.search(r"replica_groups=\{\{([\d,]*)\}", line):
        return len(listed.group(1).split(","))
    return devices


def cost_report(config: Config, state, compiled, compile_seconds: float) -> dict:
    """What the strategy costs, from the real arrays (state bytes on this process's first
    device) and the compiled step (its memory analysis and the collectives in its HLO).
    Measure it before the first step: the step donates the state, so these arrays go away."""
    device = jax.local_devices()[0]
    full = model_shapes(config)
    leaves = jax.tree.leaves(nn.unbox((state.params, state.opt_state)))
    memory = compiled.memory_analysis()
    collectives = {op: {"count": 0, "bytes": 0, "wire_bytes": 0.0} for op in COLLECTIVES}
    for found in hlo_collectives(compiled.as_text()):
        collectives[found["op"]]["count"] += found["runs"]
        collectives[found["op"]]["bytes"] += found["runs"] * found["bytes"]
        wire = WIRE[found["op"]](found["group"]) * found["bytes"]
        collectives[found["op"]]["wire_bytes"] += found["runs"] * wire
    params = nn.unbox(full.params)
    # The compiled step's matmul FLOPs per device, against the model's count for the step's
    # tokens shared over the devices: above 1, what the strategy recomputes (--remat, a
    # pipeline's backward; the pipeline's is an upper bound, every tick counting its costliest
    # op), or what it computes on every device alike.
    step_flops, per_token = hlo_flops(compiled.as_text()), flops_per_token(config, params)
    model_flops = per_token * config.batch_size * config.seq_len / jax.device_count()
    return {
        "param_count": sum(x.size for x in jax.tree.leaves(params)),
        "param_bytes": sum(map(nbytes, jax.tree.leaves(params))),
        "flops_per_token": per_token,
        "step_flops": step_flops,
        "step_flops_over_model": step_flops / model_flops,
        "state_bytes_total": sum(
            map(nbytes, jax.tree.leaves(nn.unbox((full.params, full.opt_state))))
        ),
        "state_bytes_per_device": sum(bytes_on_device(x, device) for x in leaves),
        "compile_seconds": compile_seconds,
        "compiled_argument_bytes": getattr(memory, "argument_size_in_bytes", None),
        "compiled_temp_bytes": getattr(memory, "temp_size_in_bytes", None),
        "collectives": collectives,
    }


def show_sharding(params):
    """Print each parameter's path, shape, PartitionSpec and bytes per device, then draw one
    parameter's layout over the devices."""
    device = jax.local_devices()[0]
    leaves = [
        (jax.tree_util.keystr(path, simple=True, separator="/"), x)
        for path, x in jax.tree_util.tree_leaves_with_path(nn.unbox(params))
    ]
    rows = [
        (
            name,
            str(x.shape),
            str(getattr(x.sharding, "spec", x.sharding)),
            bytes_on_device(x, device),
        )
        for name, x in leaves
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    print(
        "parameter".ljust(widths[0]),
        "shape".ljust(widths[1]),
        "spec".ljust(widths[2]),
        "bytes/device",
    )
    for name, shape, spec, size in rows:
        print(name.ljust(widths[0]), shape.ljust(widths[1]), spec.ljust(widths[2]), f"{size:,}")
    # The drawing: the largest matrix the strategy splits (the first of equals), or the largest.
    drawable = {name: x for name, x in leaves if x.ndim == 2}
    split = {
        name: x for name, x in drawable.items() if not x.sharding.is_fully_replicated
    } or drawable
    name = max(split, key=lambda n: split[n].size, default=None)
    if name:
        print(f"{name} {drawable[name].shape} over the devices:")
        jax.debug.visualize_array_sharding(drawable[name])


def _megabytes(n) -> str:
    return "n/a" if n is None else f"{n / 1e6:.2f} MB"


def report_lines(summary: dict) -> str:
    """The end-of-run report, for people; --metrics-file has the same numbers for programs."""
    per_device, total = summary["state_bytes_per_device"], summary["state_bytes_total"]
    used = [
        f"{op} {c['count']} ({_megabytes(c['bytes'])}, sends {_megabytes(c['wire_bytes'])})"
        for op, c in summary["collectives"].items()
        if c["count"]
    ]
    mfu = (
        f"MFU {summary['mfu']:.1%}"
        if summary["mfu"] is not None
        else f"MFU n/a on {summary['platform']}"
    )
    return (
        f"state: {_megabytes(per_device)} per device of {_megabytes(total)} "
        f"({per_device * summary['devices'] / total:.2f} x total/devices) | compiled step: "
        f"arguments {_megabytes(summary['compiled_argument_bytes'])}, temporaries "
        f"{_megabytes(summary['compiled_temp_bytes'])}\ncollectives per step and device "
        "(buffers, and what a ring sends): "
        f"{', '.join(used) or 'none'}\ncompile {summary['compile_seconds']:.1f}s | "
        f"{summary['flops_per_token'] / 1e6:.1f} MFLOP/token; compiled, "
        f"{summary['step_flops'] / 1e9:.2f} GFLOP/step per device "
        f"({summary['step_flops_over_model']:.2f} x the model's) | {mfu}"
    )


# ----------------------------------------------------------------------------------------------
# Compilation, logging and the result a script returns
# ----------------------------------------------------------------------------------------------


# What jax.checkpoint (nn.remat: --remat, fsdp.py's second gather) asks to compute again is
# fenced by optimization barriers. XLA's CPU compiler in JAX 0.10 removes them at the start of
# its pipeline (the pass 'cse_barrier_expander'), and common-subexpression elimination then
# merges the recomputation back into the forward pass: on CPU, --remat kept every activation
# (shardmap_dp.py at 256 tokens and 4 layers: 32.3 MB of temporaries, 10.5 MB with the barriers)
# and fsdp.py every gathered weight. GPU and TPU compilers, and JAX 0.12's CPU one, keep the
# barriers until after scheduling; skipping the pass makes a CPU compile what they compile.
CPU_COMPILER_OPTIONS = {"xla_disable_hlo_passes": "cse_barrier_expander"}


def compile_step(step_fn, *args):
    """Compile ahead of time, for the shapes and shardings of the arguments (arrays or
    jax.ShapeDtypeStructs), so the compile time is measured apart from the steps, the step is
    checked to fit in memory before anything is allocated (check_memory), and the compiled
    step can be inspected (its HLO shows the collectives the strategy produced). The loop then
    runs this compiled step, so the report describes the program that ran."""
    start = time.perf_counter()
    # pmap's functions (which have no .trace) take no compiler options: pmap_dp.py's loop runs
    # the program pmap compiles with XLA's defaults, so that is the one to compile and report.
    options = (
        CPU_COMPILER_OPTIONS if jax.default_backend() == "cpu" and hasattr(step_fn, "trace") else {}
    )
    compiled = step_fn.lower(*args).compile(compiler_options=options)
    seconds = time.perf_counter() - start
    check_memory(compiled)
    if jax.config.jax_debug_nans:  # JAX checks for NaNs only in calls through jit
        return _StepThroughJit(step_fn, compiled), seconds
    return compiled, seconds


def device_memory() -> int | None:
    """Bytes one device can hold: the accelerator's own limit, or on CPU, where the emulated
    devices share the host's memory, this host's available memory over its devices."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return stats["bytes_limit"]
    try:
        with open("/proc/meminfo") as meminfo:
            available = next(
                int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:")
            )
    except (OSError, StopIteration):
        return None
    return available // jax.local_device_count()


def check_memory(compiled):
    """Stop with one line (exit 2) if the compiled step needs more memory per device than a
    device has: before the first step, rather than an out-of-memory error during it."""
    memory, have = compiled.memory_analysis(), device_memory()
    if memory is None or have is None:
        return
    state = memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
    need = state + memory.temp_size_in_bytes
    if need > have:
        exit_bad_input(
            f"the train step needs {_gigabytes(need)} per device (arguments and results "
            f"{_gigabytes(state)}, activations and other temporaries "
            f"{_gigabytes(memory.temp_size_in_bytes)}) but a {jax.local_devices()[0].platform} "
            f"device has {_gigabytes(have)}; activations shrink with a smaller --batch-size or "
            "--seq-len, with --microbatches and --remat; the state with a smaller --d-model or "
            "--layers, or by sharding it over more devices (fsdp.py, logical_pjit.py --rules fsdp)"
        )


def _gigabytes(n: int) -> str:
    return f"{n / 1e9:,.1f} GB" if n >= 1e8 else f"{n / 1e6:,.1f} MB"


class _StepThroughJit:
    """The compiled step for inspection, run by calling step_fn: --debug-nans needs that, as
    JAX checks for NaNs only in calls through jit. step_fn runs the same compiled program."""

    def __init__(self, step_fn, compiled):
        self.step_fn, self.compiled = step_fn, compiled

    def __call__(self, *args):
        # Inside the context, not only by the global flag: JAX 0.12's fast path of a function
        # already compiled skips the check (measured: the run ended at our own NaN stop), while
        # the context is part of what a compiled call is looked up by.
        with jax.debug_nans(True):
            return self.step_fn(*args)

    def __getattr__(self, name):
        return getattr(self.compiled, name)


def wait_until_ready(tree):
    """Wait for the device arrays of `tree` the way Python can be interrupted: polling, rather
    than blocking inside XLA, where Ctrl-C and SIGTERM would not be heard until the wait ends
    (never, if a step is stuck)."""
    pause = 1e-5
    for x in jax.tree.leaves(tree):
        while isinstance(x, jax.Array) and not x.is_ready():
            time.sleep(pause)
            pause = min(2 * pause, 0.01)


def host_value(x) -> float:
    """A metric as a Python number. One replica is enough: the metrics were summed over
    devices inside the step."""
    wait_until_ready(x)
    return float(np.asarray(x.addressable_data(0)).ravel()[0])


def stop_if_not_finite(loss: float, step: int, losses: list):
    """Stop the run (exit 1) at a non-finite loss, before anything after it is saved."""
    if not math.isfinite(loss):
        last = f"; the last finite loss was {losses[-1]:.4f}" if losses else ""
        raise SystemExit(
            f"stopped: the loss is {loss} at step {step + 1}{last}; nothing more was saved"
        )


class StepLosses:
    """The mean training loss of every step run. A step's metrics stay on device until a log
    line or a checkpoint needs them, so the host runs ahead of the devices, by IN_FLIGHT steps
    at most: enough to keep them busy, and the host never blocks inside XLA's dispatch."""

    IN_FLIGHT = 2

    def __init__(self, layers: int):
        self.values, self.grad_norms, self.pending = [], [], []
        self.router, self.layers = [], layers  # a mixture of experts' routing, step by step

    def add(self, step: int, metrics):
        self.pending.append((step, metrics))
        if len(self.pending) > self.IN_FLIGHT:
            wait_until_ready(self.pending[-self.IN_FLIGHT - 1][1])

    def fetch(self) -> list:
        """Every loss so far, as numbers; the run stops at a non-finite one."""
        for step, metrics in self.pending:
            loss = host_value(metrics["loss_sum"]) / host_value(metrics["tokens"])
            stop_if_not_finite(loss, step, self.values)
            self.values.append(loss)
            self.grad_norms.append(host_value(metrics["grad_norm"]))
            if "expert_tokens" in metrics:
                self.router.append(routing(metrics, self.layers))
        self.pending = []
        return self.values


def routing(metrics, layers: int) -> dict:
    """A step's routing, from its summed metrics: the load-balancing loss (per token, as the
    loss), the fewest and the most tokens an expert got in a block (the mean over blocks), and
    the share of top-k choices dropped for want of capacity."""
    # One replica, as host_value
    per_expert = np.asarray(metrics["expert_tokens"].addressable_data(0))
    per_expert = per_expert.reshape(-1, per_expert.shape[-1])[0] / layers
    dropped = host_value(metrics["dropped_tokens"])
    return {
        "aux_loss": host_value(metrics["aux_loss_sum"]) / host_value(metrics["tokens"]),
        "expert_tokens_min": float(per_expert.min()),
        "expert_tokens_max": float(per_expert.max()),
        "dropped_share": dropped / (dropped + float(per_expert.sum()) * layers),
    }


def open_metrics_file(path: str, start: int):
    """--metrics-file, open for appending the records of the steps after `start`, and the
    records it keeps, of the steps up to `start`. A run resumed from the checkpoint of step
    `start` keeps those; records after it (written before a stop between two checkpoints, or cut
    short by a crash) and earlier summary lines are dropped, so that the file of an interrupted
    and resumed run reads like an uninterrupted run's. A new run (start 0) starts it afresh. The
    kept records are written to a new file that replaces the old one in one step, so a crash
    here loses nothing."""
    kept = []
    if start and os.path.exists(path):
        with open(path) as old:
            for line in old:
                try:
                    record = json.loads(line)
                except ValueError:  # a line cut short by a crash
                    continue
                if isinstance(record, dict) and record.get("step", start + 1) <= start:
                    kept.append(record)
    with open(f"{path}.new", "w") as new:
        new.writelines(json.dumps(strict_json(record), allow_nan=False) + "\n" for record in kept)
        new.flush()
        os.fsync(new.fileno())
    os.replace(f"{path}.new", path)
    return open(path, "a"), kept


def strict_json(value):
    """A record as strict JSON takes it: a non-finite number (an evaluation that overflowed, say)
    becomes null, which every JSON reader reads; NaN and Infinity are not JSON."""
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [strict_json(item) for item in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


@dataclasses.dataclass
class Result:
    losses: list  # the mean training loss of every step
    grad_norms: list  # the global gradient norm of every step, before clipping
    state: Any  # the final TrainState, laid out as the strategy keeps it
    summary: dict  # what the last line of --metrics-file holds
    compiled: Any  # the compiled train step
    router: list  # with --experts, every step's routing (StepLosses.routing); else empty


class Logger:
    """Prints what the run is before it starts, a line every --log-every steps and a report at
    the end (process 0 only), and writes the same to --metrics-file as JSON Lines."""

    def __init__(self, config: Config, dataset, layout: str, report: dict, params, start: int):
        self.config, self.dataset, self.report, self.start = config, dataset, report, start
        self.tokens_per_step = config.batch_size * config.seq_len
        self.losses, self.step_seconds, self.eval_loss = StepLosses(config.layers), [], None
        self.data_seconds = []  # per step, how long the loop waited for its batch (train_batches)
        self.file, self.earlier = None, []  # earlier: the records of the steps before `start`
        if config.metrics_file and is_main_process():
            self.file, self.earlier = open_metrics_file(config.metrics_file, start)
        devices = jax.devices()
        self.info = {
            "platform": devices[0].platform,
            "device_kind": devices[0].device_kind,
            "devices": len(devices),
            "processes": jax.process_count(),
            "layout": layout,
            "dtype": config.dtype,
        }
        self.print(
            f"{len(devices)} {devices[0].platform} devices in {jax.process_count()} process(es) | "
            f"{layout} | {report['param_count'] / 1e6:.2f}M parameters, {config.dtype} compute\n"
            f"batch {config.batch_size} "
            f"x {config.seq_len} tokens ({config.batch_size // config.batch_shards()} per device) "
            f"| {dataset.describe()}\ncompiled the train step in {report['compile_seconds']:.1f}s"
        )
        if config.show_sharding and is_main_process():
            show_sharding(params)
        self.profiling = None  # the steps a --profile trace covers, once it has started
        self.last_time = time.perf_counter()

    def print(self, text):
        if is_main_process():
            print(text, flush=True)

    PROFILED_STEPS = 3

    def profile(self, step: int, metrics):
        """--profile: trace the PROFILED_STEPS steps after the first one run here (which can
        include one-off work), for TensorBoard or Perfetto (docs/operations.md: Profiling)."""
        if not self.config.profile:
            return
        if self.profiling is None and step > self.start:
            wait_until_ready(metrics)
            jax.profiler.start_trace(self.config.profile)
            self.profiling = range(step, step + self.PROFILED_STEPS)
        if self.profiling and step == self.profiling[-1]:
            wait_until_ready(metrics)  # the traced steps have run
            jax.profiler.stop_trace()
            self.print(
                f"profile of steps {self.profiling[0] + 1}-{step + 1} written to "
                f"{self.config.profile}"
            )
            self.profiling = range(0)

    def log(self, step: int, metrics):
        self.profile(step, metrics)
        self.losses.add(step, metrics)
        if (step + 1) % self.config.log_every and step + 1 != self.config.steps:
            return
        count = len(self.losses.pending)
        loss = self.losses.fetch()[-1]  # waits for the step to finish
        now = time.perf_counter()
        seconds = (now - self.last_time) / count
        self.step_seconds += [seconds] * count
        self.last_time = now
        record = {
            "step": step + 1,
            "loss": loss,
            "grad_norm": self.losses.grad_norms[-1],
            "tokens_per_sec": self.tokens_per_step / seconds,
            "step_seconds": seconds,
        }
        eta = seconds * (self.config.steps - step - 1)
        routing = ""
        if self.losses.router:
            record.update(self.losses.router[-1])
            routing = (
                f"aux {record['aux_loss']:.4f} | expert tokens "
                f"{record['expert_tokens_min']:.0f}-{record['expert_tokens_max']:.0f}, "
                f"{record['dropped_share']:.1%} dropped | "
            )
        self.print(
            f"step {step + 1:>{len(str(self.config.steps))}}/{self.config.steps} | loss {loss:.4f} "
            f"| grad norm {record['grad_norm']:.3f} | {routing}{record['tokens_per_sec']:,.0f} "
            f"tokens/s | ETA {eta // 60:.0f}:{eta % 60:02.0f}"
        )
        self.write(record)

    def eval_due(self, step: int) -> bool:
        return bool(self.config.eval_every) and (step + 1) % self.config.eval_every == 0

    def eval(self, step: int, eval_fn, state, batches):
        """Evaluate on the held-out batches and log their mean loss. The time it takes (the
        first time, compilation too) is left out of the training speed."""
        for _, metrics in self.losses.pending:  # let the steps before it finish first
            host_value(metrics["loss_sum"])
        start = time.perf_counter()
        fetched = [
            (host_value(m["loss_sum"]), host_value(m["tokens"]))
            for m in (eval_fn(state, b) for b in batches)
        ]
        self.eval_loss = sum(loss for loss, _ in fetched) / sum(tokens for _, tokens in fetched)
        self.last_time += time.perf_counter() - start
        self.print(f"eval at step {step + 1}: held-out loss {self.eval_loss:.4f}")
        self.write({"step": step + 1, "eval_loss": self.eval_loss})

    def write(self, record):
        if not self.file:
            return
        try:
            self.file.write(json.dumps(strict_json(record), allow_nan=False) + "\n")
            self.file.flush()
        except OSError as error:
            self.file = None
            raise SystemExit(
                f"error: could not write --metrics-file {self.config.metrics_file} "
                f"({error.strerror or error}); its records so far and the checkpoints are kept"
            ) from None

    def finish(self, state, compiled) -> "Result":
        """Print and write the end-of-run report; return it with the final state and the
        compiled step (what the tests check)."""
        if self.profiling:  # the run ended inside the traced steps
            jax.profiler.stop_trace()
        losses = self.losses.fetch()
        steps = len(losses)
        # The first interval can include one-off warm-up work; use the median step time.
        step_seconds = float(np.median(self.step_seconds)) if steps else None
        tokens_per_sec = self.tokens_per_step / step_seconds if steps else None
        data_seconds = float(np.median(self.data_seconds)) if self.data_seconds else None
        peak = peak_flops()
        # The whole run's: a resumed run's file holds the records of the steps before it.
        earlier_losses = [r["loss"] for r in self.earlier if "loss" in r]
        earlier_evals = [r["eval_loss"] for r in self.earlier if "eval_loss" in r]
        summary = {
            **self.info,
            "steps": self.start + steps,
            "resumed_from": self.start or None,
            "final_loss": (earlier_losses + losses or [None])[-1],
            "eval_loss": self.eval_loss
            if self.eval_loss is not None
            else (earlier_evals or [None])[-1],
            "loss_floor": getattr(self.dataset, "loss_floor", None),
            "tokens_per_sec": tokens_per_sec,
            "step_seconds": step_seconds,
            "data_wait_seconds": data_seconds,
            "mfu": self.report["flops_per_token"] * tokens_per_sec / (peak * self.info["devices"])
            if steps and peak
            else None,
            **self.report,
        }
        if steps:  # not when resumed at or after --steps
            floor = (
                f" (floor {summary['loss_floor']:.4f})" if summary["loss_floor"] is not None else ""
            )
            self.print(
                f"done: final loss {summary['final_loss']:.4f}{floor}, {tokens_per_sec:,.0f} "
                f"tokens/s, {step_seconds * 1e3:.1f} ms/step, {data_seconds * 1e3:.2f} ms/step "
                "waiting for data"
            )
            self.print(report_lines(summary))
        # A program whose run is complete ignores a SIGTERM from here on, while the summary is
        # written and the program winds down (JAX's shutdown: about half a second): it ends with
        # success, not with status -15.
        if _FROM_COMMAND_LINE and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self.write({"summary": summary})
        if self.file:
            self.file.close()
        return Result(losses, self.losses.grad_norms, state, summary, compiled, self.losses.router)
