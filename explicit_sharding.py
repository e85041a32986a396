"""The layout in the arrays' types: JAX's default Explicit mesh axes, and jax.jit.

What is where: a ('data', 'model') mesh (--mesh, data=2,model=4 on 8 devices) of Explicit axes,
JAX's default: the sharding is part of every array's type (jax.typeof(x) prints
float32[256@model,128]), and each operation types its result from its inputs'. The parameters
are split by rules on the model's logical axis names (logical_pjit.py's presets); --rules:
  dp       the batch over all devices; everything else replicated (as shardmap_dp.py)
  fsdp     the batch and every parameter's 'embed' axis over all devices (as fsdp.py)
  hsdp     fsdp within groups along 'model', replicated across 'data'
  tp       the batch over 'data'; heads, MLP units and the vocabulary over 'model' (as pjit_tp.py)
  tp_sp    tp, and the sequence over 'model' between the matmuls (pjit_tp.py --sequence-parallel)
  fsdp_tp  tp, plus every parameter's 'embed' axis over 'data' (2-D sharding)
A step: the single-device step, which jit partitions from the types of the state and batch. Each
change of layout is written where it happens, in the model contract's hooks: in `wrap`, reshard
gathers a piece's parameters (FSDP) and out_sharding says where partial sums, lookups and
dropout masks land; in `attend`, keys and values are laid out as the queries. Collectives: dp,
an all-reduce of the gradients; fsdp, all-gathers of the parameters and reductions of their
gradients; tp, all-reduces over 'model' of the row-parallel matmuls' partial sums; tp_sp, those
as reduce-scatters into sequence pieces and all-gathers along the sequence; fsdp_tp, fsdp's and
tp's. With --microbatches, the gradients stay unreduced through the loop, summed once a step.

What changes from pjit_tp.py: the mesh keeps JAX's default axes, so no sharding is left to the
compiler: where pjit_tp.py's jit takes shardings and places the rest itself, here the arrays
carry them, and the layout changes the compiler would have chosen unseen are written in the
model's hooks (the collectives are the same: docs/three_ways.md). The layout is stated by rules
on logical names (logical_pjit.py's presets).

Run:
  python explicit_sharding.py            # a laptop: 8 emulated CPU devices, data=2,model=4
  python explicit_sharding.py --rules fsdp --mesh data=8,model=1 --steps 2000   # a GPU/TPU host
  python explicit_sharding.py --distributed   # every host of a TPU pod slice (README)

Read before: pjit_tp.py and logical_pjit.py. Read next: JAX's "Explicit sharding" and "Autodiff
and sharding" pages.
Read more: docs/three_ways.md; docs/concepts.md (the three modes).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax

import common

from flax import nnx
from flax.nnx import bridge
from flax.traverse_util import flatten_dict, unflatten_dict
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.sharding import reshard

# Logical axis name -> mesh axis (or axes). A parameter axis whose name has no rule is not
# split, if UNSPLIT names it; any other name stops the run (exit 2), so that a new model's
# parameter is never replicated unseen: give it a rule, or add its name to UNSPLIT.
UNSPLIT = ("vocab", "pos", "embed", "heads", "kv_heads", "mlp", "norm", "layers", "expert")
TP = (  # Megatron's layout: heads, MLP units and the vocabulary over 'model'
    ("batch", "data"),
    ("heads", "model"),
    ("mlp", "model"),
    ("vocab", "model"),
    ("act_heads", "model"),
    ("act_mlp", "model"),
    ("act_vocab", "model"),
)
RULES = {
    "dp": (("batch", ("data", "model")),),
    "fsdp": (("batch", ("data", "model")), ("embed", ("data", "model"))),
    "hsdp": (("batch", ("data", "model")), ("embed", "model")),
    "tp": TP,
    # tp, and Megatron's sequence parallelism: between the matmuls (the residual stream, the
    # norms, dropout) the sequence split over 'model'. The first rule whose mesh axis is free
    # wins: an activation split by heads, MLP units or vocabulary keeps its whole sequence.
    "tp_sp": (*TP, ("length", "model")),
    # tp, and FSDP's split of the weights' other axis over 'data'
    "fsdp_tp": (*TP, ("embed", "data")),
}


@dataclasses.dataclass(frozen=True)
class Config(common.Config):
    mesh: str = common.arg(
        "auto", "mesh axis sizes, e.g. data=2,model=4; 'auto' gives that on 8 devices"
    )
    rules: str = common.arg("fsdp_tp", "logical-to-mesh rules preset", choices=tuple(RULES))

    def mesh_axes(self):
        return common.mesh_shape(self.mesh, ("data", "model"), self.auto_mesh())

    def auto_mesh(self):
        """'auto': up to 4 devices on 'model' (at most half of them, and a divisor of the
        key-value heads), the rest on 'data'."""
        n, kv = jax.device_count(), self.kv_heads or self.heads
        model = max(m for m in (1, 2, 4) if n % m == 0 and kv % m == 0 and m <= max(1, n // 2))
        return {"data": n // model, "model": model}

    def axis_size(self, logical_name):
        """How many ways the rules split a logical axis on this mesh (a mesh axis's name, as the
        Flax docs annotate parameters, P(None, 'model'): over that axis)."""
        shape = self.mesh_axes()
        axes = dict(RULES[self.rules]).get(logical_name, (logical_name,) * (logical_name in shape))
        return functools.reduce(
            lambda n, axis: n * shape[axis], (axes,) if isinstance(axes, str) else axes, 1
        )

    def batch_shards(self):
        return self.axis_size("batch")

    def validate(self):
        common.require(self.rules in RULES, "rules", f"must be one of {', '.join(RULES)}")
        super().validate()
        check_layout(self)  # the layout's checks: at the end of this file, before main()


def make_mesh(config):
    shape = config.mesh_axes()
    # Explicit axes, JAX's default: every array's type says how it is split (jax.typeof(x) prints
    # float32[256@model,128]), and an operation whose result's split is not implied refuses to
    # guess. jax.set_mesh (main) makes this mesh the one such types refer to.
    return common.make_mesh(shape)


def axes_of(spec_entry):
    """The mesh axes one entry of a PartitionSpec names: None, 'data' or ('data', 'model')."""
    return (spec_entry,) if isinstance(spec_entry, str) else tuple(spec_entry or ())


def at_use(param, x):
    """A reduced parameter (summed_once) as it is beside x split over its axes, else whole (its
    gradient arrives summed)."""
    spec = jax.typeof(param).sharding.spec
    split = () if x is None else jax.typeof(x).sharding.spec.partitions
    if spec.reduced <= {a for s in split for a in axes_of(s)}:
        return param
    return reshard(param, P(*spec.partitions))


def gather_for_use(params, batch_axes):
    """FSDP's all-gather, written as a change of type: just before a piece runs, each of its
    parameters loses its split over the axes that split the batch (a tensor-parallel split over
    'model' stays). The transpose of reshard is reshard back: the gradient arrives split again,
    summed over the batch's devices (a reduce-scatter, or an all-reduce and a slice)."""

    def gather(param):
        spec = jax.typeof(param).sharding.spec
        kept = [
            tuple(a for a in axes_of(s) if a not in batch_axes) or None for s in spec.partitions
        ]
        return reshard(param, P(*kept, reduced=spec.reduced))

    return jax.tree.map(gather, params)


