"""Print every parameter of a script's state with its shape, layout and bytes per device, then
draw the largest matrix the strategy splits (or the largest): from the state's shapes and
shardings alone, nothing allocated. The script is a path (your copy, its common.py beside it,
as tools/compile_for.py takes it); the flags are the script's.

  python tools/show_sharding.py pjit_tp.py --mesh data=2,model=4
  python tools/show_sharding.py my_project/logical_pjit.py --rules fsdp_tp --model my_model.py
"""

import importlib
import math
import sys
from pathlib import Path

import jax


def show_sharding(params):
    """The table of `params` (ShapeDtypeStructs or arrays, no boxes), then the drawing."""
    leaves = jax.tree_util.tree_leaves_with_path(params)
    named = [(jax.tree_util.keystr(path, simple=True, separator="/"), x) for path, x in leaves]
    size = lambda x: math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize  # noqa: E731
    rows = [(n, str(x.shape), str(x.sharding.spec), f"{size(x):,}") for n, x in named]
    rows = [("parameter", "shape", "spec", "bytes/device"), *rows]
    widths = [max(len(row[i]) for row in rows) for i in range(3)] + [0]
    for row in rows:
        print(*(text.ljust(width) for text, width in zip(row, widths, strict=True)))
    matrices = {name: x for name, x in named if x.ndim == 2}
    split = {n: x for n, x in matrices.items() if not x.sharding.is_fully_replicated} or matrices
    if name := max(split, key=lambda n: split[n].size, default=None):
        print(f"{name} {split[name].shape} over the devices:")
        jax.debug.visualize_sharding(split[name].shape, split[name].sharding)


def main(argv):
    path = Path(argv[0] if argv else "none")
    if path.suffix != ".py" or not path.exists() or path.stem == "pmap_dp":  # pmap: all on all
        print(
            f"show_sharding.py: error: {path} is not a script with a mesh, e.g. fsdp.py",
            file=sys.stderr,
        )
        raise SystemExit(2)
    sys.path.insert(0, str(path.parent))  # the script's common.py
    script, common = importlib.import_module(path.stem), importlib.import_module("common")
    config = common.parse_config(script.Config, script.__doc__, argv[1:])
    common.setup(config)
    state = script.init_state(config, script.make_mesh(config), shapes_only=True)
    show_sharding(common.unbox(state.params))


if __name__ == "__main__":
    main(sys.argv[1:])
