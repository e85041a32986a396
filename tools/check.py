"""Check a model or dataset of yours against the scripts' contract before you train on it:
every piece is built and traced on shapes alone, then each script's step as the script runs it
(its shard_map's manual axes, its rules' Auto layout, its Explicit types), nothing compiled or
computed; a batch of each split is read (after the loader's prepare(config), if it has one:
tests/tfds_text.py's downloads its dataset). Each breach is one line naming the piece, parameter
or batch and what to do (a script's refusal in its own words), exit status 2.

  python tools/check.py --model my_model.py             # the flags of any script, e.g.
  python tools/check.py --model my_project.model --layers 2 --seq-len 128 --scripts fsdp
  python tools/check.py --dataset my_data.py --vocab-size 50304
  python tools/check.py --dataset tests/tfds_text.py:tiny_shakespeare --data-dir ~/tfds

The contract is written in common.py's model section. The scripts refuse what they can see
themselves (a flag the model ignores, a layout call they cannot run) before compiling; the
contract's other breaches would show there as a crash, or as numbers that are silently another
model's (positions made without the hook a strategy replaces, which context_parallel.py refuses).
"""

import contextlib
import dataclasses
import importlib
import io
import os
import re
import sys
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # common.py, beside the scripts

import common  # noqa: E402
from common import ConfigError, require  # noqa: E402

# Each way a script runs a model (pmap_dp.py's is shardmap_dp.py's; expert_parallel.py's with
# --experts): shard_map's manual axes, by hand, the rules' Auto layout and the Explicit types
SCRIPTS = "shardmap_dp fsdp pjit_tp logical_pjit explicit_sharding pipeline context_parallel"
SCRIPTS = (*SCRIPTS.split(), "expert_parallel")


@dataclasses.dataclass(frozen=True)
class Config(common.Config):
    scripts: str = common.arg(
        ",".join(SCRIPTS), "the scripts to trace --model's step in (none: the contract alone)"
    )


def _failure(error: Exception, origin: str) -> str:
    """An error in one line: the deepest line of the user's code (or the syntax error's), what
    it is."""
    if isinstance(error, SyntaxError):
        place = f"{error.filename}, line {error.lineno}"
    else:
        folder = os.path.dirname(os.path.abspath(origin))
        frames = traceback.extract_tb(error.__traceback__)
        theirs = [f for f in frames if os.path.dirname(os.path.abspath(f.filename)) == folder]
        theirs = theirs or [f for f in frames if not f.filename.startswith("<")]
        place = f"{theirs[-1].filename}, line {theirs[-1].lineno}" if theirs else origin
    message = (error.msg if isinstance(error, SyntaxError) else str(error)).splitlines()
    return f"{place}: {type(error).__name__}: {message[0] if message else ''}"


