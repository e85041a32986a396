"""Checkpoints and the run's data: exact resume, resume under another script, a metrics file
that survives a resume, preemption and Ctrl-C, crash safety, a full disk, one run per folder,
unreadable checkpoints, changed flags, and the checkpoint folders that are bad input."""

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

import common
import pjit_tp
import shardmap_dp
from tests.harness import (
    LLAMA_SPECS,
    STRATEGIES,
    RTOL,
    SMALL,
    TINY,
    as_flags,
    cluster,
    copy_alone,
    matrix,
    model_flags,
    record_flags,
    run,
    run_script,
    run_uncached,
    wait_ok,
)


def relative(mine, ref):
    """The largest difference between two lists of numbers, relative to the reference's."""
    return max(abs(a - b) / abs(b) for a, b in zip(mine, ref, strict=True))


def steps_in(folder):
    """The checkpoints in a folder, oldest first."""
    return sorted(int(name) for name in os.listdir(folder) if name.isdigit())


def interrupted(name, checkpoint_dir, **flags):
    """Train 20 steps saving at 10 and 20, then forget step 20: as if stopped after step 10."""
    result = run_uncached(name, checkpoint_dir=str(checkpoint_dir), checkpoint_every=10, **flags)
    shutil.rmtree(checkpoint_dir / "20")
    return result


@pytest.mark.parametrize("name", matrix(["pmap_dp", "fsdp"], ["pmap_dp"]))
def test_resume_is_exact_in_the_same_script(name, tmp_path):
    first = interrupted(name, tmp_path, dropout=0.1)  # dropout: the rng must resume too
    resumed = run_uncached(name, checkpoint_dir=str(tmp_path), checkpoint_every=10, dropout=0.1)
    record_flags(STRATEGIES[name][0], resumed.config)
    print(f"\n{name} resumed at step 10: {len(resumed.losses)} steps, bitwise equal")
    # Bitwise
    assert resumed.losses == first.losses[10:] and resumed.grad_norms == first.grad_norms[10:]
    assert steps_in(tmp_path) == [10, 20]


# Every pytest: fsdp.py's blocks one by one read into pipeline.py's stages; -m full: every pair.
PAIRS = [
    ("pmap_dp", "fsdp"),  # one copy per device -> one copy split over all
    ("fsdp", "pipeline_1f1b"),  # blocks one by one -> stacked by stage
    ("expert_parallel", "pjit_tp"),  # a mixture of experts: experts split, then their hidden units
    ("explicit_fsdp_tp", "pipeline_1f1b"),  # a state whose shardings are in its types -> stages
    ("fsdp", "explicit_tp"),  # and back: boxed shards -> Explicit types
    ("fsdp", "logical_fsdp_tp"),
    ("pipeline_1f1b", "logical_fsdp_tp"),
    ("context_parallel", "pjit_tp"),
    ("pipeline_interleaved", "fsdp"),  # stage s's groups s, s + stages, ... -> the blocks in order
    ("context_parallel", "context_ulysses"),  # the ring's run, on with Ulysses
    ("pjit_tp_sp", "context_all_gather"),  # sequence parallel -> the keys and values gathered
    ("fsdp", "pipeline_zbv"),  # -> stage s holding groups s and 2 stages - 1 - s (zbv's V)
]


def check_resumes(writer, reader, flags, folder, uninterrupted):
    """The reader resumes the writer's checkpoint of step 10 and trains on as if uninterrupted."""
    interrupted(writer, folder, **flags)
    resumed = run_uncached(reader, checkpoint_dir=str(folder), checkpoint_every=10, **flags)
    record_flags(STRATEGIES[reader][0], resumed.config)
    diff = relative(resumed.losses, uninterrupted.losses[10:])
    norm_diff = relative(resumed.grad_norms, uninterrupted.grad_norms[10:])
    print(f"\n{writer} -> {reader} {flags}: loss {diff:.1e}, gradient norm {norm_diff:.1e}")
    assert diff <= RTOL and norm_diff <= RTOL
    return resumed


