"""pipeline.py's schedules as tables: every dependency met, each operation run once, every
activation and gradient kept in a slot nothing overwrites before its last use, no stage holding
more micro-batches than the schedule claims, and each bubble what its formula says. Checked
from the table alone, not from how make_schedule builds it."""

import numpy as np
import pytest

import common
import pipeline
from pipeline import (
    BACKWARD,
    FORWARD,
    FROM_ABOVE,
    FROM_BELOW,
    FROM_SELF,
    GRADIENT_SLOT,
    IDLE,
    INPUT_GRAD,
    INPUT_SLOT,
    MICROBATCH,
    OP,
    SCHEDULES,
    VIRTUAL,
    WEIGHT_GRAD,
    make_schedule,
)
from tests.harness import record_flags

SIZES = sorted(
    {(stages, microbatches) for stages in (2, 3, 4, 8) for microbatches in (stages, 2 * stages, 16)}
)
# (kind, stages, micro-batches, groups of layers per stage); interleaved takes multiples of the
# stages, zbv any number (below 3 S / 2 too).
ONE_GROUP = [kind for kind in SCHEDULES if kind not in ("interleaved", "zbv")]
CASES = [(kind, s, m, 1) for kind in ONE_GROUP for s, m in SIZES]
CASES += [("interleaved", s, m, v) for s, m in SIZES if m % s == 0 for v in (2, 3, 4)]
CASES += [("zbv", s, m, 2) for s, m in sorted(SIZES + [(4, 1), (4, 5), (8, 11)])]
SPLIT = ("zero-bubble", "zbv")  # the backward split into B and W


def stage_of(kind, stages, chunk):
    """The stage that holds a group of layers: chunk % stages, but zbv's V: stage s holds chunks
    s and 2 stages - 1 - s."""
    return min(chunk, 2 * stages - 1 - chunk) if kind == "zbv" else chunk % stages


def bubble_formula(kind, stages, microbatches, virtual):
    """The idle share of the stages' ticks. GPipe and 1F1B: S - 1 ticks of filling and S - 1 of
    draining around M forwards and M backwards of a tick each, (S - 1) / (M + S - 1). ZB-H1
    (Qi et al. 2023, T_F = T_B = T_W): (S - 1)(T_F + T_B - T_W) idle beside 3M ticks of work.
    Interleaved (Narayanan et al. 2021): a tick is a group of layers, 1 / V of a stage's, so
    the same S - 1 ticks each way are beside V M of each: (S - 1) / (V M + S - 1). ZB-V (Qi et
    al. 2023, section 6): S - 1 ticks of half a stage idle beside 6 M of work, once the V is
    full; below 3 S / 2 micro-batches it never is, and a step takes 4 M + 4 S - 2 ticks (the
    last micro-batch's way down the V and back, 4 S - 2, after 4 M ticks; measured here)."""
    if kind == "zbv":
        return 1 - 6 * microbatches / max(
            6 * microbatches + stages - 1, 4 * (microbatches + stages) - 2
        )
    work = {"zero-bubble": 3 * microbatches, "interleaved": virtual * microbatches}.get(
        kind, microbatches
    )
    return (stages - 1) / (work + stages - 1)