def state_layouts(module, sequence):
    """Where explicit mode will not guess a layout, stated layer by layer in a piece made for
    one call (nnx.merge). A matmul whose contracted axis is split alike on both sides (the
    row-parallel attn/out and fc2) says where its partial sums land (`matmul`: an all-reduce over
    'model'); a lookup into a table, its rows' layout (`Lookup`); a reduced scale or bias meets
    the activations laid out as them (`Affine`). With `sequence` (tp_sp) a matmul's input is
    gathered along the sequence, row-parallel sums land in sequence pieces (a reduce-scatter),
    and a mixture of experts routes whole sequences."""
    for path, layer in list(nnx.iter_modules(module)):
        if getattr(layer, "ragged_dot", None) is jax.lax.ragged_dot_general:  # a TPU's: its own
            layer.ragged_dot = grouped_matmul
        if hasattr(layer, "dot_general"):
            layer.dot_general = functools.partial(matmul, sequence=sequence)
        if isinstance(layer, nnx.Embed):
            replace(module, path, Lookup(layer, sequence))
        if isinstance(layer, AFFINE) and any(map(is_reduced, vars(layer).values())):
            replace(module, path, Affine(layer))
        if sequence and isinstance(layer, common.MoeMlp):
            replace(module, path, WholeSequence(layer, sequence))