def balance_biases(result):
    """A mixture of experts' balance biases (--router-bias-rate), as numbers: {path: values}."""
    params = common.unbox(result.state.params)
    return {
        jax.tree_util.keystr(path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_leaves_with_path(params)
        if common.is_balance(path)
    }


@pytest.mark.parametrize("writer, reader", matrix(PAIRS, PAIRS[1:2]))
def test_another_script_resumes(writer, reader, tmp_path):
    flags = {**model_flags(writer), **model_flags(reader)}
    resumed = check_resumes(writer, reader, flags, tmp_path, run(reader, **flags))
    if flags.get("router_bias_rate"):  # the balance bias resumed too, and moved on the same
        mine, theirs = balance_biases(resumed), balance_biases(run(reader, **flags))
        assert mine and mine.keys() == theirs.keys()
        assert all(np.array_equal(mine[path], theirs[path]) for path in mine)


# (writer, reader, the model): a tied head's one table, and an NNX model's parameters, move too
MODELS_MOVED = [
    ("fsdp", "pipeline_1f1b", {"tie_embeddings": True}),  # the table whole for both stages
    ("pipeline_1f1b", "explicit_fsdp_tp", {"model": "tests.nnx_llama"}),
    ("pjit_tp", "fsdp", {"model": "tests.tied_llama"}),
    ("pipeline_1f1b", "fsdp", {"model": "tests.docs_model", "kv_heads": 2}),  # written whole
]


# -m full: every pytest moves the GPT (NNX pieces) between scripts above.
@pytest.mark.parametrize(
    "writer, reader, flags",
    matrix(MODELS_MOVED, []),
    ids=["tied-gpt", "nnx-llama", "tied-llama", "docs-model"],
)
def test_a_tied_or_nnx_model_moves_between_scripts(writer, reader, flags, tmp_path, monkeypatch):
    monkeypatch.setattr(pjit_tp, "PARAM_SPECS", LLAMA_SPECS + pjit_tp.PARAM_SPECS)
    check_resumes(writer, reader, flags, tmp_path, run_uncached(reader, **flags))


def test_resume_at_the_end_trains_nothing(tmp_path):
    run_uncached("shardmap_dp", checkpoint_dir=str(tmp_path), steps=3)
    assert run_uncached("shardmap_dp", checkpoint_dir=str(tmp_path), steps=3).losses == []


def wait_for(predicate, procs, timeout=300):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.05)


def start_training(tmp_path, *flags):
    copy_alone("shardmap_dp", tmp_path)
    log = open(tmp_path / "out.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "shardmap_dp.py",
            *TINY,
            "--steps",
            "100000",
            "--checkpoint-dir",
            "ckpt",
            *flags,
        ],
        cwd=tmp_path,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    log.close()
    return proc


@functools.cache
def uninterrupted(steps):
    """(loss, gradient norm) of every step of start_training's run, had it been run for `steps`
    steps and never stopped: during the warmup the learning rate does not depend on --steps."""
    config = common.parse_config(shardmap_dp.Config, argv=[*TINY, "--steps", str(steps)])
    assert steps <= config.warmup_steps
    result = shardmap_dp.main(config)
    return list(zip(result.losses, result.grad_norms, strict=True))


