"""Replay a routing trace through the real residency manager, next to LRU and Belady.

    python scripts/replay.py TRACE --slots-per-layer N [--working-slots N]
        [--pinned N] [--usage-file PATH] [--json] [--plot out.png] [--sweep 1,2,4]

"ours" is `coordinator.residency.ExpertResidencyManager` over an
`InMemoryBackend` (no I/O): per visit (token, layer) it records the routes,
acquires the deduplicated experts, counts the lease entries that hit and
releases the lease. Hit rate = hits / unique experts looked up; "all
resident" = fraction of visits whose every expert hit. Visits are replayed in
trace order; the layers' caches are independent, so the order of layers
within a token does not change any figure.

Baselines, per layer: LRU (hits judged against the cache before the visit;
then the visit's hits and then its misses become most recent, evicting the
least recent) and Belady's MIN with the scratch bank (after each visit keep
the `capacity` experts of cache + visit whose next use is soonest, the
visit's own included; the optimum of every demand-fetch policy with that
capacity, see `simulate_belady`). Both use next-use/recency only, so they
run in O(visits * k * log capacity).

Capacity and fairness (printed in the capacity block): every policy is
demand-fetch with a scratch working bank (a miss is served from it and may
or may not be kept). Ours has `slots_per_layer` LRU slots per layer plus its
pins; layer L holding P_L of the pins, LRU and Belady get
`slots_per_layer + P_L` slots at layer L, the same resident capacity per
layer, and all three start with the pinned experts resident (ours preloads
them before the first token). Without pins all three start empty. The
working bank size only bounds the experts of one visit; it holds nothing
between visits, so the baselines ignore it.

Pins (`--pinned N`): the top N (layer, expert) pairs by count of the
`--usage-file` (an ExpertUsageLedger file, `layer expert count` rows; pairs of
layers not in the trace are skipped), or, without a usage file, the N most
frequent pairs of the trace itself, which is oracle knowledge of the future.
Ties go to the smaller (layer, expert). `plan_expert_auto_pins` is not used:
its byte thresholds (0.5 GB pin budget) never pin at slot_bytes=1.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import sys
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

try:
    import shared.trace as trace_format
except ImportError:  # not installed and no PYTHONPATH: run from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import shared.trace as trace_format

from shared.trace import Trace, measure_overlap, read_trace


@dataclass(frozen=True)
class PolicyResult:
    """Hits and unique lookups per layer, and visits whose experts were all resident."""

    hits: dict[int, int]
    lookups: dict[int, int]
    all_resident: int
    visits: int
    extra: dict | None = None

    @property
    def hit_rate(self) -> float:
        total = sum(self.lookups.values())
        return sum(self.hits.values()) / total if total else 0.0

    def layer_rate(self, layer: int) -> float:
        return self.hits[layer] / self.lookups[layer] if self.lookups[layer] else 0.0

    def as_json(self) -> dict:
        out = {
            "hit_rate": self.hit_rate,
            "per_layer": {str(layer): self.layer_rate(layer) for layer in sorted(self.lookups)},
            "all_resident": self.all_resident / self.visits if self.visits else 0.0,
            "hits": sum(self.hits.values()),
            "lookups": sum(self.lookups.values()),
        }
        if self.extra:
            out.update(self.extra)
        return out


@dataclass(frozen=True, kw_only=True)
class Capacity:
    """Ours: `slots_per_layer` LRU slots per layer + the pins; a `working_slots` scratch bank."""

    slots_per_layer: int
    working_slots: int
    pins: tuple[tuple[int, int], ...]
    pins_source: str

    def pins_at(self, layer: int) -> list[int]:
        return [expert for pin_layer, expert in self.pins if pin_layer == layer]

    def as_json(self, layer_ids: Sequence[int]) -> dict:
        return {
            "slots_per_layer": self.slots_per_layer,
            "working_slots": self.working_slots,
            "pinned": len(self.pins),
            "pins_source": self.pins_source,
            "pinned_per_layer": {str(layer): len(self.pins_at(layer)) for layer in layer_ids},
            "baseline_slots_per_layer": {
                str(layer): self.slots_per_layer + len(self.pins_at(layer)) for layer in layer_ids
            },
            "fairness": "lru and belady get slots_per_layer + the layer's pin count per layer "
            "and start with the pinned experts resident, as ours does; all three are "
            "demand-fetch with a scratch working bank",
        }


def unique_rows(rows: Sequence[Sequence[int]]) -> list[list[int]]:
    """Each row's experts, first occurrences only, in row order."""
    return [list(dict.fromkeys(row)) for row in rows]