def replace(module, path, layer):
    """Put `layer` at `path` in `module` in place of the one there."""
    *parents, name = path
    for key in parents:
        module = module[key] if isinstance(key, int) else getattr(module, key)
    if isinstance(name, int):
        module[name] = layer
    else:
        setattr(module, name, layer)


def is_reduced(param):
    return isinstance(param, nnx.Param) and bool(jax.typeof(param[...]).sharding.spec.reduced)


class Affine(nnx.Module):
    """A norm or Linear layer whose reduced scale and bias (summed_once) are laid out as its
    output first: JAX refuses them beside batch-split activations."""

    def __init__(self, layer):
        self.layer = layer
        for name in ("scale", "bias"):  # taken from the layer, which runs without them
            setattr(self, name, getattr(layer, name, None))
            if getattr(layer, name, None) is not None:
                setattr(layer, name, None)
        if hasattr(layer, "use_bias"):  # nnx.Linear's check
            layer.use_bias = False

    def __call__(self, x):
        y = self.layer(x)
        for name, combine in (("scale", jnp.multiply), ("bias", jnp.add)):
            if (param := getattr(self, name)) is not None:
                p, dims = at_use(param[...], y).astype(y.dtype), range(y.ndim - param.ndim, y.ndim)
                laid_out = jax.typeof(y).sharding.spec
                y = combine(y, jax.lax.broadcast_in_dim(p, y.shape, dims, out_sharding=laid_out))
        return y


# The layers that read a parameter reduced, by its name there; any other's gradient (a linen
# piece's, a layer of the model's own) is summed over the devices at each micro-batch.
TAKES_REDUCED = {
    "kernel": (nnx.Linear, nnx.LinearGeneral, common.ExpertDense),
    "embedding": nnx.Embed,
    "scale": (nnx.LayerNorm, nnx.RMSNorm),
    "bias": (nnx.Linear, nnx.LinearGeneral, nnx.LayerNorm),
}
AFFINE = (*TAKES_REDUCED["scale"], *TAKES_REDUCED["bias"])


def summed_once(model, params, batch_axes):
    """The parameters whole over the batch's axes that a layer takes reduced, typed reduced
    over them: each gradient stays each device's partial sum until train_step sums it once."""
    taken = set()
    for name, piece in model.defs.items():
        held = {**flatten_dict(nnx.to_pure_dict(piece.params)), **piece.unread}
        module = nnx.merge(piece.graphdef, unflatten_dict(held), piece.streams)
        for path, layer in nnx.iter_modules(module):
            taken |= {
                (name, *path, a) for a in vars(layer) if isinstance(layer, TAKES_REDUCED.get(a, ()))
            }

    def typed(path, param):
        piece, *keys = [k.key for k in path]  # embed, block_0 (or blocks), head; the layer's
        spec = jax.typeof(param).sharding.spec
        split = {a for s in spec for a in axes_of(s)} & set(batch_axes)  # FSDP's: gathered
        if split or ("block" if piece.startswith("block") else piece, *keys) not in taken:
            return param
        return reshard(param, P(*spec, reduced=set(batch_axes)))

    return jax.tree_util.tree_map_with_path(typed, params)


