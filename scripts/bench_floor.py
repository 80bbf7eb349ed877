"""What the reads alone cost decode: the resident system with and without a streaming run's I/O beside it.

    python scripts/bench_floor.py [benchmark model flags, as bench_generate.py]
                                  [--resident-fraction 0.25 --target 0.95 [--bytes-per-token B] | --rate-mbps R]
                                  [--batch N] [--rounds 6 --tokens 32 --prompt-tokens 16] [--json]

A streaming run must read the experts it misses: B bytes a decode token. Decoding at `target` x
the resident system's speed then means reading at

    rate = target x resident tok/s x B

a second. B is `--bytes-per-token`, or by default what a run at resident fraction f reads when
routing is uniform and prediction perfect: `(1 - f) x top_k` experts a sparse layer, i.e.
B = sparse layers x top_k x (1 - f) x expert bytes. That is the default benchmark model's case
(its streaming run reads 1.14x that: prefetch's precision); a router that prefers some experts
misses less (the deep bench shape's, 48 x 64: 31 misses a token at 25%, not 288), so give such
a model the bytes a streaming run of it read (`bench_generate.py`: `streaming.miss_bytes_per_token`
plus `streaming.prefetch.bytes_per_token`).

This bench starts the resident system (every expert in the slab, no reads while it decodes),
measures its tok/s in warm-up, and then runs rounds of two jobs: one alone, one with
`instruments/paced_reads.py` reading random experts at that rate (a layer visit's misses, B over
the sparse layers, or `--batch`, at a time; O_DIRECT through the I/O workers' native reader, no
Python between the reads but the pacing), in the order alone, with, then with, alone. The median over rounds
of (with / alone) is the **floor ratio**: how close to the resident system a streaming run can
come on this machine when everything it does besides the reads is free. Where it is below
`target`, no streaming design that reads these bytes on this machine's CPUs reaches the target.
`--rate-mbps` reads at a fixed rate instead.

Speeds vary with the host (this kind of VM drifts 10-15% over minutes); both jobs of a round run
minutes within each other on the same started system. Both decode greedily from one prompt: their
tokens must be equal (`tokens_match`, exit 1 otherwise). `--json`: the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
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
from instruments.bench_cli import exit_on_sigterm, one_expert_bytes, open_model
from instruments.figures import MB, median
from shared.store import ExpertStore

ROOT = Path(__file__).resolve().parents[1]
READER = ROOT / "instruments" / "paced_reads.py"
MAX_WARMUP_JOBS = 4  # the first job loads what the prompt routes to; then every visit hits
WARM_JOBS = 2  # jobs without a miss whose median speed the modelled rate is read for


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    run = parser.add_argument_group("the run")
    run.add_argument("--resident-fraction", type=float, default=0.25, help="the streaming run whose reads are modelled")
    run.add_argument(
        "--bytes-per-token",
        type=float,
        default=None,
        help="bytes a streaming decode token reads (default: uniform routing)",
    )
    run.add_argument(
        "--target", type=float, default=0.95, help="the streaming speed, as a share of resident, to read for"
    )
    run.add_argument("--rate-mbps", type=float, default=None, help="read at this rate (MB/s) instead")
    run.add_argument(
        "--batch", type=int, default=None, help="experts read together (default: a layer visit's share of the bytes)"
    )
    run.add_argument("--rounds", type=int, default=6, help="rounds of two jobs (alone, with the reads)")
    run.add_argument("--tokens", type=int, default=32)
    run.add_argument("--prompt-tokens", type=int, default=16)
    run.add_argument("--io-mode", choices=("auto", "direct", "buffered"), default="auto")
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    args = parser.parse_args(argv)
    for name in ("rounds", "tokens", "prompt_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 < args.resident_fraction < 1:
        parser.error(f"--resident-fraction must be in (0, 1), got {args.resident_fraction}")
    if not 0 < args.target <= 1:
        parser.error(f"--target must be in (0, 1], got {args.target}")
    if args.rate_mbps is not None and not args.rate_mbps > 0:
        parser.error(f"--rate-mbps must be > 0, got {args.rate_mbps}")
    if args.bytes_per_token is not None and not args.bytes_per_token > 0:
        parser.error(f"--bytes-per-token must be > 0, got {args.bytes_per_token}")
    if args.batch is not None and args.batch < 1:
        parser.error(f"--batch must be >= 1, got {args.batch}")
    if args.bytes_per_token is not None and args.rate_mbps is not None:
        parser.error("give --bytes-per-token or --rate-mbps, not both")
    return args


class PacedReads:
    """`instruments/paced_reads.py` as a child: started and reading, then stopped with its report."""

    def __init__(self, model_dir: Path, *, rate_mbps: float, batch: int, io_mode: str, seed: int) -> None:
        command = [sys.executable, str(READER), str(model_dir), f"--rate-mbps={rate_mbps}", f"--batch={batch}"]
        command += [f"--io-mode={io_mode}", f"--seed={seed}"]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        line = self.process.stdout.readline()
        if not line.startswith("{"):
            self.process.kill()
            raise RuntimeError(f"paced reads did not start (exit code {self.process.wait()})")

    def stop(self) -> dict[str, Any]:
        """Stop it; its report (bytes, seconds, MB/s, CPU)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            out, _ = self.process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.communicate()
            raise RuntimeError("paced reads did not stop within 60 s of SIGTERM (killed)") from None
        if self.process.returncode != 0:
            raise RuntimeError(f"paced reads failed (exit code {self.process.returncode})")
        return json.loads(out.strip().splitlines()[-1])