def simulate_lru(rows: Sequence[Sequence[int]], *, capacity: int, initial: Sequence[int] = ()) -> list[int]:
    """Plain per-layer LRU; returns the hits of each visit (rows must be deduplicated).

    A visit's hits are decided against the cache as it stood before the
    visit; then its experts become most recent, hits first and misses after,
    each group in row order, evicting the least recent (`initial` starts
    resident, oldest first). A visit with more experts than `capacity` ends
    holding the last `capacity` of that order.
    """
    cache: OrderedDict[int, None] = OrderedDict((expert, None) for expert in initial)
    if len(cache) > capacity:
        raise ValueError(f"{len(cache)} initial experts exceed capacity {capacity}")
    out = []
    for row in rows:
        misses = [expert for expert in row if expert not in cache]
        for expert in row:
            if expert in cache:
                cache.move_to_end(expert)
        for expert in misses:
            cache[expert] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
        out.append(len(row) - len(misses))
    return out


def next_uses(rows: Sequence[Sequence[int]]) -> tuple[list[list[int]], dict[int, int]]:
    """For each (visit, expert) the index of that expert's next visit (len(rows) if none),
    and each expert's first visit; one backward pass."""
    never = len(rows)
    following: dict[int, int] = {}
    out: list[list[int]] = [[]] * len(rows)
    for index in range(len(rows) - 1, -1, -1):
        row = rows[index]
        out[index] = [following.get(expert, never) for expert in row]
        for expert in row:
            following[expert] = index
    return out, following


def simulate_belady(rows: Sequence[Sequence[int]], *, capacity: int, initial: Sequence[int] = ()) -> list[int]:
    """Belady's MIN for one layer with a scratch bank; hits per visit (rows deduplicated).

    After each visit the cache keeps the `capacity` experts of (cache before
    the visit) + (the visit's experts) whose next use is soonest; experts
    never used again go first. The visit's own experts are candidates too:
    they have been served from the scratch bank, so keeping them is a choice.

    Why this is the optimum of every demand-fetch policy with this capacity
    and start (ours included: it loads only requested experts, and after a
    visit its resident set at the layer is a subset of its set before plus
    the visit's experts, of at most capacity): a visit's hits are the
    requested experts resident at its start, and after it any subset of
    (before + requested) of size <= capacity is reachable. Take an optimal
    schedule OPT that agrees with MIN up to visit t and differs after it:
    MIN keeps y, OPT does not (if OPT keeps fewer than capacity, adding y
    costs nothing). OPT keeps some x that MIN dropped, so next(y) <= next(x).
    Let OPT' keep y instead of x and copy OPT's choices (minus x) from then
    on. Up to next(y) neither x nor y is requested, so the hits agree; at
    next(y) OPT' hits y where OPT misses it (or both hit, when next(x) ==
    next(y)); afterwards OPT' holds OPT's set minus at most x and loses at
    most x's hit at next(x), where it can take OPT's set again. So OPT' is
    optimal and agrees with MIN one visit longer; by induction MIN is
    optimal. The tests compare it with an exhaustive search over every
    reachable cache state.
    """
    following, first = next_uses(rows)
    never = len(rows)
    cache: dict[int, int] = {expert: first.get(expert, never) for expert in initial}
    if len(cache) > capacity:
        raise ValueError(f"{len(cache)} initial experts exceed capacity {capacity}")
    heap = [(-use, expert) for expert, use in cache.items()]
    heapq.heapify(heap)
    out = []
    for row, uses in zip(rows, following):
        out.append(sum(1 for expert in row if expert in cache))
        for expert, use in zip(row, uses):
            cache[expert] = use
            heapq.heappush(heap, (-use, expert))
        while len(cache) > capacity:
            use, expert = heapq.heappop(heap)
            if cache.get(expert) == -use:  # else a stale entry: the expert was used again
                del cache[expert]
        if len(heap) > 4 * capacity + 64:  # drop stale entries, keep the heap O(capacity)
            heap = [(-use, expert) for expert, use in cache.items()]
            heapq.heapify(heap)
    return out


