"""Several processes on this machine, joined by JAX's distributed runtime (gloo on CPU): when
one dies or cannot be reached, the others stop in bounded time. (That 2 processes compute
what 1 does is in test_equivalence.py; that they resume from a checkpoint, in
test_checkpoints.py.)"""

import re
import time

import pytest

from tests.harness import SMALL, TINY, as_flags, cluster, free_port, run_script


@pytest.mark.parametrize("victim", [1, 0], ids=["worker dies", "coordinator dies"])
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
    port = free_port()  # nobody listens on it
    start = time.monotonic()
    done = run_script("fsdp", tmp_path, *TINY, f"--coordinator-address=127.0.0.1:{port}", "--num-processes=2",
                      "--process-id=1", "--heartbeat-timeout=3")  # fmt: skip
    waited = time.monotonic() - start
    assert done.returncode == 1 and waited < 30
    assert f"cannot reach the coordinator at 127.0.0.1:{port} after 3s" in done.stderr.strip().splitlines()[-1]
    assert "Traceback" not in done.stderr and "compiled" not in done.stdout
