"""Which compared runs set each flag away from its default, and each pair of flags one function
reads together: docs/flags.md's table and dev/flag_pairs.md's.

A flag that no compared run sets (compared with one device, with a definition written in a
test, or with a formula) guards code that could be wrong in any way: nothing would notice. The
tests record every compared run's flags (tests/harness.py's record_flags, into $FLAGS_RECORD);
this tool turns a whole run's records into the tables, and tests/test_flags.py fails for a row
without a test. A flag every script shares (common.Config's) counts once, under any script; a
script's own flag (one it adds, whose default or meaning it changes, or its own code reads)
only in runs of that script. Pairs are read from the code (the AST): the flags each function
reads. A refusal's runs (tests/test_command_line.py's) count for the functions that refuse
flags. After the tests, conftest.py checks the tables' examples that ran against what they
recorded, so a table cannot keep a claim a test stopped making.

  FLAGS_RECORD=/tmp/flags pytest -m ""        # every test, recording (about 45 minutes)
  python dev/flags.py /tmp/flags --write    # rewrite docs/flags.md's table from the records
  python dev/flags.py /tmp/a /tmp/b         # the table from several runs' records, printed
  FLAGS_RECORD=/tmp/new pytest tests/test_new.py; python dev/flags.py /tmp/new --added --write
                                            # a new test file's records added to the tables
"""

import argparse
import ast
import dataclasses
import importlib
import itertools
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "flags.md"
MARKER = re.compile(r"<!-- flags:start -->\n.*?<!-- flags:end -->", re.DOTALL)
PAIRS_PAGE = ROOT / "dev" / "flag_pairs.md"
PAIRS = re.compile(r"<!-- pairs:start -->\n.*?<!-- pairs:end -->", re.DOTALL)
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


def _read(node, names, where=(), in_config=False, found=None) -> dict:
    """{function: flags} of an AST: config.x, c.x, self.config.x, self.x in a Config."""
    found = {} if found is None else found
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.ClassDef, ast.FunctionDef)):
            config = child.name == "Config" if isinstance(child, ast.ClassDef) else in_config
            _read(child, names, (*where, child.name), config, found)
            continue
        if isinstance(child, ast.Attribute) and child.attr in names and where:
            held = ast.unparse(child.value)
            if held in ("config", "c", "self.config") or (held == "self" and in_config):
                found.setdefault(".".join(where), set()).add(child.attr)
        _read(child, names, where, in_config, found)
    return found


def _refusing(node, where=(), found=None) -> set:
    """The functions of an AST that refuse flags: they call require() or raise ConfigError."""
    found = set() if found is None else found
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.ClassDef, ast.FunctionDef)):
            _refusing(child, (*where, child.name), found)
            continue
        called = ast.unparse(child.func) if isinstance(child, ast.Call) else ""
        raised = ast.unparse(child.exc) if isinstance(child, ast.Raise) and child.exc else ""
        if where and (called.endswith("require") or "ConfigError(" in raised):
            found.add(".".join(where))
        _refusing(child, where, found)
    return found


def refusing() -> set:
    """{"file:function"} of the functions that refuse flags, common.py's and each script's."""
    return {
        f"{file}:{function}"
        for file in ["common.py"] + [f"{script}.py" for script in SCRIPTS]
        for function in _refusing(ast.parse((ROOT / file).read_text()))
    }


def reads() -> dict:
    """{(file, function): the flags it reads}, common.py's and each script's."""
    names = {name for name, _ in required()}
    return {
        (file, function): read
        for file in ["common.py"] + [f"{script}.py" for script in SCRIPTS]
        for function, read in _read(ast.parse((ROOT / file).read_text()), names).items()
    }


def required_pairs() -> dict:
    """{(flag, flag, script or SHARED): the functions that read both}: a script's own code needs
    its runs, common.py's any script's."""
    pairs = {}
    for (file, function), read in reads().items():
        whose = SHARED if file == "common.py" else file.removesuffix(".py")
        for a, b in itertools.combinations(sorted(read), 2):
            pairs.setdefault((a, b, whose), []).append(f"{file}:{function}")
    return pairs