def read_usage_counts(path: str | Path, trace: Trace) -> Counter:
    """(layer, expert) -> count, read with the real `ExpertUsageLedger`.

    The ledger ignores a damaged profile with a warning (right for a server's
    derived state); here the file is the user's explicit input, so a warning
    is an error.
    """
    from coordinator.usage import ExpertUsageLedger

    warnings: list[str] = []
    ledger = ExpertUsageLedger.open(
        path,
        layers=trace.layer_ids,
        experts_per_layer=trace_experts(trace),
        on_warning=warnings.append,
    )
    if warnings:
        raise ValueError(warnings[0])
    return Counter({(c.layer, c.expert_id): c.count for c in ledger.ranked_counts()})


def trace_experts(trace: Trace) -> int:
    """Experts per layer as far as the trace shows: its largest id + 1."""
    return int(trace.experts.max()) + 1


def plan_auto_pins(
    trace: Trace, usage_file: str, *, slots_per_layer: int, slot_bytes: int, min_pin_budget: int
) -> tuple[tuple[tuple[int, int], ...], str]:
    """Pins from `plan_expert_auto_pins`, as the launcher plans them (`--pinned auto`).

    The resident tier (slots_per_layer × layers slots) is what pins and LRU
    slots share: pins take their planned share, the LRU tier keeps the rest.
    """
    from coordinator.usage import ExpertUsageLedger
    from shared.pins import plan_expert_auto_pins

    warnings: list[str] = []
    ledger = ExpertUsageLedger.open(
        usage_file, layers=trace.layer_ids, experts_per_layer=trace_experts(trace), on_warning=warnings.append
    )
    if warnings:
        raise ValueError(warnings[0])
    layers = len(trace.layer_ids)
    tier = slots_per_layer * layers * slot_bytes
    plan = plan_expert_auto_pins(
        ledger=ledger,
        resident_tier_budget_bytes=tier,
        mandatory_resident_bytes=layers * slot_bytes,
        slot_bytes=lambda layer: slot_bytes,
        min_pin_budget_bytes=min_pin_budget,
    )
    pins = tuple(sorted((pin.layer, pin.expert_id) for pin in plan.pins))
    source = (
        f"auto from {usage_file}: {len(pins)} pins, confidence {plan.confidence:.2f}, "
        f"{plan.planned_bytes} of {plan.usable_budget_bytes} usable bytes"
    )
    return pins, source


def choose_pins(trace: Trace, *, count: int, usage_file: str | None) -> tuple[tuple[tuple[int, int], ...], str]:
    """The top `count` (layer, expert) pairs by usage-file count, or by trace frequency (oracle)."""
    if count == 0:
        return (), "none"
    if usage_file is not None:
        layers = set(trace.layer_ids)
        counts = Counter(
            {key: n for key, n in read_usage_counts(usage_file, trace).items() if key[0] in layers and n > 0}
        )
        source = f"usage file {usage_file} (top {count} by count)"
    else:
        counts = Counter(
            (layer, expert)
            for layer, row in zip(trace.layers.tolist(), unique_rows(trace.experts.tolist()))
            for expert in row
        )
        source = f"trace itself (top {count} by frequency: oracle knowledge)"
    if len(counts) < count:
        raise ValueError(f"--pinned {count}: only {len(counts)} candidate (layer, expert) pairs in {source}")
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:count]
    return tuple(sorted(key for key, _ in ranked)), source