def matmul(x, kernel, dims, precision=None, out_sharding=None, sequence=None, **kwargs):
    """lax.dot_general, its result's layout stated where its partial sums land (state_layouts):
    any kernel's, [in, out] or nnx.LinearGeneral's ([embed, heads, head_dim], ...)."""
    (x_in, kernel_in), (x_batch, kernel_batch) = dims
    x_spec, kernel_spec = (jax.typeof(t).sharding.spec.partitions for t in (x, kernel))
    pairs = zip(x_in, kernel_in, strict=True)  # the contracted axes, x's and the kernel's
    split = [(axes_of(x_spec[a]), axes_of(kernel_spec[b])) for a, b in pairs]
    in_sequence = sequence and x.ndim >= 3 and not x_batch  # [rows, length, features...]
    if any(k for _, k in split) and all(a == k for a, k in split):  # each device a part
        free = [d for d in range(x.ndim) if d not in (*x_in, *x_batch)]
        out = [x_spec[d] for d in (*x_batch, *free)]  # dot_general's order: batch, x's, kernel's
        out += [kernel_spec[d] for d in range(kernel.ndim) if d not in (*kernel_in, *kernel_batch)]
        if in_sequence:  # the sums land in sequence pieces: a reduce-scatter
            out[1] = sequence
        out_sharding = P(*out)
    elif in_sequence:  # a column-parallel matmul (or a whole one) takes the whole sequence
        x = along_sequence(x, None)
    # Sums into sequence pieces: JAX 0.10 cannot leave the kernel's gradient unreduced
    kernel = at_use(kernel, None if in_sequence and out_sharding else x)
    return jax.lax.dot_general(x, kernel, dims, precision, out_sharding=out_sharding, **kwargs)


class Lookup(nnx.Module):
    """An nnx.Embed whose lookup states its result's layout (state_layouts)."""

    def __init__(self, embed, sequence):
        self.embed, self.sequence = embed, sequence

    def __call__(self, tokens, out_sharding=None):
        if out_sharding is not None:  # the model states its own
            return self.embed(tokens, out_sharding=out_sharding)
        table = at_use(self.embed.embedding[...], tokens).astype(self.embed.dtype or jnp.float32)
        features, spec = (
            jax.typeof(table).sharding.spec.partitions[-1],
            jax.typeof(tokens).sharding.spec,
        )
        if self.sequence and tokens.ndim == 1:  # positions, [length]: their pieces of the table
            return table.at[tokens].get(out_sharding=P(self.sequence, features))
        looked_up = table.at[tokens].get(out_sharding=P(*spec, features))
        if self.sequence and tokens.ndim == 2:  # the lookup's sums (a split table) into pieces
            return reshard(looked_up, P(spec[0], self.sequence, features))
        return looked_up

    def attend(self, query):  # a tied head's product with the table, as nnx.Embed's
        return self.embed.attend(query)

    embedding = property(lambda self: self.embed.embedding)  # the table, as common.GPT reads it


class WholeSequence(nnx.Module):
    """A mixture of experts given whole sequences, its output split along them again."""

    def __init__(self, mixture, sequence):
        self.mixture, self.sequence = mixture, sequence

    def __call__(self, x):
        out, stats = self.mixture(along_sequence(x, None))
        return along_sequence(out, self.sequence), stats


def along_sequence(x, sequence):
    """x [rows, length, ...] split along the sequence over `sequence`, or gathered whole along it
    (None), its other axes split as they are."""
    spec = jax.typeof(x).sharding.spec
    return reshard(x, P(spec[0], sequence, *spec[2:]))


def grouped_matmul(x, kernel, group_sizes, dimensions):
    """jax.lax.ragged_dot_general (common.ExpertDense given groups: dropless experts), laid out
    by the compiler inside (jax.sharding.auto_axes, as laid_out_inside): explicit mode infers no
    layout for a grouped matmul, and its gradient's grouped matmuls take no out_sharding (JAX
    0.10). Its result is laid out as x's slots and the kernel's outputs are."""
    out = P(*jax.typeof(x).sharding.spec[:-1], jax.typeof(kernel).sharding.spec.partitions[-1])
    grouped = functools.partial(jax.lax.ragged_dot_general, ragged_dot_dimension_numbers=dimensions)
    return jax.sharding.auto_axes(grouped, out_sharding=out)(x, kernel, group_sizes)


def attend_as_queries(q, k, v, attend):
    """Attention with its keys and values laid out as its queries: grouped-query attention has
    fewer key heads, which explicit mode will not pair with split query heads unseen."""
    spec = jax.typeof(q).sharding.spec
    return attend(q, reshard(k, spec), reshard(v, spec))


