"""Where each script sums its gradients under --microbatches: the reductions of its compiled step
at 1 and 4 micro-batches, on XLA:CPU (8 emulated devices, width 64) and in the v5e-8 TPU program
(tools/compile_for.py, width 128): the figures of docs/costs.md's table.

  python dev/accumulation.py             # about 30 minutes: each row compiled four times
  python dev/accumulation.py tpu fsdp    # one machine's columns, the rows of the scripts named
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROWS = {
    "pmap_dp": ["pmap_dp.py"],
    "shardmap_dp": ["shardmap_dp.py"],
    "context_parallel": ["context_parallel.py"],
    "expert_parallel": ["expert_parallel.py"],
    "fsdp": ["fsdp.py"],
    "fsdp --keep-gathered": ["fsdp.py", "--keep-gathered"],
    "pipeline (1F1B)": ["pipeline.py"],
    "logical_pjit --rules dp": ["logical_pjit.py", "--rules", "dp"],
    "explicit_sharding --rules dp": ["explicit_sharding.py", "--rules", "dp"],
    "pjit_tp": ["pjit_tp.py"],
    "explicit_sharding --rules tp": ["explicit_sharding.py", "--rules", "tp"],
    "logical_pjit --rules fsdp": ["logical_pjit.py", "--rules", "fsdp"],
    "explicit_sharding --rules fsdp": ["explicit_sharding.py", "--rules", "fsdp"],
}
CPU = ["--layers", "2", "--d-model", "64", "--batch-size", "32", "--steps", "1"]
TPU = ["--layers", "2", "--d-model", "128", "--seq-len", "64", "--batch-size", "32"]
SUMS = ("all-reduce", "reduce-scatter", "all-gather")


def reductions(command: list) -> str:
    """The step's all-reduces, reduce-scatters and all-gathers: count (MB), from its summary."""
    with tempfile.TemporaryDirectory() as folder:
        metrics = Path(folder) / "m.jsonl"
        done = subprocess.run(
            [sys.executable, *command, "--metrics-file", str(metrics)],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        if done.returncode:
            return "refused: " + done.stderr.strip().splitlines()[-1]
        found = json.loads(metrics.read_text().splitlines()[-1])["summary"]["collectives"]
    return ", ".join(
        f"{op} {found[op]['count']} ({found[op]['bytes'] / 1e6:.2f} MB)"
        for op in SUMS
        if found.get(op, {}).get("count")
    )


def main(machines=("cpu", "tpu"), *scripts):
    print("| script | " + " | ".join(f"{m}, M = 1 | M = 4" for m in machines) + " |")
    for name, (script, *flags) in ROWS.items():
        if scripts and script.removesuffix(".py") not in scripts:
            continue
        cells = []
        for machine in machines:
            for m in ("1", "4"):
                if script == "pipeline.py" and m == "1":  # M is the schedule's, at least S
                    cells.append("–")
                    continue
                run = [script, *flags, "--microbatches", m]
                tool = ["tools/compile_for.py", "v5e:2x4"] if machine == "tpu" else []
                cells.append(reductions([*tool, *run, *(TPU if tool else CPU)]))
        print(f"| `{name}` | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main(*([sys.argv[1].split(",")] + sys.argv[2:] if sys.argv[1:] else []))
