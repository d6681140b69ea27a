"""Devices, topology and the immutable (possibly heterogeneous) parallel plan.

A :class:`ParallelPlan` says, for one plan generation, which devices run each stage of
each replica (a TP group, any power-of-two degree, or none when that replica's stage
vanished), which layers each stage holds (shared by all replicas), and which replica
*executes* each (stage, micro-batch) when work is migrated. Every other part of ResiHP
passes plans around; none mutates one.

The plan has a compact text form (:meth:`ParallelPlan.to_text` / :func:`parse_plan`)
that round-trips exactly, and a validator whose errors name the replica, stage, device
or micro-batch at fault.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Iterable, Iterator, Sequence

__all__ = [
    "Device",
    "Topology",
    "ScheduleKind",
    "Migration",
    "ParallelPlan",
    "PlanError",
    "parse_plan",
    "is_power_of_two",
]


class PlanError(ValueError):
    """A plan, topology or plan text is invalid; the message names what is at fault."""


def is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


@dataclass(frozen=True)
class Device:
    """One device: a stable id, the node it sits on and its memory in GiB."""

    id: int
    node: int
    memory_gib: float = 80.0

    def __post_init__(self) -> None:
        if self.id < 0:
            raise PlanError(f"device id must be >= 0, got {self.id}")
        if self.node < 0:
            raise PlanError(f"device {self.id}: node must be >= 0, got {self.node}")
        if not self.memory_gib > 0:
            raise PlanError(f"device {self.id}: memory_gib must be > 0, got {self.memory_gib}")


@dataclass(frozen=True)
class Topology:
    """The job's devices grouped into nodes."""

    devices: tuple[Device, ...]

    def __post_init__(self) -> None:
        seen: set[int] = set()
        for d in self.devices:
            if d.id in seen:
                raise PlanError(f"topology lists device {d.id} twice")
            seen.add(d.id)

    @classmethod
    def uniform(cls, num_nodes: int, devices_per_node: int, memory_gib: float = 80.0) -> Topology:
        """``num_nodes`` nodes of ``devices_per_node`` devices, ids numbered node-major."""
        if num_nodes < 1 or devices_per_node < 1:
            raise PlanError(
                f"uniform topology needs >= 1 node and device, got {num_nodes}x{devices_per_node}"
            )
        return cls(
            tuple(
                Device(n * devices_per_node + i, n, memory_gib)
                for n in range(num_nodes)
                for i in range(devices_per_node)
            )
        )

    @cached_property
    def ids(self) -> frozenset[int]:
        """Every device id (built once: plans are checked against it many times)."""
        return frozenset(d.id for d in self.devices)

    def device(self, device_id: int) -> Device:
        for d in self.devices:
            if d.id == device_id:
                return d
        raise PlanError(f"unknown device {device_id}")

    def node_of(self, device_id: int) -> int:
        return self.device(device_id).node

    def nodes(self) -> dict[int, tuple[int, ...]]:
        """Node id -> the ids of its devices, in topology order."""
        out: dict[int, list[int]] = {}
        for d in self.devices:
            out.setdefault(d.node, []).append(d.id)
        return {n: tuple(ids) for n, ids in out.items()}


