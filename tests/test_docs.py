"""The documentation cannot go stale: README.md's excerpts are the scripts' code."""

import contextlib
import io
import re
import subprocess
import sys

import pipeline

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
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for kind in ("gpipe", "1f1b"):
            print(f"--schedule {kind} on 4 stages, 8 micro-batches:")
            pipeline.show_schedule(pipeline.make_schedule(kind, 4, 8))
    readme = (ROOT / "README.md").read_text()
    block = readme.split("<!-- schedule:start -->\n```\n", 1)[1].split("```\n<!-- schedule:end -->", 1)[0]
    assert block == out.getvalue()
