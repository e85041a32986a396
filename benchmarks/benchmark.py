"""Run every strategy on one configuration and tabulate what each one costs.

Each script (and each logical_pjit.py rules preset) runs in its own process with the same
flags and writes --metrics-file; this reads the logged losses and the end-of-run report and
prints the table; with --out DIR it also writes into DIR:
  results.md   one row per strategy: losses, state bytes per device, the compiled step's
               memory, collectives per step and their bytes, compile time, speed
  results.png  the loss curves and the state bytes per device
and with --write it writes those into benchmarks/ (docs/costs.md links there): the tracked files
change only when asked. With --remat, each strategy is also compiled with --remat (one step) to
show what rematerialisation saves.

  python benchmarks/benchmark.py --write              # benchmarks/results.md (~8 min on CPU)
  python benchmarks/benchmark.py -- --dtype bfloat16  # flags after -- go to every script
"""

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STRATEGIES = {
    "pmap_dp": ["pmap_dp.py"],
    "shardmap_dp": ["shardmap_dp.py"],
    "fsdp": ["fsdp.py"],
    "hsdp": ["fsdp.py", "--mesh", "replica=2,data=4"],
    "pjit_tp": ["pjit_tp.py"],
    **{
        f"logical {rules}": ["logical_pjit.py", "--rules", rules]
        for rules in ("dp", "fsdp", "hsdp", "tp", "fsdp_tp")
    },
    "pipeline gpipe": ["pipeline.py", "--schedule", "gpipe"],
    "pipeline 1f1b": ["pipeline.py", "--schedule", "1f1b"],
    "pipeline zero-bubble": ["pipeline.py", "--schedule", "zero-bubble"],
    # 4 layers: data=4,stage=2
    "pipeline interleaved": ["pipeline.py", "--schedule", "interleaved"],
    "context_parallel": ["context_parallel.py"],
    **{
        f"context {split}": ["context_parallel.py", "--attention-split", split]
        for split in ("all-gather", "ulysses")
    },
    "pjit_tp sp": ["pjit_tp.py", "--sequence-parallel"],
    "explicit fsdp_tp": ["explicit_sharding.py"],
}
# Each stage's backward recomputes it
NO_REMAT = {name for name in STRATEGIES if name.startswith("pipeline")}


