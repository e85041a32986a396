"""pipeline.py's schedules as tables: every dependency met, each operation run once, no stage
holding more micro-batches than the schedule claims, and each bubble what its formula says.
Checked from the table alone, not from how make_schedule builds it."""

import numpy as np
import pytest

from pipeline import BACKWARD, FORWARD, IDLE, INPUT_GRAD, SCHEDULES, WEIGHT_GRAD, make_schedule

SIZES = [(stages, microbatches) for stages in (2, 3, 4, 8) for microbatches in (stages, 2 * stages, 16)]


def bubble_formula(kind, stages, microbatches):
    """The idle share of the stages' ticks. GPipe and 1F1B: S - 1 ticks of filling and S - 1 of
    draining around M forwards and M backwards of a tick each, (S - 1) / (M + S - 1). ZB-H1
    (Qi et al. 2023, T_F = T_B = T_W): (S - 1)(T_F + T_B - T_W) idle beside 3M ticks of work."""
    work = 3 * microbatches if kind == "zero-bubble" else microbatches
    return (stages - 1) / (work + stages - 1)


def most_held(kind, stages, microbatches, s):
    """The micro-batches a stage may hold between its forward and the end of its backward:
    GPipe all of them, 1F1B stages - s, zero-bubble `stages` (1F1B's first stage's) on every
    stage, from the forward to the WEIGHT_GRAD."""
    return {"gpipe": microbatches, "1f1b": min(stages - s, microbatches), "zero-bubble": min(stages, microbatches)}[
        kind
    ]


@pytest.mark.parametrize("kind", SCHEDULES)
@pytest.mark.parametrize("stages, microbatches", SIZES)
def test_schedule_is_valid_and_its_bubble_is_the_formulas(kind, stages, microbatches):
    table = make_schedule(kind, stages, microbatches)
    ticks = table.shape[0]
    when = {}  # (op, stage, micro-batch) -> tick
    for t in range(ticks):
        for s in range(stages):
            op, m = table[t, s, :2]
            if op != IDLE:
                assert (op, s, m) not in when, f"{kind}: stage {s} runs {op} of {m} twice"
                when[op, s, m] = t
    backward = INPUT_GRAD if kind == "zero-bubble" else BACKWARD
    expected_ops = {FORWARD, backward} | ({WEIGHT_GRAD} if kind == "zero-bubble" else set())
    assert {op for op, _, _ in when} == expected_ops
    for s in range(stages):
        for m in range(microbatches):
            forward, back = when[FORWARD, s, m], when[backward, s, m]  # each one exactly once
            if s > 0:  # its input arrived from the previous stage at the end of an earlier tick
                assert forward > when[FORWARD, s - 1, m] and table[when[FORWARD, s - 1, m], s, 2] == m
            if s < stages - 1:  # the gradient of its output arrived from the next stage
                assert back > when[backward, s + 1, m] and table[when[backward, s + 1, m], s, 3] == m
            else:
                assert back > forward
            if kind == "zero-bubble":
                assert when[WEIGHT_GRAD, s, m] > back
        release = WEIGHT_GRAD if kind == "zero-bubble" else backward
        held = [sum(when[FORWARD, s, m] <= t < when[release, s, m] for m in range(microbatches)) for t in range(ticks)]
        assert max(held) == most_held(kind, stages, microbatches, s), f"{kind}: stage {s}"
    idle = (table[:, :, 0] == IDLE).mean()
    assert idle == pytest.approx(bubble_formula(kind, stages, microbatches), abs=1e-12)


def test_zero_bubble_leaves_a_third_of_1f1bs_bubble():
    """Every stage idles S - 1 ticks of one unit of work (a forward, an input's or the weights'
    gradient) in zero-bubble, against 2 (S - 1) ticks in 1F1B: S - 1 while the pipeline fills,
    when the others run forwards (1 unit), and S - 1 while it drains, when they run whole
    backwards (2 units): the paper's (S - 1)(T_F + T_B + T_W) = 3 (S - 1) units for 1F1B and
    (S - 1)(T_F + T_B - T_W) = S - 1 for ZB-H1."""
    for stages, microbatches in SIZES:
        zb, onef1b = (make_schedule(kind, stages, microbatches) for kind in ("zero-bubble", "1f1b"))
        assert zb.shape[0] == 3 * microbatches + stages - 1
        assert ((zb[:, :, 0] == IDLE).sum(axis=0) == stages - 1).all()
        assert ((onef1b[:, :, 0] == IDLE).sum(axis=0) == 2 * (stages - 1)).all()
        assert np.all((onef1b[:, :, 0] != IDLE).sum(axis=0) == 2 * microbatches)