def uniform_bytes_per_token(store: ExpertStore, fraction: float) -> float:
    """What a decode token reads at resident `fraction` when routing is uniform and prediction perfect."""
    return len(store.sparse_layers) * store.top_k * (1 - fraction) * one_expert_bytes(store)


def warm_up(side: Side, say) -> float:
    """Jobs until `WARM_JOBS` of them ran without a miss; the median of their tok/s."""
    warm = []
    for _ in range(MAX_WARMUP_JOBS):
        job = side.run()
        say(f"resident: warm-up job {job['decode_tok_s']:.3f} tok/s, {job['misses']} misses")
        if job["misses"] == 0:
            warm.append(job["decode_tok_s"])
            if len(warm) == WARM_JOBS:
                break
    if not warm:
        raise RuntimeError(f"the resident system still missed after {MAX_WARMUP_JOBS} warm-up jobs")
    return median(warm)


def run_rounds(side: Side, reads: dict[str, Any], rounds: int, say) -> list[dict[str, Any]]:
    """`rounds` rounds of a job alone and a job with paced reads (`reads`: PacedReads' arguments)."""
    measured = []
    for index in range(rounds):
        order = ("alone", "with") if index % 2 == 0 else ("with", "alone")
        row: dict[str, Any] = {"order": list(order)}
        for part in order:
            reader = PacedReads(**reads, seed=index) if part == "with" else None
            try:
                row[part] = side.run()
            finally:
                if reader is not None:
                    row["reads"] = reader.stop()
        row["ratio"] = row["with"]["decode_tok_s"] / row["alone"]["decode_tok_s"]
        measured.append(row)
        say(
            f"round {index + 1} ({','.join(order)}): alone {row['alone']['decode_tok_s']:.3f}, with reads "
            f"{row['with']['decode_tok_s']:.3f} tok/s ({row['reads']['MBps']:.0f} MB/s): {row['ratio']:.3f}"
        )
    return measured