def read_by_scripts() -> dict:
    """{(flag, script): the functions}: each flag a script's own code reads, which its runs must
    set (runs only checked will do where every function reading it refuses flags)."""
    found = {}
    for (file, function), read in reads().items():
        for name in read if file != "common.py" else ():
            found.setdefault((name, file.removesuffix(".py")), []).append(f"{file}:{function}")
    return found


def rows() -> set:
    """{(flag, script or SHARED)}: the table's rows, required()'s and read_by_scripts()'s."""
    return required() | read_by_scripts().keys()


def setting(records) -> dict:
    """{(flag, script or SHARED): the tests that set it}: compared runs; where every function of
    a script's own code that reads it refuses flags, runs only checked too."""
    found, checked, refuses = covering(records), covering(records, True), refusing()
    for key, functions in read_by_scripts().items():
        if not found.get(key) and set(functions) <= refuses:
            found[key] = checked.get(key, set())
    return found


def covered_pairs(records) -> dict:
    """{(flag, flag, script or SHARED): the tests whose runs set them together}."""
    found = {}
    for record in records:
        for a, b in itertools.combinations(sorted(record["flags"]), 2):
            for key in ((a, b, SHARED), (a, b, record["script"])):
                found.setdefault(key, set()).add(record["test"])
    return found


def refused_together(records) -> dict:
    """{(flag, flag, script or SHARED): tests} whose refusal names one of them and whose example,
    passing every check, leaves the other out: no run can set them together."""
    passed = {
        (r["test"], r["script"]): set(r["flags"])
        for r in records
        if r.get("checked") and not r.get("refused")
    }
    found = {}
    for r in (r for r in records if r.get("refused") in r["flags"]):
        named, kept = r["refused"], passed.get((r["test"], r["script"]), set(r["flags"]))
        for dropped in set(r["flags"]) - kept - {named}:
            a, b = sorted([named, dropped])
            for key in ((a, b, SHARED), (a, b, r["script"])):
                found.setdefault(key, set()).add(r["test"])
    return found


def pair_tests(records) -> dict:
    """{(flag, flag, script or SHARED): (the tests that set them together, or that refuse them
    together)}: compared runs; where every function reading the pair refuses flags, runs only
    checked too (a refusal, or the example its message gives, which passes every check)."""
    compared = covered_pairs([r for r in records if not r.get("checked")])
    checked, refuses = covered_pairs([r for r in records if r.get("checked")]), refusing()
    never, found = refused_together(records), {}
    for key, functions in required_pairs().items():
        tests = compared.get(key, set())
        tests |= checked.get(key, set()) if set(functions) <= refuses else set()
        found[key] = (tests, set() if tests else never.get(key, set()))
    return found


def open_pairs(records) -> dict:
    """{(flag, flag, script or SHARED): the functions} whose pair no test sets or refuses."""
    pairs = required_pairs()
    return {
        key: pairs[key]
        for key, (set_, refused) in pair_tests(records).items()
        if not set_ | refused
    }


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


def covering(records, checked=False) -> dict:
    """{(flag, script or SHARED): the tests whose compared runs (or runs only `checked`) set it}."""
    found = {}
    for record in (r for r in records if checked or not r.get("checked")):
        for name in record["flags"]:
            for key in ((name, SHARED), (name, record["script"])):
                found.setdefault(key, set()).add(record["test"])
    return found


def table(records, plain: set, counted=None) -> str:
    """The markdown table: each flag, whose it is, how many tests set it, a few of them; added
    to `counted` (read_table()'s rows), if given, the records being of tests it has not counted."""
    found, lines = setting(records), []
    for name, script in sorted(rows()):
        tests = sorted(found.get((name, script), ()), key=lambda t: (t not in plain, t))
        before, kept = (counted or {}).get((name, script), (0, []))
        examples = ", ".join(f"`{t}`" for t in (kept + tests)[:EXAMPLES]) or "**none**"
        whose = SHARED if script == SHARED else f"`{script}.py`"
        lines.append(f"| `{flag(name)}` | {whose} | {before + len(tests)} | {examples} |")
    head = "| flag | of | tests that set it in a compared run | e.g. |\n|---|---|---|---|\n"
    return head + "\n".join(lines)


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


