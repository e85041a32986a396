"""A checkpoint's parameters as a .safetensors file: each tensor named by its path in the model
(block_0/attn/qkv/kernel), the flags the checkpoint was made by in the file's metadata. Any
script's --init-from reads it, as it reads the checkpoint folder itself; other tools read it too.
With --names gpt2, Hugging Face GPT-2's names, both ways: its published weights for the built-in
GPT (run with --tie-embeddings, --heads, --d-model, --layers and --seq-len as its), or a run's.

  python tools/export.py runs/first weights.safetensors   # the folder's newest checkpoint
  python tools/export.py --names gpt2 gpt2/model.safetensors gpt2.safetensors   # GPT-2 124M in
  python tools/export.py --names gpt2 runs/first hf/model.safetensors            # and out
"""

import argparse
import json
import os
import sys
import tempfile
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


PAD_LOGIT = -1e4  # a padded vocabulary row's logit, for every input: it cannot win
SAME = {  # a block's tensors that GPT-2 holds as the model does: its name for each
    "ln1/scale": "ln_1.weight", "ln1/bias": "ln_1.bias",
    "ln2/scale": "ln_2.weight", "ln2/bias": "ln_2.bias",
    "mlp/fc1/kernel": "mlp.c_fc.weight", "mlp/fc1/bias": "mlp.c_fc.bias",
    "mlp/fc2/kernel": "mlp.c_proj.weight", "mlp/fc2/bias": "mlp.c_proj.bias",
}  # fmt: skip


def from_gpt2(hf: dict, heads: int, vocab_size: int, seq_len: int) -> dict:
    """Hugging Face GPT-2's tensors in the model's paths: Conv1D's [in, out] is a kernel's layout;
    c_attn's queries, keys and values regrouped head by head; the key bias dropped and the value
    bias moved into the out layer's (attention's weights sum to 1); the vocabulary padded."""
    hf = {k.removeprefix("transformer."): np.asarray(v, np.float64) for k, v in hf.items()}
    table, scale, bias = hf["wte.weight"], hf["ln_f.weight"], hf["ln_f.bias"]
    # A row c / scale meets every input at the same logit, c * sum(bias / scale): the norm's
    # output less its bias sums to zero. c puts it at PAD_LOGIT.
    pad = PAD_LOGIT / np.sum(bias / scale) / scale
    ours = {
        "embed/token/embedding": np.concatenate(
            [table, np.tile(pad, (vocab_size - len(table), 1))]
        ),
        "embed/position/embedding": hf["wpe.weight"][:seq_len],
        "head/ln_f/scale": scale,
        "head/ln_f/bias": bias,
    }
    for i in range(sum(k.endswith("attn.c_attn.weight") for k in hf)):
        h, block = {k.removeprefix(f"h.{i}."): v for k, v in hf.items()}, f"block_{i}"
        d = len(h["ln_1.weight"])
        q_bias, _, v_bias = np.split(h["attn.c_attn.bias"], 3)
        qkv = h["attn.c_attn.weight"].reshape(d, 3, heads, -1).transpose(0, 2, 1, 3)
        ours |= {
            f"{block}/attn/qkv/kernel": qkv.reshape(d, 3 * d),
            f"{block}/attn/query_bias": q_bias,
            f"{block}/attn/out/kernel": h["attn.c_proj.weight"],
            f"{block}/attn/out/bias": h["attn.c_proj.bias"] + v_bias @ h["attn.c_proj.weight"],
        }
        ours |= {f"{block}/{mine}": h[theirs] for mine, theirs in SAME.items()}
    return {k: v.astype(np.float32) for k, v in ours.items()}


