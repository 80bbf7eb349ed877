"""Decode tok/s of two streaming configurations, measured side by side with alternating jobs.

    python scripts/bench_ab.py [benchmark model flags, as bench_generate.py]
                               [--a "prefetch=auto"] [--b "prefetch=on prefetch_distance=2"]
                               [--rounds 8 --passes 2 --tokens 32 --prompt-tokens 16 --resident-fraction 0.25]
                               [--json]

Each side is a started system (both at once, same model, same resident fraction)
with its own options: `key=value` words naming keyword arguments of
`instruments.system_jobs.System` (prefetch, prefetch_margin, prefetch_distance,
io_workers, io_staging, lease_path, copy_ahead, helper_scheduling,
compute_lanes, max_sequences; values are read as JSON where they parse, e.g.
`prefetch_margin=4`, else as strings), plus `root=PATH` to run that side on
another checkout's code (a worktree of another commit: `git worktree add`,
with its native extension built).

Why side by side: this kind of host drifts by 10-15% over minutes, more than
most changes move decode, so two benchmark runs minutes apart compare the
drift. Here both systems live through the same drift: after warm-up jobs
(until auto prefetch's first trial has a verdict), each round runs one job on
each side, in the order A,B then B,A, and the figure is the median over rounds
of B's tok/s over A's in the same round (with how many rounds B was faster).
The idle side sleeps meanwhile. A started system can also run a few percent
faster than another of the same code for its whole life (same-code runs here,
deep shape, 8 rounds: medians 1.011 and 1.018, single rounds 0.92-1.08), so
`--passes` starts both sides afresh that many times, the other side first
each time, and reports each pass's median besides the median of all rounds.
Both sides decode greedily from the same prompt: their tokens must be equal
(`tokens_match`, exit 1 otherwise).
`--throttle-read-mbps MB` limits the sides' reads from the model's disk (a cgroup,
as root: instruments/read_throttle.py), for the bandwidth-bound regime of users'
machines on this CPU-bound host.
`--json`: the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

try:
    from instruments.bench_model import add_model_arguments
except ImportError:  # run from a checkout without the editable install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from instruments.bench_model import add_model_arguments

from instruments.ab_side import Side
from instruments.bench_cli import exit_on_sigterm, open_model
from instruments.figures import median
from instruments.read_throttle import ReadThrottle
from shared.scheduling import resolve_io_workers

ROOT = Path(__file__).resolve().parents[1]
MAX_WARMUP_JOBS = 4  # as bench_generate: auto prefetch's first trial takes 40-72 decode steps


def parse_side(text: str) -> tuple[Path, dict[str, Any]]:
    """(code root, System options) of a side's `key=value` words."""
    root, options = ROOT, {}
    for word in shlex.split(text):
        key, sep, value = word.partition("=")
        if not sep or not key:
            raise ValueError(f"expected key=value, got {word!r}")
        if key == "root":
            root = Path(value).resolve()
            if not (root / "instruments" / "system_jobs.py").is_file():
                raise ValueError(f"root={value}: no moeslab checkout there (instruments/system_jobs.py)")
            continue
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return root, options


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    run = parser.add_argument_group("the run")
    run.add_argument("--a", default="", help="side A's options (key=value words; root=PATH for other code)")
    run.add_argument("--b", default="", help="side B's options")
    run.add_argument("--rounds", type=int, default=8, help="measured rounds a pass (one job a side each)")
    run.add_argument(
        "--passes",
        type=int,
        default=2,
        help="times both sides are started afresh (the first side started alternates): one started system "
        "can run a few percent faster than another of the same code for its whole life",
    )
    run.add_argument("--tokens", type=int, default=32)
    run.add_argument("--prompt-tokens", type=int, default=16)
    run.add_argument("--resident-fraction", type=float, default=0.25)
    run.add_argument("--io-mode", choices=("auto", "direct", "buffered"), default="auto")
    run.add_argument(
        "--throttle-read-mbps",
        type=float,
        default=None,
        metavar="MB",
        help="limit the sides' reads from the model's disk to MB (10^6 bytes) a second, for the I/O-bound "
        "regime of users' machines on a CPU-bound host (Linux cgroups, as root: instruments/read_throttle.py)",
    )
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    args = parser.parse_args(argv)
    for name in ("rounds", "passes", "tokens", "prompt_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 < args.resident_fraction <= 1:
        parser.error("--resident-fraction must be in (0, 1]")
    if args.throttle_read_mbps is not None and not 1 <= args.throttle_read_mbps * 1e6 < math.inf:
        parser.error(f"--throttle-read-mbps must be a positive rate, got {args.throttle_read_mbps}")
    try:
        args.sides = {"A": parse_side(args.a), "B": parse_side(args.b)}
    except ValueError as error:
        parser.error(str(error))
    return args


def summarize(
    specs: dict[str, tuple[Path, dict[str, Any]]], passes: list[list[dict[str, dict[str, Any]]]], jobs: dict[str, list]
) -> dict[str, Any]:
    """The report of every pass's rounds (`jobs`: each side's jobs, warm-ups included)."""
    rounds = [measured for rounds in passes for measured in rounds]

    def ratios(of: list[dict[str, dict[str, Any]]]) -> list[float]:
        return [r["B"]["decode_tok_s"] / r["A"]["decode_tok_s"] for r in of if r["A"]["decode_tok_s"] > 0]

    every = ratios(rounds)
    report: dict[str, Any] = {"passes": len(passes), "rounds": len(rounds), "b_over_a_rounds": every}
    report["b_over_a_round_median"] = median(every) if every else 0.0
    report["b_over_a_pass_medians"] = [median(ratios(rounds)) if ratios(rounds) else 0.0 for rounds in passes]
    report["b_faster_rounds"] = sum(ratio > 1 for ratio in every)
    report["tokens_match"] = len({tuple(job["tokens"]) for side in jobs.values() for job in side}) == 1
    for name, (root, options) in specs.items():
        measured = [r[name] for r in rounds]
        report[name] = {
            "root": str(root),
            "options": options,
            "decode_tok_s": median([job["decode_tok_s"] for job in measured]),
            "decode_tok_s_rounds": [job["decode_tok_s"] for job in measured],
            "ipc_wait_ms_per_token": median([job["ipc_wait_ms_per_token"] for job in measured]),
            "decode_cpu_ms_per_token": {
                part: median([job["decode_cpu_ms_per_token"][part] for job in measured])
                for part in measured[0]["decode_cpu_ms_per_token"]
            },
            "warmup_jobs": len(jobs[name]) - len(rounds),
            "prefetch_paused_rounds": sum(bool(job["prefetch"]["paused"]) for job in measured),
        }
    return report


def run_pass(
    index: int, specs: dict[str, tuple[Path, dict[str, Any]]], model_dir: Path, rounds: int, jobs: dict[str, list], say
) -> list[dict[str, dict[str, Any]]]:
    """Start both sides (A first in even passes, B first in odd ones), warm them up, run `rounds`
    rounds; every job joins `jobs`. Both sides are stopped on the way out, whatever happens."""
    names = ("A", "B") if index % 2 == 0 else ("B", "A")
    sides: dict[str, Side] = {}
    try:
        for name in names:
            root, spec = specs[name]
            sides[name] = Side(name, root, model_dir, spec)
        for name in names:
            sides[name].ready()
        for name in names:  # warm-up: the steady state, auto prefetch's first verdict included
            for _ in range(MAX_WARMUP_JOBS):
                job = sides[name].run()
                say(f"pass {index + 1}, {name}: warm-up job {job['decode_tok_s']:.3f} tok/s")
                if not job["prefetch"]["trialling"]:
                    break
        measured_rounds = []
        for round_index in range(rounds):
            order = names if round_index % 2 == 0 else names[::-1]
            measured = {name: sides[name].run() for name in order}
            measured_rounds.append(measured)
            a, b = measured["A"]["decode_tok_s"], measured["B"]["decode_tok_s"]
            say(
                f"pass {index + 1}, round {round_index + 1} ({','.join(order)}): A {a:.3f}, B {b:.3f} tok/s, "
                f"B/A {b / a if a else 0:.3f}"
            )
        return measured_rounds
    finally:
        for name, side in sides.items():
            jobs[name].extend(side.jobs)
            side.stop()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    exit_on_sigterm()

    def say(text: str) -> None:
        print(text, file=sys.stderr if args.json else sys.stdout, flush=True)

    model_dir, store, io_mode = open_model(args, say)
    slots = max(1, round(store.experts_per_layer * args.resident_fraction))
    workers = resolve_io_workers(None)[0]  # the system's auto choice, as a count a side of older code takes
    specs = {
        name: (
            root,
            {
                "slots_per_layer": slots,
                "tokens": args.tokens,
                "prompt_tokens": args.prompt_tokens,
                "options": {"io_workers": workers, "io_mode": io_mode, "working_slots": None, **options},
            },
        )
        for name, (root, options) in args.sides.items()
    }
    jobs: dict[str, list] = {"A": [], "B": []}
    rate = None if args.throttle_read_mbps is None else round(args.throttle_read_mbps * 1e6)
    try:
        with ReadThrottle(model_dir, rate) if rate else contextlib.nullcontext() as throttle:
            if throttle is not None:
                say(f"reads from {throttle.device} limited to {rate / 1e6:g} MB/s ({throttle.group})")
            passes = [run_pass(index, specs, model_dir, args.rounds, jobs, say) for index in range(args.passes)]
            throttled = throttle.bytes_read() if throttle is not None else None
    except (RuntimeError, OSError) as error:  # a side that could not start or died, a limit refused
        print(f"bench_ab: {error}", file=sys.stderr, flush=True)
        return 2
    report = summarize({name: (root, spec["options"]) for name, (root, spec) in specs.items()}, passes, jobs)
    report["throttle"] = None if rate is None else {"read_MBps": rate / 1e6, "bytes_read": throttled}
    say(
        f"B/A decode tok/s: median {report['b_over_a_round_median']:.3f} over {report['rounds']} rounds of "
        f"{report['passes']} pass(es) (pass medians {', '.join(f'{m:.3f}' for m in report['b_over_a_pass_medians'])}; "
        f"B faster in {report['b_faster_rounds']}); A {report['A']['decode_tok_s']:.3f}, "
        f"B {report['B']['decode_tok_s']:.3f} tok/s; tokens match: {report['tokens_match']}"
    )
    if args.json:
        print(json.dumps(report))
    return 0 if report["tokens_match"] else 1


if __name__ == "__main__":
    sys.exit(main())
