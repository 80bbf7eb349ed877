"""Decode tok/s of two streaming configurations, measured side by side with alternating jobs.

    python scripts/bench_ab.py [benchmark model flags, as bench_generate.py]
                               [--a "prefetch=auto"] [--b "prefetch=on prefetch_distance=2"]
                               [--rounds 8 --tokens 32 --prompt-tokens 16 --resident-fraction 0.25]
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
The idle side sleeps meanwhile. Both sides decode greedily from the same
prompt: their tokens must be equal (`tokens_match`, exit 1 otherwise).
`--json`: the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

try:
    from instruments.bench_model import add_model_arguments, model_from_arguments
except ImportError:  # run from a checkout without the editable install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from instruments.bench_model import add_model_arguments, model_from_arguments

from instruments.disk import resolve_io_mode
from instruments.figures import median
from shared.store import ExpertStore

ROOT = Path(__file__).resolve().parents[1]
SIDE = ROOT / "instruments" / "ab_side.py"
MAX_WARMUP_JOBS = 4  # as bench_generate: auto prefetch's first trial takes 40-72 decode steps
START_TIMEOUT_S = 300


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
    run.add_argument("--rounds", type=int, default=8, help="measured rounds (one job a side each)")
    run.add_argument("--tokens", type=int, default=32)
    run.add_argument("--prompt-tokens", type=int, default=16)
    run.add_argument("--resident-fraction", type=float, default=0.25)
    run.add_argument("--io-mode", choices=("auto", "direct", "buffered"), default="auto")
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    args = parser.parse_args(argv)
    for name in ("rounds", "tokens", "prompt_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 < args.resident_fraction <= 1:
        parser.error("--resident-fraction must be in (0, 1]")
    try:
        args.sides = {"A": parse_side(args.a), "B": parse_side(args.b)}
    except ValueError as error:
        parser.error(str(error))
    return args


class Side:
    """One side's process (instruments/ab_side.py): a job per `run`."""

    def __init__(self, name: str, root: Path, model_dir: Path, spec: dict[str, Any]) -> None:
        self.name, self.root, self.options = name, root, spec["options"]
        self.process = subprocess.Popen(
            [sys.executable, str(SIDE), str(root), str(model_dir), json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.jobs: list[dict[str, Any]] = []

    def _line(self) -> dict[str, Any]:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"side {self.name} exited (code {self.process.wait()})")
        return json.loads(line)

    def ready(self) -> None:
        first = self._line()
        if "error" in first:
            raise RuntimeError(f"side {self.name} could not start: {first['error']}")

    def run(self) -> dict[str, Any]:
        self.process.stdin.write("go\n")
        self.process.stdin.flush()
        job = self._line()
        self.jobs.append(job)
        return job

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                self.process.stdin.close()  # the side stops its system at end of input
            except OSError:
                pass
            try:
                self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def summarize(sides: dict[str, Side], rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    ratios = [r["B"]["decode_tok_s"] / r["A"]["decode_tok_s"] for r in rounds if r["A"]["decode_tok_s"] > 0]
    report: dict[str, Any] = {"rounds": len(rounds), "b_over_a_rounds": ratios}
    report["b_over_a_round_median"] = median(ratios) if ratios else 0.0
    report["b_faster_rounds"] = sum(ratio > 1 for ratio in ratios)
    report["tokens_match"] = len({tuple(job["tokens"]) for side in sides.values() for job in side.jobs}) == 1
    for name, side in sides.items():
        measured = [r[name] for r in rounds]
        report[name] = {
            "root": str(side.root),
            "options": side.options,
            "decode_tok_s": median([job["decode_tok_s"] for job in measured]),
            "decode_tok_s_rounds": [job["decode_tok_s"] for job in measured],
            "ipc_wait_ms_per_token": median([job["ipc_wait_ms_per_token"] for job in measured]),
            "decode_cpu_ms_per_token": {
                part: median([job["decode_cpu_ms_per_token"][part] for job in measured])
                for part in measured[0]["decode_cpu_ms_per_token"]
            },
            "warmup_jobs": len(side.jobs) - len(rounds),
            "prefetch_paused_rounds": sum(bool(job["prefetch"]["paused"]) for job in measured),
        }
    return report


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through main's finally: both sides are stopped


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)

    def say(text: str) -> None:
        print(text, file=sys.stderr if args.json else sys.stdout, flush=True)

    model_dir, built, seconds = model_from_arguments(args)
    say(f"model {model_dir}" + (f" (built in {seconds:.0f} s)" if built else ""))
    store = ExpertStore.open(model_dir)
    slots = max(1, round(store.experts_per_layer * args.resident_fraction))
    io_mode = resolve_io_mode(args.io_mode, model_dir)
    sides: dict[str, Side] = {}
    try:
        for name, (root, options) in args.sides.items():
            spec = {
                "slots_per_layer": slots,
                "tokens": args.tokens,
                "prompt_tokens": args.prompt_tokens,
                "options": {"io_workers": 2, "io_mode": io_mode, "working_slots": None, **options},
            }
            sides[name] = Side(name, root, model_dir, spec)
        for side in sides.values():
            side.ready()
        for side in sides.values():  # warm-up: the steady state, auto prefetch's first verdict included
            for _ in range(MAX_WARMUP_JOBS):
                job = side.run()
                say(f"{side.name}: warm-up job {job['decode_tok_s']:.3f} tok/s")
                if not job["prefetch"]["trialling"]:
                    break
        rounds: list[dict[str, dict[str, Any]]] = []
        for index in range(args.rounds):
            order = ("A", "B") if index % 2 == 0 else ("B", "A")
            measured = {name: sides[name].run() for name in order}
            rounds.append(measured)
            a, b = measured["A"]["decode_tok_s"], measured["B"]["decode_tok_s"]
            say(f"round {index + 1} ({','.join(order)}): A {a:.3f}, B {b:.3f} tok/s, B/A {b / a if a else 0:.3f}")
        report = summarize(sides, rounds)
    except RuntimeError as error:  # a side that could not start, or died: nothing to compare
        print(f"bench_ab: {error}", file=sys.stderr, flush=True)
        return 2
    finally:
        for side in sides.values():
            side.stop()
    say(
        f"B/A decode tok/s: median {report['b_over_a_round_median']:.3f} over {report['rounds']} rounds "
        f"(B faster in {report['b_faster_rounds']}); A {report['A']['decode_tok_s']:.3f}, "
        f"B {report['B']['decode_tok_s']:.3f} tok/s; tokens match: {report['tokens_match']}"
    )
    if args.json:
        print(json.dumps(report))
    return 0 if report["tokens_match"] else 1


if __name__ == "__main__":
    sys.exit(main())
