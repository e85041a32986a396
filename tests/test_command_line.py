"""The command line, from a folder holding only the script and common.py: --help, bad input
(one line, exit 2, nothing compiled), and what a run does from start to end: the same flags
give the same losses, a non-finite loss stops it, and the loop runs the program the report
describes."""

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import time
import typing

import jax
import numpy as np
import pytest

import common
from tests.harness import (
    DEFAULTS,
    PIPELINED,
    ROOT,
    RTOL,
    SCRIPTS,
    SMALL,
    TINY,
    copy_alone,
    matrix,
    record_flags,
    run,
    run_script,
    run_uncached,
)
from test_equivalence import reference

# Every XLA compilation, and every lowering to XLA, in this process
COMPILATIONS, LOWERINGS = ([], [])
jax.monitoring.register_event_duration_secs_listener(
    lambda event, seconds, **_: (
        COMPILATIONS.append(event) if event.endswith("backend_compile_duration") else None
    )
)
# A program found in the persistent compilation cache is not compiled, but it is lowered again.
jax.monitoring.register_event_duration_secs_listener(
    lambda event, seconds, **_: (
        LOWERINGS.append(event) if event.endswith("jaxpr_to_mlir_module_duration") else None
    )
)
MESH_SCRIPTS = ("pjit_tp", "logical_pjit", "explicit_sharding")
RULED = ("logical_pjit", "explicit_sharding")  # a layout as rules on logical names (--rules)
ALL_MESH_SCRIPTS = (
    "fsdp",
    "pjit_tp",
    "logical_pjit",
    "pipeline",
    "context_parallel",
    "expert_parallel",
    "explicit_sharding",
)


# (flags, the scripts they apply to, what the one-line error must say). Every message names the
# flag and gives a valid example ("e.g."), except argparse's own for unknown flags and values.
def tiny(script):
    """TINY, and for pipeline.py two stages (PIPELINED)."""
    return [*TINY, *PIPELINED * (script == "pipeline")]


