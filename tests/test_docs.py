"""The documentation cannot go stale: README.md's excerpts are the scripts' code."""

import re
import subprocess
import sys


from tests.harness import ROOT, SCRIPTS

BRANCHES = ["pipeline", "context_parallel"]  # read after shardmap_dp.py, beside the chain


def test_readme_transitions_match_the_scripts():
    """README.md's diff excerpts, one per neighbouring pair (the chain from pmap_dp.py to
    logical_pjit.py, and the branches from shardmap_dp.py), are what tools/transitions.py
    makes from the scripts today."""
    done = subprocess.run(
        [sys.executable, ROOT / "tools" / "transitions.py", "--check"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    readme = (ROOT / "README.md").read_text()
    pairs = re.findall(r"<!-- diff (\S+) (\S+):", readme)
    chain = [name for name in SCRIPTS if name not in BRANCHES]
    expected = list(zip(chain[:-1], chain[1:], strict=True)) + [("shardmap_dp", name) for name in BRANCHES]
    assert pairs == [(f"{a}.py", f"{b}.py") for a, b in expected]


def test_readme_schedules_are_what_the_script_prints():
    """README.md's picture of the two pipeline schedules is pipeline.py's --show-schedule."""
    out = ""
    for kind in ("gpipe", "1f1b"):
        done = subprocess.run(
            [sys.executable, "pipeline.py", "--show-schedule", "--schedule", kind, "--mesh", "data=2,stage=4",
             "--layers", "4", "--microbatches", "8"],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0 and "step " not in done.stdout, done.stderr  # printed, trained nothing
        out += done.stdout
    readme = (ROOT / "README.md").read_text()
    block = readme.split("<!-- schedule:start -->\n```\n", 1)[1].split("```\n<!-- schedule:end -->", 1)[0]
    assert block == out


def test_readme_error_examples_are_what_the_scripts_say():
    """Every '$ python SCRIPT FLAGS' example in README.md followed by an error line is that
    command's real, one-line answer."""
    readme = (ROOT / "README.md").read_text()
    examples = re.findall(r"^\$ python (\S+\.py) ?(.*)\n(\S+\.py: error: .*)$", readme, re.MULTILINE)
    assert examples
    for script, flags, expected in examples:
        done = subprocess.run(
            [sys.executable, script, *flags.split()], cwd=ROOT, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 2 and done.stderr.strip() == expected, (script, flags, done.stderr)


def test_a_benchmark_run_changes_no_tracked_file(tmp_path):
    """benchmarks/benchmark.py prints its table; README.md and benchmarks/results.* change only
    with --write (before: a 20-step trial run rewrote all three)."""
    tracked = [ROOT / "README.md", ROOT / "benchmarks" / "results.md", ROOT / "benchmarks" / "results.png"]
    before = [path.read_bytes() for path in tracked]
    done = subprocess.run(
        [sys.executable, "benchmarks/benchmark.py", "--only", "shardmap_dp", "--no-remat", "--", "--steps=2",
         "--batch-size=8", "--seq-len=16", "--layers=1", "--d-model=32"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| shardmap_dp" in done.stdout and "wrote" not in done.stdout
    assert [path.read_bytes() for path in tracked] == before
