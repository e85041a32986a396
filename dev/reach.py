"""What a copier of a script carries: the script's and common.py's lines, and how many of
common.py's top-level definitions the script reaches (through the ones it calls, transitively).

  python dev/reach.py fsdp.py            # or any script
"""

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def definitions(tree) -> dict:
    """Each top-level name of a module and the names its definition mentions."""
    found = {}
    for node in tree.body:
        targets = getattr(node, "targets", None) or [getattr(node, "target", None)]
        names = (
            [node.name]
            if hasattr(node, "name")
            else [t.id for t in targets if isinstance(t, ast.Name)]
        )
        used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        for name in names:
            found[name] = found.get(name, set()) | used
    return found


def main(script: str):
    common = definitions(ast.parse((ROOT / "common.py").read_text()))
    text = (ROOT / script).read_text()
    used = {
        n.attr
        for n in ast.walk(ast.parse(text))
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "common"
    }
    reached, todo = set(), [name for name in used if name in common]
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo += [n for n in common[name] if n in common and n not in reached]
    lines = [len(text.splitlines()), len((ROOT / "common.py").read_text().splitlines())]
    print(
        f"{script}: {lines[0]} lines + common.py {lines[1]} = {sum(lines)} carried; it reaches "
        f"{len(reached)} of common.py's {len(common)} top-level definitions"
    )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "fsdp.py")