# Every pytest: SIGTERM (a preemption); -m full: Ctrl-C too, the same handler (common.StopSignals)
@pytest.mark.parametrize(
    "signum", matrix([signal.SIGTERM, signal.SIGINT], [signal.SIGTERM]), ids=["SIGTERM", "Ctrl-C"]
)
def test_a_stop_signal_saves_writes_the_summary_and_exits_0(signum, tmp_path):
    """SIGTERM (preemption) and Ctrl-C finish the step, save it, write the summary and exit 0;
    the resumed run continues the same metrics file, every step once."""
    proc = start_training(tmp_path, "--checkpoint-every", "1000", "--metrics-file", "metrics.jsonl")
    try:
        wait_for(lambda: re.search(r"step +2/", (tmp_path / "out.log").read_text()), [proc])
        proc.send_signal(signum)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = (tmp_path / "out.log").read_text()
    assert "Traceback" not in out
    stopped = int(re.search(r"stopped: saved the checkpoint of step (\d+)", out).group(1))
    assert steps_in(tmp_path / "ckpt") == [stopped]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["summary"]["steps"] == stopped
    done = run_script(
        "shardmap_dp",
        tmp_path,
        *TINY,
        "--steps",
        str(stopped + 2),
        "--checkpoint-dir",
        "ckpt",
        "--metrics-file",
        "metrics.jsonl",
    )
    assert done.returncode == 0 and f"resumed from the checkpoint of step {stopped}" in done.stdout
    assert re.search(rf"step +{stopped + 1}/", done.stdout) and not re.search(
        rf"step +{stopped}/", done.stdout
    )
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records[:-1]] == list(range(1, stopped + 3))
    assert (
        records[-1]["summary"]["steps"] == stopped + 2
        and records[-1]["summary"]["resumed_from"] == stopped
    )
    # And it trained on as if never stopped: every step's loss and gradient norm, bit for bit.
    assert [(r["loss"], r["grad_norm"]) for r in records[:-1]] == uninterrupted(stopped + 2)


def test_a_resumed_run_keeps_every_metrics_record(tmp_path):
    """A run stopped between two checkpoints (here: after step 20, whose checkpoint is lost) and
    resumed from the one before (step 10) writes a metrics file like an uninterrupted run's:
    every step once, in order, and one summary of the whole run."""
    metrics, ckpt = tmp_path / "metrics.jsonl", tmp_path / "ckpt"
    first = interrupted("shardmap_dp", ckpt, log_every=1, metrics_file=str(metrics))
    with metrics.open("a") as file:
        file.write('{"step": 21, "lo')  # and a record cut short by the crash
    resumed = run_uncached(
        "shardmap_dp",
        checkpoint_dir=str(ckpt),
        checkpoint_every=10,
        log_every=1,
        metrics_file=str(metrics),
    )
    record_flags(shardmap_dp, resumed.config)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [(r["step"], "eval_loss" in r) for r in records[:-1]]  # the evaluation after step 20
    assert steps == [(s, False) for s in range(1, 21)] + [(20, True)] and "summary" in records[-1]
    assert [r["loss"] for r in records[:-2]] == first.losses  # bitwise: the same steps
    summary = records[-1]["summary"]
    assert (summary["steps"], summary["resumed_from"], summary["final_loss"]) == (
        20,
        10,
        resumed.losses[-1],
    )


def test_a_save_killed_halfway_is_never_read(tmp_path):
    proc = start_training(tmp_path, "--checkpoint-every", "1", "--keep", "2")
    ckpt = tmp_path / "ckpt"

    def saving_with_one_done():
        names = os.listdir(ckpt) if ckpt.exists() else []
        return any("tmp" in n for n in names) and any(n.isdigit() for n in names)

    try:
        wait_for(saving_with_one_done, [proc])
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    complete = max(int(n) for n in os.listdir(ckpt) if n.isdigit())
    assert any("tmp" in n for n in os.listdir(ckpt))  # killed in the middle of a save
    done = run_script(
        "shardmap_dp",
        tmp_path,
        *TINY,
        "--steps",
        str(complete + 1),
        "--checkpoint-dir",
        "ckpt",
        "--metrics-file",
        "metrics.jsonl",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    record_flags(shardmap_dp, None, argv=proc.args[2:])  # the run killed, with --keep 2
    assert f"resumed from the checkpoint of step {complete}" in done.stdout
    assert not any("tmp" in n for n in os.listdir(ckpt))  # cleaned up
    # The step after the checkpoint, as a run never killed trains it, bit for bit.
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["loss"], r["grad_norm"]) for r in records[:-1]] == uninterrupted(complete + 1)[
        complete:
    ]