BAD_INPUTS = [
    (["--batch-size", "9"], SCRIPTS, "--batch-size must be divisible by"),
    (
        ["--batch-size", "16", "--microbatches", "4"],
        ("shardmap_dp", "fsdp"),
        "8 batch shards x 4 micro-batches",
    ),
    (["--mesh", "data=3,model=2"], MESH_SCRIPTS, "--mesh data=3,model=2 has 6 devices, not 8"),
    (
        ["--mesh", "data=2,tensor=4"],
        MESH_SCRIPTS,
        "--mesh data=2,tensor=4 may name only the axes data and model",
    ),
    (["--mesh", "data=4,data=2"], ALL_MESH_SCRIPTS, "--mesh data=4,data=2 names an axis twice"),
    (["--mesh", "data=3"], ("fsdp",), "--mesh data=3 has 3 devices, not 8"),
    (["--mesh", "data"], ("fsdp",), "--mesh data is not axis=size pairs"),
    (["--mesh", ""], ("fsdp",), "--mesh  is not axis=size pairs"),
    (["--mesh", "data=-8"], ("fsdp",), "--mesh data=-8 has an axis of size < 1"),
    (["--mesh", "replica=3,data=4"], ("fsdp",), "--mesh replica=3,data=4 has 12 devices, not 8"),
    (["--mesh", "eight"], MESH_SCRIPTS, "--mesh eight is not axis=size pairs"),
    (
        ["--heads", "6", "--d-model", "96", "--mesh", "data=2,model=4"],
        ("pjit_tp",),
        "model=4 must divide the 6 key-value heads",
    ),
    (
        ["--kv-heads", "1", "--mesh", "data=4,model=2"],
        ("pjit_tp",),
        "model=2 must divide the 1 key-value heads (each device holds whole ones)",
    ),
    (
        ["--kv-heads", "2", "--mesh", "data=2,model=4"],
        RULED,
        "which does not divide the 2 key-value heads; e.g. --kv-heads 4",
    ),
    (
        ["--heads", "6", "--d-model", "96", "--mesh", "data=2,model=4"],
        RULED,
        "splits 'heads' 4 ways",
    ),
    (
        ["--d-model", "36", "--rules", "fsdp"],
        RULED,
        "splits 'embed' 8 ways under --rules fsdp",
    ),
    (["--d-model", "100", "--heads", "8"], SCRIPTS, "--heads must divide --d-model 100"),
    (["--kv-heads", "3"], SCRIPTS, "--kv-heads must divide --heads 4, e.g. --kv-heads 2"),
    (
        ["--mlp-dim", "98", "--mesh", "data=2,model=4"],
        ("pjit_tp",),
        "model=4 does not divide the axis of 98 of block_0/mlp/fc1/bias, e.g. --mesh "
        "data=4,model=2 (or P() in its entry: whole)",
    ),
    (
        ["--mlp-dim", "98", "--mesh", "data=2,model=4"],
        RULED,
        "which does not divide its size 98 in block_0/mlp/fc1/bias; give it a size 4 divides "
        "(100) or a mesh that does, e.g. --mesh data=4,model=2; kept whole (its axis in UNSPLIT), "
        "every device holds all 392 bytes of it",
    ),
    (
        ["--mesh", "data=2,stage=4", "--layers", "3", "--microbatches", "4"],
        ("pipeline",),
        "--layers 3 must split evenly over stage=4",
    ),
    (
        ["--mesh", "data=2,stage=4", "--layers", "4", "--microbatches", "2", "--batch-size", "16"],
        ("pipeline",),
        "--microbatches must be at least the 4 stages for --schedule 1f1b",
    ),
    (
        [
            "--mesh",
            "data=2,stage=4",
            "--layers",
            "4",
            "--microbatches",
            "2",
            "--batch-size",
            "16",
            "--schedule",
            "zero-bubble",
        ],
        ("pipeline",),
        "--microbatches must be at least the 4 stages for --schedule zero-bubble",
    ),
    (
        ["--mesh", "data=2,stage=4", "--layers", "4", "--batch-size", "20", "--microbatches", "8"],
        ("pipeline",),
        "--batch-size 20 must be divisible by 2 batch shards x 8 micro-batches, e.g. "
        "--microbatches 5 (or --batch-size 16)",
    ),
    (
        ["--d-model", "96", "--heads", "6", "--kv-heads", "3", "--mesh", "data=2,model=4"],
        RULED,
        "e.g. --heads 4 --kv-heads 4",
    ),
    (["--schedule", "zigzag"], ("pipeline",), "argument --schedule: invalid choice: 'zigzag'"),
    (
        ["--schedule", "interleaved", "--virtual-stages", "1", "--layers", "4"],
        ("pipeline",),
        "--virtual-stages must be at least 2",
    ),
    # The automatic mesh is worked out during the shared checks, even with --mesh given: it
    # must survive what is refused next (before: ZeroDivisionError, max() of an empty sequence)
    (
        ["--schedule", "interleaved", "--virtual-stages", "0", "--mesh", "data=4,stage=2"]
        + ["--layers", "4", "--microbatches", "2"],
        ("pipeline",),
        "--virtual-stages must be at least 2",
    ),
    (
        ["--schedule", "interleaved", "--layers", "3"],
        ("pipeline",),
        "--layers 3 must split evenly over stage=2 x 2 groups, e.g. --layers 4",
    ),
    (
        ["--schedule", "interleaved", "--layers", "2"],
        ("pipeline",),
        "--mesh auto gives stage=1 under --schedule interleaved: nothing is pipelined; e.g. --mesh "
        "data=4,stage=2 --layers 4",
    ),
    (
        ["--virtual-stages", "3", "--layers", "6"],
        ("pipeline",),
        "--virtual-stages is for --schedule interleaved only",
    ),
    (
        ["--schedule", "interleaved", "--mesh", "data=2,stage=4", "--layers", "4"]
        + ["--microbatches", "4"],
        ("pipeline",),
        "--layers 4 must split evenly over stage=4 x 2 groups, e.g. --layers 8",
    ),
    (
        [
            "--schedule",
            "interleaved",
            "--mesh",
            "data=2,stage=4",
            "--layers",
            "8",
            "--microbatches",
            "6",
            "--batch-size",
            "24",
        ],
        ("pipeline",),
        "--microbatches must be a multiple of the 4 stages",
    ),
    (
        ["--mesh", "data=2,context=4", "--seq-len", "12"],
        ("context_parallel",),
        "--seq-len must split into 2 x context = 8 equal pieces",
    ),
    (["--experts", "-1"], ("fsdp",), "--experts must be at least 0"),
    (["--experts", "8", "--top-k", "9"], ("fsdp",), "--top-k must be from 1 to --experts 8"),
    (["--experts", "2", "--top-k", "0"], ("pjit_tp",), "--top-k must be from 1 to --experts 2"),
    (
        ["--experts", "8", "--capacity-factor", "-1"],
        ("shardmap_dp",),
        "--capacity-factor must be at least 0",
    ),
    (
        ["--experts", "8", "--shared-experts", "-1"],
        ("expert_parallel",),
        "--shared-experts must be at least 0, e.g. --shared-experts 0",
    ),
    (["--shared-experts", "1"], ("fsdp",), "--shared-experts needs --experts"),
    (
        ["--experts", "8", "--router-bias-rate", "nan"],
        ("expert_parallel",),
        "--router-bias-rate must be a finite float32",
    ),
    (
        ["--experts", "8", "--router-bias-rate", "-0.001"],
        ("fsdp",),
        "--router-bias-rate must be at least 0",
    ),
    (["--router-bias-rate", "0.001"], ("pjit_tp",), "--router-bias-rate needs --experts"),
    (["--experts", "4", "--top-k", "5"], ("expert_parallel",), "--top-k must be from 1 to"),
    (
        ["--experts", "0"],
        ("expert_parallel",),
        "--experts must be positive: this script splits experts",
    ),
    (
        ["--experts", "6", "--mesh", "data=2,expert=4"],
        ("expert_parallel",),
        "expert=4 must divide --experts 6",
    ),
    (
        ["--model", "tests/llama.py"],
        ("expert_parallel",),
        "--experts 8: the model's parameters are the same without it",
    ),
    # A flag the model does not honour, refused where the scripts see it (before: ignored)
    (
        ["--model", "tests/minigpt.py", "--dtype", "bfloat16"],
        ("fsdp",),
        "--dtype bfloat16: the model attends with float32 queries",
    ),
    (
        ["--model", "tests/minigpt.py", "--kv-heads", "2"],
        ("shardmap_dp",),
        "--kv-heads 2: the model attends with 4 key-value heads",
    ),
    (
        ["--model", "tests/minigpt.py", "--experts", "4"],
        ("fsdp",),
        "--experts 4: the model's parameters are the same without it",
    ),
    (
        ["--model", "tests/minigpt.py", "--sequence-parallel"],
        ("pjit_tp",),
        "--sequence-parallel splits what the model's activations name 'length'",
    ),
    (
        ["--model", "tests.docs_model", "--kv-heads", "2", "--rules", "tp_sp"],
        ("logical_pjit",),
        "--rules tp_sp splits what the model's activations name 'length'",
    ),
    (
        ["--model", "tests/minigpt.py", "--rules", "tp_sp"],
        ("explicit_sharding",),
        "--rules tp_sp splits the sequence over 'model' between the matmuls, where the model",
    ),
    (
        ["--model", "tests/minigpt_as_written.py"],
        ("shardmap_dp",),
        "defines no Model(config, hooks, rngs=rngs), e.g. --model gpt",
    ),
    (["--steps", "0"], SCRIPTS, "--steps must be at least 1"),
    (["--layers", "0"], SCRIPTS, "--layers must be at least 1"),
    (["--seq-len", "-1"], SCRIPTS, "--seq-len must be at least 1"),
    (["--lr", "0"], SCRIPTS, "--lr must be positive"),
    (["--lr", "inf"], ("fsdp",), "--lr must be a finite float32"),
    (["--lr", "1e39"], ("fsdp",), "--lr must be a finite float32"),
    (["--weight-decay", "inf"], ("fsdp",), "--weight-decay must be a finite float32"),
    (["--clip-norm", "nan"], ("fsdp",), "--clip-norm must be a finite float32"),
    (["--vocab-size", "100000000"], ("fsdp",), "--vocab-size must be at most 1,048,576"),
    (["--metrics-file", "/dev/null"], ("fsdp",), "--metrics-file /dev/null is not a file"),
    (["--cpu-devices", "0"], SCRIPTS, "--cpu-devices must be at least 1"),
    (["--microbatches", "0"], ("pmap_dp",), "--microbatches must be at least 1"),
    (["--log-every", "0"], ("pmap_dp",), "--log-every must be at least 1"),
    (["--dropout", "1"], ("pmap_dp",), "--dropout must be below 1"),
    (["--warmup-steps", "-1"], ("pmap_dp",), "--warmup-steps must be at least 0"),
    (["--min-shard-size", "-1"], ("fsdp",), "--min-shard-size must be zero or more"),
    (["--dtype", "float16"], SCRIPTS, "argument --dtype: invalid choice: 'float16'"),
    (["--rules", "zero3"], RULED, "argument --rules: invalid choice: 'zero3'"),
    (["--dataset", "no_such_dataset"], ("shardmap_dp",), "--dataset no_such_dataset is neither"),
    (
        ["--metrics-file", "FILE/metrics.jsonl"],
        SCRIPTS,
        "--metrics-file FILE/metrics.jsonl cannot be written",
    ),
    (["--metrics-file", "FOLDER"], ("fsdp",), "--metrics-file FOLDER is not a file"),
    (
        ["--metrics-file", "/proc/no/such/dir/m.jsonl"],
        ("fsdp",),
        "--metrics-file /proc/no/such/dir/m.jsonl cannot be",
    ),
    (["--checkpoint-dir", "FILE/ckpt"], ("fsdp",), "--checkpoint-dir FILE/ckpt cannot be written"),
    (["--stepz", "3"], SCRIPTS, "unrecognized arguments: --stepz 3"),
    (["--steps", "three"], ("pmap_dp",), "argument --steps: invalid int value: 'three'"),
    (
        ["--num-processes", "2"],
        ("pmap_dp",),
        "--num-processes and --process-id need --coordinator-address",
    ),
    (
        ["--coordinator-address", "localhost", "--num-processes", "2"],
        ("pmap_dp",),
        "--coordinator-address is not host:port",
    ),
    (
        ["--coordinator-address", "localhost:1", "--num-processes", "2", "--process-id", "2"],
        ("pmap_dp",),
        "--process-id must be < --num-processes",
    ),
    (
        ["--heartbeat-timeout", "0", "--coordinator-address", "localhost:1"],
        ("pmap_dp",),
        "--heartbeat-timeout must",
    ),
    # A CPU; the ring's own attention; a splash block of 128 tokens
    (["--attention", "cudnn"], ("fsdp", "context_parallel"), "--attention cudnn"),
    (["--attention", "splash"], ("fsdp",), "--attention splash takes blocks of 128 tokens"),
    (
        ["--attention", "splash", "--seq-len", "128"],
        ("context_parallel",),
        "--attention splash: --attention-split ring computes attention itself",
    ),
    (
        ["--attention", "cudnn", "--attention-split", "all-gather"],
        ("context_parallel",),
        "--attention cudnn: --attention-split all-gather computes attention itself",
    ),
    (
        ["--attention-split", "ulysses", "--heads", "2", "--attention", "xla"],
        ("context_parallel",),
        "--heads 2 under --attention-split ulysses",
    ),
    (
        ["--sequence-parallel", "--seq-len", "18"],
        ("pjit_tp",),
        "--seq-len 18 under --sequence-parallel",
    ),
    (
        ["--rules", "tp_sp", "--seq-len", "18"],
        ("logical_pjit", "explicit_sharding"),
        "--seq-len 18 under --rules tp_sp",
    ),
    (
        ["--heads", "3", "--d-model", "96"],  # before: data=8,model=1 in silence
        ("pjit_tp", *RULED),
        "auto puts no device on 'model' (no tensor parallelism): 2 does not divide --heads 3",
    ),
    (["--attention", "flash"], ("fsdp",), "argument --attention: invalid choice: 'flash'"),
    (
        ["--distributed", "--coordinator-address", "localhost:1", "--num-processes", "2"]
        + ["--process-id", "1", "--cpu-devices", "4", "--heartbeat-timeout", "30"],
        ("shardmap_dp",),
        "--distributed finds the cluster itself: give no --coordinator-address",
    ),
    # Many flags, refused by the last check that reads them, with an example that passes every
    # check: the pairs a checking function reads, set together (dev/flags.py)
    (
        ["--dataset", "TEXT.txt", "--seed", "3", "--lr", "1e-3", "--heads", "8", "--kv-heads"]
        + ["2", "--attention", "xla", "--model", "tests/llama.py", "--tie-embeddings"],
        ("shardmap_dp",),
        "--tie-embeddings is the GPT's: a model of yours ties its head itself, e.g. --model gpt",
    ),
    (
        ["--mesh", "data=4,stage=2", "--batch-size", "16", "--microbatches", "4", "--layers"]
        + ["8", "--schedule", "interleaved", "--virtual-stages", "4", "--scan-layers"],
        ("pipeline",),
        "--scan-layers is how the pipeline holds its blocks already, e.g. --no-scan-layers",
    ),
    (
        ["--scan-layers", "--remat"],
        ("pipeline",),
        "--scan-layers is how the pipeline holds its blocks already, e.g. --no-scan-layers",
    ),
    (
        ["--model", "tests/llama.py", "--experts", "4", "--top-k", "1", "--vocab-size", "512"],
        ("shardmap_dp",),
        "--experts 4: the model's parameters are the same without it",
    ),
    (["--top-k", "1"], ("fsdp",), "--top-k needs --experts, e.g. --experts 8"),  # before: ignored
    (["--dataset", "TEXT.txt", "--experts", "4", "--top-k", "5"], ("shardmap_dp",), "--top-k must"),
    (
        ["--model", "tests/llama.py", "--experts", "4"],
        ("expert_parallel",),
        "--experts 4: the model's parameters are the same without it",
    ),
    *[
        (
            ["--model", "tests/llama.py", "--heads", "8", "--kv-heads", "8", "--mesh"]
            + ["data=4,model=2", *more, "--tie-embeddings"],
            (script,),
            "--tie-embeddings is the GPT's",
        )
        for script, more in [
            ("pjit_tp", ["--sequence-parallel"]),
            ("logical_pjit", ["--rules", "tp"]),
            ("explicit_sharding", ["--rules", "tp"]),
        ]
    ],
]


