"""Replay a routing trace through the real residency manager, next to LRU and Belady.

    python scripts/replay.py TRACE[.gz] --slots-per-layer N [--working-slots N]
        [--replacement lrfu,lru] [--pinned N] [--usage-file PATH] [--json]
        [--sweep 6,8,16] [--plot out.png]

"ours" is `coordinator.residency.ExpertResidencyManager` over an
`InMemoryBackend` (no I/O), once per replacement policy named by
`--replacement` (default: the system's, as `moeslab-launch` uses it; the
first named is "ours" in the JSON, every one is "ours:NAME"): per visit
(token, layer) it records the routes, acquires the deduplicated experts,
counts the lease entries that hit and releases the lease. Hit rate = hits / unique experts looked up; "all
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

`--sweep` replays every policy at each of its capacities (slots per layer)
and prints the hit rates; `--plot` draws them (by default at about a dozen
capacities up to twice `--slots-per-layer`).

Pins (`--pinned N`): the top N (layer, expert) pairs by count of the
`--usage-file` (an ExpertUsageLedger file, `layer expert count` rows; pairs of
layers not in the trace are skipped), or, without a usage file, the N most
frequent pairs of the trace itself, which is oracle knowledge of the future.
Ties go to the smaller (layer, expert). `plan_expert_auto_pins` is not used:
its byte thresholds (0.5 GB pin budget) never pin at slot_bytes=1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

try:
    import shared.trace as trace_format
    from instruments.residency_replay import Capacity, PolicyResult, describe, replay
except ImportError:  # not installed and no PYTHONPATH: run from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import shared.trace as trace_format
    from instruments.residency_replay import Capacity, PolicyResult, describe, replay

from instruments.cache_policies import unique_rows
from instruments.replay_pins import choose_pins, plan_auto_pins
from instruments.replay_sweep import format_sweep, plot_sweep, sweep_hit_rates, sweep_points
from shared.config import DEFAULT_REPLACEMENT, parse_replacement
from shared.trace import read_trace


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
    shown = {name: result for name, result in results.items() if name != "ours"}  # "ours" is the first's alias
    width = max(8, *(len(name) for name in shown))
    print(f"{'policy':<{width}} {'hit rate':>9} {'all-resident':>13}")
    for name, result in shown.items():
        print(f"{name:<{width}} {result.hit_rate:>9.4f} {result.as_json()['all_resident']:>13.4f}")
    print(f"{'layer':<6} {'pins':>4} " + " ".join(f"{name:>{width}}" for name in shown))
    for layer in layer_ids:
        rates = " ".join(f"{result.layer_rate(layer):>{width}.4f}" for result in shown.values())
        print(f"{layer:<6} {len(capacity.pins_at(layer)):>4} {rates}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] + "\n\n" + "\n\n".join(__doc__.split("\n\n")[2:]),
        epilog=trace_format.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("trace", help="routing trace file (format below), plain or gzip-compressed")
    parser.add_argument("--slots-per-layer", type=int, required=True, help="resident LRU slots per sparse layer")
    parser.add_argument(
        "--working-slots",
        type=int,
        default=None,
        help="working bank size (default: the most unique experts of one visit)",
    )
    parser.add_argument(
        "--replacement",
        default=DEFAULT_REPLACEMENT,
        metavar="NAME[,NAME...]",
        help=f"the manager's replacement policies to replay: nextuse[:TRANSITION_HALF_LIFE], lrfu[:HALF_LIFE], lru "
        f"(default {DEFAULT_REPLACEMENT}, the system's); the first is 'ours' in the JSON",
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
    parser.add_argument(
        "--plot", default=None, metavar="OUT.png", help="hit rate against slots per layer, every policy"
    )
    parser.add_argument(
        "--sweep",
        default=None,
        metavar="N,N,...",
        help="replay every policy at these slots per layer and print the table (and plot it with --plot; "
        "--plot alone sweeps ~1..2N)",
    )
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
    replacements = list(dict.fromkeys(name.strip() for name in args.replacement.split(",") if name.strip()))
    try:
        if not replacements:
            raise ValueError("--replacement names no policy")
        for name in replacements:
            parse_replacement(name)
        points = sweep_points(args.slots_per_layer, args.sweep) if args.sweep or args.plot else None
    except ValueError as error:
        parser.error(str(error))
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
        results = replay(trace, capacity, replacements=replacements, rows=rows)
        elapsed = time.perf_counter() - started
    except (OSError, ValueError) as error:
        print(f"replay: {error}", file=sys.stderr)
        return 2
    info = describe(trace, args.trace)
    print_tables(info, capacity, results, trace.layer_ids)
    print(f"replayed in {elapsed:.2f} s")
    report = {"trace": info, "capacity": capacity.as_json(trace.layer_ids), "replacement": replacements}
    report.update({name: results[name].as_json() for name in ("ours", "lru", "belady")})
    report["policies"] = {name: results[f"ours:{name}"].as_json() for name in replacements}
    if points is not None:
        curves = sweep_hit_rates(
            trace,
            points,
            working_slots=working,
            pins=pins,
            pins_source=source,
            replacements=replacements,
            rows=rows,
        )
        print(f"sweep: hit rate (%) against slots per layer; {len(pins)} pinned ({source})")
        for line in format_sweep(points, curves):
            print(line)
        report["sweep"] = {
            "slots_per_layer": points,
            "ours": curves[f"ours:{replacements[0]}"],
            "lru": curves["lru"],
            "belady": curves["belady"],
            "policies": {name: curves[f"ours:{name}"] for name in replacements},
        }
        if args.plot:
            title = (
                f"{Path(args.trace).name}: top-{trace.top_k}, {len(trace.layer_ids)} layers, "
                f"overlap {info['overlap'] or 0:.2f}; {working} working, {len(pins)} pinned"
            )
            plot_sweep(args.plot, points, curves, title=title, marked=args.slots_per_layer)
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