@pytest.mark.parametrize("kind", SCHEDULES)
def test_show_schedule_prints_each_stages_work_once_in_the_formulas_ticks(kind, capsys):
    """pipeline.py --show-schedule, as run from the command line, trains nothing and prints one
    row per stage: each micro-batch's forward and backward there once per group of layers
    (zero-bubble: and its weights' gradient), in as many ticks as the bubble's formula counts
    (the stage's work over 1 - bubble). On 4 stages of 12 micro-batches; interleaved, 4 groups
    of layers per stage (--virtual-stages 4, 16 layers); zbv, 2; with --no-remat, whose table
    differs in its slots only."""
    stages, microbatches = 4, 12
    virtual = {"interleaved": 4, "zbv": 2}.get(kind, 1)
    flags = ["--show-schedule", "--schedule", kind, "--mesh", "data=2,stage=4", "--batch-size"]
    flags += ["48", "--microbatches", "12", "--layers", str(stages * virtual), "--no-remat"]
    flags += ["--virtual-stages", "4"] if kind == "interleaved" else []
    config = common.parse_config(pipeline.Config, None, flags)
    assert pipeline.main(config) is None
    record_flags(pipeline, config)
    head, said = capsys.readouterr().out.splitlines(), f", {virtual} groups of layers per stage"
    assert head[0] == f"--schedule {kind} on 4 stages, 12 micro-batches{said * (virtual > 1)}:"
    held = [most_held(kind, stages, microbatches, virtual, s) for s in range(stages)]
    assert head[2].endswith(": " + " ".join(map(str, held)))  # micro-batches in flight
    rows = [line.split(": ")[1].split() for line in head[3:]]
    ops = "FBW" if kind in SPLIT else "FB"
    work = len(ops) * virtual * microbatches
    for s, row in enumerate(rows):
        done = sorted(cell for cell in row if cell != ".")
        chunks = [c for c in range(stages * virtual) if stage_of(kind, stages, c) == s]
        groups = [f"{c}" if virtual > 1 else "" for c in chunks]
        expected = [f"{g}{op}{m}" for g in groups for op in ops for m in range(microbatches)]
        assert done == sorted(expected), s
    bubble = bubble_formula(kind, stages, microbatches, virtual)
    ticks = round(work / (1 - bubble))
    assert len(rows) == stages and all(len(row) == ticks for row in rows)
    assert (
        head[1] == f"schedule: {ticks} ticks, {bubble:.0%} of the stages' ticks idle (the bubble)"
    )


def most_held(kind, stages, microbatches, virtual, s):
    """The (group, micro-batch) pairs a stage may hold between a forward and the end of its
    backward: GPipe all of them, 1F1B stages - s, zero-bubble `stages` (1F1B's first stage's) on
    every stage, from the forward to the WEIGHT_GRAD; interleaved, its warm-up's forwards
    (V - 1) S + 2 (S - 1 - s) and one more, at most all V M; zbv, 2 S of half a stage (1F1B's
    first stage's, by the layers), or M + s + 1 where fewer micro-batches fill it."""
    return {
        "zbv": min(2 * stages, microbatches + s + 1, 2 * microbatches),
        "gpipe": microbatches,
        "1f1b": min(stages - s, microbatches),
        "zero-bubble": min(stages, microbatches),
        "interleaved": min(
            (virtual - 1) * stages + 2 * (stages - 1 - s) + 1, virtual * microbatches
        ),
    }[kind]


@pytest.mark.parametrize("keep", [False, True], ids=["remat", "no-remat"])
@pytest.mark.parametrize("kind, stages, microbatches, virtual", CASES)
def test_schedule_is_valid_and_its_bubble_is_the_formulas(
    kind, stages, microbatches, virtual, keep
):
    """Under --remat a backward reads its input again; without, a forward is its input's last
    use. The last group's forward sends itself the loss's gradient for its backward."""
    table = make_schedule(kind, stages, microbatches, virtual, keep)
    ticks, chunks = table.shape[0], stages * virtual
    when = {}  # (op, chunk, micro-batch) -> tick
    for t in range(ticks):
        for s in range(stages):
            op, m, v = table[t, s, [OP, MICROBATCH, VIRTUAL]]
            chunk = [c for c in range(chunks) if stage_of(kind, stages, c) == s][v]
            if op != IDLE:
                assert (op, chunk, m) not in when, f"{kind}: stage {s} runs {op} of {v}, {m} twice"
                when[op, chunk, m] = t
    backward = INPUT_GRAD if kind in SPLIT else BACKWARD
    expected_ops = {FORWARD, backward} | ({WEIGHT_GRAD} if kind in SPLIT else set())
    assert {op for op, _, _ in when} == expected_ops
    last = WEIGHT_GRAD if kind in SPLIT else backward  # the last to run on what a stage keeps
    for c in range(chunks):
        s = stage_of(kind, stages, c)
        for m in range(microbatches):
            forward, back = when[FORWARD, c, m], when[backward, c, m]  # each one exactly once
            if kind in SPLIT:
                assert when[WEIGHT_GRAD, c, m] > back
            if c > 0:  # its input arrived from the previous group at the end of an earlier tick
                sent, reads = when[FORWARD, c - 1, m], [forward] + [back] * (not keep)
                kept(table, kind, s, stage_of(kind, stages, c - 1), sent, INPUT_SLOT, reads)
            assert table[back, s, INPUT_SLOT] == -1 or not keep
            if c < chunks - 1:  # the gradient of its output arrived from the next group
                sent = when[backward, c + 1, m]
                kept(table, kind, s, stage_of(kind, stages, c + 1), sent, GRADIENT_SLOT, [back])
            else:  # the loss's, from its own forward (which runs the head's backward)
                kept(table, kind, s, s, forward, GRADIENT_SLOT, [back])
    for s in range(stages):
        mine = [
            (c, m)
            for c in range(chunks)
            if stage_of(kind, stages, c) == s
            for m in range(microbatches)
        ]
        held = [
            sum(when[FORWARD, c, m] <= t < when[last, c, m] for c, m in mine) for t in range(ticks)
        ]
        assert max(held) == most_held(kind, stages, microbatches, virtual, s), f"{kind}: stage {s}"
        # all that arrives is read: an input for each group's forward but the model's first, a
        # gradient for each backward
        arrived = (table[:, s, [FROM_BELOW, FROM_ABOVE, FROM_SELF]] >= 0).sum()
        assert arrived == sum((c > 0) + 1 for c, m in mine)
    idle = (table[:, :, OP] == IDLE).mean()
    assert idle == pytest.approx(bubble_formula(kind, stages, microbatches, virtual), abs=1e-12)


