"""A checkpoint's parameters as a .safetensors file: each tensor named by its path in the model
(block_0/attn/qkv/kernel), the flags the checkpoint was made by in the file's metadata. Any
script's --init-from reads it, as it reads the checkpoint folder itself; other tools read it too.

  python tools/export.py runs/first weights.safetensors   # the folder's newest checkpoint
"""

import json
import os
import sys
from pathlib import Path

import jax
import numpy as np
import safetensors.numpy
from orbax.checkpoint import v1 as ocp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # common.py
import common  # noqa: E402


def export(folder: str, out: str) -> dict:
    """Write `folder`'s newest checkpoint's parameters to `out`; return them, by name."""
    with ocp.training.Checkpointer(os.path.abspath(folder)) as saved:
        step = saved.latest.step
        shapes, flags = saved.metadata(step).metadata["params"], common.recorded_flags(folder)
    here = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=here), shapes)
    params = common.read_params(folder, like)
    tensors = {
        jax.tree_util.keystr(path, simple=True, separator="/"): np.asarray(x)
        for path, x in jax.tree_util.tree_leaves_with_path(params)
    }
    safetensors.numpy.save_file(tensors, out, metadata={"flags": json.dumps(flags)})
    return tensors


def main(argv: list) -> int:
    if len(argv) != 2:
        print("usage: python tools/export.py CHECKPOINT_DIR OUT.safetensors", file=sys.stderr)
        return 2
    folder, out = argv
    try:
        tensors = export(folder, out)
    except Exception as error:  # Orbax's errors have no common type
        print(f"export.py: error: {folder}: {common.one_line(error)}", file=sys.stderr)
        return 2
    print(
        f"wrote {len(tensors)} tensors ({sum(x.size for x in tensors.values()):,} values) to {out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
