"""The compiled step read closely: its matmul FLOPs and every collective with its trips, group
and wire bytes, TPU programs included. tools/compile_for.py and the tests read a step with it;
a run prints common.collectives' shorter count, which the tests hold equal to this one's.

  summary = hlo.costs(config, compiled)  # the run's collectives with wire bytes, the FLOPs
"""

import functools
import itertools
import math
import re

import jax


# Dense bf16 peak FLOP/s of one device, by jax.Device.device_kind (lower case); the first match.
PEAK_FLOPS = (
    ("tpu v5 lite", 197e12),  # v5e
    ("tpu v5", 459e12),  # v5p
    ("tpu v6 lite", 918e12),  # v6e
    ("tpu v4", 275e12),
    ("h100 pcie", 756e12),
    ("h100", 989e12),  # SXM
    ("h200", 989e12),
    ("a100", 312e12),
)


def flops_per_token(config, params) -> int:
    """Training FLOPs per token: 6 per matmul parameter (forward 2, backward 4) and the attention's
    6 * 2 * layers * seq_len * d_model (PaLM, appendix B). Embedding tables (nnx.Embed's
    'embedding') are lookups, left out; of the experts (an axis 'expert') a token uses top-k."""
    import common

    leaves = jax.tree_util.tree_leaves_with_path(params)
    tables = sum(x.size for path, x in leaves if getattr(path[-1], "key", None) == "embedding")
    # A table the head ties is also its matmul's kernel
    tied = [
        f"embed/{path}" for path in common.make_model(config).tied if path.endswith("embedding")
    ]
    tables -= sum(box.value.size for path, box in common.logical_names(config) if path in tied)
    experts = sum(
        box.value.size for _, box in common.logical_names(config) if "expert" in box.names
    )
    unused = experts - experts * config.top_k // config.experts if experts else 0
    matmul_params = sum(x.size for _, x in leaves) - tables - unused
    return 6 * matmul_params + 12 * config.layers * config.seq_len * config.d_model


_ARRAY = re.compile(r"\b(pred|[a-z]+\d+[a-z0-9]*)\[([\d,]*)\]")  # f32[64,128], bf16[], pred[8]
_CALLS = re.compile(r"\b(body|condition|calls|to_apply|branch_computations)=\{?%([\w.\-]+)")


def _closing(text: str, start: int) -> int:
    """The index just past the bracket that closes the one at text[start]."""
    depths = itertools.accumulate((c == "(") - (c == ")") for c in text[start:])
    return start + 1 + next(i for i, depth in enumerate(depths) if depth == 0)


def _hlo_program(hlo_text: str):
    """HLO text as ({computation: [(name, opcode, operands, attributes, line)]}, {name: shape})."""
    computations, shapes, entry, current = {}, {}, None, None
    for line in hlo_text.splitlines():
        if not line.startswith((" ", "}")) and line.endswith("{") and "%" in line:
            current = line.split("%")[1].split(" ")[0]
            computations[current], entry = [], current if line.startswith("ENTRY") else entry
        elif current and (instruction := re.match(r"\s*(?:ROOT )?%(\S+) = (.*)$", line)):
            name, rest = instruction.groups()
            end = _closing(rest, 0) if rest.startswith("(") else rest.index(" ")
            shapes[name], rest = rest[:end], rest[end:].lstrip()
            opcode, operands_end = rest[: rest.index("(")], _closing(rest, rest.index("("))
            operands = re.findall(r"%([\w.\-]+)", rest[len(opcode) : operands_end])
            computations[current].append((name, opcode, operands, rest[operands_end:], line))
    return computations, shapes, entry


def _taps(attributes: str, labels: tuple, lhs: list, out: list) -> float:
    """A convolution's window taps per output that read its input, not padding or holes."""
    taps, w = 1.0, dict(size=1, stride=1, pad=0, lhs_dilate=1, rhs_dilate=1)
    for name, default in list(w.items()):  # a number per spatial axis (a pad's low side)
        found = re.search(rf"\b{name}=([\d_x-]+)", attributes)
        w[name] = [int(n.split("_")[0]) for n in found[1].split("x")] if found else [default] * 9
    for axis, (size, stride, pad, dilation, spread) in enumerate(zip(*w.values(), strict=False)):
        if str(axis) in labels[0]:  # the positions it reads, of those the dilated input has
            n, o = lhs[labels[0].index(str(axis))], out[labels[2].index(str(axis))]
            reads = [p * stride + t * spread - pad for p in range(o) for t in range(size)]
            taps *= sum(0 <= q <= (n - 1) * dilation and q % dilation == 0 for q in reads) / o
    return taps


