"""Several processes on this machine, joined by JAX's distributed runtime (gloo on CPU): when
one dies or cannot be reached, the others stop in bounded time. (That 2 processes compute
what 1 does is in test_equivalence.py; that they resume from a checkpoint, in
test_checkpoints.py.)"""

import json
import os
import re
import signal
import time

import pytest

from tests.harness import SMALL, TINY, as_flags, cluster, free_port, matrix, run_script


@pytest.mark.parametrize("victim", matrix([1, 0], [1]), ids=["worker dies", "coordinator dies"])
def test_a_dead_process_stops_the_others(victim, tmp_path):
    heartbeat = 5
    metrics = tmp_path / "metrics.jsonl"
    flags = as_flags({**SMALL, "steps": 100_000, "log_every": 1, "metrics_file": metrics})
    with cluster("shardmap_dp", tmp_path, flags, heartbeat) as procs:
        deadline = time.monotonic() + 300
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):  # training runs
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.5)
        procs[victim].kill()
        start = time.monotonic()
        survivor = procs[1 - victim]
        code = survivor.wait(timeout=heartbeat + 60)
        waited = time.monotonic() - start
    log = (tmp_path / f"process{1 - victim}.log").read_text()
    print(f"\nprocess {victim} killed: process {1 - victim} exited {code} after {waited:.1f}s")
    assert code != 0
    assert waited < heartbeat + 20
    if victim == 1:
        # Either the coordinator names the process whose heartbeats stopped, or, when the dead
        # process took part in a collective, gloo aborts at once on the broken connection.
        named = re.search(r"stopped sending heartbeats\):\s*1\b", log)
        assert named or "gloo" in log.rsplit("step ", 1)[-1], log[-2000:]


def test_unreachable_coordinator_fails_in_bounded_time(tmp_path):
    """Process 1 with no process 0 to join stops after --heartbeat-timeout seconds, with JAX's
    own error (its initialization timeout), before anything is compiled."""
    port = free_port()  # nobody listens on it
    start = time.monotonic()
    done = run_script(
        "fsdp",
        tmp_path,
        *TINY,
        f"--coordinator-address=127.0.0.1:{port}",
        "--num-processes=2",
        "--process-id=1",
        "--heartbeat-timeout=3",
    )
    waited = time.monotonic() - start
    print(f"\nno coordinator: exit {done.returncode} after {waited:.1f}s")
    assert done.returncode != 0 and waited < 30 and "compiled" not in done.stdout


def stopped(procs, tmp_path, timeout=120):
    """Each process's exit status and its output's non-empty lines, once all have stopped."""
    codes = [proc.wait(timeout=timeout) for proc in procs]
    logs = [(tmp_path / f"process{i}.log").read_text() for i in range(len(procs))]
    # Gloo's C++ threads print "[Gloo] Rank 0 is connected to 1 peer ranks. ..." as the processes
    # connect, two at once, so that their lines can come cut and interleaved: leave out the pieces.
    gloo = ("[Gloo]", "peer ranks")
    return codes, [
        [line for line in log.splitlines() if line.strip() and not any(g in line for g in gloo)]
        for log in logs
    ]


def said_once(lines, error) -> bool:
    """A process's output holds one error line, this one, and no traceback: what else the runtime
    prints around it (gloo's connection lines, a stray line of its own) is not the run's."""
    errors = [line for line in lines if "error:" in line or "Traceback" in line]
    return len(errors) == 1 and error in errors[0]


@pytest.mark.parametrize(
    "flag, values",
    [("seed", (0, 1)), ("layers", (1, 2)), ("steps", (3, 4)), ("cpu-devices", (4, 2))],
    ids=["seed", "layers", "steps", "cpu-devices"],
)
def test_processes_with_different_flags_stop_naming_the_flag(flag, values, tmp_path):
    """Every process compares its flags with the others' before compiling; a difference stops
    all of them with one line naming the flag (before: a different --seed trained on silently,
    --layers aborted both after a minute, --steps aborted at shutdown)."""
    extra = [[f"--{flag}={value}"] for value in values]
    start = time.monotonic()
    with cluster("shardmap_dp", tmp_path, TINY, heartbeat=20, extra=extra) as procs:
        codes, lines = stopped(procs, tmp_path)
    print(
        f"\n--{flag} {values[0]} vs {values[1]}: exits {codes} after "
        f"{time.monotonic() - start:.1f}s: {lines[0]}"
    )
    # Found from the devices themselves, before the flags are gathered over them
    said = "gives the processes [4, 2] devices" if flag == "cpu-devices" else "differs between"
    assert codes == [2, 2] and all(said_once(out, f"error: --{flag} {said}") for out in lines), (
        lines
    )


def test_a_bad_flag_on_one_process_stops_both(tmp_path):
    """A bad flag given to one process only differs from the others': every process says so
    (exit 2), before any of them checks it."""
    with cluster(
        "shardmap_dp", tmp_path, TINY, heartbeat=20, extra=([], ["--batch-size=9"])
    ) as procs:
        codes, lines = stopped(procs, tmp_path)
    said = "error: --batch-size differs between processes"
    assert codes == [2, 2] and all(said_once(out, said) for out in lines), lines


def test_ctrl_c_on_one_process_stops_both_at_the_same_step(tmp_path):
    """Ctrl-C (SIGINT) on one process: through JAX's preemption service every process stops
    after the same step, saves it and exits 0 (before: both aborted, 134, after the heartbeat
    timeout, with nothing saved since the last checkpoint)."""
    metrics, ckpt = tmp_path / "metrics.jsonl", tmp_path / "ckpt"
    flags = as_flags(
        {
            **SMALL,
            "steps": 100_000,
            "log_every": 1,
            "metrics_file": metrics,
            "checkpoint_dir": ckpt,
            "checkpoint_every": 100_000,
        }
    )
    with cluster("shardmap_dp", tmp_path, flags, heartbeat=20) as procs:
        deadline = time.monotonic() + 300
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):  # training runs
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.5)
        procs[1].send_signal(signal.SIGINT)
        codes, lines = stopped(procs, tmp_path)
    saved = [
        int(line.split()[-1])
        for out in lines
        for line in out
        if line.startswith("stopped: saved the checkpoint")
    ]
    print(f"\nCtrl-C on process 1: exits {codes}, stopped at {saved}")
    assert codes == [0, 0] and "Traceback" not in "".join(map(str, lines))
    # Process 0 reports
    assert len(saved) == 1 and [int(n) for n in os.listdir(ckpt) if n.isdigit()] == saved
    assert any("Ctrl-C: the run will finish its step" in line for line in lines[1])
    assert json.loads(metrics.read_text().splitlines()[-1])["summary"]["steps"] == saved[0]
