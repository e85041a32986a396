"""Checkpoints: exact resume, resume under another script, preemption, crash safety, and
the checkpoint folders that are bad input."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.harness import (
    RTOL, SMALL, TINY, as_flags, cluster, copy_alone, once_more_after_runtime_abort, run, run_script, run_uncached,
    wait_ok,
)  # fmt: skip


def interrupted(name, checkpoint_dir, **flags):
    """Train 20 steps saving at 10 and 20, then forget step 20: as if stopped after step 10."""
    result = run_uncached(name, checkpoint_dir=str(checkpoint_dir), checkpoint_every=10, **flags)
    shutil.rmtree(checkpoint_dir / "20")
    return result


@pytest.mark.parametrize("name", ["pmap_dp", "fsdp"])
def test_resume_is_exact_in_the_same_script(name, tmp_path):
    first = interrupted(name, tmp_path, dropout=0.1)  # dropout: the rng must resume too
    resumed = run_uncached(name, checkpoint_dir=str(tmp_path), checkpoint_every=10, dropout=0.1)
    print(f"\n{name} resumed at step 10: {len(resumed.losses)} steps, bitwise equal")
    assert resumed.losses == first.losses[10:]  # bitwise
    assert sorted(os.listdir(tmp_path)) == ["10", "20"]


@pytest.mark.parametrize("writer, reader", [("fsdp", "logical_fsdp_tp"), ("pmap_dp", "fsdp")])
def test_another_script_resumes(writer, reader, tmp_path):
    interrupted(writer, tmp_path)
    resumed = run_uncached(reader, checkpoint_dir=str(tmp_path), checkpoint_every=10)
    uninterrupted = run(reader).losses[10:]
    diff = max(abs(a - b) / b for a, b in zip(resumed.losses, uninterrupted, strict=True))
    print(f"\n{writer} -> {reader}: loss {diff:.1e}")
    assert diff <= RTOL


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
        [sys.executable, "shardmap_dp.py", *TINY, "--steps", "100000", "--checkpoint-dir", "ckpt", *flags],
        cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    log.close()
    return proc


def test_sigterm_saves_and_exits_0(tmp_path):
    proc = start_training(tmp_path, "--checkpoint-every", "1000")
    try:
        wait_for(lambda: re.search(r"step +2/", (tmp_path / "out.log").read_text()), [proc])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = (tmp_path / "out.log").read_text()
    stopped = int(re.search(r"preempted: saved the checkpoint of step (\d+)", out).group(1))
    assert os.listdir(tmp_path / "ckpt") == [str(stopped)]
    done = run_script("shardmap_dp", tmp_path, *TINY, "--steps", str(stopped + 2), "--checkpoint-dir", "ckpt")
    assert done.returncode == 0 and f"resumed from the checkpoint of step {stopped}" in done.stdout
    assert f"step {stopped + 1}/" in done.stdout and f"step {stopped}/" not in done.stdout


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
    done = run_script("shardmap_dp", tmp_path, *TINY, "--steps", str(complete + 1), "--checkpoint-dir", "ckpt")
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"resumed from the checkpoint of step {complete}" in done.stdout
    assert not any("tmp" in n for n in os.listdir(ckpt))  # cleaned up


def test_checkpoint_of_another_model_exits_2(tmp_path):
    run_uncached("shardmap_dp", checkpoint_dir=str(tmp_path / "ckpt"), steps=1)  # d_model 64, 2 layers
    done = run_script("fsdp", tmp_path, *TINY, "--checkpoint-dir", "ckpt")  # d_model 32, 1 layer
    assert done.returncode == 2 and "Traceback" not in done.stderr
    error = done.stderr.strip().splitlines()[-1]
    assert "holds another model: block_0/attn/out/bias is (64,) there but (32,) here" in error, error


def test_unwritable_checkpoint_dir_exits_2(tmp_path):
    (tmp_path / "a_file").write_text("")  # no folder can be made under a file, not even by root
    done = run_script("pjit_tp", tmp_path, *TINY, "--checkpoint-dir", "a_file/ckpt")
    assert done.returncode == 2 and "--checkpoint-dir a_file/ckpt cannot be written" in done.stderr, done.stderr


@pytest.mark.parametrize("script", ["pmap_dp", "fsdp"])  # one copy per device; each process its shards
@once_more_after_runtime_abort
def test_two_processes_resume(script, tmp_path):
    ckpt = tmp_path / "ckpt"
    flags = as_flags({**SMALL, "steps": 10, "log_every": 1, "checkpoint_dir": ckpt, "checkpoint_every": 5})
    with cluster(script, tmp_path, flags + [f"--metrics-file={tmp_path / 'first.jsonl'}"]) as procs:
        wait_ok(procs, tmp_path)
    shutil.rmtree(ckpt / "10")
    with cluster(script, tmp_path, flags + [f"--metrics-file={tmp_path / 'resumed.jsonl'}"]) as procs:
        wait_ok(procs, tmp_path)
    first, resumed = (
        [json.loads(line) for line in (tmp_path / name).read_text().splitlines()][:-1]
        for name in ("first.jsonl", "resumed.jsonl")
    )
    assert [r["step"] for r in resumed] == list(range(6, 11))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in first[5:]]  # bitwise