def _trips(attributes: str, computations: dict) -> int:
    """A while loop's trip count: XLA's, or its condition's `i < N` (TPU programs state none)."""
    if known := re.search(r'"known_trip_count":\{"n":"(\d+)"', attributes):
        return int(known[1])
    condition = computations[re.search(r"\bcondition=%([\w.\-]+)", attributes)[1]]
    _, opcode, operands, rest, _ = condition[-1]  # its ROOT
    bound = {name: line for name, op, *_, line in condition if op == "constant"}
    below = opcode == "compare" and "direction=LT" in rest and bound.get(operands[-1], "")
    return int(re.search(r"constant\((\d+)\)", below)[1]) if below else 1


def hlo_flops(hlo_text: str) -> float:
    """The matmul FLOPs of one run of compiled HLO, per device: a loop's body times its trips
    (_trips; XLA's own cost analysis counts it once), a conditional's costliest branch (an upper
    bound where branches differ: a pipeline's ticks, ring attention's skipped blocks)."""
    computations, shapes, entry = _hlo_program(hlo_text)

    def dims(name):
        return [int(d) for d in _ARRAY.search(shapes[name]).group(2).split(",") if d]

    @functools.cache
    def flops(computation):
        total = 0
        for name, opcode, operands, attributes, _ in computations.get(computation, ()):
            if opcode == "dot":
                contracted = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", attributes)
                lhs = dims(operands[0])
                k = math.prod(lhs[int(i)] for i in contracted.group(1).split(",") if i)
                total += 2 * math.prod(dims(name)) * k
            elif opcode == "convolution":  # TPU's matmuls: over the kernel's inputs, its taps
                labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", attributes).groups()
                k = dims(operands[1])[labels[1].index("i")]
                taps = _taps(attributes, labels, dims(operands[0]), dims(name))
                total += 2 * math.prod(dims(name)) * k * taps
            elif kernel := re.match(r"splash_\w+?_(fwd|dq|dkv)", name):  # common.py's: its
                # 2, 3 or 4 matmuls of the queries (its first floats, [..., length, head_dim])
                q = next(dims(o) for o in operands if re.match(r"(bf|f)\d+\[", shapes[o]))
                total += {"fwd": 2, "dq": 3, "dkv": 4}[kernel[1]] * 2 * math.prod(q) * q[-2]
            elif opcode == "custom-call" and re.search(r"jit\(t?gmm\)\)*/pallas_call", attributes):
                # megablox's grouped matmuls (common.py's): its lhs [m, k] or [k, m] times n
                lhs = next(dims(o) for o in operands if re.match(r"(bf|f)\d+\[", shapes[o]))
                total += 2 * math.prod(lhs) * dims(name)[-1]
            elif opcode == "while":
                body = re.search(r"\bbody=%([\w.\-]+)", attributes).group(1)
                total += _trips(attributes, computations) * flops(body)
            elif opcode == "conditional":
                branches = re.findall(r"_computations?=(\{[^}]*\}|%[\w.\-]+)", attributes)
                total += max(map(flops, re.findall(r"%([\w.\-]+)", " ".join(branches))))
            else:
                total += sum(map(flops, re.findall(r"\bcalls=%([\w.\-]+)", attributes)))
        return total

    return float(flops(entry))