def check_model(config: common.Config):
    """The model contract, checked piece by piece on shapes alone (nothing is computed or
    compiled): ConfigError naming the piece or parameter that breaks it, and what to do; else a
    note if it names no axes."""
    pieces = common.cut_at_blocks(common.model_class(config))
    tokens = jax.ShapeDtypeStruct((2, config.seq_len), jnp.int32)
    where = f"--model {config.model}:"
    contract = "(common.py's model contract; README: Your own model and data)"
    named = {}  # the first parameter with logical axis names (True), and without (False)
    meshed = {}  # parameters named by mesh axes, as the Flax docs annotate them: P(None, 'model')

    def build(name, piece, x):
        try:
            made = common.PieceDef.of(name, piece, config, PROBES)
            out = jax.eval_shape(lambda p, x: common.run_piece(made, p, x), made.params, x)
        except Exception as error:  # e.g. a piece that takes other arguments
            raise ConfigError(
                f"{where} {PIECE[name]} fails, built as Model(config, hooks, rngs=rngs) and "
                f"cut at its blocks as the scripts run it: {_failure(error, config.model)} "
                f"{contract}"
            ) from None
        for path, (shape, names) in _parameter_shapes(made.params).items():
            parameter = f"parameter {path}"
            named.setdefault(bool(names), parameter)
            if not names:
                continue
            if len(names) > len(shape):  # fewer: the rest whole, as a PartitionSpec's
                raise ConfigError(
                    f"{where} {parameter} has {len(shape)} axes but names {names}: a name per "
                    f"axis at most {contract}"
                )
            if set(names) & {"data", "model"}:
                meshed.setdefault(parameter, sorted(set(names) & {"data", "model"}))
        return out, made

    def calls(made, x):
        """The hooks the piece calls, and whether it makes an arange along the sequence itself
        (an iota [length] or [length, length] at this length and at one more: its own positions,
        or its own causal mask)."""

        def aranges(length):
            shape = jax.ShapeDtypeStruct((x.shape[0], length, *x.shape[2:]), x.dtype)
            run = lambda p, x: common.run_piece(made, p, x)  # noqa: E731
            traced = jax.make_jaxpr(run)(made.params, shape)
            return any(s in ((length,), (length, length)) for s in _iota_shapes(traced.jaxpr))

        called.clear()
        own = aranges(x.shape[1]) and aranges(x.shape[1] + 1)
        return set(called), own

    x, embed = build("embed", pieces["embed"], tokens)
    if not (isinstance(x, jax.ShapeDtypeStruct) and x.ndim == 3 and x.shape[:2] == tokens.shape):
        raise ConfigError(
            f"{where} its blocks get {_shape_text(x)} for tokens {_shape_text(tokens)}; they "
            f"must get activations [batch, length, features] {contract}"
        )
    out, block = build("block", pieces["block"], x)
    sums = out[1] if isinstance(out, tuple) and len(out) == 2 else None
    if not (
        isinstance(out, tuple)
        and len(out) == 2
        and _shape_text(out[0]) == _shape_text(x)
        and (
            sums is None
            or isinstance(sums, dict)
            and all(s.dtype == jnp.float32 for s in jax.tree.leaves(sums))
        )
    ):
        raise ConfigError(
            f"{where} a block returns {_shape_text(out[0] if sums is None else out)} for "
            f"activations {_shape_text(x)}; it must return activations of the same shape and "
            f"dtype, or (them, a dict of float32 sums) {contract}"
        )
    # Contract point 3: the hooks a strategy replaces must be where attention and positions are
    embed_hooks, embed_own = calls(embed, tokens)
    block_hooks, block_own = calls(block, x)
    if "attend" not in block_hooks:
        raise ConfigError(
            f"{where} a block never calls hooks.attend(q, k, v): attention must go through that "
            "hook, which context_parallel.py replaces with ring attention (each device holds "
            f"pieces of every sequence) {contract}"
        )
    for name, own in ((PIECE["embed"], embed_own), (PIECE["block"], block_own)):
        if own:
            raise ConfigError(
                f"{where} {name} makes its own token positions or causal mask (an arange along "
                "the sequence): take positions from hooks.positions(length) and attend through "
                "hooks.attend, the hooks context_parallel.py replaces, where each device holds "
                f"pieces of every sequence {contract}"
            )
    logits, head = build("head", pieces["head"], x)
    wanted = jax.ShapeDtypeStruct((*tokens.shape, config.vocab_size), jnp.float32)
    if _shape_text(logits) != _shape_text(wanted):
        raise ConfigError(
            f"{where} the model returns {_shape_text(logits)}; it must return float32 logits "
            f"{_shape_text(wanted)} (batch, length, --vocab-size) {contract}"
        )
    if meshed:  # split as named by the scripts that lay parameters out by name, the rest whole
        split = ", ".join(f"{p.split()[-1]} over {a}" for p, a in list(meshed.items())[:2])
        whole = f", {named[False].split()[-1]} whole, ..." if False in named else ""
        return f" (it names mesh axes, not logical ones, as the Flax docs do: {split}{whole})"
    if True in named and False in named:  # some named, some not
        raise ConfigError(
            f"{where} {named[False]} has no logical axis names, where {named[True]} has: "
            "declare it with nnx.with_partitioning(init, names) or nnx.Param(value, "
            f"out_sharding=names) (linen: nn.with_logical_partitioning) {contract}"
        )
    unnamed = " (it names no axes: pjit_tp.py, logical_pjit.py and explicit_sharding.py, which lay"
    return "" if True in named else f"{unnamed} parameters out by name, will ask for them)"


class _Traced(Exception):
    """A script's step traced: where check_scripts stops it."""