@pytest.mark.parametrize(
    "script, flags, message",
    [(script, flags, message) for flags, scripts, message in BAD_INPUTS for script in scripts],
    ids=[f"{script} {' '.join(flags)}" for flags, scripts, _ in BAD_INPUTS for script in scripts],
)
def test_bad_input_exits_2_with_one_line(script, flags, message, tmp_path, capsys, monkeypatch):
    """Each bad flag through the script's own command line and main(), in this process: exit 2,
    one line on stderr naming the flag, nothing on stdout, nothing compiled; its example, given
    as well, passes every check."""
    (tmp_path / "FILE").write_text("")  # a file, under which nothing can be created
    (tmp_path / "FOLDER").mkdir()
    (tmp_path / "TEXT.txt").write_text("The quick brown fox jumps over the lazy dog.\n" * 300)
    flags = [str(tmp_path / f) if f.startswith(("FILE", "FOLDER", "TEXT")) else f for f in flags]
    message = message.replace("FILE", str(tmp_path / "FILE")).replace(
        "FOLDER", str(tmp_path / "FOLDER")
    )
    module = SCRIPTS[script]
    compiled_before = len(COMPILATIONS)
    config = None
    with pytest.raises(SystemExit) as exit_info:
        config = common.parse_config(module.Config, module.__doc__, [*tiny(script), *flags])
        module.main(config)
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err, err
    if config:  # a refusal checks the pairs of flags it was given (dev/flags.py)
        record_flags(module, config, refused=field(re.search(r"error: (--[\w-]+)", err)[1]))
    if "invalid" not in message and "unrecognized" not in message:
        assert "e.g." in err, err
        suggested = re.search(r"e\.g\. (--[\w-]+)", err).group(1)  # the example is a real flag
        assert field(suggested) in module.Config.__dataclass_fields__, err
        # and its flags, given too, pass every check (a suggestion that fails the next one sends
        # the user round in circles); a cluster's start processes: tests/test_multi_process.py
        given = example(module, err)
        fixed = common.parse_config(module.Config, None, [*tiny(script), *flags, *given])
        if given and fixed.num_processes == 1 and not fixed.coordinator_address:
            monkeypatch.chdir(tmp_path)
            common.setup(fixed)
            assert capsys.readouterr().err == "", given
            record_flags(module, fixed, checked=True)
    assert len(COMPILATIONS) == compiled_before


