"""Which compared runs set each flag away from its default: docs/flags.md's table.

A flag that no compared run sets (compared with one device, with a definition written in a
test, or with a formula) guards code that could be wrong in any way: nothing would notice. The
tests record every compared run's flags (tests/harness.py's record_flags, into $FLAGS_RECORD);
this tool turns a whole run's records into the table, and tests/test_flags.py fails for a flag
the table leaves without one. A flag every script shares (common.Config's) counts once, under
any script; a script's own flag (one it adds, or whose default or meaning it changes) only in
runs of that script. After the tests, conftest.py checks the table's examples that ran against
what they recorded, so the table cannot keep a claim a test stopped making.

  FLAGS_RECORD=/tmp/flags pytest -m ""        # every test, recording (about 45 minutes)
  python dev/flags.py /tmp/flags --write    # rewrite docs/flags.md's table from the records
  python dev/flags.py /tmp/a /tmp/b         # the table from several runs' records, printed
"""

import argparse
import dataclasses
import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "flags.md"
MARKER = re.compile(r"<!-- flags:start -->\n.*?<!-- flags:end -->", re.DOTALL)
SCRIPTS = (
    "pmap_dp shardmap_dp fsdp pjit_tp logical_pjit pipeline context_parallel expert_parallel "
    "explicit_sharding"
).split()
SHARED = "every script"
EXAMPLES = 2  # tests named per flag, those of a plain `pytest` first


def required() -> dict:
    """{(flag, script or SHARED)}: every flag of every script, a shared one once."""
    sys.path.insert(0, str(ROOT))
    import common

    shared = {f.name: f for f in dataclasses.fields(common.Config)}
    needed = {(name, SHARED) for name in shared}
    for script in SCRIPTS:
        for field in dataclasses.fields(importlib.import_module(script).Config):
            base = shared.get(field.name)
            if base is None or (base.default, base.metadata) != (field.default, field.metadata):
                needed.add((field.name, script))
    return needed


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def recorded(*folders) -> list:
    """Every compared run's record: {test, script, flags} (tests/harness.py's record_flags)."""
    return [
        json.loads(line)
        for folder in folders
        for path in sorted(Path(folder).glob("*.jsonl"))
        for line in path.read_text().splitlines()
    ]


def covering(records) -> dict:
    """{(flag, script or SHARED): the tests whose compared runs set it}."""
    found = {}
    for record in records:
        for name in record["flags"]:
            for key in ((name, SHARED), (name, record["script"])):
                found.setdefault(key, set()).add(record["test"])
    return found


def table(records, plain: set) -> str:
    """The markdown table: each flag, whose it is, how many tests set it, a few of them."""
    found, rows = covering(records), []
    for name, script in sorted(required()):
        tests = sorted(found.get((name, script), ()), key=lambda t: (t not in plain, t))
        examples = ", ".join(f"`{t}`" for t in tests[:EXAMPLES]) or "**none**"
        whose = SHARED if script == SHARED else f"`{script}.py`"
        rows.append(f"| `{flag(name)}` | {whose} | {len(tests)} | {examples} |")
    head = "| flag | of | tests that set it in a compared run | e.g. |\n|---|---|---|---|\n"
    return head + "\n".join(rows)


def read_table(text=None) -> dict:
    """docs/flags.md's table: {(flag, script or SHARED): (count, [example tests])}."""
    text = PAGE.read_text() if text is None else text
    rows = {}
    for name, whose, count, examples in re.findall(
        r"^\| `--([\w-]+)` \| (.+?) \| (\d+) \| (.*) \|$", MARKER.search(text)[0], re.M
    ):
        script = SHARED if whose == SHARED else whose.strip("`").removesuffix(".py")
        rows[name.replace("-", "_"), script] = (int(count), re.findall(r"`([^`]+)`", examples))
    return rows


def stale(folder, ran: set) -> list:
    """The table's examples that ran in this session and did not set their flag: one line each."""
    found = covering(recorded(folder))
    return [
        f"{test} no longer sets {flag(name)} in a compared run"
        for (name, script), (_, examples) in read_table().items()
        for test in examples
        if test in ran and test not in found.get((name, script), ())
    ]


def plain_tests() -> set:
    """The node ids a plain `pytest` runs (not -m full)."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-m", "not full"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return {line for line in done.stdout.splitlines() if "::" in line}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", help="the records: $FLAGS_RECORD of the runs")
    parser.add_argument("--write", action="store_true", help="rewrite docs/flags.md's table")
    args = parser.parse_args()
    records = recorded(*args.folders)
    text = table(records, plain_tests())
    print(text)
    missing = text.count("**none**")
    print(f"{len(required())} flags, {len({r['test'] for r in records})} tests, {missing} unset")
    if args.write:
        PAGE.write_text(
            MARKER.sub(f"<!-- flags:start -->\n{text}\n<!-- flags:end -->", PAGE.read_text())
        )
        print(f"wrote {PAGE.relative_to(ROOT)}")
    return 1 if missing else 0


if __name__ == "__main__":
    raise SystemExit(main())
