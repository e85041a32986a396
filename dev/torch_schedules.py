"""pipeline.py's interleaved and zbv orders against PyTorch's ScheduleInterleaved1F1B (issue 26)
and ScheduleZBVZeroBubble (issue 86).

For every stage of every size below, the order of the stage's forwards and backwards (which
group of layers, which micro-batch; zbv: and weights' gradients) that pipeline.stage_order gives
and the order PyTorch's schedule computes for its rank (its idle steps left out) must be the same
list. PyTorch is not
a requirement of this project; in a virtual environment of its own:

  python3 -m venv /tmp/torch && /tmp/torch/bin/pip install torch numpy jax flax optax
  orbax-checkpoint /tmp/torch/bin/python dev/torch_schedules.py"""

import os
import sys
import types

from torch.distributed.pipelining.schedules import (
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
    _ComputationType,
)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from pipeline import BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, chunk_of, stage_order  # noqa: E402

LETTER = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W"}


def torch_order(stages, virtual, microbatches, rank):
    """ScheduleInterleaved1F1B's list for one rank, from the method its constructor calls, on an
    object with only the attributes that method reads (no process group, no model)."""
    rounds = max(1, microbatches // stages)
    schedule = types.SimpleNamespace(
        pp_group_size=stages,
        n_local_stages=virtual,
        _n_microbatches=microbatches,
        number_of_rounds=rounds,
        microbatches_per_round=microbatches // rounds,
    )
    actions = ScheduleInterleaved1F1B._calculate_single_rank_operations(schedule, rank)
    return listed(actions)


def torch_zbv(stages, microbatches, rank):
    """ScheduleZBVZeroBubble's list for one rank, as above."""
    schedule = types.SimpleNamespace(
        pp_group_size=stages, _n_microbatches=microbatches, num_stages=2 * stages
    )
    return listed(ScheduleZBVZeroBubble._calculate_single_rank_operations(schedule, rank))


def listed(actions):
    """(F, B or W, stage index, micro-batch) of each action that is not idle."""
    name = lambda a: _ComputationType(a.computation_type).name  # noqa: E731
    return [(LETTER[name(a)], a.stage_index, a.microbatch_index) for a in actions if a]


def ours(kind, stages, microbatches, s, virtual):
    """pipeline.stage_order's list for stage s, in the same letters."""
    letter = {FORWARD: "F", BACKWARD: "B", INPUT_GRAD: "B", WEIGHT_GRAD: "W"}
    order = stage_order(kind, stages, microbatches, s, virtual)
    return [(letter[op], chunk_of(kind, stages, s, v), m) for op, v, m in order]


def main():
    checked = 0
    for stages in (2, 3, 4, 8):
        for virtual in (2, 3, 4):
            for microbatches in sorted({stages, 2 * stages, 3 * stages, 16}):
                if microbatches % stages:
                    continue  # pipeline.py asks for a multiple of the stages, as Megatron does
                for s in range(stages):
                    mine = ours("interleaved", stages, microbatches, s, virtual)
                    assert mine == torch_order(stages, virtual, microbatches, s), (stages, s)
                    checked += 1
    print(f"interleaved: the same order as PyTorch's ScheduleInterleaved1F1B on {checked} stages")
    checked = 0
    for stages in (1, 2, 3, 4, 8):
        for microbatches in range(1, 25):
            for s in range(stages):
                mine = ours("zbv", stages, microbatches, s, 2)
                assert mine == torch_zbv(stages, microbatches, s), (stages, microbatches, s)
                checked += 1
    print(f"zbv: the same order as PyTorch's ScheduleZBVZeroBubble on {checked} stages")


if __name__ == "__main__":
    main()
