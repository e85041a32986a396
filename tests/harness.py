"""What the tests share: the small configuration, cached runs of every strategy, and helpers
to run a script as a user does (alone in a folder, from the command line, as several
processes). Every test file imports from here, so each run is computed once per session."""

import contextlib
import dataclasses
import functools
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

import common
from tools import hlo
import context_parallel
import expert_parallel
import explicit_sharding
import fsdp
import logical_pjit
import pipeline
import pjit_tp
import pmap_dp
import shardmap_dp

ROOT = Path(__file__).resolve().parent.parent
DEVICES = 8  # conftest.py starts JAX with 8 emulated CPU devices
# The JAX that docs/ was measured with: requirements.txt's. The pages' figures of XLA's buffers
# are checked under it; another version's XLA sizes its temporaries otherwise.
PINNED_JAX = f"jax=={jax.__version__}\n" in (ROOT / "requirements.txt").read_text()
SMALL = dict(
    steps=20,
    batch_size=16,
    seq_len=32,
    layers=2,
    d_model=64,
    heads=4,
    dropout=0.0,
    lr=3e-3,
    warmup_steps=5,
    log_every=20,
    cpu_devices=DEVICES,
)
# The runs compared with one device evaluate once, after their 20 steps, on 2 held-out batches
EVAL = dict(eval_every=20, eval_batches=2)
RTOL = 1e-5  # per-step losses and final parameters within 1e-5 of one device, relative
# A still smaller run, for the command line: seconds, not tens of seconds.
TINY = [
    "--steps",
    "3",
    "--batch-size",
    "8",
    "--seq-len",
    "16",
    "--layers",
    "1",
    "--d-model",
    "32",
    "--log-every",
    "1",
    "--microbatches",
    "1",
]

# pipeline.py's TINY: two stages of a layer, a micro-batch each (one stage pipelines nothing)
PIPELINED = ["--layers", "2", "--microbatches", "2"]

SCRIPTS = {
    "pmap_dp": pmap_dp,
    "shardmap_dp": shardmap_dp,
    "fsdp": fsdp,
    "pjit_tp": pjit_tp,
    "logical_pjit": logical_pjit,
    "pipeline": pipeline,
    "context_parallel": context_parallel,
    "expert_parallel": expert_parallel,
    "explicit_sharding": explicit_sharding,
}
# The mixture of experts the tests train: 8 routed experts, top-2, dropless, 1 shared expert,
# balanced by a bias (moving 0.001 a step) and the load-balancing loss.
MOE = {"experts": 8, "top_k": 2, "shared_experts": 1, "router_bias_rate": 0.001}
# A strategy is a script with its own flags: every script, each logical_pjit.py preset, HSDP
# and each pipeline schedule (on SMALL's 2 layers: 'auto' gives data=4,stage=2).
STRATEGIES = {
    name: (module, {})
    for name, module in SCRIPTS.items()
    if name not in ("logical_pjit", "pipeline", "expert_parallel", "explicit_sharding")
}
STRATEGIES["hsdp"] = (fsdp, {"mesh": "replica=2,data=4"})
STRATEGIES.update(
    {f"logical_{rules}": (logical_pjit, {"rules": rules}) for rules in logical_pjit.RULES}
)
STRATEGIES.update(
    {f"pipeline_{s}": (pipeline, {"schedule": s, "microbatches": 2}) for s in pipeline.SCHEDULES}
)
# Interleaved and zbv: 2 groups of layers per stage need 4 layers on 2 stages ('auto':
# data=4,stage=2).
STRATEGIES["pipeline_interleaved"][1]["layers"] = STRATEGIES["pipeline_zbv"][1]["layers"] = 4
# explicit_sharding.py's presets: the layouts of logical_pjit.py's, on Explicit axes.
STRATEGIES.update(
    {
        f"explicit_{rules}": (explicit_sharding, {"rules": rules})
        for rules in explicit_sharding.RULES
    }
)
# context_parallel.py's other two splits of attention (the ring is its default)
STRATEGIES.update(
    {
        f"context_{split.replace('-', '_')}": (context_parallel, {"attention_split": split})
        for split in ("all-gather", "ulysses")
    }
)
# Tensor parallelism with Megatron's sequence parallelism, by table, by rules and in the types
STRATEGIES["pjit_tp_sp"] = (pjit_tp, {"sequence_parallel": True})
# (logical_tp_sp and explicit_tp_sp come with their scripts' presets, above)
# expert_parallel.py trains a mixture of experts only: data=2,expert=4 ('auto') and data=1,expert=8.
STRATEGIES["expert_parallel"] = (expert_parallel, MOE)
STRATEGIES["expert_parallel_8"] = (expert_parallel, {**MOE, "mesh": "data=1,expert=8"})
# Each script with its default flags, as a strategy name: logical_pjit.py defaults to fsdp_tp.
DEFAULTS = {name: name for name in SCRIPTS} | {
    "logical_pjit": "logical_fsdp_tp",
    "pipeline": "pipeline_1f1b",
    "explicit_sharding": "explicit_fsdp_tp",
}