def test_checkpoint_of_another_model_exits_2(tmp_path):
    """Named by the first flag that differs; for a checkpoint that records no flags (written
    by an earlier version), by the first parameter whose shape differs."""
    # d_model 64, 2 layers
    run_uncached("shardmap_dp", checkpoint_dir=str(tmp_path / "ckpt"), steps=1)
    done = run_script("fsdp", tmp_path, *TINY, "--checkpoint-dir", "ckpt")  # d_model 32, 1 layer
    assert done.returncode == 2 and "Traceback" not in done.stderr
    error = done.stderr.strip().splitlines()
    assert (
        len(error) == 1
        and "--layers 1 differs from 2 in the checkpoint of step 1 in ckpt" in error[0]
    ), error
    metadata = tmp_path / "ckpt" / "1" / "_CHECKPOINT_METADATA"
    metadata.write_text(json.dumps({**json.loads(metadata.read_text()), "custom_metadata": {}}))
    done = run_script("fsdp", tmp_path, *TINY, "--checkpoint-dir", "ckpt")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    error = done.stderr.strip().splitlines()
    assert len(error) == 1 and "--checkpoint-dir ckpt: step 1 is unreadable (" in error[0], error


def test_unwritable_checkpoint_dir_exits_2(tmp_path):
    (tmp_path / "a_file").write_text("")  # no folder can be made under a file, not even by root
    done = run_script("pjit_tp", tmp_path, *TINY, "--checkpoint-dir", "a_file/ckpt")
    assert (
        done.returncode == 2 and "--checkpoint-dir a_file/ckpt cannot be written" in done.stderr
    ), done.stderr


def two_processes(script, tmp_path, metrics_file):
    """2 processes x 4 devices train SMALL for 10 steps with a checkpoint every 5 in
    tmp_path/ckpt; their metrics records, less the summary."""
    flags = as_flags(
        {
            **SMALL,
            "steps": 10,
            "log_every": 1,
            "checkpoint_dir": tmp_path / "ckpt",
            "checkpoint_every": 5,
        }
    )
    with cluster(script, tmp_path, flags + [f"--metrics-file={tmp_path / metrics_file}"]) as procs:
        wait_ok(procs, tmp_path)
    return [json.loads(line) for line in (tmp_path / metrics_file).read_text().splitlines()][:-1]


TWO_PROCESS_WRITERS = ["fsdp", "pmap_dp"]  # each process its shards; one copy per device


@pytest.mark.parametrize("script", matrix(TWO_PROCESS_WRITERS, ["fsdp"]))
def test_two_processes_resume(script, tmp_path):
    first = two_processes(script, tmp_path, "first.jsonl")
    shutil.rmtree(tmp_path / "ckpt" / "10")
    resumed = two_processes(script, tmp_path, "resumed.jsonl")
    assert [r["step"] for r in resumed] == list(range(6, 11))
    assert [(r["loss"], r["grad_norm"]) for r in resumed] == [
        (r["loss"], r["grad_norm"]) for r in first[5:]
    ]  # bitwise


def test_metrics_file_folder_is_created(tmp_path):
    done = run_script("fsdp", tmp_path, *TINY, "--metrics-file", "runs/exp1/metrics.jsonl")
    assert done.returncode == 0, done.stderr[-2000:]
    records = (tmp_path / "runs" / "exp1" / "metrics.jsonl").read_text().splitlines()
    assert len(records) == 4 and "summary" in records[-1]


def corrupt(folder, how):
    """Damage the checkpoint in `folder` the way `how` says."""
    data = [p for p in folder.rglob("*") if p.is_file() and p.parent.name == "d"]
    if how == "data file deleted":
        data[0].unlink()
    elif how == "data file truncated":
        for p in data:
            p.write_bytes(p.read_bytes()[:100])
    elif how == "data file overwritten":
        for p in data:
            p.write_bytes(bytes(len(p.read_bytes())))
    elif how == "garbage metadata":
        (folder / "state" / "_METADATA").write_text("{garbage")
    elif how == "empty step folder":
        shutil.rmtree(folder)
        folder.mkdir()


