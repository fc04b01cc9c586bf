"""What a compiled program's collectives move, read from its HLO text.

XLA writes the body of a loop once, however many times it runs (the scan over layers, the loop
over microbatches); its ``while`` instruction carries the trip count
(``known_trip_count``). :func:`collectives` weighs each collective by how many times its
computation runs, and gives the group of devices it spans, so that the traffic can be put on
the right link: within a node (NVLink, ICI) or across nodes.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator

import numpy as np

DTYPE_BYTES = {
    "f64": 8, "s64": 8, "u64": 8, "c64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s16": 2,
    "u16": 2, "s8": 1, "u8": 1, "pred": 1, "f8e4m3fn": 1, "f8e5m2": 1,
}  # fmt: skip

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_COLLECTIVE = re.compile(r"=\s*(\(?[^=]*?\)?)\s+(" + "|".join(KINDS) + r")(?:-start)?\((.*)$")
_CALLED = re.compile(
    r"\b(body|condition|calls|to_apply|branch_computations|called_computations)=\{?([^,}]+(?:,\s*%[\w.\-]+)*)\}?"
)
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction: its kind, the bytes of its result per device, how many times
    a step runs it, and the devices of its first group (ids in the mesh's device order)."""

    kind: str
    result_bytes: int
    count: int
    group: tuple[int, ...]

    @property
    def group_size(self) -> int:
        return len(self.group)

    def sent_bytes(self) -> float:
        """Bytes each device sends per run, for ring algorithms over ``n`` devices: an all-gather
        or reduce-scatter passes ``(n - 1) / n`` of the whole array, an all-reduce twice that, an
        all-to-all ``(n - 1) / n`` of its buffer, a permute its whole buffer."""
        n = self.group_size
        if n <= 1:
            return 0.0
        share = (n - 1) / n
        if self.kind == "all-gather":
            return self.result_bytes * share
        if self.kind == "reduce-scatter":
            return self.result_bytes * n * share  # the result is one device's share of the array
        if self.kind == "all-reduce":
            return 2 * self.result_bytes * share
        if self.kind == "all-to-all":
            return self.result_bytes * share
        return float(self.result_bytes)


def shape_bytes(text: str) -> int:
    """Bytes of the array shapes written in ``text`` (``f32[4,8]``, a tuple of them)."""
    total = 0
    for dtype, dims in re.findall(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]", text):
        if dtype not in DTYPE_BYTES:
            continue
        total += math.prod(int(d) for d in dims.split(",") if d) * DTYPE_BYTES[dtype]
    return total


def _computations(hlo: str) -> tuple[dict[str, list[str]], str | None]:
    """The module's computations by name (their instruction lines), and the entry's name."""
    computations: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            current = header.group(1)
            computations[current] = []
            if line.startswith("ENTRY"):
                entry = current
            continue
        if current is not None:
            if line.strip() == "}":
                current = None
            else:
                computations[current].append(re.sub(r"/\*.*?\*/", "", line))
    return computations, entry


def execution_counts(hlo: str) -> dict[str, int]:
    """How many times one run of the module runs each computation: a loop's body and condition
    its trip count times (once where XLA does not know it), a called computation as often as its
    caller."""
    computations, entry = _computations(hlo)
    if entry is None:
        return dict.fromkeys(computations, 1)
    counts: dict[str, int] = {}

    def visit(name: str, times: int, depth: int = 0) -> None:
        if name not in computations or depth > 64:
            return
        counts[name] = counts.get(name, 0) + times
        for line in computations[name]:
            trip = _TRIP.search(line)
            for role, names in _CALLED.findall(line):
                factor = int(trip.group(1)) if trip and role in ("body", "condition") else 1
                for callee in re.findall(r"%?([\w.\-]+)", names):
                    visit(callee, times * factor, depth + 1)

    visit(entry, 1)
    return counts


def _group(attributes: str) -> tuple[int, ...]:
    """The device ids of an instruction's first replica group, in any of XLA's three notations:
    ``{{0,1},{2,3}}``, ``[2,2]<=[4]`` (iota, optionally transposed) and
    ``mesh['a'=2,'b'=2] {'b'}``; ``source_target_pairs`` for a permute."""
    pairs = re.search(r"source_target_pairs=\{([^}]*(?:\}[^}]*)*?)\}\}?", attributes)
    if pairs:
        ids = sorted({int(i) for i in re.findall(r"\d+", pairs.group(1))})
        return tuple(ids)
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attributes)
    if mesh:
        axes = [(name, int(size)) for name, size in re.findall(r"'([^']+)'=(\d+)", mesh.group(1))]
        grouped = set(re.findall(r"'([^']+)'", mesh.group(2)))
        mesh_ids = np.arange(math.prod(size for _, size in axes)).reshape([size for _, size in axes] or [1])
        index = tuple(slice(None) if name in grouped else 0 for name, _ in axes)
        return tuple(int(i) for i in np.asarray(mesh_ids[index]).ravel())
    iota = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attributes)
    if iota:
        shape = [int(d) for d in iota.group(1).split(",")]
        dims = [int(d) for d in iota.group(2).split(",")]
        iota_ids = np.arange(math.prod(dims)).reshape(dims)
        if iota.group(3):
            iota_ids = iota_ids.transpose([int(d) for d in iota.group(3).split(",")])
        return tuple(int(i) for i in iota_ids.reshape(shape[0], -1)[0])
    explicit = re.search(r"replica_groups=\{\{([\d,\s]*)\}", attributes)
    if explicit:
        return tuple(int(i) for i in re.findall(r"\d+", explicit.group(1)))
    return ()


def collectives(hlo: str, devices: int) -> Iterator[Collective]:
    """Each collective of the compiled module, weighed by how often a run executes it. A group
    that the text does not give (``replica_groups={}``) is all ``devices``."""
    counts = execution_counts(hlo)
    computations, _ = _computations(hlo)
    for name, lines in computations.items():
        times = counts.get(name, 0)
        if not times:
            continue
        for line in lines:
            match = _COLLECTIVE.search(line)
            if not match or "-done(" in line:
                continue
            shapes, kind, attributes = match.groups()
            group = _group(attributes) or tuple(range(devices))
            size = shape_bytes(shapes)
            if f"{kind}-start(" in line:
                # an asynchronous start's result holds its operand and its result (and, for a
                # permute, two context words): the result alone is what moves
                parts = [shape_bytes(p) for p in re.findall(r"[a-z]+[0-9]*[a-z0-9]*\[[0-9,]*\]", shapes)]
                size = parts[1] if len(parts) > 1 else size
            yield Collective(kind, size, times, group)