def laid_out_inside(module, x, batch_axes):
    """A linen piece (flax.nnx.bridge), out of state_layouts' sight: laid out inside by the
    compiler (jax.sharding.auto_axes), its edges' rows split over the batch axes."""
    graphdef, state = nnx.split(module)
    returns_pair = []

    def run(state, x):
        out = nnx.merge(graphdef, state)(x)
        returns_pair.append(isinstance(out, tuple))  # a block's (activations, sums)
        return out if returns_pair[0] else (out, None)

    out = jax.sharding.auto_axes(run, out_sharding=(P(batch_axes), P()))(state, x)
    return out if returns_pair[0] else out[0]


def explicit_layout(batch_axes, sequence=None):
    """The model contract's `wrap`: each piece gathers its parameters for use and states the
    layouts explicit mode asks for (state_layouts); with `sequence` (tp_sp), its input split."""

    def wrap(run):
        def run_explicit(piece, params, x, rng):
            def laid_out(module):
                if any(isinstance(m, bridge.ToNNX) for _, m in nnx.iter_modules(module)):
                    return lambda x: laid_out_inside(module, x, batch_axes)
                state_layouts(module, sequence)
                if not (sequence and jnp.issubdtype(x.dtype, jnp.floating)):
                    return module
                # The residual stream split along the sequence; the head's input gathered whole,
                # for whatever contraction makes its logits (a tied table's is no nnx.Linear)
                split = None if piece.name == "head" else sequence
                return lambda x: module(along_sequence(x, split))

            return run(piece, gather_for_use(params, batch_axes), x, rng, laid_out)

        return run_explicit

    return wrap


def state_shardings(abstract_state, mesh, rules):
    # The boxes' logical names become shardings over the mesh through the rules (Flax NNX's
    # own: a name the rules leave out must map to None), unboxed as the state holds them.
    with nnx.logical_axis_rules((*((name, None) for name in UNSPLIT), *rules)):
        return common.unbox(nnx.get_named_sharding(abstract_state, mesh))


@functools.cache  # one per config: the state holds the model, and an equal state an equal one
def explicit_model(config):
    """The model with the contract's two hooks this layout needs: `wrap` and `attend`."""
    attend = functools.partial(
        common.causal_attention, implementation=common.attention_kernel(config)
    )
    hooks = common.Hooks(attend=functools.partial(attend_as_queries, attend=attend))
    rules = dict(RULES[config.rules])
    wrap = explicit_layout(axes_of(rules["batch"]), rules.get("length"))
    return common.make_model(config, wrap=wrap, hooks=hooks)


def init_state(config, mesh, shapes_only=False):
    create = functools.partial(common.create_state, config, explicit_model(config))
    # Box the abstract state's parameters with their logical names, to read them; not the real one.
    boxed = jax.eval_shape(functools.partial(create, hold=common.named(config)))
    # Each device computes only its own shards: the full model never exists on one device.
    create = jax.jit(create, out_shardings=state_shardings(boxed, mesh, RULES[config.rules]))
    # The state itself, or only its shapes and shardings (nothing allocated) to compile for.
    return create.eval_shape() if shapes_only else create()


def train_step(state, batch, config):
    """The single-device step, unchanged: jit partitions it over the mesh."""
    rng = jax.random.fold_in(state.rng, state.step)
    local = state
    if config.microbatches > 1:  # the gradients summed over the devices once, after all
        batch_axes = axes_of(jax.typeof(batch).sharding.spec[0])
        local = state.replace(params=summed_once(state.apply_fn, state.params, batch_axes))
    grads, metrics = common.accumulate_gradients(local, batch, rng, config.microbatches)
    # The step's one reduction of what stayed unreduced, to the parameters' layout
    grads = jax.tree.map(lambda g, p: reshard(g, jax.typeof(p).sharding.spec), grads, state.params)
    # The global norm, for clipping: jit adds up its shards' partial sums
    norm = optax.tree.norm(common.learned(grads))
    state = state.apply_gradients(grads=common.clip(grads, norm, config.clip_norm))
    return state, {**metrics, "grad_norm": norm}


def eval_step(state, batch):
    """Summed held-out losses of the batch: jit partitions it like the train step."""
    return common.eval_metrics(state, batch)


def batch_sharding(mesh, rules):
    # Over axes of more than one device (lax.scan refuses the micro-batches' reshape otherwise)
    return NamedSharding(
        mesh, P(tuple(a for a in axes_of(dict(rules)["batch"]) if mesh.shape[a] > 1))
    )