def field(flag: str) -> str:
    """The Config field a flag sets: --kv-heads kv_heads, --no-remat remat."""
    name = flag.removeprefix("--").replace("-", "_")
    return name.removeprefix("no_") if name.startswith("no_") else name


def example(module, err) -> list:
    """The flags an error's example gives ("e.g. --heads 4 --kv-heads 4"), as a command line."""
    words, argv = err.split("e.g. ", 1)[1].split(), []
    hints = typing.get_type_hints(module.Config)
    while words and words[0].startswith("--"):
        name = words.pop(0).rstrip(",;")
        argv.append(name)
        if hints[field(name)] is not bool and words:
            argv.append(words.pop(0).rstrip(",;)"))
    return argv


def test_an_axis_left_out_of_the_mesh_has_size_1():
    """--mesh names the axes that are split; the others have size 1."""
    assert SCRIPTS["pipeline"].Config(mesh="stage=8", layers=8).mesh_axes() == {
        "data": 1,
        "stage": 8,
    }
    assert SCRIPTS["context_parallel"].Config(mesh="context=8").mesh_axes() == {
        "data": 1,
        "context": 8,
    }
    assert SCRIPTS["pjit_tp"].Config(mesh="model=4,data=2").mesh_axes() == {"data": 2, "model": 4}


