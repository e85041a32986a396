"""Every script compiled for real TPU slices on this machine, none run: benchmarks/tpu_slices.md.

Each script runs under tools/compile_for.py (libtpu's compile-only devices: pip install -t .tpu
-r requirements-tpu.txt) at GPT-2 small (12 layers, width 768, 12 heads, 1,024 tokens, vocabulary
50,304, bfloat16, batch 64, XLA's attention) and at about 1B parameters (24 layers, width 1,792,
14 heads, the same tokens; with --remat too), on v5e-8 (v5e:2x4), v5p-8 (v5p:2x2x1, 4 chips)
and a v5p slice of 64 chips (v5p:4x4x4, 16 hosts), and reports what the compiled TPU program
holds: whether it fits in a chip's HBM, memory per chip, the collectives' bytes, and the step
time and MFU predicted from it at the chip's published rates (tools/compile_for.py's CHIPS).
These are compiled, not run.

  python tools/tpu_slices.py --jobs 2             # print the table (about an hour, 2 cores)
  python tools/tpu_slices.py --write              # and put its rows in benchmarks/tpu_slices.md
  python tools/tpu_slices.py --slices v5e:2x4 --sizes gpt2_small --scripts fsdp   # a part
"""

import argparse
import concurrent.futures
import datetime
import functools
import importlib.metadata
import json
import math
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "benchmarks" / "tpu_slices.md"
MARKER = re.compile(r"<!-- tpu:start -->\n.*?<!-- tpu:end -->", re.DOTALL)

SIZES = {
    "gpt2_small": "--layers 12 --d-model 768 --heads 12",
    "1b": "--layers 24 --d-model 1792 --heads 14",
    "1b_remat": "--layers 24 --d-model 1792 --heads 14 --remat",  # what makes it fit a v5e
}
COMMON = "--seq-len 1024 --vocab-size 50304 --dtype bfloat16 --batch-size 64 --attention xla"
SLICES = {"v5e:2x4": "v5e-8", "v5p:2x2x1": "v5p-8", "v5p:4x4x4": "v5p-128 (64 chips)"}
SCRIPTS = {  # the script and what it needs beyond the size
    "pmap_dp": "",
    "shardmap_dp": "",
    "fsdp": "",
    "pjit_tp": "",
    "logical_pjit": "",
    "explicit_sharding": "",
    "pipeline": "",
    "context_parallel": "",
    # with a capacity, as the table was first measured; dropless in docs/tpu.md's list
    "expert_parallel": "--experts 8 --capacity-factor 1.25",
}


def compile_for(script: str, topology: str, flags: str) -> dict:
    """One script compiled for one slice: its summary, or why it has none."""
    with tempfile.TemporaryDirectory() as folder:
        metrics = Path(folder) / "m.jsonl"
        command = [sys.executable, "tools/compile_for.py", topology, f"{script}.py"]
        command += [*flags.split(), "--metrics-file", str(metrics)]
        began = time.perf_counter()
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        seconds = time.perf_counter() - began
        layout = re.search(r"\(mesh ([^)]*)\)", done.stdout)  # the tool's first line
        mesh = {a: int(n) for a, n in re.findall(r"(\w+)=(\d+)", layout[1])} if layout else None
        if not metrics.exists():
            lines = (done.stderr.strip() or done.stdout.strip() or "?").splitlines()
            return {"error": lines[-1], "seconds": seconds, "mesh": mesh}
        summary = json.loads(metrics.read_text().splitlines()[-1])["summary"]
        return {**summary, "fits": done.returncode == 0, "seconds": seconds, "mesh": mesh}