def device_batch(batch, mesh, rules):
    # This process's rows become one global array, split as the rules split 'batch'.
    return jax.make_array_from_process_local_data(batch_sharding(mesh, rules), batch)


def check_layout(config):
    """The flags against the mesh and the model's parameters (Config.validate's, at the end)."""
    n, kv = jax.device_count(), config.kv_heads or config.heads
    wrote = f"--kv-heads {kv}" if config.kv_heads else f"--heads {kv}"
    common.require(  # auto splits the heads over 'model', or says why it cannot
        config.mesh != "auto"
        or config.auto_mesh()["model"] > 1
        or n < 4
        or n % 2
        or "heads" not in dict(RULES[config.rules]),
        "mesh",
        f"auto puts no device on 'model' (no tensor parallelism): 2 does not divide {wrote}; "
        f"make them even, or run without it, e.g. --mesh data={n},model=1",
    )
    common.require(
        (config.kv_heads or config.heads) % config.axis_size("heads") == 0,
        "mesh",
        f"splits 'heads' {config.axis_size('heads')} ways under --rules {config.rules}, which does "
        f"not divide the {config.kv_heads or config.heads} key-value heads; {example(config)}",
    )
    # Every parameter names its axes: the rules lay out by name (unnamed, it would replicate)
    boxes = common.logical_names(config)
    whole = common.names_mesh_axes(config, config.mesh_axes())  # the rest: as Flax places them
    nameless = [f"{p} {box.value.shape}" for p, box in boxes if not box.declared and not whole]
    common.require(
        not nameless,
        "model",
        f"{config.model}: {', '.join(nameless[:3])}{', ...' * (len(nameless) > 3)} name no "
        "logical axes for the rules to lay out: declare them with nnx.with_partitioning(init, "
        "names), e.g. ('embed', 'mlp')",
    )
    # Every axis name the rules and UNSPLIT do not know, at once (the first parameter of each)
    ruled, unknown = dict(RULES[config.rules]), {}
    for path, box in boxes:
        for name in set(box.names) - {*ruled, *UNSPLIT, *config.mesh_axes(), None}:
            unknown.setdefault(name, f"{path} {box.value.shape}")
    common.require(
        not unknown,
        "rules",
        f"{config.rules} has no rule for the axes "
        + ", ".join(f"'{name}' (of {where})" for name, where in unknown.items())
        + ", and UNSPLIT does not name them: add a rule for each to RULES (e.g. "
        f'("{next(iter(unknown), "")}", "model")), or add them to UNSPLIT to keep them '
        f"whole: {', '.join(map(repr, unknown))}",
    )
    sequence = dict(RULES[config.rules]).get("length")  # tp_sp: the sequence over 'model'
    own = [path for path, box in boxes if sequence and sequence in box.names]
    common.require(
        not own,
        "rules",
        f"{config.rules} splits the sequence over '{sequence}' between the matmuls, where the "
        f"model splits {', '.join(own[:2])} over '{sequence}' itself: e.g. --rules tp",
    )
    common.require(
        config.seq_len % config.axis_size("length") == 0,
        "seq_len",
        f"{config.seq_len} under --rules {config.rules}: split {config.axis_size('length')} ways "
        f"along the sequence, it must be a multiple of that, e.g. --seq-len "
        f"{config.axis_size('length') * max(1, config.seq_len // config.axis_size('length'))}",
    )
    for path, box in common.logical_names(config):
        for name, size in zip(box.names, box.value.shape, strict=True):
            if size % config.axis_size(name):  # --d-model, if it is the GPT's width
                gpt = (name, size) == ("embed", config.d_model)
                common.require(
                    False,
                    "mesh",
                    f"splits '{name}' {config.axis_size(name)} ways under --rules {config.rules}, "
                    f"which does not divide its size {size} in {path}; "
                    + (example(config) if gpt else split_or_keep(config, name, size, box)),
                )