def check_scripts(config: Config) -> list:
    """Each script of --scripts run with check.py's flags (the rest its defaults) up to its step,
    traced and lowered on shapes, nothing compiled: ConfigError with the first refusal, in the
    script's own words; else the scripts that traced it."""
    names = [n for n in config.scripts.split(",") if n and n != "none" and config.model != "gpt"]
    names = [n for n in names if n != "expert_parallel" or config.experts]  # it splits experts
    flags = {  # what check.py was given, the rest each script's defaults
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(common.Config)
        if getattr(config, f.name) != f.default
    }

    def lowered(config, step_fn, *args):  # common.compile_step, stopped before compiling
        common.lower_step(config, step_fn, *args)
        raise _Traced

    traced, (compile_step, common.compile_step) = [], (common.compile_step, lowered)
    try:
        for name in names:
            require(name in SCRIPTS, "scripts", f"{name} is no script, e.g. --scripts fsdp")
            module, said = importlib.import_module(name), io.StringIO()
            try:
                with contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()):
                    module.main(module.Config(**flags))
            except _Traced:
                traced.append(f"{name}.py")
            except SystemExit:
                why = (
                    said.getvalue().strip().split(": error: ", 1)[-1].removesuffix(" (see --help)")
                )
                if name == "pjit_tp" and "PARAM_SPECS" in why:  # the entries to paste
                    why = why.split(" (tools/check.py")[0] + suggestions(module.Config(**flags))
                raise ConfigError(f"{name}.py refuses it: {why}") from None
    finally:
        common.compile_step = compile_step
    return traced


MEGATRON = ("heads", "kv_heads", "mlp", "vocab")  # the logical axes split over 'model'


def suggested_entries(config) -> tuple:
    """pjit_tp.py's PARAM_SPECS entries for what no entry covers: {pattern: (path, shape, entry)}
    (the blocks' taken together, block_N), Megatron's from the logical names (the heads, MLP
    units and vocabulary over 'model' where they split evenly; None: no names to go by); and a
    line for each axis 'model' does not divide, which its entry keeps whole."""
    import pjit_tp

    model, found, whole = config.mesh_axes()["model"], {}, []
    n, kv = jax.device_count(), config.kv_heads or config.heads
    for path, box in common.logical_names(config):
        if any(re.search(pattern, path) for pattern, _ in pjit_tp.param_specs(config)):
            continue
        pattern, shape = (
            re.escape(re.sub(r"^(block_\d+|blocks)/", "/", path)) + "$",
            box.value.shape,
        )
        megatron = [(name in MEGATRON, size) for name, size in zip(box.names, shape, strict=True)]
        axes = ["'model'" if m and size % model == 0 else "None" for m, size in megatron]
        for size in [s for m, s in megatron if m and s % model and pattern not in found]:
            fits = max(m for m in (1, 2, 4) if size % m == 0 and n % m == 0 and kv % m == 0)
            whole.append(
                f"{path} {tuple(shape)}: model={model} does not divide its axis of {size}: give "
                f"it a size {model} divides ({-(-size // model) * model}) or a mesh whose 'model' "
                f"does, e.g. --mesh data={n // fits},model={fits}; whole (P()), every device "
                f"holds all {box.value.size * 4:,} bytes of it ({model}x a split one's)"
            )
        entry = (f"P({', '.join(axes)})" if "'model'" in axes else "P()") if box.declared else None
        found.setdefault(pattern, (re.sub(r"block_\d+", "block_N", path), tuple(shape), entry))
    return found, whole


def suggestions(config) -> str:
    """suggested_entries as the end of pjit_tp.py's refusal: what to paste, what it keeps
    whole, and the parameters that name no axes to go by."""
    missing, whole = suggested_entries(config)
    entries = [f'(r"{pattern}", {spec}),' for pattern, (*_, spec) in missing.items() if spec]
    nameless = [path for path, _, spec in missing.values() if spec is None]
    line = "; their logical names suggest (P() replicates): " + " ".join(entries) if entries else ""
    line += f"; {whole[0]}" if whole else ""
    declare = "name no axes: declare them with nnx.with_partitioning(init, names), e.g. ('embed',"
    return line + f"; {', '.join(nameless)} {declare} 'mlp')" * bool(nameless)


PIECE = {"embed": "the model before its blocks", "block": "a block", "head": "the model after them"}
called = []  # the hooks the pieces called while check_model traced them


def _probe(name, hook):
    def probe(*args):
        called.append(name)
        return hook(*args)

    return probe


