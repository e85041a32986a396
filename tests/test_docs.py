"""The documentation cannot go stale: its excerpts are the scripts' code and output, and
README.md stays what a newcomer reads first."""

import re
import subprocess
import sys

import pipeline
from tests.harness import ROOT, SCRIPTS

BRANCHES = ["pipeline", "context_parallel", "expert_parallel"]  # read after shardmap_dp.py, beside the chain


def test_readme_transitions_match_the_scripts():
    """docs/transitions.md's diff excerpts, one per neighbouring pair (the chain from pmap_dp.py
    to logical_pjit.py, and the branches from shardmap_dp.py), are what tools/transitions.py
    makes from the scripts today; README.md has a paragraph for each."""
    done = subprocess.run(
        [sys.executable, ROOT / "tools" / "transitions.py", "--check"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    pairs = re.findall(r"<!-- diff (\S+) (\S+):", (ROOT / "docs" / "transitions.md").read_text())
    chain = [name for name in SCRIPTS if name not in BRANCHES]
    expected = list(zip(chain[:-1], chain[1:], strict=True)) + [("shardmap_dp", name) for name in BRANCHES]
    assert pairs == [(f"{a}.py", f"{b}.py") for a, b in expected]
    readme = (ROOT / "README.md").read_text()
    for a, b in expected:
        assert f"(`{a}.py` → `{b}.py`)" in readme


def test_the_schedules_shown_are_pipeline_pys():
    """docs/strategies.md's picture of the pipeline schedules is what pipeline.py's
    --show-schedule prints, and README.md's table of them is what their tables say: both are
    what tools/schedules.py makes today."""
    done = subprocess.run([sys.executable, ROOT / "tools" / "schedules.py", "--check"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    for kind in pipeline.SCHEDULES:
        assert f"--schedule {kind} on 4 stages" in (ROOT / "docs" / "strategies.md").read_text()
        assert f"| {kind} |" in (ROOT / "README.md").read_text()


def test_readme_error_examples_are_what_the_scripts_say():
    """Every '$ python SCRIPT FLAGS' example in the documentation followed by an error line is
    that command's real, one-line answer."""
    readme = "".join(path.read_text() for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    examples = re.findall(r"^\$ python (\S+\.py) ?(.*)\n(\S+\.py: error: .*)$", readme, re.MULTILINE)
    assert examples
    for script, flags, expected in examples:
        done = subprocess.run(
            [sys.executable, script, *flags.split()], cwd=ROOT, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 2 and done.stderr.strip() == expected, (script, flags, done.stderr)


def test_a_benchmark_run_changes_no_tracked_file(tmp_path):
    """benchmarks/benchmark.py prints its table; docs/costs.md and benchmarks/results.* change
    only with --write (before: a 20-step trial run rewrote all three)."""
    tracked = [ROOT / "docs" / "costs.md", ROOT / "benchmarks" / "results.md", ROOT / "benchmarks" / "results.png"]
    before = [path.read_bytes() for path in tracked]
    done = subprocess.run(
        [sys.executable, "benchmarks/benchmark.py", "--only", "shardmap_dp", "--no-remat", "--", "--steps=2",
         "--batch-size=8", "--seq-len=16", "--layers=1", "--d-model=32"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| shardmap_dp" in done.stdout and "wrote" not in done.stdout
    assert [path.read_bytes() for path in tracked] == before


def test_readme_is_what_a_newcomer_needs():
    """About 400 lines at most, the rest in docs/; every docs page it names exists."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 400
    for page in re.findall(r"\]\((docs/[\w.]+)\)", readme):
        assert (ROOT / page).exists(), page


def test_the_count_of_bad_inputs_is_the_tests_own():
    """docs/operations.md says how many bad inputs the command-line test tries."""
    from tests.test_command_line import BAD_INPUTS

    cases = sum(len(scripts) for _, scripts, _ in BAD_INPUTS)
    text = (ROOT / "docs" / "operations.md").read_text()
    assert f"({len(BAD_INPUTS)} of them, {cases} cases over the scripts they apply to)" in text
