"""The parity matrix: how far each strategy's run is from one device's, for every model and dtype.

Runs the comparisons of test_equivalence.py (`pytest -m full`) with PARITY_RECORD set, so that
each comparison writes what it measured: the largest relative difference from one device, over
the run's steps, of the loss and of the gradient norm, and of the final parameters (in
bfloat16, of their update). Then prints the table, and with --write puts it into
dev/parity.md. tests/test_docs.py checks the page against the code: a row for every strategy
and model the tests train, and every figure within the bound the tests hold it to.

  python dev/parity.py            # print the table; about 10 minutes on 2 cores
  python dev/parity.py --write    # and rewrite dev/parity.md
  python dev/parity.py --only pjit_tp_sp --write   # re-measure its rows, keep the others
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "dev" / "parity.md"
MARKER = re.compile(r"<!-- parity:start -->\n.*?<!-- parity:end -->", re.DOTALL)
# The tests whose comparisons make the matrix: each model in each dtype, through every strategy
TESTS = (
    "test_matches_single_device_reference",  # the GPT; expert parallelism's mixture of experts
    "test_a_mixture_of_experts_matches",
    "test_a_model_the_scripts_do_not_know_matches",  # tests/llama.py
    "test_bfloat16_matches",
    "test_bfloat16_matches_for_the_other_models",
)
MODELS = {"gpt": "GPT", "moe": "GPT, 8 experts", "llama": "tests/llama.py"}


def model_of(record: dict) -> str:
    """The model a comparison trained: a strategy's own flags may make it a mixture of experts."""
    if record["flags"].get("model") == "tests.llama":
        return "llama"
    return "moe" if record["flags"].get("experts") or record["experts"] else "gpt"


def measure(workers: int, only=()) -> list:
    """Run the matrix's tests (of the strategies `only` names, if any); every comparison they
    made, as a dict."""
    with tempfile.TemporaryDirectory() as folder:
        record = os.path.join(folder, "parity")
        tests = f"({' or '.join(TESTS)})"
        if only:
            tests += f" and ({' or '.join(only)})"
        # Every cell, marked full or not; spread over the workers test by test, not by file
        command = [sys.executable, "-m", "pytest", "-m", "", "-q", "-x", "-n", str(workers)]
        command += ["--dist", "load", "test_equivalence.py", "-k", tests]
        started = time.monotonic()
        done = subprocess.run(command, cwd=ROOT, env={**os.environ, "PARITY_RECORD": record})
        if done.returncode:
            raise SystemExit(f"the tests failed (exit {done.returncode}): no table written")
        print(f"measured in {time.monotonic() - started:.0f}s", file=sys.stderr)
        records = []
        for path in Path(folder).glob("parity.*"):
            records += [json.loads(line) for line in path.read_text().splitlines()]
    return records


def table(records: list) -> str:
    """One row per strategy and model; its float32 and bfloat16 figures side by side."""
    cells = {}
    for r in records:
        dtype = r["flags"].get("dtype", "float32")
        if r["test"] in TESTS:
            cells[(r["strategy"], model_of(r), dtype)] = r
    rows = [
        "| strategy | model | float32: loss | grad norm | parameters "
        "| bfloat16: loss | grad norm | update |",
        "|---|---|---|---|---|---|---|---|",
    ]
    # The strategies in the tests' order, each with its models
    ranked = sorted(cells, key=lambda c: (cells[c]["order"], list(MODELS).index(c[1])))
    for strategy, model in dict.fromkeys((s, m) for s, m, _ in ranked):
        row = [f"`{strategy}`", MODELS[model]]
        for dtype in ("float32", "bfloat16"):
            r = cells.get((strategy, model, dtype))
            if r is None:
                raise SystemExit(f"no {dtype} comparison of {strategy} with {MODELS[model]}")
            row += [f"{x:.1e}" for x in r["measured"][:3]]  # the 4th: the largest element's
        rows.append("| " + " | ".join(row) + " |")
    return "\n".join(rows)


def merged(old: str, new: str) -> str:
    """The page's table with the new rows in place of (or beside) its own, in the tests' order
    of the strategies (tests/harness.py) and models."""
    sys.path.insert(0, str(ROOT))
    from tests.harness import STRATEGIES

    rows = {}
    for text in (old, new):
        for row in text.splitlines():
            if found := re.match(r"\| `([\w-]+)` \| ([^|]+) \|", row):
                rows[found.group(1), found.group(2).strip()] = row
    labels = list(MODELS.values())
    order = sorted(rows, key=lambda key: (list(STRATEGIES).index(key[0]), labels.index(key[1])))
    return "\n".join(new.splitlines()[:2] + [rows[key] for key in order])


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--write", action="store_true", help="rewrite dev/parity.md")
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist workers")
    parser.add_argument(
        "--only", nargs="+", default=(), help="these strategies' rows; the others stay as written"
    )
    args = parser.parse_args()
    text = table(measure(args.workers, args.only))
    print(text)
    if args.write:
        page = PAGE.read_text()
        if args.only:
            text = merged(MARKER.search(page).group(), text)
        new = f"<!-- parity:start -->\n{text}\n<!-- parity:end -->"
        PAGE.write_text(MARKER.sub(lambda _: new, page))
        print(f"wrote {PAGE.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
