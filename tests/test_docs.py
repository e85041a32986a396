"""The documentation cannot go stale: README.md's excerpts are the scripts' code."""

import re
import subprocess
import sys

from tests.harness import ROOT, SCRIPTS


def test_readme_transitions_match_the_scripts():
    """README.md's diff excerpts, one per neighbouring pair, are what tools/transitions.py makes
    from the scripts today."""
    done = subprocess.run(
        [sys.executable, ROOT / "tools" / "transitions.py", "--check"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    readme = (ROOT / "README.md").read_text()
    pairs = re.findall(r"<!-- diff (\S+) (\S+):", readme)
    assert pairs == [(f"{a}.py", f"{b}.py") for a, b in zip(list(SCRIPTS)[:-1], list(SCRIPTS)[1:], strict=True)]