def run(strategy, flags, folder):
    """One script in its own process; its logged records and its summary."""
    metrics = Path(folder) / (re.sub(r"\W", "_", strategy) + ".jsonl")
    command = [sys.executable, *STRATEGIES[strategy], *flags, f"--metrics-file={metrics}"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return records[:-1], records[-1]["summary"]


def megabytes(n):
    return "n/a" if n is None else f"{n / 1e6:.2f}"


def collective_cell(c):
    return f"{c['count']} / {c['bytes'] / 1e6:.2f}" if c["count"] else "–"


def table(rows):
    header = (
        "| strategy | final loss | held-out loss | state MB/device | × total/N | compiled args MB "
        "| temp MB | temp MB, --remat | all-reduce n / MB | all-gather n / MB | reduce-scatter n "
        "/ MB | other n / MB | compile s | ms/step | tokens/s |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for strategy, (_, s, remat) in rows.items():
        c = s["collectives"]
        other = {
            "count": c["all-to-all"]["count"] + c["collective-permute"]["count"],
            "bytes": c["all-to-all"]["bytes"] + c["collective-permute"]["bytes"],
        }
        cells = [
            strategy,
            f"{s['final_loss']:.4f}",
            "n/a" if s["eval_loss"] is None else f"{s['eval_loss']:.4f}",
            megabytes(s["state_bytes_per_device"]),
            f"{s['state_bytes_per_device'] * s['devices'] / s['state_bytes_total']:.2f}",
            megabytes(s["compiled_argument_bytes"]),
            megabytes(s["compiled_temp_bytes"]),
            megabytes(remat["compiled_temp_bytes"]) if remat else "–",
            collective_cell(c["all-reduce"]),
            collective_cell(c["all-gather"]),
            collective_cell(c["reduce-scatter"]),
            collective_cell(other),
            f"{s['compile_seconds']:.1f}",
            f"{s['step_seconds'] * 1e3:.1f}",
            f"{s['tokens_per_sec']:,.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    figure, (losses, memory) = plt.subplots(1, 2, figsize=(13, 4.5))
    for strategy, (records, _, _) in rows.items():
        trained = [r for r in records if "loss" in r]  # not the held-out evaluations
        losses.plot(
            [r["step"] for r in trained], [r["loss"] for r in trained], label=strategy, linewidth=1
        )
    floor = next(iter(rows.values()))[1]["loss_floor"]
    if floor is not None:
        losses.axhline(floor, color="black", linestyle=":", linewidth=1, label="loss floor")
    losses.set(xlabel="step", ylabel="training loss", yscale="log", title="Loss curves")
    losses.legend(fontsize=8)
    names = list(rows)
    per_device = [rows[n][1]["state_bytes_per_device"] / 1e6 for n in names]
    bars = memory.barh(names, per_device, color="tab:blue")
    memory.bar_label(bars, fmt="%.2f", fontsize=8)
    total = next(iter(rows.values()))[1]
    memory.axvline(
        total["state_bytes_total"] / total["devices"] / 1e6,
        color="black",
        linestyle=":",
        label="total / N",
    )
    memory.set(xlabel="MB per device (parameters + Adam state)", title="State bytes per device")
    memory.invert_yaxis()
    memory.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, help="write results.md and results.png into this folder"
    )
    parser.add_argument(
        "--write",
        action="store_true",
        help="write them into benchmarks/",
    )
    parser.add_argument(
        "--only", default=",".join(STRATEGIES), help="comma-separated strategies to run"
    )
    parser.add_argument(
        "--remat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also compile with --remat",
    )
    parser.add_argument(
        "flags", nargs="*", help="flags for every script, after --, e.g. -- --steps 50"
    )
    args = parser.parse_args()
    unknown = set(args.only.split(",")) - set(STRATEGIES)
    if unknown:
        parser.error(
            f"--only: unknown strategies {', '.join(sorted(unknown))}; choose from "
            f"{', '.join(STRATEGIES)}"
        )
    flags = ["--log-every=5", *args.flags]
    rows = {}
    with tempfile.TemporaryDirectory() as folder:
        for strategy in args.only.split(","):
            start = time.perf_counter()
            records, summary = run(strategy, flags, folder)
            remat = None
            if args.remat and strategy not in NO_REMAT:
                remat = run(strategy, [*flags, "--steps=1", "--eval-every=0", "--remat"], folder)[1]
            rows[strategy] = (records, summary, remat)
            print(
                f"{strategy}: final loss {summary['final_loss']:.4f} "
                f"({time.perf_counter() - start:.0f}s)",
                flush=True,
            )
    first = next(iter(rows.values()))[1]
    command = " ".join(
        ["python benchmarks/benchmark.py", *(["--", *args.flags] if args.flags else [])]
    )
    described = (
        f"`{command}`: {first['devices']} {first['device_kind']} devices, {first['steps']} steps, "
        f"{first['param_count'] / 1e6:.2f}M parameters ({first['param_bytes'] / 1e6:.2f} MB), "
        f"state {first['state_bytes_total'] / 1e6:.2f} MB in all. Collectives: count per step and "
        "MB per device (the larger of each op's input and output); what a ring sends of them: "
        "docs/costs.md's formulas."
    )
    picture = "![loss curves and state bytes per device](results.png)"
    markdown = f"{described}\n\n{table(rows)}\n\n{picture}\n"
    print(markdown)
    out = Path(__file__).parent if args.write else args.out
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.md").write_text(markdown)
        plot(rows, out / "results.png")
        print(f"wrote {out / 'results.md'} and {out / 'results.png'}")


if __name__ == "__main__":
    main()