@functools.cache
def counted(flags: str) -> tuple:
    """The training config of a row's flags, and its parameters by piece (embed, blocks, head)
    and by the axis that splits them (model: heads, MLP, vocabulary; expert)."""
    sys.path.insert(0, str(ROOT))
    import common

    given, key = {}, None
    for word in flags.split():  # --layers 12 --remat ...: the training config's fields
        if word.startswith("--"):
            key = word[2:].replace("-", "_")
            given[key] = True
        else:
            given[key] = type(getattr(common.Config, key))(word)
    config, sized = common.Config(**given), {}
    shapes = {name: getattr(config, name) for name in common.SHAPE_FLAGS}
    # One block, the others its copies: built whole, a model of 24 took 28 s
    for path, box in common.logical_names(common.Config(**{**shapes, "layers": 1})):
        piece = "blocks" if path.startswith("block") else path.split("/")[0]
        size = box.value.size * (config.layers if piece == "blocks" else 1)
        sized[piece] = sized.get(piece, 0) + size
        split = "expert" in box.names and "expert"
        if split := split or ({"heads", "mlp", "vocab"} & set(box.names) and "model"):
            sized[split] = sized.get(split, 0) + size
    return config, sized


def formula(script: str, size: str, topology: str, mesh: dict | None) -> tuple | None:
    """What the script's strategy needs per chip by docs/costs.md's formulas, in the TPU's
    dtypes: its state and float32 gradients (16 B a parameter it holds), the activations its
    backward keeps (values of the compute dtype, attention's probabilities and the logits in
    float32) and, for FSDP, twice the largest piece's gathered float32 parameters."""
    c, sized = counted(f"{SIZES[size]} {COMMON} {SCRIPTS[script]}")
    p = sized["embed"] + sized["blocks"] + sized["head"]
    largest = max(sized["embed"], sized["blocks"] / c.layers, sized["head"])
    chips = math.prod(int(n) for n in topology.split(":")[1].split("x"))
    mesh = mesh or ({"data": chips} if script == "pmap_dp" else None)
    if mesh is None:
        return None
    data, b = mesh.get("data", 1), (2 if c.dtype == "bfloat16" else 4)
    s, d, h, v, layers = c.seq_len, c.d_model, c.heads, c.vocab_size, c.layers
    block, head = 16 * d * b + 4 * h * s, 2 * d * b + 4 * v  # a token's, in a layer, in the head
    held, tokens, layer, whole, gathered = p, c.batch_size / data * s, block, block, 0
    if script == "fsdp":  # dots_saveable: the block's input and its matmuls' outputs
        held, layer, gathered = p / data, 10 * d * b + 4 * h * s, 2 * 4 * largest
    elif script in ("pjit_tp", "logical_pjit", "explicit_sharding"):
        t = mesh["model"]  # the heads, the MLP and the vocabulary split t ways; the rest whole
        held = p - sized.get("model", 0) * (1 - 1 / t)
        layer = whole = 4 * d * b + (12 * d * b + 4 * h * s) / t
        head = 2 * d * b + 4 * v / t
        if script != "pjit_tp":  # their default rules, fsdp_tp: 'embed' split over 'data' too
            held, gathered = held / data, 2 * 4 * largest / t
    elif script == "pipeline":  # 1F1B, under its default --remat: min(M, S) stage inputs, one
        stages, m = mesh["stage"], 8  # micro-batch's stage at a time, its head's logits and their
        held, tokens, whole = p / stages, tokens / m, 0  # gradient; the embedding and head
        layer, layers, head = 0, 0, min(m, stages) * d * b + layers / stages * block + head + 4 * v
        gathered = 2 * 4 * (sized["embed"] + sized["head"])  # gathered, with their gradients
    elif script == "context_parallel":  # the ring: for each hop a key, a value, the running sums
        hops = mesh["context"]
        tokens, layer = tokens / hops, 16 * d * b + hops * (3 * d * b + 2 * 4 * h)
    elif script == "expert_parallel":  # each token's top_k copies, capacity_factor over its share
        copies = c.top_k * c.capacity_factor
        held = p - sized["expert"] * (1 - 1 / mesh["expert"])
        tokens = c.batch_size / chips * s
        layer = whole = block + (copies - 1) * 8 * d * b + 2 * copies * d * b
    act = tokens * (layers * (d * b if c.remat else layer) + whole * c.remat + head)
    return 16 * held, act, gathered


def short(error: str) -> str:
    """compile_for.py's one line, in a table's cell."""
    if over := re.search(r"temporaries \(([\d.]+\w)\) exceeds available HBM \(([\d.]+\w)\)", error):
        return f"XLA's temporaries {over[1][:-1]} GiB, of {over[2][:-1]} GiB"
    error = re.sub(r"^compile_for.py: error: (\S+ does not compile for \S+ )?", "", error)
    return re.sub(r"^\S+\.py: (error: )?| \(see --help\)$", "", error)