def split_or_keep(config, name, size, box):
    """What would split a parameter's axis evenly, and what keeping it whole would cost."""
    split, n, kv = config.axis_size(name), jax.device_count(), config.kv_heads or config.heads
    fits = max(m for m in (1, 2, 4) if size % m == 0 and n % m == 0 and kv % m == 0)
    return (
        f"give it a size {split} divides ({-(-size // split) * split}) or a mesh that does, "
        f"e.g. --mesh data={n // fits},model={fits}; kept whole (its axis in UNSPLIT), every "
        f"device holds all {box.value.size * 4:,} bytes of it"
    )


def example(config):
    """A valid --kv-heads or --heads, or else --d-model, for these rules and this mesh."""
    split = config.axis_size("heads")
    groups = [k for k in range(split, config.heads + 1, split) if config.heads % k == 0]
    if config.kv_heads and config.kv_heads % split and groups:
        return f"e.g. --kv-heads {groups[0]}"
    if config.heads % split:  # and key-value heads that divide them, if given
        heads = [h for h in range(split, config.d_model + 1, split) if config.d_model % h == 0]
        eg = f"--heads {heads[0]}" if heads else f"--heads {split} --d-model {split * 32}"
        return f"e.g. {eg}" + f" --kv-heads {split}" * bool(config.kv_heads)
    for d_model in range(config.d_model, 16 * config.d_model + 1):
        if d_model % config.heads == 0 and d_model % config.axis_size("embed") == 0:
            return f"e.g. --d-model {d_model}"


def main(config):
    common.setup(config)
    mesh = make_mesh(config)
    dataset = common.load_dataset(config)
    state_shapes = init_state(config, mesh, shapes_only=True)
    rules = RULES[config.rules]
    # No in_shardings or out_shardings: the state's and the batch's types carry their shardings,
    # and the step's results have the types its operations give: the new state the old one's.
    step_fn = jax.jit(functools.partial(train_step, config=config), donate_argnums=0)
    eval_fn = jax.jit(eval_step)
    # Compiled for the shapes of the state and of a batch, before either exists: a step too big
    # for the devices stops here, with one line, before anything is allocated.
    batch_shapes = common.batch_shape(config, batch_sharding(mesh, rules))
    # The mesh the types name, while tracing. (No rules: the model's logical constraints on its
    # activations stay inert; each activation's type follows from its inputs'.)
    with jax.set_mesh(mesh):
        compiled, compile_seconds = common.compile_step(config, step_fn, state_shapes, batch_shapes)
    state = init_state(config, mesh)
    checkpoints = common.Checkpoints(config)
    state, start = checkpoints.restore(state)
    eval_data = [device_batch(b, mesh, rules) for b in common.eval_batches(dataset, config)]
    report = common.cost_report(config, state, compiled, compile_seconds)
    layout = (
        f"Explicit mesh data={mesh.shape['data']},model={mesh.shape['model']}, rules {config.rules}"
    )
    log = common.Logger(config, dataset, layout, report, start)
    stop = common.StopSignals()  # Ctrl-C or SIGTERM: the run finishes its step, saves, stops
    try:
        # Each made while the devices run the step before (JAX dispatches asynchronously)
        for step, rows, waited in common.train_batches(dataset, config, start):
            batch = device_batch(rows, mesh, rules)
            # The program compiled above, which the report describes.
            state, metrics = compiled(state, batch)
            log.log(step, metrics, waited)
            if common.log_due(config, step):  # checked as often as printed: a check waits
                if not common.finite(metrics["loss_sum"]):  # summed over every device
                    raise SystemExit(common.not_saved(f"the loss at step {step + 1}"))
            if common.eval_due(config, step):
                with jax.set_mesh(mesh):  # traced here the first time
                    log.eval(step, eval_fn, state, eval_data)
            stopping = stop.requested(step)  # the same step on every process
            if checkpoints.due(step, stopping):  # a policy's step, or the run stops
                if not common.finite(state):
                    raise SystemExit(common.not_saved(f"the state after step {step + 1}"))
                checkpoints.save(step, state, stopping)
            if stopping:
                break
    finally:
        stop.close()  # the signals back to their handlers
        checkpoints.close()  # waits for the saves still being written, whatever happened
    return log.finish(state, compiled)  # the end-of-run report, and what the run made


if __name__ == "__main__":
    main(common.parse_config(Config, __doc__))