# Each way of drawing dropout's random bits once: the compiler splitting one draw over the
# devices (pjit_tp.py; logical_pjit.py the same), a device's index folded in by hand
# (shardmap_dp.py; fsdp.py, context_parallel.py and expert_parallel.py the same), pmap_dp.py's
# and pipeline.py's own.
BITWISE = ["pjit_tp", "shardmap_dp", "pmap_dp", "pipeline_1f1b"]


@pytest.mark.parametrize("name", matrix(list(DEFAULTS.values()), BITWISE))
def test_same_flags_same_losses_bitwise(name):
    """Two runs with the same flags and seed, dropout on: identical losses, bit for bit."""
    first, second = run(name, dropout=0.1, steps=5), run_uncached(name, dropout=0.1, steps=5)
    assert (
        first.losses == second.losses
        and first.grad_norms == second.grad_norms
        and len(first.losses) == 5
    )


@pytest.mark.parametrize("script", SCRIPTS)
def test_bad_batch_size_exits_2_with_one_line(script, tmp_path):
    done = run_script(script, tmp_path, *tiny(script), "--batch-size", "9")  # no mesh splits 9
    assert done.returncode == 2
    assert done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and "--batch-size" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_help_lists_every_flag(tmp_path):
    done = run_script("logical_pjit", tmp_path, "--help")
    assert done.returncode == 0
    for field in SCRIPTS["logical_pjit"].Config.__dataclass_fields__:
        assert "--" + field.replace("_", "-") in done.stdout