def summarize(
    measured: list[dict[str, Any]], *, rate_mbps: float, batch: int, modelled: dict[str, Any] | None
) -> dict[str, Any]:
    ratios = [row["ratio"] for row in measured]
    reads = [row["reads"] for row in measured]
    return {
        "rate_mbps": rate_mbps,
        "batch": batch,
        "modelled": modelled,
        # The same greedy job alone and beside the reads: one list of tokens, or something is wrong.
        "tokens_match": len({tuple(row[part]["tokens"]) for row in measured for part in ("alone", "with")}) == 1,
        "rounds": len(measured),
        "floor_ratio": median(ratios),
        "floor_ratio_rounds": ratios,
        "alone_tok_s": median([row["alone"]["decode_tok_s"] for row in measured]),
        "with_reads_tok_s": median([row["with"]["decode_tok_s"] for row in measured]),
        "reads_MBps": median([r["MBps"] for r in reads]),
        "reads_cpu_ms_per_s": median(
            [(r["cpu_user_s"] + r["cpu_system_s"]) * 1e3 / max(r["seconds"], 1e-9) for r in reads]
        ),
        "reads_system_share": median(
            [r["cpu_system_s"] / max(1e-9, r["cpu_user_s"] + r["cpu_system_s"]) for r in reads]
        ),
        "decode_cpu_ms_per_token": {
            part: {
                process: median([row[part]["decode_cpu_ms_per_token"][process] for row in measured])
                for process in measured[0][part]["decode_cpu_ms_per_token"]
            }
            for part in ("alone", "with")
        },
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    exit_on_sigterm()

    def say(text: str) -> None:
        print(text, file=sys.stderr if args.json else sys.stdout, flush=True)

    model_dir, store, io_mode = open_model(args, say)
    spec = {
        "slots_per_layer": store.experts_per_layer,
        "tokens": args.tokens,
        "prompt_tokens": args.prompt_tokens,
        "options": {"io_workers": 2, "io_mode": io_mode, "working_slots": None},
    }
    side = Side("resident", ROOT, model_dir, spec)
    try:
        side.ready()
        resident_tok_s = warm_up(side, say)
        per_token = args.bytes_per_token or uniform_bytes_per_token(store, args.resident_fraction)
        modelled, rate = None, args.rate_mbps
        if rate is None:
            rate = args.target * resident_tok_s * per_token / MB
            modelled = {
                "resident_fraction": args.resident_fraction,
                "target": args.target,
                "resident_tok_s": resident_tok_s,
                "bytes_per_token": per_token,
                "bytes_per_token_from": "uniform routing" if args.bytes_per_token is None else "given",
            }
        # A layer visit's misses are read together, as the I/O workers read a wave's. Where routing
        # is skewed, misses bunch in fewer visits than bytes over layers says: give --batch.
        batch = args.batch or max(1, round(per_token / len(store.sparse_layers) / one_expert_bytes(store)))
        say(f"paced reads: {rate:.0f} MB/s, {batch} experts at a time ({io_mode})")
        reads = {"model_dir": model_dir, "rate_mbps": rate, "batch": batch, "io_mode": io_mode}
        measured = run_rounds(side, reads, args.rounds, say)
    except RuntimeError as error:
        print(f"bench_floor: {error}", file=sys.stderr, flush=True)
        return 2
    finally:
        side.stop()
    report = summarize(measured, rate_mbps=rate, batch=batch, modelled=modelled)
    say(
        f"floor: decode with the reads / alone, median {report['floor_ratio']:.3f} over {report['rounds']} rounds "
        f"({', '.join(f'{r:.3f}' for r in report['floor_ratio_rounds'])}); alone {report['alone_tok_s']:.3f}, "
        f"with reads {report['with_reads_tok_s']:.3f} tok/s; reads {report['reads_MBps']:.0f} MB/s, "
        f"their own CPU {report['reads_cpu_ms_per_s']:.0f} ms a second; tokens match: {report['tokens_match']}"
    )
    if args.json:
        print(json.dumps(report))
    return 0 if report["tokens_match"] else 1


if __name__ == "__main__":
    sys.exit(main())
