"""`moeslab-send` / `scripts/send.py`: send one generation job and show what comes back.

    moeslab-send --endpoint ipc://RUN_DIR/jobs --prompt "Hello" [--max-tokens 32]
        [--temperature 0.7 --top-p 0.9 --seed 1] [--json] [--timeout 60]
    moeslab-send --endpoint tcp://127.0.0.1:5555 --prompt-tokens 72,101,108 --json
    moeslab-send --endpoint tcp://HOST:5555 --server-key RUN_DIR/curve/server.key --prompt "Hello"
    moeslab-send --endpoint ipc://RUN_DIR/jobs --health [--json]   # who serves: pids, restarts

Without --json the text is written to stdout as it arrives, then one stats
line goes to stderr (so redirected output holds the text alone). With --json
stdout gets one JSON object: {"id", "tokens", "text", "finish_reason",
"stats"} (stats = the job's JobStats fields).

Exit status: 0 done; 1 the job failed, the coordinator was busy or did not
answer in time, or nobody serves the ipc endpoint (said at once); 2 usage
error (bad arguments, a request the protocol refuses); 130 interrupted (the
job is cancelled).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import TextIO

from shared.client import DEFAULT_TIMEOUT, Client, ClientError, JobFailedError, JobStream, ServerBusy
from shared.curve import read_server_key
from shared.job_messages import Done, HealthReply, JobStats, TokenEvent

__all__ = ["format_health", "format_stats", "main", "parse_token_list"]

ENDPOINT_ENV = "MOESLAB_ENDPOINT"
_PROG = "moeslab-send"


def parse_token_list(text: str) -> tuple[int, ...]:
    """'1,2, 3' -> (1, 2, 3); refuses empty lists, empty items, signs and non-integers."""
    items = [item.strip() for item in text.split(",")]
    if not text.strip() or any(not item.isascii() or not item.isdigit() for item in items):
        raise argparse.ArgumentTypeError(f"expected comma-separated non-negative integers like 1,2,3, got {text!r}")
    return tuple(int(item) for item in items)


def _positive_float(text: str) -> float:
    value = _finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be finite, got {text!r}")
    return value


def _count(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def _mib(value: int) -> str:
    return f"{value / (1 << 20):.1f} MiB"


def format_stats(done: Done) -> str:
    """The one-line summary printed after the streamed text."""
    stats: JobStats = done.stats
    parts = [
        f"{stats.generated_tokens} tokens ({stats.prompt_tokens} prompt, {done.finish_reason})",
        f"prefill {stats.prefill_tok_s:.1f} tok/s",
        f"decode {stats.decode_tok_s:.1f} tok/s",
        f"hit rate {stats.hit_rate:.1%} ({stats.hits} hits, {stats.misses} misses)",
        f"read {_mib(stats.bytes_read)}",
    ]
    if stats.prefetch_issued:
        stopped = stats.prefetch_disabled_layers
        parts.append(
            f"prefetch {_mib(stats.prefetch_bytes)}: recall {stats.prefetch_recall:.0%}, "
            f"precision {stats.prefetch_precision:.0%}"
            + (f", stopped on {stopped} layer{'s' if stopped != 1 else ''} (auto)" if stopped else "")
        )
    if stats.prefetch_paused:
        parts.append("prefetch paused (auto: decode steps were faster without it)")
    elif stats.prefetch_trialling:
        parts.append("prefetch on trial (auto: timing decode steps with it and without)")
    parts += [
        f"footprint {_mib(stats.footprint_bytes)} (peak {_mib(stats.peak_footprint_bytes)})"
        f" / budget {_mib(stats.budget_bytes)}: processes {_mib(stats.processes_bytes)}"
        f" + slab {_mib(stats.slab_bytes)}",
    ]
    return " | ".join(parts)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=_PROG,
        description="Send one generation job to a moeslab coordinator and print the result.",
    )
    parser.add_argument(
        "--endpoint",
        default=os.environ.get(ENDPOINT_ENV),
        help=f"the coordinator's job endpoint, e.g. ipc://RUN_DIR/jobs (default: ${ENDPOINT_ENV})",
    )
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (tokenized by the coordinator)")
    prompt.add_argument("--prompt-tokens", type=parse_token_list, metavar="1,2,3", help="prompt as token ids")
    prompt.add_argument(
        "--health", action="store_true", help="ask who serves (pids, restarts) and whether it is ready; send no job"
    )
    parser.add_argument(
        "--server-key",
        metavar="KEY_OR_FILE",
        help="the server's CURVE public key (the ready line's curve_public_key) or a file holding it "
        "(RUN_DIR/curve/server.key); needed when the launcher ran with --curve",
    )
    parser.add_argument("--max-tokens", type=_count(1), default=64)
    parser.add_argument("--temperature", type=_finite_float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=_finite_float, default=1.0)
    parser.add_argument("--seed", type=_count(0), default=None, help="sampling seed")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    parser.add_argument(
        "--timeout",
        type=_positive_float,
        default=DEFAULT_TIMEOUT,
        help=f"seconds to wait for each reply (default {DEFAULT_TIMEOUT:g})",
    )
    return parser


def _parse(argv: Sequence[str] | None) -> argparse.Namespace | int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse exits 2 on usage errors, 0 on --help
        return exit_.code if isinstance(exit_.code, int) else 2
    problems = []
    if not args.endpoint:
        problems.append(f"--endpoint is required (or set ${ENDPOINT_ENV})")
    if args.temperature < 0:
        problems.append(f"--temperature must be >= 0, got {args.temperature:g}")
    if not 0 < args.top_p <= 1:
        problems.append(f"--top-p must be in (0, 1], got {args.top_p:g}")
    if problems:
        parser.print_usage(sys.stderr)
        for problem in problems:
            print(f"{_PROG}: error: {problem}", file=sys.stderr)
        return 2
    return args


def _stream(stream: JobStream, out: TextIO, written: list[str]) -> Done:
    """Write each token's text as it arrives (also into `written`); return the Done."""
    for event in stream:
        if isinstance(event, TokenEvent):
            out.write(event.text)
            out.flush()
            written.append(event.text)
            continue
        shown = "".join(written)
        # A detokenizer may hold back a partial character until the end: show the rest.
        if event.text.startswith(shown) and len(event.text) > len(shown):
            out.write(event.text[len(shown) :])
        out.write("\n")
        out.flush()
        return event
    raise AssertionError("a job stream ends with a Done or raises")