def test_non_finite_loss_stops_and_is_never_saved(tmp_path):
    done = run_script(
        "fsdp",
        tmp_path,
        *TINY,
        "--steps",
        "50",
        "--lr",
        "1e6",
        "--checkpoint-dir",
        "ckpt",
        "--checkpoint-every",
        "1",
    )
    assert done.returncode == 1
    message = done.stderr.strip().splitlines()[-1]
    found = re.search(r"^stopped: the loss at step (\d+) is not finite; not saved", message)
    bad = int(found[1])
    assert re.search(rf"^step\s+{bad}/50 \| loss (nan|inf) ", done.stdout, re.M)  # its line, too
    saved = [int(n) for n in os.listdir(tmp_path / "ckpt") if n.isdigit()]
    assert saved and max(saved) < bad


def test_pmap_loop_runs_the_compiled_program():
    """pmap_dp.py's loop calls step_fn, not the AOT-compiled step the report describes; pmap
    runs the executable it compiled then, so the loop lowers and compiles nothing new."""
    logger_init, counts = common.Logger.__init__, []

    def counting_logger_init(*args, **kwargs):  # the Logger starts right before the loop
        logger_init(*args, **kwargs)
        counts.append((len(LOWERINGS), len(COMPILATIONS)))

    common.Logger.__init__ = counting_logger_init
    try:
        result = run_uncached("pmap_dp", steps=5, eval_every=0)
    finally:
        common.Logger.__init__ = logger_init
    assert len(result.losses) == 5 and counts == [(len(LOWERINGS), len(COMPILATIONS))]