HOW = [
    "data file deleted",
    "data file truncated",
    "data file overwritten",
    "garbage metadata",
    "empty step folder",
]


@pytest.mark.parametrize("how", matrix(HOW, ["data file truncated"]))
def test_an_unreadable_checkpoint_is_one_line_and_kept(how, tmp_path, capsys):
    """The newest checkpoint is unreadable: the run says which and why (Orbax's error) in one
    line, exit 2, deleting nothing; moved out of the folder, the run resumes from the one
    before, as if it had stopped there."""
    first = interrupted("shardmap_dp", tmp_path)  # checkpoints 10 and 20, then 20 forgotten
    run_uncached("shardmap_dp", checkpoint_dir=str(tmp_path), checkpoint_every=10)  # 20 again
    corrupt(tmp_path / "20", how)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        run_uncached("shardmap_dp", checkpoint_dir=str(tmp_path), checkpoint_every=10)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1, err
    print(f"\n{how}: {err.strip()}")
    assert f"--checkpoint-dir {tmp_path}: step 20 is unreadable (" in err
    assert steps_in(tmp_path) == [10, 20]  # nothing deleted
    (tmp_path / "20").rename(tmp_path.parent / f"{tmp_path.name}-20")
    resumed = run_uncached("shardmap_dp", checkpoint_dir=str(tmp_path), checkpoint_every=10)
    assert "resumed from the checkpoint of step 10" in capsys.readouterr().out
    assert resumed.losses == first.losses[10:]  # bitwise
    assert steps_in(tmp_path) == [10, 20]  # 20 saved anew


def test_a_folder_of_other_folders_is_not_a_checkpoint_folder(tmp_path):
    for name in ("1", "2023"):
        (tmp_path / "ckpt" / name).mkdir(parents=True)
    done = run_script("fsdp", tmp_path, *TINY, "--checkpoint-dir", "ckpt")
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1
    assert (
        "--checkpoint-dir ckpt holds folders named 1, 2023 that are not checkpoints" in done.stderr
    )


ANOTHER_MODEL = [
    (
        ["--heads", "2"],
        "--heads 2 differs from 4 in the checkpoint of step 3 in ckpt, e.g. --heads 4",
    ),
    (["--d-model", "64"], "--d-model 64 differs from 32 in the checkpoint of step 3"),
    (
        ["--scan-layers"],
        "--scan-layers True differs from False in the checkpoint of step 3 in ckpt, e.g. "
        "--no-scan-layers",
    ),
    (
        ["--tie-embeddings"],
        "--tie-embeddings True differs from False in the checkpoint of step 3 in ckpt, e.g. "
        "--no-tie-embeddings",
    ),
]


# Every pytest: the same shapes read another way (--heads), and another set of parameters
@pytest.mark.parametrize(
    "flags, message",
    matrix(
        [tuple(case) for case in ANOTHER_MODEL], [tuple(ANOTHER_MODEL[0]), tuple(ANOTHER_MODEL[3])]
    ),
    ids=["heads", "d-model", "scan-layers", "tie-embeddings"],
)
def test_resuming_with_another_model_exits_2(flags, message, tmp_path):
    """A flag that changes what the saved weights mean cannot change on resume, even when the
    shapes stay the same (--heads re-reads the attention weights as another head layout)."""
    assert run_script("shardmap_dp", tmp_path, *TINY, "--checkpoint-dir", "ckpt").returncode == 0
    done = run_script(
        "shardmap_dp", tmp_path, *TINY, "--checkpoint-dir", "ckpt", "--steps", "5", *flags
    )
    assert done.returncode == 2 and done.stdout == "", done.stdout
    assert len(done.stderr.strip().splitlines()) == 1 and message in done.stderr, done.stderr