def hlo_collectives(hlo_text: str) -> list:
    """Every collective of compiled HLO as a dict: op, runs per step (a loop's, once a trip),
    bytes (per device, the larger of its operands and its result), group and its HLO line."""
    import common

    computations, shapes, entry = _hlo_program(hlo_text)
    sizes = {name: common._shape_bytes(shape) for name, shape in shapes.items()}
    counts = re.findall(r"(?:num_partitions|replica_count)=(\d+)", hlo_text)  # jit's, pmap's
    devices = max(map(int, counts or [1]))
    callers = {}
    for caller, instructions in computations.items():
        for _, opcode, _, attributes, _ in instructions:
            trips = _trips(attributes, computations) if opcode == "while" else 1  # body, condition
            for _, callee in _CALLS.findall(attributes):
                callers.setdefault(callee, []).append((caller, trips))

    # TPU's async collectives repeat the op where they end and in what overlaps them: not counted
    repeats = [c for c, ops in computations.items() if "AsyncCollectiveDone" in str(ops)]

    @functools.cache
    def runs(computation):
        if computation == entry or computation in repeats:
            return int(computation == entry)
        return sum(runs(caller) * times for caller, times in callers.get(computation, ()))

    found = []
    for comp, instructions in computations.items():
        for name, opcode, operands, _, line in instructions:
            op = opcode.removesuffix("-start")  # async pairs: count the start, not the done
            if comp.startswith("all-reduce-scatter"):  # TPU's reduce-scatter: a fused all-reduce
                op = op.replace("all-reduce", "reduce-scatter")
            if ragged := op == "ragged-all-to-all":  # the smaller of its rows and its room: a
                op, operands = "all-to-all", operands[:1]  # device's choices, routed evenly
            if (
                op in common.COLLECTIVES
                and runs(comp)
                and not comp.startswith("async_collective_fusion")
            ):
                operand_bytes = sum(sizes.get(o, 0) for o in operands)
                # An async start's result holds its operands too, then the outputs and its
                # context (u32[] scalars: a collective-permute-start's two)
                result_bytes = sizes[name]
                if opcode.endswith("-start"):
                    result_bytes -= operand_bytes + 4 * shapes[name].count("u32[]")
                pick = min if ragged else max
                size, group = pick(operand_bytes, result_bytes), group_size(line, devices)
                found.append(dict(op=op, runs=runs(comp), bytes=size, group=group, line=line))
    return found


def wire(op: str, n: int) -> float:
    """A ring's share of the larger buffer a device sends: (n - 1) / n, twice for an all-reduce."""
    return 1.0 if op == "collective-permute" else (1 + (op == "all-reduce")) * (n - 1) / n


def group_size(line: str, devices: int) -> int:
    """How many devices are in each group of a collective's HLO line (all, if it names none)."""
    if iota := re.search(r"replica_groups=\[\d+,(\d+)\]<=", line):
        return int(iota.group(1))
    if mesh := re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", line):
        sizes = dict((a, int(n)) for a, n in re.findall(r"'(\w+)'=(\d+)", mesh.group(1)))
        return math.prod(sizes[a] for a in re.findall(r"'(\w+)'", mesh.group(2)))
    if listed := re.search(r"replica_groups=\{\{([\d,]*)\}", line):
        return len(listed.group(1).split(","))
    return devices


def by_kind(hlo_text: str) -> dict:
    """A program's collectives by kind: count, bytes and wire_bytes (what a ring sends)."""
    import common

    collectives = {op: {"count": 0, "bytes": 0, "wire_bytes": 0.0} for op in common.COLLECTIVES}
    for found in hlo_collectives(hlo_text):
        counted, runs = collectives[found["op"]], found["runs"]
        counted["count"] += runs
        counted["bytes"] += runs * found["bytes"]
        counted["wire_bytes"] += runs * wire(found["op"], found["group"]) * found["bytes"]
    return collectives


def costs(config, compiled) -> dict:
    """A compiled step's collectives by kind (by_kind), its matmul FLOPs per device against the
    model's (above 1: what the strategy computes again)."""
    import common

    hlo_text, params = compiled.as_text(), common.unbox(common.model_shapes(config).params)
    collectives = by_kind(hlo_text)
    step_flops, per_token = hlo_flops(hlo_text), flops_per_token(config, params)
    model_flops = per_token * config.batch_size * config.seq_len / jax.device_count()
    return {
        "collectives": collectives,
        "flops_per_token": per_token,
        "step_flops": step_flops,
        "step_flops_over_model": step_flops / model_flops,
    }