def pair_table(records, plain: set, counted=None) -> str:
    """The markdown table of pairs: the functions that read both, how many tests set them
    together (or refuse them together), one of those tests; added to `counted` as table()'s."""
    pairs, rows = required_pairs(), []
    for (a, b, whose), (tests, refused) in sorted(pair_tests(records).items()):
        before, kept = (counted or {}).get((a, b, whose), (0, []))
        refused |= set(kept) if before == "refused together" else set()
        before = before if isinstance(before, int) else 0
        order = lambda t: (t not in plain, t)  # noqa: E731
        first = (kept if before else []) + sorted(tests or refused, key=order)
        count = before + len(tests) if before or tests or not refused else "refused together"
        first = first[:1]
        example = f"`{first[0]}`" if first else "**none**"
        reader = ", ".join(pairs[a, b, whose])
        rows.append(f"| `{flag(a)}` `{flag(b)}` | {reader} | {count} | {example} |")
    head = "| flags | read by | tests that set them together | e.g. |\n|---|---|---|---|\n"
    return head + "\n".join(rows)


def read_pairs(text=None) -> dict:
    """dev/flag_pairs.md's table: {(flag, flag, script or SHARED): (count or "refused
    together", [example test])}."""
    text = PAIRS_PAGE.read_text() if text is None else text
    rows = {}
    for a, b, reader, count, examples in re.findall(
        r"^\| `--([\w-]+)` `--([\w-]+)` \| (.+?) \| (\d+|refused together) \| (.*) \|$",
        PAIRS.search(text)[0],
        re.M,
    ):
        file = reader.split(":")[0]
        whose = SHARED if file == "common.py" else file.removesuffix(".py")
        key = (a.replace("-", "_"), b.replace("-", "_"), whose)
        rows[key] = (int(count) if count.isdigit() else count, re.findall(r"`([^`]+)`", examples))
    return rows


def stale(folder, ran: set) -> list:
    """The tables' examples that ran in this session and did not set their flag (or pair): one
    line each."""
    records = recorded(folder)
    found, together = setting(records), pair_tests(records)
    flags_ = [
        f"{test} no longer sets {flag(name)} in a compared run"
        for (name, script), (_, examples) in read_table().items()
        for test in examples
        if test in ran and test not in found.get((name, script), ())
    ]
    return flags_ + [
        f"{test} no longer sets {flag(a)} {flag(b)} together"
        for (a, b, whose), (_, examples) in read_pairs().items()
        for test in examples
        if test in ran and test not in set.union(*together.get((a, b, whose), (set(),)))
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
    parser.add_argument("--write", action="store_true", help="rewrite the tables")
    new = "the records are of tests the tables have not counted: add them to their counts"
    parser.add_argument("--added", action="store_true", help=new)
    args = parser.parse_args()
    records = recorded(*args.folders)
    plain = plain_tests()
    counted = (read_table(), read_pairs()) if args.added else (None, None)
    text, pairs = table(records, plain, counted[0]), pair_table(records, plain, counted[1])
    print(text)
    missing = text.count("**none**")
    print(f"{len(rows())} flags, {len({r['test'] for r in records})} tests, {missing} unset")
    left = {k: f for k, f in open_pairs(records).items() if k not in (counted[1] or {})}
    for (a, b, whose), functions in sorted(left.items()):
        print(f"never together: {flag(a)} {flag(b)} ({whose}: {', '.join(functions)})")
    print(f"{len(required_pairs())} pairs of flags one function reads, {len(left)} never together")
    if args.write:
        page = MARKER.sub(f"<!-- flags:start -->\n{text}\n<!-- flags:end -->", PAGE.read_text())
        PAGE.write_text(page)
        pairs = f"<!-- pairs:start -->\n{pairs}\n<!-- pairs:end -->"
        PAIRS_PAGE.write_text(PAIRS.sub(lambda _: pairs, PAIRS_PAGE.read_text()))
        print(f"wrote {PAGE.relative_to(ROOT)} and {PAIRS_PAGE.relative_to(ROOT)}")
    return 1 if missing or left else 0


if __name__ == "__main__":
    raise SystemExit(main())