def matrix(values, default):
    """A test's parameters: those in `default` run in every `pytest`, the others only in the
    whole matrix (`pytest -m full`, see pyproject.toml). A value may be a tuple of several."""
    return [
        value
        if value in default
        else pytest.param(*value if isinstance(value, tuple) else [value], marks=FULL)
        for value in values
    ]


FULL = pytest.mark.full
# Each script once, with its default flags
EVERY_SCRIPT = list(DEFAULTS.values())


def model_flags(name) -> dict:
    """The flags of a strategy that change the model (a mixture of experts', the layers), for
    its reference."""
    return {key: value for key, value in STRATEGIES[name][1].items() if key in (*MOE, "layers")}


def run_uncached(name, **overrides):
    """Train a strategy on SMALL (with overrides) in this process; its common.Result, with the
    config it ran (`config`)."""
    module, strategy_flags = STRATEGIES[name]
    config = module.Config(**{**SMALL, **EVAL, **strategy_flags, **overrides})
    result = module.main(config)
    result.config = config
    return result


# ----------------------------------------------------------------------------------------------
# The flags of compared runs (tests/test_flags.py): every flag must be set away from its default
# in some run that is compared with something (one device, a definition written in a test, a
# formula), or the code behind it could be wrong in any way.
# ----------------------------------------------------------------------------------------------


def changed_flags(module, config) -> list:
    """The flags a config sets away from its script's defaults (module: the script, or common)."""
    defaults = {f.name: f.default for f in dataclasses.fields(module.Config)}
    return sorted(name for name, default in defaults.items() if getattr(config, name) != default)


def record_flags(module, config, argv=None, checked=False, refused=False):
    """Note that the running test compares a run of `module` with this config (or command line,
    `argv`), or only its checks (`checked`: passed, or `refused` naming a flag): one JSON line
    per run in $FLAGS_RECORD (conftest.py), read by dev/flags.py."""
    folder = os.environ.get("FLAGS_RECORD")
    if argv is not None:
        config = common.parse_config(module.Config, None, [str(a) for a in argv])
    if not folder:
        return
    test = os.environ["PYTEST_CURRENT_TEST"].rsplit(" (", 1)[0]
    record = {"test": test, "script": module.__name__, "flags": changed_flags(module, config)}
    record.update({"checked": True} if checked or refused else {})
    record.update({"refused": refused} if refused else {})
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(os.path.join(folder, f"{worker}.jsonl"), "a") as file:
        file.write(json.dumps(record) + "\n")


@functools.cache
def run(name, **overrides):
    """run_uncached, once per session for each strategy and overrides."""
    return run_uncached(name, **overrides)


def read_closely(result) -> dict:
    """A run's summary with tools/hlo.py's reading of its step: wire bytes, FLOPs."""
    return {**result.summary, **hlo.costs(result.config, result.compiled)}


# What a user adds to pjit_tp.py's PARAM_SPECS to train tests/llama.py (the other scripts need
# nothing): its parameters' names, in the Megatron layout.
LLAMA_SPECS = (
    (
        r"/(q|gate|up)/kernel",
        PartitionSpec(None, "model"),
    ),  # by output columns: whole heads, hidden units
    (r"/(o|down)/kernel", PartitionSpec("model", None)),  # by input rows: partial sums
    (
        r"/kv/kernel",
        PartitionSpec(),
    ),  # 2 key/value heads, fewer than model=4: kept whole, as Megatron does
    (r"norm/scale", PartitionSpec()),
)


# ----------------------------------------------------------------------------------------------
# Reading the compiled step: which collectives run, over which groups of devices
# ----------------------------------------------------------------------------------------------


def collectives(compiled):
    """{op: [replica groups of each instance]} for every collective in the compiled HLO."""
    found = {}
    for collective in hlo.hlo_collectives(compiled.as_text()):
        found.setdefault(collective["op"], []).append(replica_groups(collective["line"]))
    return found


def replica_groups(line):
    """The device groups of one collective, from any of the three forms XLA prints."""
    # Groups vary along named axes of a mesh, whose devices are in order or an iota's permutation.
    mesh = re.search(
        r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))? "
        r"\{([^}]*)\}",
        line,
    )
    if mesh:
        axes = re.findall(r"'(\w+)'=(\d+)", mesh.group(1))
        varying = [
            [name for name, _ in axes].index(a) for a in re.findall(r"'(\w+)'", mesh.group(4))
        ]
        ids = np.arange(DEVICES)
        if mesh.group(2):
            ids = ids.reshape([int(d) for d in mesh.group(2).split(",")])
            ids = (
                ids.transpose([int(p) for p in mesh.group(3).split(",")]) if mesh.group(3) else ids
            )
        ids = ids.reshape([int(size) for _, size in axes])
        kept = [i for i in range(ids.ndim) if i not in varying]
        ids = ids.transpose(kept + varying)
        return {tuple(g) for g in ids.reshape(-1, math.prod(ids.shape[len(kept) :])).tolist()}
    if explicit := re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", line):
        return {
            tuple(map(int, g.split(","))) for g in re.findall(r"\{([\d,]+)\}", explicit.group(1))
        }
    if iota := re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line):
        count, size, dims, perm = iota.groups()
        ids = np.arange(DEVICES).reshape([int(d) for d in dims.split(",")])
        ids = ids.transpose([int(p) for p in perm.split(",")]) if perm else ids
        return {tuple(g) for g in ids.reshape(int(count), int(size)).tolist()}
    assert "replica_groups" not in line, f"unknown replica group format: {line}"
    return None  # e.g. collective-permute, whose source_target_pairs are not groups