@pytest.mark.parametrize(
    "flags",
    [["--batch-size", "1048576"], ["--d-model", "65536"], ["--seq-len", "1000000"]],
    ids=lambda f: " ".join(f),
)
def test_a_step_too_big_for_the_devices_exits_2(flags, capsys):
    """Compiled for shapes before anything is allocated, the step's memory is compared with the
    devices': one line saying what it needs, what there is and which flags reduce it, within
    seconds (before: minutes of silence building held-out batches, then out of memory)."""

    module = SCRIPTS["fsdp"]
    start = time.monotonic()
    with pytest.raises(SystemExit) as exit_info:
        module.main(common.parse_config(module.Config, module.__doc__, [*TINY, *flags]))
    seconds = time.monotonic() - start
    out, err = capsys.readouterr()
    print(f"\n{' '.join(flags)}: {seconds:.1f}s: {err.strip()[:160]}")
    assert exit_info.value.code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert re.search(
        r"the train step needs [\d,.]+ GB per device, a cpu device has [\d,.]+ GB", err
    )
    assert "--batch-size" in err and "--microbatches" in err and "--remat" in err
    assert seconds < 120


def test_no_held_out_batch_is_built_without_evaluation():
    config = common.Config(**{**SMALL, "eval_every": 0})
    assert common.eval_batches(common.load_dataset(config), config) == []


def test_emulated_devices_may_be_late_to_a_collective(tmp_path):
    """XLA's CPU collectives abort a run when one emulated device reaches a collective 40 s after
    the others (a busy or sleeping machine; README: Running on CPU, GPU and TPU). The scripts allow
    a day, keeping any value the user set in XLA_FLAGS."""
    (tmp_path / "show_flags.py").write_text(
        "import os, common\ncommon.setup(common.Config(steps=1, "
        "batch_size=8))\nprint(os.environ['XLA_FLAGS'])\n"
    )
    copy_alone("shardmap_dp", tmp_path)
    for user, expected in [
        ("", 86400),
        ("--xla_cpu_collective_call_terminate_timeout_seconds=5", 5),
    ]:
        env = {**os.environ, "XLA_FLAGS": user}
        done = subprocess.run(
            [sys.executable, "show_flags.py"], cwd=tmp_path, env=env, capture_output=True, text=True
        )
        flags = done.stdout.split()
        assert (
            done.returncode == 0
            and f"--xla_cpu_collective_call_terminate_timeout_seconds={expected}" in flags
        )
        assert len([f for f in flags if "terminate_timeout" in f]) == 1