@pytest.mark.parametrize("keep", [False, True], ids=["remat", "no-remat"])
@pytest.mark.parametrize("kind", SCHEDULES)
def test_a_kept_slot_holds_one_micro_batch_from_the_op_that_fills_it_to_the_last_that_reads_it(
    kind, keep
):
    """The table's KEPT column: filled by each INPUT_GRAD under --remat (what its WEIGHT_GRAD
    reads), by each forward without (what its backward reads, then in the same slot what its
    INPUT_GRAD leaves for its WEIGHT_GRAD): the lowest free, read by that micro-batch's later ops
    and no other's in between; -1 at every other operation; at most the micro-batches the stage
    holds in flight without --remat (zero-bubble: `stages`, 1F1B's first stage's), with it
    `stages` for zero-bubble (zbv: 2 stages - 1, the Ws its last stage defers) and none for the
    schedules it runs whole backwards in."""
    fills, last = (
        (FORWARD, WEIGHT_GRAD if kind in SPLIT else BACKWARD) if keep else (INPUT_GRAD, WEIGHT_GRAD)
    )
    for stages, microbatches in SIZES:
        if not pipeline.Config(schedule=kind).takes(microbatches, stages):
            continue
        table = make_schedule(
            kind, stages, microbatches, {"zbv": 2, "interleaved": 2}.get(kind, 1), keep
        )
        slots = table[:, :, pipeline.KEPT]
        for s in range(stages):
            held = {}
            for t, (op, m, v) in enumerate(table[:, s, :3]):
                if op == fills:
                    assert slots[t, s] == min(
                        set(range(4 * stages * microbatches)) - set(held.values())
                    )
                    held[v, m] = slots[t, s]
                elif op in (BACKWARD, INPUT_GRAD, WEIGHT_GRAD) and (v, m) in held:
                    assert slots[t, s] == (held.pop if op == last else held.get)((v, m))
                else:
                    assert slots[t, s] == -1
            assert not held
        if keep:
            assert slots.max() + 1 == max(pipeline.in_flight(table))
        else:
            assert slots.max() < (
                2 * stages - 1 if kind == "zbv" else stages if kind in SPLIT else 0
            )


def kept(table, kind, s, sender, sent, read, reads):
    """What stage `sender` sent to stage s at tick `sent` (an input or a gradient) went into a
    slot, in the column of the way it came (from below, from above or from itself), which every
    read of it names (in the column `read`) and which nothing else arriving at stage s
    overwrites before the last read."""
    stages = table.shape[1]
    ring = kind == "interleaved"
    below = s == sender + 1 or (ring and s == (sender + 1) % stages)
    column = FROM_SELF if s == sender else FROM_BELOW if below else FROM_ABOVE
    slot = table[sent, s, column]
    assert slot >= 0 and sent < min(reads)
    assert all(table[t, s, read] == slot for t in reads)
    overwritten = table[sent + 1 : max(reads), s][:, [FROM_BELOW, FROM_ABOVE, FROM_SELF]]
    assert slot not in overwritten