def _end_line(written: list[str]) -> None:
    """Finish a partly streamed line so a following message starts on its own."""
    if written and not "".join(written).endswith("\n"):
        sys.stdout.write("\n")
        sys.stdout.flush()


def _as_json(done: Done) -> str:
    return json.dumps(
        {
            "id": done.id,
            "tokens": list(done.tokens),
            "text": done.text,
            "finish_reason": done.finish_reason,
            "stats": dataclasses.asdict(done.stats),
        }
    )


def _describe(error: Exception) -> str:
    if isinstance(error, ServerBusy):
        return f"coordinator busy: {error.queued} jobs queued; try again later"
    if isinstance(error, JobFailedError):
        return f"job failed ({error.code}): {error.message}"
    return str(error)


def format_health(reply: HealthReply) -> str:
    """`ready` plus one line per process: role, pid, restarts, memory (PSS less its slab share)."""
    state = "ready" if reply.ready else "not ready"
    lines = [f"{state}: {reply.io_workers} I/O workers, GPU worker {'up' if reply.gpu_worker else 'down'}"]
    if reply.liveness:
        lines[0] += f"; worker exits seen by {reply.liveness}"
    lines += [
        f"{p.name:<14} pid {p.pid:<8} restarts {p.restarts}" + (f"  {_mib(p.memory_bytes)}" if p.memory_bytes else "")
        for p in reply.processes
    ]
    if reply.baseline_bytes:
        sized = f"{reply.slots_per_layer} slots per layer"
        compiler = f" and {_mib(reply.compiler_bytes)} kept for the kernel compiler" if reply.compiler_bytes else ""
        lines.append(f"slab sized after {_mib(reply.baseline_bytes)} of processes{compiler}: {sized}")
    return "\n".join(lines)


def _health(client: Client, *, as_json: bool) -> int:
    try:
        reply = client.health()
    except (ClientError, TimeoutError) as error:
        print(f"{_PROG}: {_describe(error)}", file=sys.stderr)
        return 1
    print(json.dumps(dataclasses.asdict(reply)) if as_json else format_health(reply), flush=True)
    return 0 if reply.ready else 1


def main(argv: Sequence[str] | None = None) -> int:
    parsed = _parse(argv)
    if isinstance(parsed, int):
        return parsed
    args = parsed
    try:
        server_key = None if args.server_key is None else read_server_key(args.server_key)
        client = Client(args.endpoint, timeout=args.timeout, server_key=server_key)
    except ValueError as error:  # a bad endpoint or server key
        print(f"{_PROG}: error: {error}", file=sys.stderr)
        return 2
    except ClientError as error:  # no server at an ipc endpoint
        print(f"{_PROG}: {error}", file=sys.stderr)
        return 1
    with client:
        if args.health:
            return _health(client, as_json=args.json)
        try:
            stream = client.generate(
                args.prompt,
                prompt_tokens=args.prompt_tokens,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                seed=args.seed,
            )
        except ValueError as error:  # the protocol refuses the request as given
            print(f"{_PROG}: error: {error}", file=sys.stderr)
            return 2
        written: list[str] = []
        try:
            with stream:  # leaving early (Ctrl-C) cancels the job
                if args.json:
                    print(_as_json(stream.result()), flush=True)
                else:
                    done = _stream(stream, sys.stdout, written)
                    print(format_stats(done), file=sys.stderr, flush=True)
        except KeyboardInterrupt:
            _end_line(written)
            print(f"{_PROG}: interrupted; job {stream.id} cancelled", file=sys.stderr)
            return 130
        except (ClientError, TimeoutError) as error:
            _end_line(written)
            print(f"{_PROG}: {_describe(error)}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
