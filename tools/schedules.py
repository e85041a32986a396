"""Regenerate the pipeline schedules in the documentation from pipeline.py.

Two blocks, each between its markers: docs/strategies.md's picture of the four schedules
(`<!-- schedule:start -->`: what `python pipeline.py --show-schedule` prints for each, 4 stages,
8 micro-batches), and README.md's table of them side by side (`<!-- schedules:start -->`:
ticks, bubble from the table and from its formula, and micro-batches in flight per stage, all
read from make_schedule's tables). tests/test_docs.py fails when either is stale.

  python tools/schedules.py           # rewrite both blocks
  python tools/schedules.py --check   # exit 1 if either differs from pipeline.py
"""

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import pipeline  # noqa: E402

STAGES, MICROBATCHES, VIRTUAL, LAYERS = 4, 8, 2, 8
FORMULAS = {  # the bubble's share of the stages' ticks (tests/test_schedules.py checks them all)
    "gpipe": ("(S − 1)/(M + S − 1)", MICROBATCHES),
    "1f1b": ("(S − 1)/(M + S − 1)", MICROBATCHES),
    "zero-bubble": ("(S − 1)/(3M + S − 1)", 3 * MICROBATCHES),
    "interleaved": ("(S − 1)/(VM + S − 1)", VIRTUAL * MICROBATCHES),
}
TICK = {  # what one tick of a stage is
    "gpipe": "a forward or a whole backward of the stage",
    "1f1b": "a forward or a whole backward of the stage",
    "zero-bubble": "a forward, an input's gradient (B) or the weights' (W)",
    "interleaved": f"a forward or backward of 1/{VIRTUAL} of the stage's layers",
}


def picture():
    out = ""
    for kind in pipeline.SCHEDULES:
        command = [sys.executable, "pipeline.py", "--show-schedule", "--schedule", kind]
        command += [
            "--mesh",
            f"data=2,stage={STAGES}",
            "--layers",
            str(LAYERS),
            "--microbatches",
            str(MICROBATCHES),
        ]
        done = subprocess.run(
            command, cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
        )
        out += done.stdout
    return "<!-- schedule:start -->\n```\n" + out + "```\n<!-- schedule:end -->"


def table():
    rows = [
        f"With S = {STAGES} stages, M = {MICROBATCHES} micro-batches and V = {VIRTUAL} groups of "
        "layers per stage (interleaved). In flight: from a micro-batch's forward to the last "
        "backward that reads its input (interleaved: each group's forward and backward). `python "
        "pipeline.py --show-schedule --schedule KIND` prints each.",
        "",
        "| `--schedule` | ticks | bubble: idle share of the ticks | formula | a tick | "
        "micro-batches in flight, stage 0 … 3 |",
        "|---|---|---|---|---|---|",
    ]
    for kind in pipeline.SCHEDULES:
        schedule = pipeline.make_schedule(
            kind, STAGES, MICROBATCHES, VIRTUAL if kind == "interleaved" else 1
        )
        idle = (schedule[:, :, pipeline.OP] == pipeline.IDLE).mean()
        formula, work = FORMULAS[kind]
        held = " / ".join(map(str, pipeline.in_flight(schedule)))
        rows.append(
            f"| {kind} | {schedule.shape[0]} | {idle:.1%} | {formula} = "
            f"{(STAGES - 1) / (work + STAGES - 1):.1%} | {TICK[kind]} | {held} |"
        )
    return "<!-- schedules:start -->\n" + "\n".join(rows) + "\n<!-- schedules:end -->"


BLOCKS = [
    (
        ROOT / "docs" / "strategies.md",
        re.compile(r"<!-- schedule:start -->.*?<!-- schedule:end -->", re.DOTALL),
        picture,
    ),
    (
        ROOT / "README.md",
        re.compile(r"<!-- schedules:start -->.*?<!-- schedules:end -->", re.DOTALL),
        table,
    ),
]


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--check", action="store_true", help="only check; exit 1 if a block is stale"
    )
    args = parser.parse_args()
    for page, marker, make in BLOCKS:
        text = page.read_text()
        if not marker.search(text):
            sys.exit(f"{page.name}: no {marker.pattern.split('.')[0]} block")
        block = make()
        fresh = marker.sub(lambda _, block=block: block, text)
        if args.check and fresh != text:
            sys.exit(
                f"{page.name}'s pipeline schedules differ from pipeline.py: run python "
                "tools/schedules.py"
            )
        if not args.check:
            page.write_text(fresh)
        print(f"{page.name}: the schedules {'match pipeline.py' if args.check else 'rewritten'}")


if __name__ == "__main__":
    main()