def to_gpt2(ours: dict, heads: int) -> dict:
    """The model's tensors in Hugging Face GPT-2's names (from_gpt2 undone, keys and values
    without a bias), for a run made with --tie-embeddings and as many key-value heads as heads."""
    if "head/out/kernel" in ours:
        raise ValueError("GPT-2 ties its head to the token table: export a run of --tie-embeddings")
    hf = {
        "wte.weight": ours["embed/token/embedding"],
        "wpe.weight": ours["embed/position/embedding"],
    }
    hf |= {"ln_f.weight": ours["head/ln_f/scale"], "ln_f.bias": ours["head/ln_f/bias"]}
    for i in range(sum(k.endswith("attn/qkv/kernel") for k in ours)):
        block, h = {k.removeprefix(f"block_{i}/"): v for k, v in ours.items()}, f"h.{i}."
        d = len(block["ln1/scale"])
        if block["attn/qkv/kernel"].shape != (d, 3 * d):
            raise ValueError("GPT-2 has a key and a value head per query head: drop --kv-heads")
        qkv = block["attn/qkv/kernel"].reshape(d, heads, 3, -1).transpose(0, 2, 1, 3)
        bias = np.concatenate([block["attn/query_bias"], np.zeros(2 * d, np.float32)])
        hf |= {h + "attn.c_attn.weight": qkv.reshape(d, 3 * d), h + "attn.c_attn.bias": bias}
        hf |= {h + "attn.c_proj.weight": block["attn/out/kernel"]}
        hf |= {h + "attn.c_proj.bias": block["attn/out/bias"]}
        hf |= {h + theirs: block[mine] for mine, theirs in SAME.items()}
    return {k: np.ascontiguousarray(v) for k, v in hf.items()}


def convert(source: str, out: str, heads: int, vocab_size: int, seq_len: int) -> dict:
    """--names gpt2: GPT-2's file into the model's paths, or a checkpoint's (or file's) out."""
    if os.path.isdir(source):
        with tempfile.TemporaryDirectory() as folder:
            tensors = export(source, f"{folder}/params.safetensors")
        heads = common.recorded_flags(source).get("heads", heads)
    else:
        tensors = safetensors.numpy.load_file(source)
        with safetensors.safe_open(source, "numpy") as file:
            heads = json.loads((file.metadata() or {}).get("flags", "{}")).get("heads", heads)
    if any(k.endswith("wte.weight") for k in tensors):
        tensors = from_gpt2(tensors, heads, vocab_size, seq_len)
        layers, d_model = (
            sum(k.endswith("qkv/kernel") for k in tensors),
            len(tensors["head/ln_f/bias"]),
        )
        flags = dict(layers=layers, d_model=d_model, heads=heads, seq_len=seq_len)
        flags |= dict(vocab_size=vocab_size, tie_embeddings=True)  # as --init-from checks them
        safetensors.numpy.save_file(tensors, out, metadata={"flags": json.dumps(flags)})
    else:
        tensors = to_gpt2(tensors, heads)
        safetensors.numpy.save_file(tensors, out, metadata={"format": "pt"})  # as transformers'
    return tensors


def main(argv: list) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n")[1]
    )
    parser.add_argument("source", help="a checkpoint folder, or with --names gpt2 a .safetensors")
    parser.add_argument("out", help="the .safetensors file to write")
    parser.add_argument("--names", choices=["model", "gpt2"], default="model")
    parser.add_argument("--heads", type=int, default=12, help="GPT-2's (124M: 12), coming in")
    parser.add_argument("--vocab-size", type=int, default=50304, help="padded to, coming in")
    parser.add_argument("--seq-len", type=int, default=1024, help="positions kept, coming in")
    args = parser.parse_args(argv)
    try:
        if args.names == "gpt2":
            tensors = convert(args.source, args.out, args.heads, args.vocab_size, args.seq_len)
        else:
            tensors = export(args.source, args.out)
    except Exception as error:  # Orbax's errors have no common type
        print(f"export.py: error: {args.source}: {common.one_line(error)}", file=sys.stderr)
        return 2
    values = sum(x.size for x in tensors.values())
    print(f"wrote {len(tensors)} tensors ({values:,} values) to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