ALL = {tuple(range(DEVICES))}
# Mesh data=2,model=4
MODEL_GROUPS = {tuple(row) for row in np.arange(DEVICES).reshape(2, 4).tolist()}
DATA_GROUPS = {tuple(col) for col in np.arange(DEVICES).reshape(2, 4).T.tolist()}


def state_bytes(state):
    """(total, on device 0) bytes of the parameters and optimizer state."""
    leaves = jax.tree.leaves(common.unbox((state.params, state.opt_state)))
    return sum(x.nbytes for x in leaves), sum(x.addressable_data(0).nbytes for x in leaves)


def shard_shapes(result):
    """{parameter path: the shape of the piece device 0 holds}."""
    params = common.unbox(result.state.params)
    return {
        jax.tree_util.keystr(path, simple=True, separator="/"): leaf.addressable_data(0).shape
        for path, leaf in jax.tree_util.tree_leaves_with_path(params)
    }


# ----------------------------------------------------------------------------------------------
# Scripts as users run them: copied alone into a folder, from the command line
# ----------------------------------------------------------------------------------------------


def copy_alone(script, folder):
    """A folder holding only the script and common.py, as a user who copied them has."""
    for name in (f"{script}.py", "common.py"):
        shutil.copy(ROOT / name, folder / name)


def run_script(script, tmp_path, *flags, env=None, timeout=300):
    copy_alone(script, tmp_path)
    return subprocess.run(
        [sys.executable, f"{script}.py", *flags],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def as_flags(settings):
    """Config settings as command-line flags: --name=value, or --name / --no-name for a bool."""
    return [
        f"--{'' if value else 'no-'}{key.replace('_', '-')}"
        if isinstance(value, bool)
        else f"--{key.replace('_', '-')}={value}"
        for key, value in settings.items()
    ]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PROCESSES = 2


def slurm_job() -> dict:
    """The environment SLURM gives a job of PROCESSES tasks on this machine (each task adds its
    SLURM_PROCID); jax.distributed's coordinator port is 61440 + the job's id mod 4096: free."""
    port = next(p for p in range(61440 + os.getpid() % 4000, 65536) if free(p))
    job = dict(SLURM_NTASKS=PROCESSES, SLURM_JOB_ID=port - 61440, SLURM_STEP_NODELIST="localhost")
    return {key: str(value) for key, value in job.items()}


def free(port) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@contextlib.contextmanager
def cluster(script, tmp_path, flags, heartbeat=30, extra=((), ()), started=(0, 1), slurm=False):
    """Start PROCESSES copies of a script, each with DEVICES / PROCESSES CPU devices, from a
    folder holding only the script and common.py; kill any still running on the way out.
    `extra` adds flags to each process; only the processes in `started` are started. With
    `slurm`, the processes find each other as a SLURM job's do (--distributed)."""
    copy_alone(script, tmp_path)
    port, procs = free_port(), []
    joined = [f"--coordinator-address=127.0.0.1:{port}", f"--num-processes={PROCESSES}"]
    job = slurm_job() if slurm else {}
    try:
        for i in started:
            log = open(tmp_path / f"process{i}.log", "w")
            join = ["--distributed"] if slurm else [*joined, f"--process-id={i}"]
            env = {**os.environ, **job, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)}
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        f"{script}.py",
                        *flags,
                        f"--cpu-devices={DEVICES // PROCESSES}",
                        *join,
                        f"--heartbeat-timeout={heartbeat}",
                        *extra[i],
                    ],
                    cwd=tmp_path,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env=env if slurm else None,
                )
            )
            log.close()
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def wait_ok(procs, tmp_path, timeout=600):
    """Wait for every process of a cluster; if one fails, show what each one printed."""
    codes = [proc.wait(timeout=timeout) for proc in procs]
    logs = [(tmp_path / f"process{i}.log").read_text() for i in range(len(procs))]
    if codes != [0] * len(procs):
        raise AssertionError(
            "\n".join(
                f"--- process {i} exited {code}, its last lines:\n{log[-4000:]}"
                for i, (code, log) in enumerate(zip(codes, logs, strict=True))
            )
        )
    return logs