class ScheduleKind(str, enum.Enum):
    """Pipeline schedules ResiHP can emit and simulate."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    ZB_H1 = "zbh1"


@dataclass(frozen=True, order=True)
class Migration:
    """Stage ``stage`` of micro-batch ``(replica, mb)`` runs on replica ``to`` instead."""

    stage: int
    replica: int
    mb: int
    to: int


TPGroup = tuple[int, ...]


@dataclass(frozen=True)
class ParallelPlan:
    """One plan generation: who runs what. Validated at construction.

    ``tp_groups[r][s]`` is the ordered TP group running stage ``s`` of replica ``r``; an
    empty tuple means that stage has no devices in that replica, so every micro-batch of
    replica ``r`` must be migrated at stage ``s``. ``layer_ranges[s]`` is ``(start, end)``,
    end exclusive. ``num_heads`` (0 = unchecked) must be divisible by every TP degree.
    """

    num_layers: int
    layer_ranges: tuple[tuple[int, int], ...]
    tp_groups: tuple[tuple[TPGroup, ...], ...]
    num_microbatches: int
    schedule: ScheduleKind = ScheduleKind.ONE_F_ONE_B
    generation: int = 0
    migrations: tuple[Migration, ...] = ()
    excluded: frozenset[int] = field(default_factory=frozenset)
    standbys: tuple[int, ...] = ()
    num_heads: int = 0

    def __post_init__(self) -> None:
        # Normalise containers so equal plans compare and hash equal.
        object.__setattr__(self, "schedule", ScheduleKind(self.schedule))
        object.__setattr__(
            self, "layer_ranges", tuple((int(a), int(b)) for a, b in self.layer_ranges)
        )
        object.__setattr__(
            self,
            "tp_groups",
            tuple(tuple(tuple(int(d) for d in g) for g in rep) for rep in self.tp_groups),
        )
        object.__setattr__(self, "migrations", tuple(sorted(self.migrations)))
        object.__setattr__(self, "excluded", frozenset(self.excluded))
        object.__setattr__(self, "standbys", tuple(self.standbys))
        self._check()

    # ----------------------------------------------------------------- shape
    @property
    def dp(self) -> int:
        return len(self.tp_groups)

    @property
    def pp(self) -> int:
        return len(self.layer_ranges)

    def group(self, replica: int, stage: int) -> TPGroup:
        return self.tp_groups[replica][stage]

    def degree(self, replica: int, stage: int) -> int:
        return len(self.tp_groups[replica][stage])

    def layers(self, stage: int) -> int:
        a, b = self.layer_ranges[stage]
        return b - a

    def devices(self) -> tuple[int, ...]:
        """Every device running work in this plan, in (replica, stage, tp) order."""
        return self._devices

    @cached_property
    def _devices(self) -> tuple[int, ...]:  # asked many times per plan by the planner (131k ids)
        return tuple(d for rep in self.tp_groups for g in rep for d in g)

    def executors(self) -> Iterator[tuple[int, int]]:
        """(replica, stage) pairs that have a TP group."""
        for r, rep in enumerate(self.tp_groups):
            for s, g in enumerate(rep):
                if g:
                    yield r, s

    @cached_property
    def _moved(self) -> dict[tuple[int, int, int], int]:
        return {(m.stage, m.replica, m.mb): m.to for m in self.migrations}

    def executor(self, stage: int, replica: int, mb: int) -> int:
        """The replica that runs ``stage`` of micro-batch ``(replica, mb)``."""
        return self._moved.get((stage, replica, mb), replica)

    def executor_map(self) -> dict[tuple[int, int, int], int]:
        """(stage, replica, mb) -> executing replica, for every piece of work."""
        out = {
            (s, r, j): r
            for r in range(self.dp)
            for s in range(self.pp)
            for j in range(self.num_microbatches)
        }
        for m in self.migrations:
            out[(m.stage, m.replica, m.mb)] = m.to
        return out

    @cached_property
    def _moves_by_executor(self) -> tuple[dict, dict]:
        out: dict[tuple[int, int], set[int]] = {}
        into: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for m in self.migrations:
            out.setdefault((m.replica, m.stage), set()).add(m.mb)
            into.setdefault((m.to, m.stage), []).append((m.replica, m.mb))
        return out, into

    def work(self, replica: int, stage: int) -> list[tuple[int, int]]:
        """(owner replica, mb) pairs that ``(replica, stage)`` executes, ordered by
        (mb, owner): one global order at every stage keeps pipelines deadlock-free."""
        out, into = self._moves_by_executor
        gone = out.get((replica, stage), ())
        local = [(replica, j) for j in range(self.num_microbatches) if j not in gone]
        moved = into.get((replica, stage))
        if not moved:
            return local
        return sorted(local + moved, key=lambda x: (x[1], x[0]))

    def location(self, device: int) -> tuple[int, int, int] | None:
        """(replica, stage, tp index) of ``device``, or None when it runs nothing."""
        return self._where.get(device)

    @cached_property
    def _where(self) -> dict[int, tuple[int, int, int]]:  # built once: asked per device at scale
        return {d: (r, s, i) for r, rep in enumerate(self.tp_groups)
                for s, g in enumerate(rep) for i, d in enumerate(g)}

    def with_(self, **changes: object) -> ParallelPlan:
        """A copy with fields replaced (validated again)."""
        return replace(self, **changes)  # type: ignore[arg-type]

    # ------------------------------------------------------------ factories
    @classmethod
    def uniform(
        cls,
        *,
        tp: int,
        pp: int,
        dp: int,
        num_layers: int,
        num_microbatches: int,
        schedule: ScheduleKind | str = ScheduleKind.ONE_F_ONE_B,
        num_heads: int = 0,
        devices: Sequence[int] | None = None,
    ) -> ParallelPlan:
        """The homogeneous plan, device ids laid out Megatron-style (TP innermost, then DP,
        then PP) so TP groups stay inside a node and stages span nodes."""
        n = tp * pp * dp
        ids = list(range(n)) if devices is None else list(devices)
        if len(ids) != n:
            raise PlanError(f"uniform plan tp={tp} pp={pp} dp={dp} needs {n} devices, got {len(ids)}")
        if num_layers < pp:
            raise PlanError(f"num_layers={num_layers} is fewer than pp={pp} stages")
        groups = tuple(
            tuple(tuple(ids[s * dp * tp + r * tp + t] for t in range(tp)) for s in range(pp))
            for r in range(dp)
        )
        return cls(
            num_layers=num_layers,
            layer_ranges=even_layer_ranges(num_layers, pp),
            tp_groups=groups,
            num_microbatches=num_microbatches,
            schedule=ScheduleKind(schedule),
            num_heads=num_heads,
        )

    # ------------------------------------------------------------ validation
    def _check(self) -> None:
        if self.num_layers < 1:
            raise PlanError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.num_microbatches < 1:
            raise PlanError(f"num_microbatches must be >= 1, got {self.num_microbatches}")
        if self.generation < 0:
            raise PlanError(f"generation must be >= 0, got {self.generation}")
        if self.num_heads < 0:
            raise PlanError(f"num_heads must be >= 0, got {self.num_heads}")
        if not self.layer_ranges:
            raise PlanError("plan has no stages (layer_ranges is empty)")
        if not self.tp_groups:
            raise PlanError("plan has no replicas (tp_groups is empty)")
        # Layer ranges must tile [0, num_layers) in order, each non-empty.
        pos = 0
        for s, (a, b) in enumerate(self.layer_ranges):
            if a != pos:
                raise PlanError(
                    f"stage {s}: layer range {a}-{b} should start at layer {pos} "
                    f"(ranges must tile 0-{self.num_layers} contiguously)"
                )
            if b <= a:
                raise PlanError(f"stage {s}: layer range {a}-{b} is empty")
            pos = b
        if pos != self.num_layers:
            raise PlanError(f"layer ranges end at {pos}, model has {self.num_layers} layers")
        # TP groups: shape, degree, duplicates, exclusions.
        where: dict[int, tuple[int, int]] = {}  # formatted only for an error (131k devices)
        for r, rep in enumerate(self.tp_groups):
            if len(rep) != self.pp:
                raise PlanError(f"replica {r}: has {len(rep)} stages, plan has {self.pp}")
            for s, g in enumerate(rep):
                if not g:
                    continue
                if not is_power_of_two(len(g)):
                    raise PlanError(
                        f"replica {r} stage {s}: TP degree {len(g)} is not a power of two"
                    )
                if self.num_heads and self.num_heads % len(g):
                    raise PlanError(
                        f"replica {r} stage {s}: TP degree {len(g)} does not divide "
                        f"num_heads={self.num_heads}"
                    )
                for d in g:
                    if d < 0:
                        raise PlanError(f"replica {r} stage {s}: negative device id {d}")
                    if d in where:
                        raise PlanError(
                            f"device {d} is used twice: replica {where[d][0]} stage {where[d][1]} "
                            f"and replica {r} stage {s}"
                        )
                    where[d] = (r, s)
                    if d in self.excluded:
                        raise PlanError(f"replica {r} stage {s}: device {d} is excluded")
        for d in self.standbys:
            if d in where:
                raise PlanError(f"standby device {d} is also used by replica {where[d][0]} stage {where[d][1]}")
            if d in self.excluded:
                raise PlanError(f"standby device {d} is excluded")
        if len(set(self.standbys)) != len(self.standbys):
            raise PlanError("standbys list a device twice")
        # Every (stage, micro-batch) runs exactly once, on a replica that has the stage.
        seen: set[tuple[int, int, int]] = set()
        for m in self.migrations:
            key = (m.stage, m.replica, m.mb)
            label = f"stage {m.stage} micro-batch (replica {m.replica}, mb {m.mb})"
            if not (0 <= m.stage < self.pp):
                raise PlanError(f"migration of {label}: no stage {m.stage}")
            if not (0 <= m.replica < self.dp) or not (0 <= m.to < self.dp):
                raise PlanError(f"migration of {label} to replica {m.to}: no such replica")
            if not (0 <= m.mb < self.num_microbatches):
                raise PlanError(f"migration of {label}: no micro-batch {m.mb}")
            if key in seen:
                raise PlanError(f"{label} is migrated twice (must run exactly once)")
            if m.to == m.replica:
                raise PlanError(f"{label} is migrated to its own replica")
            if not self.tp_groups[m.to][m.stage]:
                raise PlanError(
                    f"{label} is migrated to replica {m.to}, which has no devices for stage {m.stage}"
                )
            seen.add(key)
        for r, rep in enumerate(self.tp_groups):
            for s, g in enumerate(rep):
                if g:
                    continue
                for j in range(self.num_microbatches):
                    if (s, r, j) not in seen:
                        raise PlanError(
                            f"replica {r} stage {s} has no devices but micro-batch {j} "
                            f"is not migrated (stage {s} of (replica {r}, mb {j}) would never run)"
                        )

    def validate(self, topology: Topology | None = None) -> ParallelPlan:
        """Check against a topology (unknown devices). Structural checks ran at construction."""
        if topology is not None:
            known = topology.ids
            if known.issuperset(self.devices()) and known.issuperset(self.standbys):
                return self
            for r, s in self.executors():
                for d in self.tp_groups[r][s]:
                    if d not in known:
                        raise PlanError(f"replica {r} stage {s}: unknown device {d}")
            for d in self.standbys:
                if d not in known:
                    raise PlanError(f"standby device {d} is not in the topology")
        return self

    # ------------------------------------------------------------ text form
    def to_text(self) -> str:
        lines = [
            "resihp-plan v1",
            f"generation {self.generation}",
            f"schedule {self.schedule.value}",
            f"layers {self.num_layers}",
            f"heads {self.num_heads}",
            f"microbatches {self.num_microbatches}",
            "stages " + " ".join(f"{a}-{b}" for a, b in self.layer_ranges),
        ]
        for r, rep in enumerate(self.tp_groups):
            cells = [",".join(map(str, g)) if g else "-" for g in rep]
            lines.append(f"replica {r}: " + " | ".join(cells))
        for m in self.migrations:
            lines.append(f"migrate s{m.stage} r{m.replica} m{m.mb} -> r{m.to}")
        if self.excluded:
            lines.append("excluded " + " ".join(map(str, sorted(self.excluded))))
        if self.standbys:
            lines.append("standby " + " ".join(map(str, self.standbys)))
        return "\n".join(lines) + "\n"

    def grid(self) -> str:
        """A replica x stage table of TP groups and layer ranges, for people."""
        head = ["replica"] + [
            f"stage {s} [{a}-{b})" for s, (a, b) in enumerate(self.layer_ranges)
        ]
        rows = [
            [f"r{r}"] + [("tp%d: " % len(g) + ",".join(map(str, g))) if g else "(migrated)" for g in rep]
            for r, rep in enumerate(self.tp_groups)
        ]
        widths = [max(len(x[i]) for x in [head, *rows]) for i in range(len(head))]
        fmt = lambda row: "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()  # noqa: E731
        out = [f"plan generation {self.generation}, schedule {self.schedule.value}, "
               f"{self.num_microbatches} micro-batches/replica", fmt(head)]
        out += [fmt(r) for r in rows]
        if self.migrations:
            out.append("migrated: " + ", ".join(
                f"s{m.stage}(r{m.replica},m{m.mb})->r{m.to}" for m in self.migrations))
        if self.standbys:
            out.append("standbys: " + ",".join(map(str, self.standbys)))
        if self.excluded:
            out.append("excluded: " + ",".join(map(str, sorted(self.excluded))))
        return "\n".join(out)


def even_layer_ranges(num_layers: int, pp: int) -> tuple[tuple[int, int], ...]:
    """Split ``num_layers`` into ``pp`` contiguous ranges, earlier stages one larger."""
    return ranges_from_counts([num_layers // pp + (1 if s < num_layers % pp else 0) for s in range(pp)])


def ranges_from_counts(counts: Iterable[int]) -> tuple[tuple[int, int], ...]:
    out, pos = [], 0
    for c in counts:
        out.append((pos, pos + c))
        pos += c
    return tuple(out)


def _ints(text: str, lineno: int, what: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise PlanError(f"plan text line {lineno}: {what} must be integers, got {text!r}") from None


def parse_plan(text: str) -> ParallelPlan:
    """Parse :meth:`ParallelPlan.to_text` output; errors name the line at fault."""
    if not isinstance(text, str):
        raise PlanError(f"plan text must be str, got {type(text).__name__}")
    lines = [(i + 1, ln.strip()) for i, ln in enumerate(text.splitlines())]
    lines = [(i, ln) for i, ln in lines if ln and not ln.startswith("#")]
    if not lines or lines[0][1] != "resihp-plan v1":
        raise PlanError("plan text must start with 'resihp-plan v1'")
    fields: dict[str, object] = {}
    replicas: dict[int, tuple[TPGroup, ...]] = {}
    migrations: list[Migration] = []
    for lineno, ln in lines[1:]:
        key, _, rest = ln.partition(" ")
        rest = rest.strip()
        if key in ("generation", "layers", "heads", "microbatches"):
            vals = _ints(rest, lineno, key)
            if len(vals) != 1:
                raise PlanError(f"plan text line {lineno}: {key} takes one integer, got {rest!r}")
            fields[key] = vals[0]
        elif key == "schedule":
            try:
                fields["schedule"] = ScheduleKind(rest)
            except ValueError:
                kinds = ", ".join(k.value for k in ScheduleKind)
                raise PlanError(f"plan text line {lineno}: unknown schedule {rest!r} (one of {kinds})") from None
        elif key == "stages":
            rngs = []
            for tok in rest.split():
                a, sep, b = tok.partition("-")
                if not sep:
                    raise PlanError(f"plan text line {lineno}: stage range {tok!r} is not START-END")
                lo, hi = _ints(f"{a} {b}", lineno, "stage range bounds")
                rngs.append((lo, hi))
            fields["stages"] = tuple(rngs)
        elif key == "replica":
            idx, sep, cells = rest.partition(":")
            if not sep:
                raise PlanError(f"plan text line {lineno}: expected 'replica N: ...'")
            (r,) = _ints(idx, lineno, "replica index") or [None]
            if r in replicas:
                raise PlanError(f"plan text line {lineno}: replica {r} given twice")
            groups = []
            for cell in cells.split("|"):
                cell = cell.strip()
                groups.append(() if cell == "-" else tuple(_ints(cell, lineno, "device ids")))
            replicas[r] = tuple(groups)
        elif key == "migrate":
            toks = rest.replace("->", " ").split()
            try:
                s, r, j, to = (int(t[1:]) for t in toks)
                assert [t[0] for t in toks] == ["s", "r", "m", "r"]
            except (ValueError, AssertionError):
                raise PlanError(
                    f"plan text line {lineno}: expected 'migrate sS rR mJ -> rT', got {ln!r}"
                ) from None
            migrations.append(Migration(s, r, j, to))
        elif key == "excluded":
            fields["excluded"] = frozenset(_ints(rest, lineno, "excluded devices"))
        elif key == "standby":
            fields["standby"] = tuple(_ints(rest, lineno, "standby devices"))
        else:
            raise PlanError(f"plan text line {lineno}: unknown key {key!r}")
    for need in ("layers", "microbatches", "stages"):
        if need not in fields:
            raise PlanError(f"plan text is missing the '{need}' line")
    if sorted(replicas) != list(range(len(replicas))):
        raise PlanError(f"plan text replicas must be numbered 0..n-1, got {sorted(replicas)}")
    return ParallelPlan(
        num_layers=fields["layers"],  # type: ignore[arg-type]
        layer_ranges=fields["stages"],  # type: ignore[arg-type]
        tp_groups=tuple(replicas[r] for r in range(len(replicas))),
        num_microbatches=fields["microbatches"],  # type: ignore[arg-type]
        schedule=fields.get("schedule", ScheduleKind.ONE_F_ONE_B),  # type: ignore[arg-type]
        generation=fields.get("generation", 0),  # type: ignore[arg-type]
        migrations=tuple(migrations),
        excluded=fields.get("excluded", frozenset()),  # type: ignore[arg-type]
        standbys=fields.get("standby", ()),  # type: ignore[arg-type]
        num_heads=fields.get("heads", 0),  # type: ignore[arg-type]
    )
