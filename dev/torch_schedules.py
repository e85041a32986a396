"""pipeline.py's interleaved order against PyTorch's ScheduleInterleaved1F1B (issue 26).

For every stage of every size below, the order of the stage's forwards and backwards (which
group of layers, which micro-batch) that pipeline.stage_order gives and the order PyTorch's
schedule computes for its rank (its idle steps left out) must be the same list. PyTorch is not
a requirement of this project; in a virtual environment of its own:

  python3 -m venv /tmp/torch && /tmp/torch/bin/pip install torch numpy jax flax optax
  orbax-checkpoint /tmp/torch/bin/python dev/torch_schedules.py"""

import os
import sys
import types

from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from pipeline import FORWARD, stage_order  # noqa: E402


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
    forward = _ComputationType.FORWARD
    return [
        ("F" if a.computation_type == forward else "B", a.stage_index, a.microbatch_index)
        for a in actions
        if a
    ]


def main():
    checked = 0
    for stages in (2, 3, 4, 8):
        for virtual in (2, 3, 4):
            for microbatches in sorted({stages, 2 * stages, 3 * stages, 16}):
                if microbatches % stages:
                    continue  # pipeline.py asks for a multiple of the stages, as Megatron does
                for s in range(stages):
                    ours = [
                        ("F" if op == FORWARD else "B", v * stages + s, m)
                        for op, v, m in stage_order("interleaved", stages, microbatches, s, virtual)
                    ]
                    assert ours == torch_order(stages, virtual, microbatches, s), (
                        stages,
                        virtual,
                        microbatches,
                        s,
                    )
                    checked += 1
    print(
        f"interleaved: the same order as PyTorch's ScheduleInterleaved1F1B on all {checked} stages "
        "checked"
    )


if __name__ == "__main__":
    main()