async def _replay_ours(trace: Trace, rows: list[list[int]], capacity: Capacity) -> PolicyResult:
    from coordinator.memory_backend import InMemoryBackend
    from coordinator.residency import ExpertResidencyManager
    from shared.plan import plan_expert_residency
    from shared.segments import ExpertIOSegment, ExpertResidencyLocation

    layer_ids = trace.layer_ids
    working, pinned, slots = capacity.working_slots, len(capacity.pins), capacity.slots_per_layer
    plan = plan_expert_residency(
        budget_bytes=working + pinned + len(layer_ids) * slots,
        fixed_bytes=0,
        slot_bytes=1,
        sparse_layers=len(layer_ids),
        working_slots=working,
        pinned_experts=pinned,
        max_slots_per_layer=slots,
    )
    if plan.slots_per_layer != slots:
        raise RuntimeError(f"plan gave {plan.slots_per_layer} slots per layer, asked for {slots}")
    segments = (ExpertIOSegment(0, 0, 1, 0),)
    manager = ExpertResidencyManager(
        plan=plan,
        sparse_layer_ids=layer_ids,
        backend=InMemoryBackend(plan.total_slots),
        locate=lambda layer, expert: ExpertResidencyLocation(layer, expert, segments),
        pinned=list(capacity.pins),
        usage=None,
    )
    if capacity.pins:
        await manager.preload_pinned()
    hits = dict.fromkeys(layer_ids, 0)
    lookups = dict.fromkeys(layer_ids, 0)
    all_resident = 0
    for layer, raw, row in zip(trace.layers.tolist(), trace.experts.tolist(), rows):
        manager.record_routes(layer, [raw])
        lease = await manager.acquire_block(layer, row)
        hit = sum(1 for entry in lease.entries if entry.hit)
        lease.release_fenced()
        hits[layer] += hit
        lookups[layer] += len(row)
        all_resident += hit == len(row)
    snap = manager.snapshot()
    extra = {"manager": {"hits": snap.hits, "misses": snap.misses, "evictions": snap.evictions}}
    return PolicyResult(hits, lookups, all_resident, trace.num_visits, extra)


def _baseline(trace: Trace, rows: list[list[int]], capacity: Capacity, simulate) -> PolicyResult:
    hits: dict[int, int] = {}
    lookups: dict[int, int] = {}
    per_visit = [0] * len(rows)
    layer_of = trace.layers
    for layer in trace.layer_ids:
        index = np.flatnonzero(layer_of == layer).tolist()
        layer_rows = [rows[i] for i in index]
        pins = capacity.pins_at(layer)
        got = simulate(layer_rows, capacity=capacity.slots_per_layer + len(pins), initial=pins)
        for i, hit in zip(index, got):
            per_visit[i] = hit
        hits[layer] = sum(got)
        lookups[layer] = sum(len(row) for row in layer_rows)
    full = sum(1 for row, hit in zip(rows, per_visit) if hit == len(row))
    return PolicyResult(hits, lookups, full, len(rows))


def replay(trace: Trace, capacity: Capacity, *, rows: list[list[int]] | None = None) -> dict[str, PolicyResult]:
    """Ours, LRU and Belady at one capacity."""
    rows = unique_rows(trace.experts.tolist()) if rows is None else rows
    widest = max(len(row) for row in rows)
    if capacity.working_slots < widest:
        raise ValueError(f"--working-slots {capacity.working_slots} < {widest}, the most unique experts of one visit")
    return {
        "ours": asyncio.run(_replay_ours(trace, rows, capacity)),
        "lru": _baseline(trace, rows, capacity, simulate_lru),
        "belady": _baseline(trace, rows, capacity, simulate_belady),
    }