# check_model's hooks: each records its call. Positions come out of a cumulative sum and
# attention returns the queries, so that no arange along the sequence is the hooks' own.
PROBES = common.Hooks(
    attend=_probe("attend", lambda q, k, v: q),
    positions=_probe("positions", lambda length: jnp.cumsum(jnp.ones(length, jnp.int32)) - 1),
    to_experts=_probe("to_experts", common.Hooks.to_experts),
    dropless=_probe("dropless", common.Hooks.dropless),
    whole_sequence=_probe("whole_sequence", common.Hooks.whole_sequence),
)


def _iota_shapes(jaxpr) -> list:
    """The shapes of every iota in a jaxpr and the jaxprs inside it."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "iota":
            found.append(tuple(eqn.params["shape"]))
        for param in eqn.params.values():
            for inner in param if isinstance(param, (tuple, list)) else [param]:
                inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's Jaxpr
                if hasattr(inner, "eqns"):
                    found += _iota_shapes(inner)
    return found


def _parameter_shapes(params) -> dict:
    """{path: (shape, logical names)} of a piece's parameters (an nnx.State of shapes)."""
    return {
        "/".join(map(str, path)): (tuple(v.get_value().shape), v.get_metadata().get("out_sharding"))
        for path, v in nnx.to_flat_state(params)
    }


def _shape_text(x) -> str:
    if isinstance(x, tuple):
        return "(" + ", ".join(map(_shape_text, x)) + ")"
    if isinstance(x, jax.ShapeDtypeStruct):
        return f"{x.dtype}{list(x.shape)}"
    return repr(x)


READ = 16  # batches of each split read: the largest id of one batch may not be the data's


def check_dataset(config: Config):
    """The dataset --dataset names, prepared if its loader has prepare(config), and READ
    batches of each split read: int32 tokens [rows, --seq-len + 1], from 0 to --vocab-size - 1.
    What it is, and the ids read."""
    name = config.dataset
    origin = name.partition(":")[0]
    try:
        if common.is_yours(name):  # its loader's prepare(config) first, e.g. tfds_text.py's
            vars(common.import_yours(origin, "dataset")).get("prepare", lambda c: None)(config)
        dataset = common.load_dataset(config)
    except ConfigError:
        raise
    except Exception as error:
        raise ConfigError(
            f"--dataset {name}: load(config) failed: {_failure(error, origin)}"
        ) from None
    for method in ("batch", "describe"):
        require(
            callable(getattr(dataset, method, None)),
            "dataset",
            f"{name}: what load(config) returns has no {method}(): a dataset has batch(step, "
            "start, stop, split) and describe() (README: Your own model and data)",
        )
    rows, wanted = config.batch_size, (config.batch_size, config.seq_len + 1)
    seen = []  # each batch's least and largest id
    for split in common.SPLITS:
        for step in range(READ):
            call = f"batch({step}, 0, {rows}, '{split}')"
            try:
                tokens = np.asarray(dataset.batch(step, 0, rows, split))
            except Exception as error:
                raise ConfigError(
                    f"--dataset {name}: {call} failed: {_failure(error, origin)}"
                ) from None
            require(
                tokens.shape == wanted and tokens.dtype == np.int32,
                "dataset",
                f"{name}: {call} returns {tokens.dtype}{list(tokens.shape)}; it must return "
                f"int32 tokens {list(wanted)} (rows, --seq-len + 1)",
            )
            seen.append((int(tokens.min()), int(tokens.max())))
    least, most = min(low for low, _ in seen), max(high for _, high in seen)
    require(
        least >= 0 and most < config.vocab_size,
        "dataset",
        f"{name}: token ids from {least} to {most} in {2 * READ} batches, outside 0 .. "
        f"--vocab-size {config.vocab_size} - 1: give your tokenizer's size (at least {most + 1})",
    )
    return f"{dataset.describe()}; token ids from {least} to {most} in {2 * READ} batches"


def main(argv=None):
    config = common.parse_config(Config, __doc__, argv)
    try:
        common.start_devices(config)
        config.validate()
        note = check_model(config)
        data = check_dataset(config)
        traced = check_scripts(config)
    except ConfigError as error:
        common.exit_bad_input(str(error))
    print(f"--model {config.model} keeps the scripts' contract{note}")
    if traced:
        print(f"and trains in {', '.join(traced)}: each traced its step with these flags")
    print(f"--dataset {config.dataset} keeps it too: {data}")


if __name__ == "__main__":
    main()