def test_resuming_with_another_trajectory_says_so(tmp_path):
    """Flags of the trajectory may change on resume, with one line naming old -> new; the
    strategy, the mesh and the device count change freely."""
    assert run_script("fsdp", tmp_path, *TINY, "--checkpoint-dir", "ckpt").returncode == 0
    done = run_script(
        "pjit_tp",
        tmp_path,
        *TINY,
        "--checkpoint-dir",
        "ckpt",
        "--steps",
        "5",
        "--lr",
        "0.001",
        "--mesh",
        "data=4,model=2",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "resuming with changed flags: --steps 3 -> 5, --lr 0.003 -> 0.001\n" in done.stdout
    assert "resumed from the checkpoint of step 3" in done.stdout and "step 5/5" in done.stdout


def test_a_failed_save_stops_with_orbaxs_error(tmp_path):
    """A save that cannot be written (here: a file size limit, as a full disk would) stops the
    run with Orbax's error, at the next save or at the end; the checkpoints before it are intact."""
    assert (
        run_script(
            "shardmap_dp", tmp_path, *TINY, "--checkpoint-dir", "ckpt", "--steps", "2"
        ).returncode
        == 0
    )
    # Writes past 20 kB fail (EFBIG: Python ignores SIGXFSZ), as they would on a full disk.
    flags = " ".join([*TINY, "--steps", "8", "--checkpoint-dir", "ckpt"])
    command = f"ulimit -f 20 && exec {sys.executable} shardmap_dp.py {flags}"
    done = subprocess.run(
        ["bash", "-c", command + " --checkpoint-every 2"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1
    error = done.stderr.strip().splitlines()[-1]
    print(f"\n{error}")
    assert "File too large" in error
    assert steps_in(tmp_path / "ckpt") == [2]
    again = run_script("shardmap_dp", tmp_path, *TINY, "--checkpoint-dir", "ckpt", "--steps", "4")
    assert again.returncode == 0 and "resumed from the checkpoint of step 2" in again.stdout
    assert steps_in(tmp_path / "ckpt") == [2, 4]


def test_saves_leave_no_thread_behind(tmp_path):
    """Each save's thread and open files end with it: twice the saves, no more threads (Orbax
    0.12.8 keeps both until the save's result is read: 30 saves left 29 threads and 90 open files
    behind, 3 a save against Linux's default limit of 1,024 a process)."""

    def saves(n):
        run_uncached(
            "shardmap_dp", checkpoint_dir=str(tmp_path / f"{n}"), checkpoint_every=1, steps=n
        )

    saves(6)
    threads = threading.active_count()
    saves(12)
    assert threading.active_count() <= threads


@pytest.mark.parametrize("script", matrix(["fsdp", "pjit_tp"], ["fsdp"]))
def test_resume_on_fewer_devices(script, tmp_path):
    """A checkpoint written on 8 devices resumes on 4: each array is read into the new layout,
    and the data follows from the step, so the losses continue as if nothing had happened."""
    interrupted(script, tmp_path / "ckpt")  # 8 devices, then forgotten after step 10
    flags = as_flags({**SMALL, "checkpoint_dir": "ckpt", "log_every": 1, "metrics_file": "m.jsonl"})
    done = run_script(script, tmp_path, *flags, "--cpu-devices=4")
    assert done.returncode == 0 and "resumed from the checkpoint of step 10" in done.stdout, (
        done.stderr[-2000:]
    )
    assert done.stdout.startswith("4 cpu devices") or "\n4 cpu devices" in done.stdout
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()[:-1]]
    uninterrupted = run(script)
    diff = relative([r["loss"] for r in records], uninterrupted.losses[10:])
    norm_diff = relative([r["grad_norm"] for r in records], uninterrupted.grad_norms[10:])
    print(
        f"\n{script}: 8 devices -> 4, steps 11-20: loss {diff:.1e}, gradient norm {norm_diff:.1e}"
    )
    assert (
        [r["step"] for r in records] == list(range(11, 21)) and diff <= RTOL and norm_diff <= RTOL
    )


# Fsdp: test_two_processes_resume
@pytest.mark.parametrize("script", matrix(["pjit_tp", "fsdp"], []))
def test_resume_from_two_processes_on_one(script, tmp_path):
    """2 processes x 4 devices write a checkpoint; 1 process x 8 devices resumes it."""
    first = two_processes(script, tmp_path, "first.jsonl")
    shutil.rmtree(tmp_path / "ckpt" / "10")
    resumed = run_uncached(
        script, steps=10, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=5
    )
    diff = relative(resumed.losses, [r["loss"] for r in first[5:]])
    norm_diff = relative(resumed.grad_norms, [r["grad_norm"] for r in first[5:]])
    print(
        f"\n{script}: 2 processes x 4 -> 1 x 8, steps 6-10: loss {diff:.1e}, gradient norm "
        f"{norm_diff:.1e}"
    )
    assert len(resumed.losses) == 5 and diff <= RTOL and norm_diff <= RTOL


def test_a_non_finite_state_is_never_saved(tmp_path, monkeypatch, capsys):
    """A state holding a NaN after a step whose loss was finite (an update that overflowed;
    before, `--lr 1e39`, now refused as bad input, saved 16 non-finite arrays at step 1 and a
    resumed run started from them) stops the run with one line and is not saved."""
    import common

    # Every update infinite: the loss of step 1 is finite, the state after it is not.
    monkeypatch.setattr(
        common, "clip", lambda grads, norm, max_norm: jax.tree.map(lambda g: g / 0.0, grads)
    )
    with pytest.raises(SystemExit) as stopped:
        run_uncached("shardmap_dp", checkpoint_dir=str(tmp_path), checkpoint_every=1, log_every=1)
    assert str(stopped.value.code).startswith(
        "stopped: the state after step 1 is not finite; not saved ("
    )
    assert "step  1/20 | loss 5." in capsys.readouterr().out and steps_in(tmp_path) == []


def test_the_metrics_file_is_strict_json(tmp_path):
    """A held-out loss that is not finite is written as null: NaN is not JSON."""
    import common

    logger = common.Logger.__new__(common.Logger)
    logger.config = common.Config(metrics_file=str(tmp_path / "m.jsonl"))
    logger.file = open(tmp_path / "m.jsonl", "w")
    logger.print(
        "", {"step": 3, "eval_loss": float("nan"), "summary": {"final_loss": float("inf")}}
    )
    logger.file.close()
    assert json.loads((tmp_path / "m.jsonl").read_text()) == {
        "step": 3,
        "eval_loss": None,
        "summary": {"final_loss": None},
    }


def test_a_full_disk_under_the_metrics_file_keeps_what_it_holds(tmp_path, monkeypatch):
    """A metrics file that can no longer be written stops the run with the OSError; the
    records it holds stay."""
    import errno

    import common

    lines, json_line = [], common.json_line

    def full_after_3(record):
        lines.append(record)
        if len(lines) > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return json_line(record)

    monkeypatch.setattr(common, "json_line", full_after_3)
    with pytest.raises(OSError, match="No space left on device"):
        run_uncached(
            "shardmap_dp", metrics_file=str(tmp_path / "m.jsonl"), log_every=1, eval_every=0
        )
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 3


def test_a_non_finite_checkpoint_is_refused(tmp_path, capsys):
    """A checkpoint holding a NaN (written before this check existed, or damaged in a way the
    file format cannot see) is never resumed from: it is refused like an unreadable one."""
    import jax.numpy as jnp

    import common

    first = interrupted("shardmap_dp", tmp_path)  # checkpoints 10 and 20, then 20 forgotten
    config = common.Config(**{**SMALL, "checkpoint_dir": str(tmp_path)})
    checkpoints = common.Checkpoints(config)
    # Under the script's mesh of Explicit axes: outside it, JAX 0.10 puts an eager scatter's
    # Python scalar on one device and refuses to mix it with the state's 8.
    with jax.set_mesh(jax.tree.leaves(first.state.params)[0].sharding.mesh):
        broken = first.state.replace(
            params=jax.tree.map(lambda x: x.at[0].set(jnp.nan), first.state.params)
        )
    checkpoints.checkpointer.save_async(20, broken, force=True).result()
    checkpoints.close()
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        run_uncached("shardmap_dp", checkpoint_dir=str(tmp_path), checkpoint_every=10)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "step 20 is unreadable (it holds non-finite values)" in err and steps_in(tmp_path) == [
        10,
        20,
    ]


def test_a_checkpoint_of_an_older_layout_is_refused_in_one_line(tmp_path, capsys):
    """Until clipping moved into each train_step, the optimizer state began with the last
    clipping norm: (its state, AdamW's). Such a checkpoint is not converted: the run says it
    cannot read it, sets it aside (nothing is deleted) and exits 2 with one line."""
    from orbax.checkpoint import v1 as ocp

    first = interrupted("shardmap_dp", tmp_path / "new")  # saved at step 10 in today's layout
    with ocp.training.Checkpointer(tmp_path / "new") as checkpointer:
        metadata = checkpointer.metadata(10)
        state = checkpointer.load(10)  # as plain nested dicts and lists of arrays
    # Replicated, as it was
    norm = jax.device_put(np.float32(first.grad_norms[9]), state["step"].sharding)
    old = {**state, "opt_state": [{"norm": norm}, state["opt_state"]]}
    with ocp.training.Checkpointer(tmp_path / "old") as checkpointer:
        checkpointer.save(10, old, custom_metadata=metadata.custom_metadata)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        run_uncached("shardmap_dp", checkpoint_dir=str(tmp_path / "old"), checkpoint_every=10)
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "step 10 is unreadable (" in err and steps_in(tmp_path / "old") == [10]


def test_a_copy_without_the_logger_still_stops_and_saves(tmp_path):
    """A copier's fsdp.py with the logger and the cost report deleted, the first things most
    replace: it still saves, resumes, and stops at a non-finite loss, in its loop's own lines."""
    copy_alone("fsdp", tmp_path)
    text = (tmp_path / "fsdp.py").read_text()
    for line in (
        "    report = common.cost_report(config, state, compiled, compile_seconds)\n",
        "    log = common.Logger(config, dataset, layout, report, start)\n",
        "            log.log(step, metrics, waited)\n",
        "            if common.eval_due(config, step):\n",
        "                log.eval(step, eval_fn, state, eval_data)\n",
    ):
        assert text.count(line) == 1, line
        text = text.replace(line, "")
    end = "    return log.finish(state, compiled)  # the end-of-run report, and what the run made\n"
    assert text.count(end) == 1
    (tmp_path / "fsdp.py").write_text(text.replace(end, "    return state\n"))

    def train(*flags):
        command = [sys.executable, "fsdp.py", *TINY, "--log-every", "1", *flags]
        return subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)

    saving = ["--checkpoint-dir", "ckpt", "--checkpoint-every", "2"]
    first = train("--steps", "4", *saving)
    assert first.returncode == 0 and first.stdout == "", first.stderr[-2000:]
    assert sorted(int(n) for n in os.listdir(tmp_path / "ckpt") if n.isdigit()) == [2, 4]
    resumed = train("--steps", "6", *saving)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from the checkpoint of step 4 in ckpt\n" in resumed.stdout
    assert sorted(int(n) for n in os.listdir(tmp_path / "ckpt") if n.isdigit()) == [2, 4, 6]
    broken = train(
        "--steps", "50", "--lr", "1e6", "--checkpoint-dir", "nan", "--checkpoint-every", "1"
    )
    bad = re.search(
        r"^stopped: the loss at step (\d+) is not finite; not saved", broken.stderr, re.M
    )
    assert broken.returncode == 1 and bad, broken.stderr[-2000:]
    saved = [int(n) for n in os.listdir(tmp_path / "nan") if n.isdigit()]
    assert saved and max(saved) < int(bad[1])