def describe(trace: Trace, source: str) -> dict:
    """Trace facts for the report; overlap is None (not NaN) when no layer repeats."""
    layers = trace.layer_ids
    overlap = measure_overlap(trace)
    return {
        "path": source,
        "tokens": trace.num_tokens,
        "visits": trace.num_visits,
        "layers": len(layers),
        "layer_ids": list(layers),
        "experts": trace.num_experts,
        "top_k": trace.top_k,
        "overlap": overlap if overlap == overlap else None,
    }


def _id_list(ids: Sequence[int]) -> str:
    contiguous = list(ids) == list(range(ids[0], ids[-1] + 1))
    return f"{ids[0]}..{ids[-1]}" if contiguous and len(ids) > 2 else ",".join(map(str, ids))


def print_tables(info: dict, capacity: Capacity, results: dict[str, PolicyResult], layer_ids: Sequence[int]) -> None:
    print(
        f"trace {info['path']}: {info['tokens']} tokens, {info['layers']} layers ({_id_list(info['layer_ids'])}), "
        f"{info['experts']} experts, top-{info['top_k']}, {info['visits']} visits, overlap "
        + ("n/a" if info["overlap"] is None else f"{info['overlap']:.3f}")
    )
    print(
        f"capacity: {capacity.slots_per_layer} slots/layer + {capacity.working_slots} working + "
        f"{len(capacity.pins)} pinned (pins: {capacity.pins_source}); lru/belady: "
        f"{capacity.slots_per_layer} + the layer's pins per layer, same pins resident at start"
    )
    print(f"{'policy':<8} {'hit rate':>9} {'all-resident':>13}")
    for name, result in results.items():
        print(f"{name:<8} {result.hit_rate:>9.4f} {result.as_json()['all_resident']:>13.4f}")
    print(f"{'layer':<6} {'pins':>4} " + " ".join(f"{name:>7}" for name in results))
    for layer in layer_ids:
        rates = " ".join(f"{result.layer_rate(layer):>7.4f}" for result in results.values())
        print(f"{layer:<6} {len(capacity.pins_at(layer)):>4} {rates}")


