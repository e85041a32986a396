"""Your own model and data, as a user brings them: a model file next to a copied script
(tests/llama.py, which the scripts were not written for), a model that breaks the contract
(one line each, before anything is compiled), a layout table that forgets a parameter, and
a local text file as the data; the Flax docs' GPT trained by every script as by one device."""

import difflib
import json
import re
import shutil
import subprocess
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from orbax.checkpoint import v1 as ocp

import common
from tools import hlo
import pjit_tp
from tests import docs_model, docs_model_as_written, minigpt_as_written
from tools import check
from tests.harness import ROOT, as_flags, SCRIPTS, SMALL, TINY, copy_alone, run_script, run_uncached
from tests.harness import EVAL, RTOL, STRATEGIES, matrix, model_flags, record_flags
from tests.sharding import check_real
from test_equivalence import ANY_MODEL, compare, one_device, reference, relative

LLAMA = (ROOT / "tests" / "llama.py").read_text()


def run_with_llama(script, tmp_path, *flags, copy=True):
    """The script (copied with common.py, unless it is there already) with llama.py beside it."""
    (tmp_path / "llama.py").write_text(LLAMA)
    if copy:
        copy_alone(script, tmp_path)
    return subprocess.run(
        [sys.executable, f"{script}.py", "--model", "llama.py", *TINY, "--eval-every", "0", *flags],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("script", ["fsdp", "pipeline"])
def test_a_copied_script_trains_a_model_file_unchanged(script, tmp_path):
    """The script and common.py copied as they are, the model in its own file: it trains."""
    done = run_with_llama(
        script,
        tmp_path,
        "--metrics-file",
        "m.jsonl",
        *(["--layers", "2", "--microbatches", "2"] * (script == "pipeline")),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[-1])["summary"]
    assert summary["steps"] == 3 and np.isfinite(summary["final_loss"])


def test_pjit_tp_trains_a_model_file_with_its_table_entries(tmp_path):
    """pjit_tp.py needs what its contract asks, the new parameters' entries in PARAM_SPECS: it
    names every one missing in one line (before: one per run, 11 runs) and tools/check.py, which
    suggests the entries from their logical names (five lines, as tests/harness.LLAMA_SPECS);
    pasted, they split the parameters as they say."""
    done = run_with_llama("pjit_tp", tmp_path)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    said = "are in no entry of pjit_tp.py's PARAM_SPECS (tools/check.py --model llama.py suggests "
    assert said in done.stderr and "head/head/norm/scale (32,)" in done.stderr, done.stderr
    names = ("attn_norm/scale", "q/kernel", "kv/kernel", "o/kernel", "gate/kernel")
    assert all(f"block_N/{name}" in done.stderr for name in names), done.stderr
    tool = [sys.executable, str(ROOT / "tools" / "check.py"), "--model", "llama.py", *TINY]
    done = subprocess.run(
        [*tool, "--scripts", "pjit_tp"], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 2 and "pjit_tp.py refuses it: " in done.stderr, done.stderr
    assert all(f'(r"/{name}$", P(' in done.stderr for name in names), done.stderr
    assert '(r"head/head/norm/scale$", P()),' in done.stderr, done.stderr
    script = (tmp_path / "pjit_tp.py").read_text()
    entries = (
        '    (r"/(q|gate|up)/kernel", P(None, "model")),\n'
        '    (r"/(o|down)/kernel", P("model", None)),\n'
        '    (r"/kv/kernel|norm/scale", P()),\n'
    )
    (tmp_path / "pjit_tp.py").write_text(
        script.replace("PARAM_SPECS = (\n", "PARAM_SPECS = (\n" + entries, 1)
    )
    assert run_with_llama("pjit_tp", tmp_path, copy=False).returncode == 0
    tool = [sys.executable, str(ROOT / "tools" / "show_sharding.py"), "pjit_tp.py", "--model"]
    done = subprocess.run([*tool, "llama.py", *TINY], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(
        r"block_0/gate/kernel +\(32, 80\) +P\(None, 'model'\) +2,560\n", done.stdout
    ), done.stdout
    assert re.search(r"block_0/kv/kernel +\(32, 32\) +P\(\) +4,096\n", done.stdout), done.stdout


def test_pjit_tp_says_what_a_suggested_entry_keeps_whole(tmp_path):
    """An MLP width that model=4 does not divide: the entries tools/check.py suggests keep it
    whole, and its line says so, with what would split it and what whole costs (not a silent
    replication)."""
    wide = ("hidden = 8 * c.d_model // 3 // 16 * 16 or 16", "hidden = 98")
    (tmp_path / "wide.py").write_text(broken(wide))
    model = {"model": str(tmp_path / "wide.py"), "mesh": "data=2,model=4"}
    missing, whole = check.suggested_entries(pjit_tp.Config(**{**SMALL, **model}))
    assert missing[r"/gate/kernel$"][2] == missing[r"/down/kernel$"][2] == "P()"
    assert (
        "block_0/gate/kernel (64, 98): model=4 does not divide its axis of 98: give it a size 4 "
        "divides (100) or a mesh whose 'model' does, e.g. --mesh data=4,model=2; whole (P()), "
        "every device holds all 25,088 bytes of it (4x a split one's)"
    ) in whole


def code(path):
    """A Python file's lines, its module docstring left out."""
    text = path.read_text()
    return text[text.index('"""', 3) + 3 :].splitlines()


def test_a_model_written_as_the_flax_guides_write_one_comes_in_with_few_changes():
    """tests/docs_model.py is tests/docs_model_as_written.py (a list of blocks, RMSNorm, rotary
    positions, GQA, a tied head) with at most 15 lines of code changed for the contract, and both
    run: the one as written on its own, the other cut at its blocks into the same function."""
    written, adapted = (code(ROOT / "tests" / f"docs_model{s}.py") for s in ("_as_written", ""))
    diff = difflib.unified_diff(written, adapted, lineterm="", n=0)
    changed = [line for line in diff if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    assert len([line for line in changed if line[0] == "+"]) <= 15, changed
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 256)
    with nnx.use_eager_sharding(False):
        alone = docs_model_as_written.Model(docs_model_as_written.ModelConfig(), rngs=nnx.Rngs(0))
        assert alone(tokens).shape == (2, 16, 256)
        config = common.Config(**{**SMALL, "model": "tests.docs_model", "kv_heads": 2})
        model = common.make_model(config)
        params = common.init_params(model, jax.random.key(0))
        whole = docs_model.Model(config, model.hooks, rngs=nnx.Rngs(0))
    # Each half holds what it reads: the embedding the table, the head its norm, reading the
    # table as its own (tied: the part after the blocks reads it too)
    assert model.tied == ("embed/embedding",) and params["head"] == {"norm": {"scale": mock.ANY}}
    blocks = {i: params[f"block_{i}"] for i in range(config.layers)}
    state = nnx.state(whole, nnx.Param)
    nnx.replace_by_pure_dict(state, {**params["embed"], **params["head"], "blocks": blocks})
    nnx.update(whole, state)
    np.testing.assert_array_equal(model(params, tokens)[0], whole(tokens))


def test_the_flax_docs_gpt_comes_in_with_few_changes():
    """tests/minigpt.py is tests/minigpt_as_written.py, the GPT the Flax NNX docs publish, with at
    most 15 lines of code changed for the contract, none an axis name, and both compute the same
    logits: the one as written under the mesh it is written for, its layout calls and all; the
    other cut at its blocks, as the scripts run it."""
    written, adapted = (code(ROOT / "tests" / f"minigpt{s}.py") for s in ("_as_written", ""))
    diff = difflib.unified_diff(written, adapted, lineterm="", n=0)
    changed = [line for line in diff if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    added = [line for line in changed if line[0] == "+"]
    assert len(added) <= 15, changed
    assert not any(re.search(r"P\(|sharding|metadata", line) for line in added), added
    config = common.Config(**{**SMALL, "model": "tests.minigpt"})
    model = common.make_model(config)
    params = common.init_params(model, jax.random.key(0))
    assert set(params["head"]) == {"output_layer"}  # what only the part after the blocks reads
    with nnx.use_eager_sharding(False):
        whole = minigpt_as_written.create_model(nnx.Rngs(0))
    whole.eval()  # its dropout off, as the scripts' without a key
    blocks = {i: params[f"block_{i}"] for i in range(config.layers)}
    state = nnx.state(whole, nnx.Param)
    top = {**params["embed"], **params["head"]}
    nnx.replace_by_pure_dict(state, {**top, "transformer_blocks": {"layers": blocks}})
    nnx.update(whole, state)
    tokens = jax.random.randint(jax.random.key(1), (2, config.seq_len), 0, config.vocab_size)
    with jax.set_mesh(jax.make_mesh((2, 4), ("batch", "model"))):
        logits = nnx.jit(lambda whole, tokens: whole(tokens))(
            whole, jax.device_put(tokens, jax.P("batch"))
        )
    ours = jax.jit(lambda params, tokens: model(params, tokens)[0])(params, tokens)
    np.testing.assert_allclose(logits, ours, rtol=1e-5, atol=1e-6)


MINIGPT = (ROOT / "tests" / "minigpt.py").read_text()
# tests/minigpt.py half adapted: (a change, a script, what its line and tools/check.py say)
HALF_ADAPTED = [
    # Its own layout call back in: shard_map's manual axes refuse it (before: JAX's internal error,
    # "Please file a bug"); the Explicit types take it (test_equivalence, -m full)
    (
        ("self.token_emb(x)", "self.token_emb(x, out_sharding=jax.typeof(x).sharding)"),
        "fsdp",
        "token_embedding = self.token_emb(x, out_sharding=jax.typeof(x).sharding) lays out "
        "activations itself, which fails here (NotImplementedError: Going from `Manual` "
        "AxisType to `Auto` or `Explicit` AxisType is not allowed.): remove it",
    ),
    # Its blocks' dropout left at the docs' 0.1 (before: --dropout 0 trained with dropout)
    (
        ("                    rate=rate,\n", ""),
        "shardmap_dp",
        "--dropout 0.0: the model's nnx.Dropout layers drop 0.1: build them from config.dropout, "
        "e.g. --dropout 0.1",
    ),
]


@pytest.mark.parametrize("change, script, message", HALF_ADAPTED, ids=["layout", "dropout"])
def test_a_half_adapted_model_is_one_line_where_it_would_train_otherwise(
    change, script, message, tmp_path, capsys
):
    """Run by the script and checked by tools/check.py (which traces the step as the script
    does): exit 2, one line, the same words."""
    (tmp_path / "half.py").write_text(
        broken(change, MINIGPT.replace("\nfrom flax", "\nimport jax\nfrom flax", 1))
    )
    flags = [*TINY, "--model", str(tmp_path / "half.py"), "--dropout", "0"]
    with pytest.raises(SystemExit) as exit_info:
        SCRIPTS[script].main(common.parse_config(SCRIPTS[script].Config, None, flags))
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert message in err, err
    said = refused(tmp_path / "half.py", capsys, "--dropout", "0", "--scripts", script)
    assert message in said, said


NNX_LLAMA = (ROOT / "tests" / "nnx_llama.py").read_text()


def broken(change, text=LLAMA):
    old, new = change
    assert old in text, old
    return text.replace(old, new)


# (a change to tests/nnx_llama.py, what the one-line error says)
BREACHES = [
    (
        ("class Model(nnx.Module)", "class Decoder(nnx.Module)"),
        "defines no Model(config, hooks, rngs=rngs), e.g. --model gpt",
    ),
    (
        ("class Model(nnx.Module)", "class Model"),
        "Model is no nnx.Module (linen's through nnx.bridge",
    ),
    (
        ('out_sharding=("norm",)', ""),
        "parameter norm/scale has no logical axis names, where parameter out/kernel has: declare "
        "it with nnx.with_partitioning",
    ),
    (
        ('_init(("vocab", "embed"))', '_init(("vocab", "embed", "embed"))'),
        "parameter token/embedding has 2 axes but names",
    ),
    (
        (
            "return x + self.dropout(self.down(gated))",
            "return (x + self.down(gated)).astype(jnp.bfloat16)",
        ),
        "a block returns bfloat16[2, 16, 32] for activations float32[2, 16, 32]",
    ),
    (
        ("norm(x)).astype(jnp.float32)", "norm(x)).astype(jnp.float32)[..., :-1]"),
        "the model returns float32[2, 16, 255]; it must return float32 logits float32[2, 16, 256]",
    ),
    (
        ("norm(x)).astype(jnp.float32)", "norm(x)).astype(jnp.bfloat16)"),
        "the model returns bfloat16[2, 16, 256]",
    ),
    # Half adapted: a module, but attention and positions bypass the hooks (before: check_model
    # passed, and context_parallel.py trained another model, exit 0)
    (
        ("self.hooks.attend(q, k, v)", "jax.nn.dot_product_attention(q, k, v, is_causal=True)"),
        "a block never calls hooks.attend(q, k, v): attention must go through that hook",
    ),
    (
        ("self.hooks.positions(x.shape[1])", "jnp.arange(x.shape[1])"),
        "a block makes its own token positions or causal mask",
    ),
    # Built otherwise than the contract says (before: a 25-line traceback)
    (
        (
            "    def __init__(self, config, hooks, *, rngs):\n        self.token",
            "    def __init__(self, config, *, rngs):\n        self.token",
        ),
        "fails when built (TypeError: Model.__init__() takes 2 positional arguments but 3 "
        "positional arguments (and 1 keyword-only argument) were given): it is built as "
        "Model(config, hooks, rngs=rngs)",
    ),
]


@pytest.mark.parametrize(
    "change, message", BREACHES, ids=[message.split(":")[0] for _, message in BREACHES]
)
def test_a_model_that_breaks_the_contract_is_one_line(change, message, tmp_path, capsys):
    """tools/check.py finds each breach on shapes alone: exit 2, one line naming the piece or
    parameter and what to do."""
    (tmp_path / "bad.py").write_text(broken(change, NNX_LLAMA))
    assert message in refused(tmp_path / "bad.py", capsys)


def refused(model, capsys, *flags):
    """tools/check.py's one line for a model file (a path of its own: a process loads a --model
    once), with exit 2 and nothing on stdout."""
    with pytest.raises(SystemExit) as exit_info:
        check.main([*TINY, "--model", str(model), *flags])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    return err


def test_the_checker_passes_the_tests_models(capsys):
    models = ("gpt", "tests.llama", "tests.tied_llama", "tests.nnx_llama", "tests.docs_model")
    for model in models:
        check.main([*TINY, "--model", model, "--scripts", "none"])
        assert capsys.readouterr().out.startswith(f"--model {model} keeps the scripts' contract\n")
    check.main([*TINY, "--model", "tests.minigpt", "--scripts", "none"])
    assert capsys.readouterr().out.startswith(
        "--model tests.minigpt keeps the scripts' contract (it names mesh axes, not logical ones, "
        "as the Flax docs do: output_layer/bias over ['model'], output_layer/kernel over "
        "['model'], embedding_layer/pos_emb/embedding whole, ...)"
    )


def test_the_checker_passes_a_model_that_names_no_axes(tmp_path, capsys):
    """Axis names are asked for only where a layout reads them: tests/docs_model.py without them
    keeps the contract, with a note of the scripts that will ask."""

    check.main([*TINY, *as_flags(unnamed_model(tmp_path)), "--scripts", "none"])
    said = capsys.readouterr().out.splitlines()[0]
    assert said.endswith(
        "keeps the scripts' contract (it names no axes: pjit_tp.py, logical_pjit.py "
        "and explicit_sharding.py, which lay parameters out by name, will ask for them)"
    ), said


@pytest.mark.parametrize(
    "breach, hook", [(7, "attend(q, k, v)"), (8, "positions(length)")], ids=["attend", "positions"]
)
def test_context_parallel_refuses_a_model_that_bypasses_its_hooks(breach, hook, tmp_path, capsys):
    """The one check a run keeps: context_parallel.py replaces hooks.attend and hooks.positions,
    so a model attending or placing its tokens without them would train another model silently
    (its own positions: exit 0, losses apart from one device's). Exit 2, one line, nothing
    compiled."""
    (tmp_path / "bypass.py").write_text(broken(BREACHES[breach][0], NNX_LLAMA))
    config = [*TINY, "--model", str(tmp_path / "bypass.py")]
    with pytest.raises(SystemExit) as exit_info:
        SCRIPTS["context_parallel"].main(
            common.parse_config(SCRIPTS["context_parallel"].Config, None, config)
        )
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert f"--model never calls hooks.{hook}, which this replaces" in err


def test_a_tie_is_found_and_tie_embeddings_is_the_gpt_s(capsys):
    """A head that reads the embedding's table is tied, found in the model's code (the part after
    its blocks reads a parameter the part before reads): stored once, in the embedding's piece;
    --tie-embeddings ties the GPT's head, and a model of yours ties its own."""
    config = common.Config(**{**SMALL, "model": "tests.tied_llama"})
    params = jax.eval_shape(
        lambda: common.init_params(common.make_model(config), jax.random.key(0))
    )
    assert common.make_model(config).tied == ("token/embedding",) and set(params["head"]) == {
        "norm"
    }
    assert "ties its head itself" in refused("tests.llama", capsys, "--tie-embeddings")


def test_a_tied_head_costs_its_matmul():
    """FLOPs per token of a tied head: its table is the head's kernel, so 6 per element."""
    untied = hlo.flops_per_token(common.Config(), common.model_shapes(common.Config()).params)
    config = common.Config(tie_embeddings=True)
    tied = hlo.flops_per_token(config, common.model_shapes(config).params)
    assert tied == untied  # the same matmuls, one table fewer to store
    assert (
        sum(x.size for x in jax.tree.leaves(common.model_shapes(config).params))
        == sum(x.size for x in jax.tree.leaves(common.model_shapes(common.Config()).params))
        - 128 * 256
    )


@pytest.mark.parametrize(
    "model, message",
    [
        (
            "no_such_model",
            "--model no_such_model cannot be imported (ModuleNotFoundError",
        ),
        ("missing.py", "--model missing.py cannot be imported (FileNotFoundError"),
    ],
)
def test_an_unknown_model_is_one_line(model, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        SCRIPTS["shardmap_dp"].main(
            common.parse_config(SCRIPTS["shardmap_dp"].Config, None, [*TINY, "--model", model])
        )
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


# (files in the folder, --model, what the one-line error says): a model that fails to load
BROKEN_FILES = [
    (
        {"syn.py": "import common\nclass Embed(common.Piece:\n    pass\n"},
        "syn.py",
        "(line 2: SyntaxError: invalid syntax",
    ),
    (
        {"boom.py": "import common\n\nraise RuntimeError('no GPU here')\n"},
        "boom.py",
        "--model boom.py cannot be imported (RuntimeError: no GPU here)",
    ),
    # A module that imports a missing one: the model is found, its import is what fails
    (
        {"netx.py": "import net\n"},
        "netx",
        "--model netx cannot be imported (ModuleNotFoundError: No module named 'net')",
    ),
    ({"mdir/model.py": ""}, "./mdir", "--model ./mdir is a folder, e.g. --model ./mdir/model.py"),
    ({}, "my-model", "--model my-model cannot be imported (ModuleNotFoundError"),
]


@pytest.mark.parametrize(
    "files, model, message", BROKEN_FILES, ids=[model for _, model, _ in BROKEN_FILES]
)
def test_a_model_that_fails_to_load_is_one_line(
    files, model, message, tmp_path, monkeypatch, capsys
):
    """What failed, in one line, exit 2, before anything is compiled (before: a 22- to 33-line
    traceback and exit 1, a TypeError for a folder); tools/check.py also names the file's
    line."""
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SystemExit) as exit_info:
        SCRIPTS["shardmap_dp"].main(
            common.parse_config(SCRIPTS["shardmap_dp"].Config, None, [*TINY, "--model", model])
        )
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err, err


def test_logical_rules_refuse_an_axis_name_they_do_not_know(tmp_path, capsys):
    """A parameter axis whose logical name no rule maps, and UNSPLIT does not name, is not
    replicated unseen: exit 2, naming every such axis, a parameter of each and the two ways
    out."""
    kv = broken(('("embed", "kv_heads")', '("embed", "kv")'))
    (tmp_path / "kv.py").write_text(kv.replace('("mlp", "embed")', '("ff", "embed")'))
    module = SCRIPTS["logical_pjit"]
    with pytest.raises(SystemExit) as exit_info:
        module.main(
            common.parse_config(
                module.Config, None, [*TINY, "--model", str(tmp_path / "kv.py"), "--rules", "tp"]
            )
        )
    err = capsys.readouterr().err
    # Both names in one line (before: one per run)
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "tp has no rule for the axes 'ff' (of block_0/down/kernel (80, 32))" in err, err
    assert "'kv' (of block_0/kv/kernel (32, 32))" in err, err
    assert "add a rule for each to RULES" in err and "UNSPLIT to keep them whole" in err, err


# ----------------------------------------------------------------------------------------------
# Your own data: a local text file
# ----------------------------------------------------------------------------------------------


def test_a_text_file_is_read_as_bytes_its_last_tenth_held_out(tmp_path):
    text = bytes(range(256)) * 40  # 10,240 bytes: train on the first 9,216, hold out the rest
    (tmp_path / "input.txt").write_bytes(text)
    config = common.Config(dataset=str(tmp_path / "input.txt"), seq_len=16)
    data = common.load_dataset(config)
    train, held_out = data.batch(3, 0, 8), data.batch(3, 0, 8, "eval")
    assert train.shape == (8, 17) and train.dtype == np.int32
    for row in train:  # every row a window of the file, in its first 90%
        start = text.index(bytes(row.astype(np.uint8)))
        assert start + 17 <= 9216
    for row in held_out:
        assert bytes(row.astype(np.uint8)) in text[9216:]
    # The same rows on any process
    assert (common.TextFile(config).batch(3, 2, 5) == train[2:5]).all()
    assert not (data.batch(4, 0, 8) == train).all()


def test_a_split_of_seq_len_plus_one_bytes_is_one_window_and_one_less_is_refused():
    """A row is --seq-len + 1 bytes: a split of exactly that many is its one window."""
    config = common.TrainingConfig(seq_len=16, dataset="input.txt")
    data = common.TextFile(config, {"train": bytes(range(40)), "eval": bytes(range(17))})
    assert (data.batch(0, 0, 2, "eval") == np.arange(17)).all()
    with pytest.raises(common.ConfigError, match="held-out split has 16 bytes"):
        common.TextFile(config, {"train": bytes(range(40)), "eval": bytes(range(16))})


def test_a_text_file_trains(tmp_path):
    shutil.copy(ROOT / "README.md", tmp_path / "input.txt")
    done = run_script("shardmap_dp", tmp_path, "--dataset", "input.txt", *TINY, "--eval-every", "2")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "input.txt as bytes" in done.stdout


@pytest.mark.parametrize(
    "content, message",
    [
        (b"too short\n" * 10, "input.txt is too short: its held-out split has 10 bytes"),
        (None, "input.txt is neither 'synthetic', a file nor a loader"),
    ],
)
def test_a_text_file_too_short_or_absent_is_one_line(
    content, message, tmp_path, monkeypatch, capsys
):
    if content is not None:
        (tmp_path / "input.txt").write_bytes(content)
    monkeypatch.chdir(tmp_path)
    module = SCRIPTS["shardmap_dp"]
    with pytest.raises(SystemExit) as exit_info:
        module.main(common.parse_config(module.Config, None, [*TINY, "--dataset", "input.txt"]))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1 and message in err, err


def test_the_flop_count_needs_no_parameter_names():
    """FLOPs per token (tools/hlo.py's) for a model with other names: 6 per parameter but
    nn.Embed's tables, plus the attention term."""
    result = run_uncached("shardmap_dp", model="tests.llama", steps=1, eval_every=0)
    n, vocab, d = result.summary["param_count"], SMALL.get("vocab_size", 256), SMALL["d_model"]
    expected = 6 * (n - vocab * d) + 12 * SMALL["layers"] * SMALL["seq_len"] * d
    assert hlo.costs(result.config, result.compiled)["flops_per_token"] == expected


# The same model with no axis names: the scripts that do not lay parameters out by name train it;
# the ones that do (tensor parallelism's table, logical rules, explicit presets) say so in a line.
UNNAMED = ["shardmap_dp", "fsdp", "pipeline_1f1b", "context_parallel", "pmap_dp", "hsdp"]


def unnamed_model(folder):
    """tests/docs_model.py with every nnx.with_partitioning taken out: its initializers bare."""
    text = (ROOT / "tests" / "docs_model.py").read_text()
    bare = re.sub(
        r"nnx\.with_partitioning\((nnx\.initializers\.\w+\([^)]*\)), (?:\w+|\([^)]*\))\)",
        r"\1",
        text,
    )
    assert "with_partitioning" not in bare and bare.count("nnx.initializers.") == 3
    (folder / "unnamed.py").write_text(bare)
    return {"model": str(folder / "unnamed.py"), "kv_heads": 2}


@pytest.mark.parametrize("name", matrix(UNNAMED, ["fsdp"]))
def test_a_model_without_axis_names_trains_where_no_layout_reads_them(name, tmp_path):
    flags = unnamed_model(tmp_path)
    compare(name, run_uncached(name, **flags), reference(**flags, **model_flags(name)), flags)


@pytest.mark.parametrize("name", ["pjit_tp", "logical_fsdp_tp", "explicit_fsdp_tp"])
def test_a_layout_by_name_says_a_model_names_no_axes(name, tmp_path, capsys):
    module, strategy_flags = STRATEGIES[name]
    config = module.Config(**{**SMALL, **strategy_flags, **unnamed_model(tmp_path)})
    with pytest.raises(SystemExit) as exit_info:
        module.main(config)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1, err
    assert "nnx.with_partitioning" in err[0], err


DOCS_GPT = {"model": "tests.minigpt"}


@pytest.mark.parametrize(
    "name", matrix([n for n in ANY_MODEL if n != "explicit_tp_sp"], ["explicit_fsdp_tp"])
)
def test_the_flax_docs_gpt_matches(name, tmp_path):
    """tests/minigpt.py through every script and preset, as its own parameters' annotations lay
    it out where the script lays out by name: every step, from the run's own state (a checkpoint
    a step), what one device's step from that state computes. Not whole trajectories: its ReLUs
    part them (a unit of block 3 flipped at step 8 of pipeline_interleaved, every step before
    within 2e-6, the gradient norm 1.2e-4 apart after it)."""
    flags = {**DOCS_GPT, "steps": 10}  # the warmup and the decay, each step checked on its own
    saving = {"checkpoint_dir": str(tmp_path), "checkpoint_every": 1, "keep": flags["steps"]}
    result = run_uncached(name, **flags, **saving)
    record_flags(STRATEGIES[name][0], result.config)
    config = common.Config(**{**SMALL, **EVAL, **flags, **model_flags(name)})
    state, train_step = one_device(config)
    data, saved = common.load_dataset(config), ocp.training.Checkpointer(str(tmp_path))
    like = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )
    worst = {"loss": 0.0, "gradient norm": 0.0, "parameters": 0.0}
    kept = jax.tree.map(lambda p: jnp.ones(p.shape, bool), state.params)  # as compare()'s
    for step in range(config.steps):
        state = saved.load(step, like) if step else state  # the run's initial state is ours
        after, metrics, kept = train_step(state, data.batch(step, 0, config.batch_size), kept)
        mine = saved.load(step + 1, like).params
        loss = float(metrics["loss_sum"]) / float(metrics["tokens"])
        leaves = zip(*map(jax.tree.leaves, (mine, after.params, kept)), strict=True)
        leaves = [(a, b, k) for a, b, k in leaves if k.any()]  # less the key biases, as compare()
        noise = [jax.tree_util.keystr(p) for p, k in jax.tree.leaves_with_path(kept) if not k.any()]
        assert all(re.search(r"\['key'\]\['bias'\]$", path) for path in noise), noise
        measured = {
            "loss": relative([result.losses[step]], [loss]),
            "gradient norm": relative([result.grad_norms[step]], [float(metrics["grad_norm"])]),
            "parameters": max(
                np.linalg.norm((a - b)[k]) / (np.linalg.norm(b[k]) or 1.0)  # 0: absolute
                for a, b, k in leaves
            ),
        }
        worst = {key: max(worst[key], value) for key, value in measured.items()}
    print(
        f"\n{name}, tests/minigpt.py step by step: "
        + ", ".join(f"{k} {v:.1e}" for k, v in worst.items())
    )
    assert max(worst.values()) <= RTOL
    check_real(name, flags, result)
