"""The compiled step read closely: its matmul FLOPs, and every collective (common.py's reading,
which a run prints by kind) with its group and wire bytes, TPU programs included.
tools/compile_for.py and the tests read a step with it.

  summary = hlo.costs(config, compiled)  # the run's collectives with wire bytes, the FLOPs
"""

import functools
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


def hlo_flops(hlo_text: str) -> float:
    """The matmul FLOPs of one run of compiled HLO, per device: a loop's body times its trips
    (common.trips; XLA's own cost analysis counts it once), a conditional's costliest branch
    (an upper bound where branches differ: a pipeline's ticks, ring attention's skipped
    blocks)."""
    import common

    computations, shapes, entry = common.hlo_program(hlo_text)

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
                total += common.trips(attributes, computations) * flops(body)
            elif opcode == "conditional":
                branches = re.findall(r"_computations?=(\{[^}]*\}|%[\w.\-]+)", attributes)
                total += max(map(flops, re.findall(r"%([\w.\-]+)", " ".join(branches))))
            else:
                total += sum(map(flops, re.findall(r"\bcalls=%([\w.\-]+)", attributes)))
        return total

    return float(flops(entry))


def hlo_collectives(hlo_text: str) -> list:
    """Every collective of compiled HLO (common.collective_ops: op, runs per step, bytes per
    device, its HLO line) with its group: how many devices it spans."""
    import common

    counts = re.findall(r"(?:num_partitions|replica_count)=(\d+)", hlo_text)  # jit's, pmap's
    devices = max(map(int, counts or [1]))
    return [dict(c, group=group_size(c["line"], devices)) for c in common.collective_ops(hlo_text)]


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