def sweep_points(slots: int, sweep: str | None) -> list[int]:
    if sweep:
        points = [int(text) for text in sweep.split(",") if text.strip()]
        if not points or min(points) < 1:
            raise ValueError(f"--sweep needs positive integers, got {sweep!r}")
        return sorted(set(points))
    step = max(1, (2 * slots) // 12)
    return sorted({*range(1, 2 * slots + 1, step), slots, 2 * slots})


def plot_sweep(path: str, points: list[int], curves: dict[str, list[float]], *, title: str, marked: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for name, values in curves.items():
        axes.plot(points, values, marker="o", label=name)
    axes.axvline(marked, color="grey", linestyle=":", linewidth=1)
    axes.set_xlabel("slots per layer (lru/belady: + the layer's pins)")
    axes.set_ylabel("hit rate")
    axes.set_ylim(0, 1)
    axes.set_title(title, fontsize=9)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] + "\n\n" + "\n\n".join(__doc__.split("\n\n")[2:]),
        epilog=trace_format.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("trace", help="routing trace file (format below)")
    parser.add_argument("--slots-per-layer", type=int, required=True, help="resident LRU slots per sparse layer")
    parser.add_argument(
        "--working-slots",
        type=int,
        default=None,
        help="working bank size (default: the most unique experts of one visit)",
    )
    parser.add_argument(
        "--pinned",
        default="0",
        help="pinned experts in all (default 0), or 'auto': plan_expert_auto_pins over --usage-file, "
        "pins then share the resident tier with the LRU slots",
    )
    parser.add_argument(
        "--slot-bytes",
        type=int,
        default=2_777_088,
        help="bytes per slot for --pinned auto budgets (default 2777088, a 2.65 MB expert)",
    )
    parser.add_argument(
        "--min-pin-budget",
        type=int,
        default=500_000_000,
        help="plan_expert_auto_pins' minimum pin budget in bytes (default 500000000)",
    )
    parser.add_argument("--usage-file", default=None, help="ledger file (layer expert count) to choose the pins from")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--plot", default=None, metavar="OUT.png", help="hit rate against slots per layer, all three")
    parser.add_argument("--sweep", default=None, help="comma list of slots-per-layer for --plot (default ~1..2N)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    auto = args.pinned == "auto"
    if not auto:
        try:
            args.pinned = int(args.pinned)
        except ValueError:
            parser.error(f"--pinned must be a count or 'auto', got {args.pinned!r}")
    if (
        args.slots_per_layer < 1
        or (not auto and args.pinned < 0)
        or (args.working_slots is not None and args.working_slots < 1)
    ):
        parser.error("--slots-per-layer and --working-slots must be >= 1, --pinned >= 0")
    if args.usage_file and not args.pinned:
        parser.error("--usage-file chooses pins: give --pinned N too")
    if auto and not args.usage_file:
        parser.error("--pinned auto plans pins from history: give --usage-file too")
    if args.slot_bytes < 1 or args.min_pin_budget < 0:
        parser.error("--slot-bytes must be >= 1 and --min-pin-budget >= 0")
    try:
        trace = read_trace(args.trace)
        rows = unique_rows(trace.experts.tolist())
        working = args.working_slots or max(len(row) for row in rows)
        if auto:
            pins, source = plan_auto_pins(
                trace,
                args.usage_file,
                slots_per_layer=args.slots_per_layer,
                slot_bytes=args.slot_bytes,
                min_pin_budget=args.min_pin_budget,
            )
            # Pins come out of the resident tier: the LRU tier keeps the rest.
            per_layer = max(1, (args.slots_per_layer * len(trace.layer_ids) - len(pins)) // len(trace.layer_ids))
            args.slots_per_layer = per_layer
        else:
            pins, source = choose_pins(trace, count=args.pinned, usage_file=args.usage_file)
        capacity = Capacity(slots_per_layer=args.slots_per_layer, working_slots=working, pins=pins, pins_source=source)
        started = time.perf_counter()
        results = replay(trace, capacity, rows=rows)
        elapsed = time.perf_counter() - started
    except (OSError, ValueError) as error:
        print(f"replay: {error}", file=sys.stderr)
        return 2
    info = describe(trace, args.trace)
    print_tables(info, capacity, results, trace.layer_ids)
    print(f"replayed in {elapsed:.2f} s")
    report = {"trace": info, "capacity": capacity.as_json(trace.layer_ids)}
    report.update({name: result.as_json() for name, result in results.items()})
    if args.plot:
        points = sweep_points(args.slots_per_layer, args.sweep)
        curves: dict[str, list[float]] = {"ours": [], "lru": [], "belady": []}
        for slots in points:
            point = replay(
                trace, Capacity(slots_per_layer=slots, working_slots=working, pins=pins, pins_source=source), rows=rows
            )
            for name in curves:
                curves[name].append(point[name].hit_rate)
        title = (
            f"{Path(args.trace).name}: top-{trace.top_k}, {len(trace.layer_ids)} layers, "
            f"overlap {info['overlap'] or 0:.2f}; {working} working, {len(pins)} pinned"
        )
        plot_sweep(args.plot, points, curves, title=title, marked=args.slots_per_layer)
        report["sweep"] = {"slots_per_layer": points, **curves}
        print(f"plot written to {args.plot} ({len(points)} capacities)")
    if args.json:
        print(json.dumps(report, sort_keys=False))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # e.g. piped into head: stop quietly
        sys.stderr.close()
        sys.exit(1)
