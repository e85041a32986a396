"""Regenerate the diff excerpts of docs/transitions.md from the scripts.

Each excerpt sits between two markers in docs/transitions.md:

  <!-- diff shardmap_dp.py fsdp.py: init_state train_step -->
  ...generated: a unified diff of those top-level definitions...
  <!-- end diff -->

The first marker names two neighbouring scripts and the top-level definitions (functions,
classes or assignments) to compare; this tool puts `diff -u` of their source in between. So the
excerpts are always the real code, and tests/test_docs.py fails when they are stale.

  python dev/transitions.py           # rewrite the excerpts
  python dev/transitions.py --check   # exit 1 if any excerpt differs from the scripts
"""

import argparse
import ast
import difflib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "transitions.md"
MARKER = re.compile(r"<!-- diff (\S+) (\S+): ([\w ]+) -->\n.*?<!-- end diff -->", re.DOTALL)


def definitions(path: Path, names: list) -> tuple:
    """The source of the named top-level definitions of a script, in the order given; a name
    the script lacks contributes nothing (the diff shows it as added or removed)."""
    source = path.read_text()
    found = {}
    for node in ast.parse(source).body:
        targets = (
            [node.name]
            if hasattr(node, "name")
            else [t.id for t in getattr(node, "targets", []) if hasattr(t, "id")]
        )
        for name in targets:
            start = min([d.lineno for d in getattr(node, "decorator_list", [])] + [node.lineno])
            found[name] = "\n".join(source.splitlines()[start - 1 : node.end_lineno])
    unknown = [n for n in names if n not in found]
    return "\n\n".join(found[n] for n in names if n in found), unknown


def excerpt(match) -> str:
    before, after, names = match.group(1), match.group(2), match.group(3).split()
    old, missing_old = definitions(ROOT / before, names)
    new, missing_new = definitions(ROOT / after, names)
    both_missing = set(missing_old) & set(missing_new)
    if both_missing:
        raise SystemExit(
            f"{PAGE.name}: neither {before} nor {after} defines {', '.join(sorted(both_missing))}"
        )
    diff = difflib.unified_diff(old.splitlines(), new.splitlines(), before, after, lineterm="", n=2)
    return (
        f"<!-- diff {before} {after}: {' '.join(names)} -->\n```diff\n"
        + "\n".join(diff)
        + "\n```\n<!-- end diff -->"
    )


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--check", action="store_true", help="only check; exit 1 if an excerpt is stale"
    )
    args = parser.parse_args()
    readme = PAGE.read_text()
    fresh = MARKER.sub(excerpt, readme)
    if args.check:
        if fresh != readme:
            sys.exit(
                f"{PAGE}'s transition excerpts differ from the scripts: run python "
                "dev/transitions.py"
            )
        print(f"{PAGE.name}: {len(MARKER.findall(readme))} transition excerpts match the scripts")
    else:
        PAGE.write_text(fresh)
        print(f"{PAGE.name}: rewrote {len(MARKER.findall(readme))} transition excerpts")


if __name__ == "__main__":
    main()