def test_zero_bubble_leaves_a_third_of_1f1bs_bubble():
    """Every stage idles S - 1 ticks of one unit of work (a forward, an input's or the weights'
    gradient) in zero-bubble, against 2 (S - 1) ticks in 1F1B: S - 1 while the pipeline fills,
    when the others run forwards (1 unit), and S - 1 while it drains, when they run whole
    backwards (2 units): the paper's (S - 1)(T_F + T_B + T_W) = 3 (S - 1) units for 1F1B and
    (S - 1)(T_F + T_B - T_W) = S - 1 for ZB-H1."""
    for stages, microbatches in SIZES:
        zb, onef1b = (make_schedule(kind, stages, microbatches) for kind in ("zero-bubble", "1f1b"))
        assert zb.shape[0] == 3 * microbatches + stages - 1
        assert ((zb[:, :, OP] == IDLE).sum(axis=0) == stages - 1).all()
        assert ((onef1b[:, :, OP] == IDLE).sum(axis=0) == 2 * (stages - 1)).all()
        assert np.all((onef1b[:, :, OP] != IDLE).sum(axis=0) == 2 * microbatches)


def test_zbv_halves_zero_bubbles_idle_time():
    """ZB-V, once its V is full (at least 3 S / 2 micro-batches), idles S - 1 ticks on every
    stage as ZB-H1 does, but each of half a stage's work: half the bubble's time of zero-bubble,
    a sixth of 1F1B's, at the peak 1F1B's first stage holds (2 S halves of a stage)."""
    for stages, microbatches in SIZES:
        if 2 * microbatches < 3 * stages:
            continue
        zbv = make_schedule("zbv", stages, microbatches, 2)
        assert ((zbv[:, :, OP] == IDLE).sum(axis=0) == stages - 1).all()
        assert zbv.shape[0] == 6 * microbatches + stages - 1
        assert max(pipeline.in_flight(zbv)) == 2 * stages


def test_interleaving_divides_the_bubbles_time_by_the_groups():
    """Interleaved, every stage idles the same 2 (S - 1) ticks as 1F1B, but a tick is one group
    of layers, 1 / V of 1F1B's: the bubble's time is 1F1B's over V, and the work the same."""
    for stages, microbatches in SIZES:
        if microbatches % stages:
            continue
        onef1b = make_schedule("1f1b", stages, microbatches)
        for virtual in (2, 3, 4):
            interleaved = make_schedule("interleaved", stages, microbatches, virtual)
            assert interleaved.shape[0] == 2 * virtual * microbatches + 2 * (stages - 1)
            idle = (interleaved[:, :, OP] == IDLE).sum(axis=0)
            assert (idle == (onef1b[:, :, OP] == IDLE).sum(axis=0)).all()  # ticks of 1 / V the time


# ----------------------------------------------------------------------------------------------
# What the ops cost: zero-bubble's B and W against 1F1B's whole backward (issue 42)
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[1, 2], ids=["one block", "two blocks"])
def costs(request):
    """dev/schedules.py's op costs, by XLA's cost analysis, for one and two blocks a stage."""
    from dev import schedules

    return schedules.op_costs(request.param)


def test_zero_bubble_splits_the_backward_without_redoing_it(costs):
    """B (the input's gradient, keeping each dense layer's input and output gradient) and W (only
    the kernels' gradients, x^T dy, from what B kept) cost together at most 1.1 x 1F1B's whole
    backward: W redoes nothing. W costs less than a forward, B less than a whole backward."""
    b, w, whole = costs[INPUT_GRAD], costs[WEIGHT_GRAD], costs[BACKWARD]
    print(f"\nin forwards: whole backward {whole:.2f}, B {b:.2f}, W {w:.2f}")
    assert b + w <= 1.1 * whole
    assert w < costs[FORWARD] < whole and b < whole


@pytest.mark.parametrize("microbatches", [8, 16])
def test_zero_bubble_is_the_fastest_by_the_measured_costs(costs, microbatches):
    """With the measured costs, each tick as long as its slowest stage's op, zero-bubble's step
    is shorter than 1F1B's (4 stages), where it was longer when W redid the backward."""
    from dev import schedules

    step = {
        kind: schedules.predicted(make_schedule(kind, 4, microbatches), costs)[0]
        for kind in ("1f1b", "zero-bubble")
    }
    print(f"\nS = 4, M = {microbatches}: step in forwards {step}")
    assert step["zero-bubble"] < step["1f1b"]
