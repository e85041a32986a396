"""Every script compiled for real TPU slices on this machine, none run: docs/tpu.md's table.

Each script runs under tools/compile_for.py (libtpu's compile-only devices: pip install -t .tpu
-r requirements-tpu.txt) at GPT-2 small (12 layers, width 768, 12 heads, 1,024 tokens, vocabulary
50,304, bfloat16, batch 64) and at about 1B parameters (24 layers, width 1,792, 14 heads, the
same tokens; with --remat too), on v5e-8 (v5e:2x4), v5p-8 (v5p:2x2x1, 4 chips) and a v5p slice
of 64 chips (v5p:4x4x4, 16 hosts), and reports what the compiled TPU program holds: whether it
fits in a chip's HBM, memory per chip, the collectives' bytes, and the step time and MFU
predicted from it at the chip's published rates (tools/compile_for.py's CHIPS). These are
compiled, not run.

  python tools/tpu_slices.py --jobs 2             # print the table (about an hour, 2 cores)
  python tools/tpu_slices.py --write              # and put its rows in docs/tpu.md's table
  python tools/tpu_slices.py --slices v5e:2x4 --sizes gpt2_small --scripts fsdp   # a part
"""

import argparse
import concurrent.futures
import datetime
import importlib.metadata
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "tpu.md"
MARKER = re.compile(r"<!-- tpu:start -->\n.*?<!-- tpu:end -->", re.DOTALL)

SIZES = {
    "gpt2_small": "--layers 12 --d-model 768 --heads 12",
    "1b": "--layers 24 --d-model 1792 --heads 14",
    "1b_remat": "--layers 24 --d-model 1792 --heads 14 --remat",  # what makes it fit a v5e
}
COMMON = "--seq-len 1024 --vocab-size 50304 --dtype bfloat16 --batch-size 64"
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
    # dropless routing's grouped matmul does not compile for TPU yet (docs/tpu.md)
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
        if not metrics.exists():
            lines = (done.stderr.strip() or done.stdout.strip() or "?").splitlines()
            return {"error": lines[-1], "seconds": seconds}
        summary = json.loads(metrics.read_text().splitlines()[-1])["summary"]
        return {**summary, "fits": done.returncode == 0, "seconds": seconds}


def short(error: str) -> str:
    """compile_for.py's one line, in a table's cell."""
    if over := re.search(r"temporaries \(([\d.]+\w)\) exceeds available HBM \(([\d.]+\w)\)", error):
        return f"XLA's temporaries {over[1][:-1]} GiB, of {over[2][:-1]} GiB"
    error = re.sub(r"^compile_for.py: error: (\S+ does not compile for \S+ )?", "", error)
    return re.sub(r"^\S+\.py: (error: )?| \(see --help\)$", "", error)


def row(script, size, topology, result) -> str:
    name = f"{script} {size} {SLICES[topology]}"
    if "error" in result:  # the tool's one line, short
        return f"| {name} | no: {short(result['error'])} | | | | | | | |"
    tpu, moved = result["predicted"], sum(c["bytes"] for c in result["collectives"].values())
    at_least, at_most = ("≥ ", "≤ ") if result["loops_counted_once"] else ("", "")  # a floor
    steps = " | ".join(f"{at_least}{s * 1e3:,.0f} ms" for s in tpu["step_seconds"].values())
    mfus = " | ".join(f"{at_most}{m:.0%}" for m in tpu["mfu"].values())
    return (
        f"| {name} | {'yes' if result['fits'] else '**no**'} "
        f"| {result['hbm_need_bytes'] / 2**30:.2f} GiB "
        f"| {result['state_bytes_per_device'] / 2**30:.2f} GiB | {moved / 2**30:.2f} GiB "
        f"| {steps} | {mfus} |"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the table in docs/tpu.md")
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
            "| script, model, slice | fits | HBM per chip | state per chip | collectives' buffers "
            "per step | step, overlapped | step, not overlapped | MFU, overlapped | MFU, not "
            "overlapped |\n|---|---|---|---|---|---|---|---|---|\n"
        )
        table = f"Compiled on {datetime.date.today()}, JAX {jax}, libtpu {libtpu}.\n\n{header}"
        table += "\n".join(line for line in lines if line)
        text = MARKER.sub(
            lambda _: f"<!-- tpu:start -->\n{table}\n<!-- tpu:end -->", PAGE.read_text()
        )
        PAGE.write_text(text)


if __name__ == "__main__":
    main()
