"""Every script compiled for real TPU slices on this machine, none run: docs/tpu.md's table.

Each script runs under tools/compile_for.py (libtpu's compile-only devices: pip install -r
requirements-tpu.txt) at GPT-2 small (12 layers, width 768, 12 heads, 1,024 tokens, vocabulary
50,304, bfloat16, batch 64) and at about 1B parameters (24 layers, width 1,792, 14 heads, the
same tokens), on v5e-8 (v5e:2x4), v5p-8 (v5p:2x2x1, 4 chips) and a v5p slice of 64 chips
(v5p:4x4x4, 16 hosts), and reports what the compiled TPU program holds: whether it fits in a
chip's HBM, memory per chip, the collectives' bytes, and the step time and MFU predicted from it
at the chip's published rates (common.CHIPS). These are compiled, not run.

  python tools/tpu_slices.py                      # print the table (43 minutes on 2 cores)
  python tools/tpu_slices.py --write              # and rewrite it in docs/tpu.md
  python tools/tpu_slices.py --slices v5e:2x4 --sizes gpt2_small   # a part of it
"""

import argparse
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
    # dropless routing's grouped matmul does not compile for TPU in JAX 0.10.2 (docs/tpu.md)
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


def row(script, size, topology, result) -> str:
    name = f"{script} {size} {SLICES[topology]}"
    if "error" in result:  # the tool's one line, less its prefix
        why = re.sub(
            r"^compile_for.py: error: \S+ (does not compile for \S+ )?", "", result["error"]
        )
        return f"| {name} | no: {why} | | | | | |"
    tpu, moved = result["predicted"], sum(c["bytes"] for c in result["collectives"].values())
    at_least, at_most = ("≥ ", "≤ ") if result["loops_counted_once"] else ("", "")  # a floor
    return (
        f"| {name} | {'yes' if result['fits'] else '**no**'} "
        f"| {result['hbm_need_bytes'] / 2**30:.2f} GiB "
        f"| {result['state_bytes_per_device'] / 2**30:.2f} GiB | {moved / 2**30:.2f} GiB "
        f"| {at_least}{tpu['step_seconds'] * 1e3:,.0f} ms | {at_most}{tpu['mfu']:.0%} |"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the table in docs/tpu.md")
    parser.add_argument("--slices", nargs="*", default=list(SLICES), help="topologies")
    parser.add_argument("--sizes", nargs="*", default=list(SIZES), help="model sizes")
    parser.add_argument("--scripts", nargs="*", default=list(SCRIPTS), help="scripts")
    args = parser.parse_args()
    lines = [
        "| script, model, slice | fits | HBM per chip | state per chip | collectives' buffers "
        "per step | predicted step | predicted MFU |",
        "|---|---|---|---|---|---|---|",
    ]
    for size in args.sizes:
        for topology in args.slices:
            for script in args.scripts:
                flags = f"{SIZES[size]} {COMMON} {SCRIPTS[script]}"
                result = compile_for(script, topology, flags)
                lines.append(row(script, size, topology, result))
                print(lines[-1], f"({result['seconds']:.0f} s)", flush=True)
    where = [str(ROOT / ".tpu")]  # requirements-tpu.txt's libtpu, beside the project
    libtpu = next(importlib.metadata.distributions(name="libtpu", path=where)).version
    stamp = f"{datetime.date.today()}, JAX {importlib.metadata.version('jax')}, libtpu {libtpu}"
    table = f"<!-- tpu:start -->\nCompiled on {stamp}.\n\n" + "\n".join(lines)
    if args.write:
        PAGE.write_text(MARKER.sub(lambda _: table + "\n<!-- tpu:end -->", PAGE.read_text()))


if __name__ == "__main__":
    main()
