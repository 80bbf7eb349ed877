"""Concurrent streams against one launched system: aggregate decode, per stream, time to first token.

    python scripts/bench_serve.py [--layers 8 --experts 128 --hidden 2048 --moe-intermediate 768 --top-k 8]
                                  [--resident-fraction 1.0] [--streams 1,2,4,8] [--tokens 32]
                                  [--prompt-tokens 16] [--repeats 3] [--max-sequences N] [--json]

One system is started (`instruments.system_jobs.System`) on the benchmark model of
`scripts/bench_generate.py` (same flags, same cache) with `--resident-fraction` of each
layer's experts resident (1.0: all) and `--max-sequences` (default: the largest stream count).
A warm-up job runs first. Then for each stream count C, `--repeats` rounds: C clients
(one thread each, its own ZeroMQ client) send a job at once, each with its own prompt
(the benchmark sentence from a different offset), and the round measures:

- aggregate decode tok/s: every stream's tokens after its first, over the time from the first
  stream's first token to the last stream's last token;
- per-stream decode tok/s: (tokens - 1) / (its last token - its first), the median stream, and
  their sum (`summed_tok_s`: the rate while the streams decode together, without the time
  their prefills are staggered, which the aggregate counts);
- time to first token: from the send to the stream's first token, p50 and p99 over the streams;
- hit rate and expert bytes read per generated token: the coordinator's cumulative stats
  before and after the round (prefill included), and the decode steps' share alone
  (`decode_bytes_read_per_token`: the experts they missed, from the GPU worker's telemetry).

Every round sends prompts no earlier round sent: a repeated prompt would route as before and
find its experts still resident. With every expert resident (`--resident-fraction 1`) the
warm-up decodes each round's prompts once first, so that the rounds measure decode from hits
only (as bench_generate's resident part does), whatever the stream count.

Figures are medians over the rounds; `vs_one_stream` divides each C's aggregate by C = 1's
(when 1 is among the stream counts). `--json`: the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

try:
    from instruments.bench_model import add_model_arguments, model_from_arguments
except ImportError:  # run from a checkout without the editable install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from instruments.bench_model import add_model_arguments, model_from_arguments

from instruments.bench_cli import one_expert_bytes
from instruments.disk import resolve_io_mode
from instruments.figures import median
from instruments.lease_telemetry import TelemetryLog
from instruments.mlx_reference import PROMPT_TEXT
from instruments.system_jobs import System
from shared.client import Client
from shared.job_messages import TokenEvent
from shared.store import ExpertStore


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    run = parser.add_argument_group("the run")
    run.add_argument("--streams", default="1,2,4,8", help="comma-separated concurrent stream counts")
    run.add_argument("--resident-fraction", type=float, default=1.0, help="share of each layer's experts resident")
    run.add_argument("--tokens", type=int, default=32, help="tokens generated per stream")
    run.add_argument("--prompt-tokens", type=int, default=16)
    run.add_argument("--repeats", type=int, default=3)
    run.add_argument("--max-sequences", type=int, default=None, help="default: the largest stream count")
    run.add_argument("--io-workers", type=int, default=None, help="default: the system's auto choice")
    run.add_argument("--io-mode", choices=("auto", "direct", "buffered"), default="auto")
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    args = parser.parse_args(argv)
    try:
        args.stream_counts = sorted({int(part) for part in args.streams.split(",") if part.strip()})
    except ValueError:
        parser.error(f"--streams: expected comma-separated integers, got {args.streams!r}")
    if not args.stream_counts or min(args.stream_counts) < 1:
        parser.error(f"--streams: every count must be >= 1, got {args.streams!r}")
    if not 0 < args.resident_fraction <= 1:
        parser.error("--resident-fraction must be in (0, 1]")
    for name in ("tokens", "prompt_tokens", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def stream_prompt(index: int, count: int) -> list[int]:
    """Prompt number `index`: `count` bytes of the benchmark sentence from its own offset, its
    first byte replaced by a letter of the index, so that prompts differ however many are sent."""
    text = PROMPT_TEXT * (count // len(PROMPT_TEXT) + 2)
    start = (index * 7) % len(PROMPT_TEXT)
    return [65 + index % 26, *text[start + 1 : start + count]]


def _stream(endpoint: str, prompt: list[int], tokens: int, start: threading.Event, out: dict) -> None:
    with Client(endpoint, timeout=600) as client:
        start.wait()
        sent = time.perf_counter()
        times = []
        for event in client.generate(prompt_tokens=prompt, max_tokens=tokens):
            if isinstance(event, TokenEvent):
                times.append(time.perf_counter())
        out.update(sent=sent, times=times)


def run_round(system: System, streams: int, args: argparse.Namespace, first_prompt: int) -> dict[str, Any]:
    """`streams` jobs sent at once (prompts `first_prompt`, ...: never one an earlier round sent, whose
    routing the residents would still hold); the round's figures."""
    endpoint = system.system.endpoint
    lines = system.telemetry.count()
    with Client(endpoint) as client:
        before = client.stats().stats
    start = threading.Event()
    outs: list[dict] = [{} for _ in range(streams)]
    threads = [
        threading.Thread(
            target=_stream,
            args=(endpoint, stream_prompt(first_prompt + i, args.prompt_tokens), args.tokens, start, out),
        )
        for i, out in enumerate(outs)
    ]
    for thread in threads:
        thread.start()
    time.sleep(0.2)  # every client connected: the jobs arrive together
    start.set()
    for thread in threads:
        thread.join()
    with Client(endpoint) as client:
        after = client.stats().stats
    if any(len(out.get("times", ())) < 2 for out in outs):
        raise RuntimeError(f"a stream produced fewer than 2 tokens: {[len(out.get('times', ())) for out in outs]}")
    first, last = min(out["times"][0] for out in outs), max(out["times"][-1] for out in outs)
    decoded = sum(len(out["times"]) - 1 for out in outs)
    ttft = sorted((out["times"][0] - out["sent"]) * 1e3 for out in outs)
    rates = [(len(out["times"]) - 1) / (out["times"][-1] - out["times"][0]) for out in outs]
    generated = after.generated_tokens - before.generated_tokens
    lookups = (after.hits - before.hits) + (after.misses - before.misses)
    # The GPU worker's telemetry since the round began (one busy period: its last line holds it all).
    record = system.telemetry.wait_for(lines + streams)
    decode_misses = sum(
        row[6] - row[7] for row in (record or {}).get("layers", ()) if row[1] == "decode" and row[0] >= 0
    )
    return {
        "aggregate_tok_s": decoded / (last - first),
        "per_stream_tok_s": median(rates),
        "summed_tok_s": sum(rates),
        "ttft_p50_ms": ttft[len(ttft) // 2],
        "ttft_p99_ms": ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))],
        "hit_rate": (after.hits - before.hits) / lookups if lookups else 0.0,
        "bytes_read_per_token": (after.bytes_read - before.bytes_read) / generated if generated else 0.0,
        # decode steps only: the experts they missed, per generated token (prefill reads apart)
        "decode_bytes_read_per_token": decode_misses * system.expert_bytes / generated if generated else 0.0,
        "generated": generated,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))  # stop the system on the way out
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)  # the children's INFO lines reach the telemetry log, not the terminal
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    telemetry = TelemetryLog()
    logging.getLogger("moeslab").addHandler(telemetry)

    def say(text: str) -> None:
        if not args.json:
            print(text, flush=True)

    model_dir, _, _ = model_from_arguments(args)
    store = ExpertStore.open(model_dir)
    slots = max(1, round(store.experts_per_layer * args.resident_fraction))
    max_sequences = args.max_sequences or max(args.stream_counts)
    say(
        f"model {model_dir.name}: {len(store.sparse_layers)} sparse layers x {store.experts_per_layer} experts, "
        f"{slots} resident per layer, --max-sequences {max_sequences}"
    )
    system = System(
        store,
        name="serve",
        slots_per_layer=slots,
        io_workers=args.io_workers,
        io_mode=resolve_io_mode(args.io_mode, model_dir),
        working_slots=None,
        telemetry=telemetry,
        expert_bytes=one_expert_bytes(store),
        max_sequences=max_sequences,
    )
    results: dict[str, Any] = {}
    try:
        system.job(stream_prompt(0, args.prompt_tokens), args.tokens, expected=None, temperature=0.0, seed=0)
        sent = 1  # prompts used so far (the warm-up's)
        if slots == store.experts_per_layer:  # all resident: first load what every round's prompts route to
            total = sent + sum(args.stream_counts) * args.repeats
            for first in range(sent, total, max_sequences):
                run_round(system, min(max_sequences, total - first), args, first)
            say(f"warm-up: the {total - sent} prompts of the rounds decoded once, so that they find every expert")
        for streams in args.stream_counts:
            rounds = []
            for _ in range(args.repeats):
                rounds.append(run_round(system, streams, args, sent))
                sent += streams
            summary = {key: median([r[key] for r in rounds]) for key in rounds[0]}
            summary["rounds"] = rounds
            results[str(streams)] = summary
            each = ", ".join(f"{r['aggregate_tok_s']:.2f}" for r in rounds)
            say(
                f"{streams} streams: aggregate {summary['aggregate_tok_s']:.2f} tok/s "
                f"(rounds {each}), per stream "
                f"{summary['per_stream_tok_s']:.2f}, TTFT p50 {summary['ttft_p50_ms']:.0f} ms p99 "
                f"{summary['ttft_p99_ms']:.0f} ms, hit rate {summary['hit_rate']:.3f}, "
                f"{summary['bytes_read_per_token'] / 2**20:.2f} MiB read per token"
            )
    finally:
        system.stop()
    report: dict[str, Any] = {
        "argv": list(sys.argv[1:] if argv is None else argv),
        "model": str(model_dir),
        "resident_fraction": args.resident_fraction,
        "slots_per_layer": slots,
        "max_sequences": max_sequences,
        "streams": results,
    }
    one = results.get("1")
    if one:
        report["vs_one_stream"] = {
            count: {
                "aggregate": figures["aggregate_tok_s"] / one["aggregate_tok_s"],
                "summed": figures["summed_tok_s"] / one["summed_tok_s"],
                "bytes_read_per_token": (
                    figures["bytes_read_per_token"] / one["bytes_read_per_token"]
                    if one["bytes_read_per_token"]
                    else None
                ),
                "decode_bytes_read_per_token": (
                    figures["decode_bytes_read_per_token"] / one["decode_bytes_read_per_token"]
                    if one["decode_bytes_read_per_token"]
                    else None
                ),
            }
            for count, figures in results.items()
        }
        for count, ratio in report["vs_one_stream"].items():
            bytes_ratio = ratio["bytes_read_per_token"]
            say(
                f"{count} streams vs 1: aggregate {ratio['aggregate']:.2f}x, summed {ratio['summed']:.2f}x"
                + (f", bytes read per token {bytes_ratio:.2f}x" if bytes_ratio is not None else "")
            )
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