def test_the_docs_profiling_recipe_writes_a_trace(tmp_path):
    """docs/operations.md's two lines, put in a copy's loop as it says, trace 3 steps."""
    recipe = (ROOT / "docs" / "operations.md").read_text().split("```python\n# profile\n")[1]
    recipe = recipe.split("```")[0]
    copy_alone("shardmap_dp", tmp_path)
    text, at = (
        (tmp_path / "shardmap_dp.py").read_text(),
        " " * 12 + "log.log(step, metrics, waited)\n",
    )
    assert text.count(at) == 1
    lines = "".join(" " * 12 + line + "\n" for line in recipe.splitlines())
    (tmp_path / "shardmap_dp.py").write_text(text.replace(at, lines + at))
    command = [sys.executable, "shardmap_dp.py", *TINY, "--steps", "6"]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    traces = list((tmp_path / "runs" / "profile").rglob("*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0


def test_devices_far_behind_the_host_do_not_deadlock():
    """dev/cpu_deadlock.py runs 300 programs with an all-gather over 4 emulated devices, none
    waited for. With XLA's own thread pool on this 2-core machine (4 threads: one per device) it
    hangs for good in its first all-gather; with the scripts' 2 x devices (common.py,
    start_devices) it finishes in under a second."""
    # As a user's shell: none set
    env = {key: value for key, value in os.environ.items() if key != "PJRT_NPROC"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "dev" / "cpu_deadlock.py"), "--devices", "4"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "done: 300 steps" in done.stdout, done.stderr[-2000:]
    assert f"PJRT_NPROC={max(os.cpu_count(), 8)}" in done.stdout


def test_the_log_and_the_summary_say_which_dtype_ran(tmp_path, capsys):
    """--dtype changes every number: the first line says it, and so does the summary; and
    which attention runs (on a CPU, XLA's: the fused kernels are a TPU's and a GPU's)."""
    module = SCRIPTS["shardmap_dp"]
    flags = [*TINY, "--dtype", "bfloat16", "--metrics-file", str(tmp_path / "m.jsonl")]
    result = module.main(common.parse_config(module.Config, None, flags))
    first = capsys.readouterr().out.splitlines()[0]
    auto = "xla attention (auto: splash needs a TPU, cudnn a GPU)"
    assert first.endswith(f"parameters, bfloat16 compute, {auto}"), first
    assert result.summary["dtype"] == "bfloat16"
    written = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[-1])
    assert written["summary"]["dtype"] == "bfloat16"


def test_a_switch_takes_no_metavar(monkeypatch):
    """Python 3.12 deprecates BooleanOptionalAction's metavar, type and choices; 3.14 refuses
    them, and every script would fail to start: parse_config passes none to a switch."""
    given, init = [], argparse.BooleanOptionalAction.__init__

    def record(self, *args, **kwargs):
        given.append(kwargs)
        init(self, *args, **kwargs)

    monkeypatch.setattr(argparse.BooleanOptionalAction, "__init__", record)
    common.parse_config(common.Config, argv=[])
    assert given and not any({"metavar", "type", "choices"} & k.keys() for k in given)


@pytest.mark.parametrize("every", [1, 3])
def test_the_logged_speed_is_the_wall_clocks(every, monkeypatch, tmp_path):
    """Each logged record's time a step, times the steps since the record before, is the wall
    time between the two (as the test's own clock sees it, within 1% and 5 ms: the printing of
    a line); its tokens a second the batch's tokens over that time; the summary's, the median
    step's. With --log-every above 1 a record stands for several steps. None of it changes a
    loss: the warm-up's are one device's."""
    written, write = [], common.Logger.print

    def clocked(self, line, record):
        written.append((time.perf_counter(), record))
        write(self, line, record)

    monkeypatch.setattr(common.Logger, "print", clocked)
    flags = dict(steps=3 * every, log_every=every, eval_every=0, metrics_file=tmp_path / "m.jsonl")
    result = run_uncached("shardmap_dp", **flags)
    record_flags(SCRIPTS["shardmap_dp"], result.config)
    warm = min(SMALL["warmup_steps"], len(result.losses))  # rates that do not hang on --steps
    pairs = zip(result.losses[:warm], reference().losses[:warm], strict=True)
    assert max(abs(a / b - 1) for a, b in pairs) < RTOL
    (*logged, (_, summary)), tokens = written, SMALL["batch_size"] * SMALL["seq_len"]
    assert [r["step"] for _, r in logged] == list(range(every, 3 * every + 1, every))
    for (before, _), (now, record) in itertools.pairwise(logged):
        took = record["step_seconds"] * every
        assert abs(took - (now - before)) <= 0.01 * took + 0.005, (took, now - before)
    for _, record in logged:
        assert record["tokens_per_sec"] == pytest.approx(tokens / record["step_seconds"])
    steps = [r["step_seconds"] for _, r in logged for _ in range(every)]
    assert summary["summary"]["step_seconds"] == pytest.approx(float(np.median(steps)))
    assert summary["summary"]["tokens_per_sec"] == pytest.approx(tokens / np.median(steps))
