"""The host's share of a training step (issue 25): how long a batch takes to make, and how long
the training loop waits for it.

First the synthetic source's batches, 8 x 1,024 and 32 x 64 tokens: the compiled walk the
scripts use against the Python loop it replaced (tests/test_data.py keeps that loop, and checks
that both make the same tokens). Then a script's run both ways, each printing its ms/step and
the median time the loop waited for a batch (the summary's data_wait_seconds). The loop makes
each batch while the devices run the step before it (JAX dispatches steps asynchronously).

  python dev/host_time.py                       # shardmap_dp.py, a small model at 8 x 1,024
  python dev/host_time.py --script fsdp.py -- --batch-size 32 --seq-len 64

On emulated CPU devices the compiled walk waits for the step before it: it runs on CPU device
0, which runs training steps in order. On a GPU or TPU host the walk has the CPU to itself.
"""

import argparse
import json
import os
import runpy
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

SMALL = [
    "--cpu-devices",
    "1",
    "--layers",
    "1",
    "--d-model",
    "32",
    "--heads",
    "2",
    "--eval-every",
    "0",
]
SMALL += ["--steps", "60", "--log-every", "10", "--batch-size", "8", "--seq-len", "1024"]


def median_ms(make, data, rows: int, batches: int) -> float:
    import numpy as np

    make(data, 0, 0, rows)  # compiles the walk
    times = []
    for step in range(1, batches + 1):
        start = time.perf_counter()
        make(data, step, 0, rows)
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def batches():
    import common
    from tests.test_data import markov_walk_in_python

    print("host time per synthetic batch (median):")
    for rows, length in ((8, 1024), (32, 64)):
        data = common.SyntheticData(seed=0, seq_len=length)
        compiled = median_ms(common.SyntheticData.batch, data, rows, 50)
        loop = median_ms(markov_walk_in_python, data, rows, 20)
        print(f"  {rows} x {length:,}: compiled walk {compiled:.2f} ms, Python loop {loop:.2f} ms")


def run(script: str, flags: list, python_loop: bool):
    """One run of a script, in this process; python_loop: the batches as before issue 25."""
    if python_loop:
        import common
        from tests.test_data import markov_walk_in_python

        common.SyntheticData.batch = markov_walk_in_python
    sys.argv = [script, *flags]
    runpy.run_path(os.path.join(ROOT, script), run_name="__main__")


def runs(script: str, flags: list):
    print(f"{script} {' '.join(flags)}:")
    for name, python_loop in (("Python loop", True), ("compiled walk", False)):
        with tempfile.TemporaryDirectory() as folder:
            metrics = os.path.join(folder, "metrics.jsonl")
            command = [sys.executable, __file__, "--run", script] + ["--python-loop"] * python_loop
            command += ["--", *flags, "--metrics-file", metrics]
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
            with open(metrics) as file:
                summary = [json.loads(line) for line in file][-1]["summary"]
        step, waited = summary["step_seconds"] * 1e3, summary["data_wait_seconds"] * 1e3
        print(
            f"  {name:<30} {step:7.1f} ms/step, waiting for data {waited:6.2f} ms "
            f"({waited / step:.0%})"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--script", default="shardmap_dp.py", help="the script to run")
    parser.add_argument("--run", help=argparse.SUPPRESS)  # one run, in a process of its own
    parser.add_argument("--python-loop", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "flags",
        nargs="*",
        help="the script's flags after --, instead of a small model at 8 x 1,024",
    )
    args = parser.parse_args()
    if args.run:
        run(args.run, args.flags, args.python_loop)
    else:
        batches()
        runs(args.script, args.flags or SMALL)
