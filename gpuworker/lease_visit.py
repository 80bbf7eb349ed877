"""One `acquire` as the lease client tracks it, and the check of each lease against it.

`LeaseClient.acquire` predicts a layer's waves (`shared.waves.wave_partition`, the
coordinator's own partition) and opens a `Visit`: the waves, the lease each one got and
which ones the module fenced. `check_lease` holds every `Lease` the coordinator sends to
that prediction (layer, wave position, experts, slots inside the slab) before any slot is
read; `visit_wave` builds the `LeasedWave` the module takes, which remembers its visit and
position so the client's `fence` can find the lease it ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuworker.channel import LeaseError
from gpuworker.copy_ahead import StagedSet
from gpuworker.expert_provider import LeasedWave
from shared.gpu_messages import Lease

__all__ = ["SplitPending", "Visit", "VisitWave", "check_lease", "counted_lease", "visit_wave"]


def counted_lease(layer: int, experts: tuple[int, ...], slots: tuple[int, ...]) -> Lease:
    """The slots the worker counted itself in on through the lease words, as a `Lease` (no id: the
    coordinator never issued it; the shared path and a split visit's early copies read by it)."""
    return Lease(
        lease_id=-1,
        layer=layer,
        wave=0,
        waves=1,
        experts=experts,
        slots=slots,
        generations=(0,) * len(slots),
        hits=len(slots),
    )


def check_lease(visit: Visit, index: int, lease: Lease, *, total_slots: int, working_slots: int) -> None:
    """Raise `LeaseError` unless `lease` is wave `index` of `visit`, in slots of the slab."""
    where = f"lease {lease.lease_id} (layer {visit.layer} wave {index})"
    want = visit.waves[index]
    if lease.layer != visit.layer:
        raise LeaseError(f"{where}: names layer {lease.layer}")
    if lease.wave != index or lease.waves != len(visit.waves):
        raise LeaseError(
            f"{where}: is wave {lease.wave} of {lease.waves}; expected wave {index} "
            f"of {len(visit.waves)} (working bank {working_slots})"
        )
    if not (len(lease.experts) == len(lease.slots) == len(lease.generations)):
        raise LeaseError(
            f"{where}: {len(lease.experts)} experts, {len(lease.slots)} slots, {len(lease.generations)} generations"
        )
    if len(set(lease.experts)) != len(lease.experts) or set(lease.experts) != set(want):
        raise LeaseError(f"{where}: leases experts {list(lease.experts)}; the wave routes {sorted(want)}")
    bad = [slot for slot in lease.slots if slot >= total_slots]
    if bad:
        raise LeaseError(f"{where}: slots {bad} are outside the slab's {total_slots} slots")
    if len(set(lease.slots)) != len(lease.slots):
        raise LeaseError(f"{where}: a slot is leased twice: {list(lease.slots)}")


def visit_wave(
    visit: Visit, index: int, tensors, *, parts=(), take_part=None, part_lanes=(), stack_rows=()
) -> VisitWave:
    """Wave `index` of `visit` as the module takes it (`tensors`: loaded, or a loader)."""
    # The copy path's stacked tensors never read the slab: detached (fenced while computing).
    wave = VisitWave(
        visit.waves[index],
        tensors,
        lease=(visit.layer, index),
        stacked=visit.stacked,
        detached=visit.stacked,
        parts=parts,
        take_part=take_part,
        part_lanes=part_lanes,
        stack_rows=stack_rows,
    )
    wave.visit, wave.index = visit, index
    return wave


@dataclass(slots=True)
class Visit:
    """One `acquire`: the predicted waves and the lease each one got (None: not yet/never)."""

    layer: int
    waves: list[tuple[int, ...]]
    leases: list[Lease | None] = field(default_factory=list)
    fenced: list[bool] = field(default_factory=list)
    stacked: bool = False  # the waves' tensors come stacked (the copy path)
    # The shared path (lease words): the slots this visit is counted in on; () once counted out.
    # None: a message-path visit.
    shared: tuple[int, ...] | None = None
    staged: StagedSet | None = None  # the copy-ahead set its tensors come from (gpuworker.copy_ahead)
    # A split visit (gpuworker.split_visit) whose `routes` was sent and whose reply was not taken yet:
    # the fence it carried (settled if the request fails). None: no reply is owed.
    pending: SplitPending | None = None


@dataclass(frozen=True, slots=True)
class SplitPending:
    """The reply a split visit still owes: to its `routes`, which carried fence `piggyback`."""

    piggyback: int | None


class VisitWave(LeasedWave):
    """A `LeasedWave` of a `Visit`: `visit` and `index` lead the client's `fence` to its lease."""

    __slots__ = ("index", "visit")