def needs(script: str, size: str, topology: str, mesh: dict | None) -> str:
    """The formula's cell: the mesh; state and gradients + activations + gathered, in GiB."""
    if not (parts := formula(script, size, topology, mesh)):
        return ""
    axes = ",".join(f"{a}={n}" for a, n in mesh.items()) if mesh else "pmap"
    each = " + ".join(f"{x / 2**30:.2f}" for x in parts)
    return f"{axes}: {each} = {sum(parts) / 2**30:.2f} GiB"


def row(script, size, topology, result) -> str:
    name, need = (
        f"{script} {size} {SLICES[topology]}",
        needs(script, size, topology, result["mesh"]),
    )
    if "error" in result:  # the tool's one line, short
        return f"| {name} | no: {short(result['error'])} | | {need} | | | | | | |"
    tpu, moved = result["predicted"], sum(c["bytes"] for c in result["collectives"].values())
    at_least, at_most = ("≥ ", "≤ ") if result["loops_counted_once"] else ("", "")  # a floor
    ways = ("overlapped", "not_overlapped")  # the metrics file sorts its keys
    steps = " | ".join(f"{at_least}{tpu['step_seconds'][w] * 1e3:,.0f} ms" for w in ways)
    mfus = " | ".join(f"{at_most}{tpu['mfu'][w]:.0%}" for w in ways)
    return (
        f"| {name} | {'yes' if result['fits'] else '**no**'} "
        f"| {result['hbm_need_bytes'] / 2**30:.2f} GiB | {need} "
        f"| {result['state_bytes_per_device'] / 2**30:.2f} GiB | {moved / 2**30:.2f} GiB "
        f"| {steps} | {mfus} |"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--write", action="store_true", help="rewrite the table in benchmarks/tpu_slices.md"
    )
    parser.add_argument("--slices", nargs="*", default=list(SLICES), help="topologies")
    parser.add_argument("--sizes", nargs="*", default=list(SIZES), help="model sizes")
    parser.add_argument("--scripts", nargs="*", default=list(SCRIPTS), help="scripts")
    parser.add_argument("--jobs", type=int, default=1, help="compiles at once (each takes a core)")
    args = parser.parse_args()
    runs = [(c, z, t) for z in args.sizes for t in args.slices for c in args.scripts]

    def one(run):
        script, size, topology = run
        result = compile_for(script, topology, f"{SIZES[size]} {COMMON} {SCRIPTS[script]}")
        line = row(script, size, topology, result)
        print(line, f"({result['seconds']:.0f} s)", flush=True)
        return line

    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        made = dict(zip(runs, pool.map(one, runs), strict=True))
    if args.write:  # these rows replace their own in the table, which keeps the others
        every = [(c, z, t) for z in SIZES for t in SLICES for c in SCRIPTS]
        old = MARKER.search(PAGE.read_text())[0].splitlines()
        kept = {line.split(" | ")[0][2:]: line for line in old if line.startswith("| ")}
        lines = [made.get(r) or kept.get(f"{r[0]} {r[1]} {SLICES[r[2]]}") for r in every]
        where = [str(ROOT / ".tpu")]  # requirements-tpu.txt's libtpu, beside the project
        libtpu = next(importlib.metadata.distributions(name="libtpu", path=where)).version
        jax = importlib.metadata.version("jax")
        header = (
            "| script, model, slice | fits | HBM per chip | its formula: mesh, state and gradients "
            "+ activations + gathered | state per chip | collectives' buffers per step | step, "
            "overlapped | step, not overlapped | MFU, overlapped | MFU, not overlapped |\n"
            "|---|---|---|---|---|---|---|---|---|---|\n"
        )
        table = f"Compiled on {datetime.date.today()}, JAX {jax}, libtpu {libtpu}.\n\n{header}"
        table += "\n".join(line for line in lines if line)
        text = MARKER.sub(
            lambda _: f"<!-- tpu:start -->\n{table}\n<!-- tpu:end -->", PAGE.read_text()
        )
        PAGE.write_text(text)


if __name__ == "__main__":
    main()
