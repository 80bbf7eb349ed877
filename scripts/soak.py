"""Soak: the real system under a long mixed load of clients, cancels, disconnects, bad frames and faults.

    python scripts/soak.py --model DIR --jobs N --clients C [--memory-budget SIZE]
        [--cancel-rate P] [--disconnect-rate P] [--malformed-every K]
        [--kill-io-every S] [--kill-gpu-every S] [--hang-every S]
        [--kill-io-at-job N] [--kill-gpu-at-job N] [--hang-at-job N]
        [--hang-role any|gpu|io] [--max-tokens T] [--seed X] [--json] [-- LAUNCHER FLAGS...]

It starts `moeslab-launch` as a subprocess (a separate supervisor, as a user runs it; flags
after `--` go to it unchanged, after the soak's own, so they win), computes mlx-lm's greedy
tokens once per prompt in this process (`instruments.mlx_reference`, before the launch, then
freed), runs one warm-up job per prompt, then N jobs from C client threads
(`instruments.soak_load`) while `instruments.soak_faults` kills or stops workers found in the
coordinator's `health` process table and `instruments.memory_watch` samples the system's
footprint (sum of PSS, the slab once) every 50 ms. Then SIGTERM to the supervisor and a leak
check (processes, `/dev/shm` segments with this run's tag, the run directory and its sockets).

Report (`--json`: one JSON object on stdout; else a summary): jobs, done, failed by code,
cancelled, lost, wrong (completed greedy jobs whose tokens differ from mlx-lm's), restarts by
child, RSS per process at start (after the 100th job, or after the warm-up when N < 200) and at
the end, the footprint's peak against the plan's budget, what the coordinator did with the
jobs of clients that vanished (from its log), and leaks. Exit 1 when a job was lost or not run
(the system died), a greedy job's tokens (or a streamed prefix) differ, anything leaked, or a
malformed frame was not answered as expected; 2 when the system did not start.

Without --memory-budget the plan streams: top_k working slots and a quarter of each layer's
experts resident (`--slots-per-layer`, an upper bound), and the budget is dense weights + the
default KV reserve + those slots + `PROCESS_ALLOWANCE_BYTES` for the processes themselves (the budget
covers every process's memory); pass --memory-budget to hold the system to a real figure.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

try:
    from instruments.disk import resolve_io_mode
except ImportError:  # run from a checkout without the editable install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from instruments.disk import resolve_io_mode

from instruments.memory_watch import FootprintWatch
from instruments.mlx_reference import MlxLm, prompt_tokens
from instruments.soak_faults import KINDS, FaultOptions, Faults, RoleBook, process_table
from instruments.soak_load import Load, LoadOptions, check_tokens, disconnect_outcomes
from instruments.soak_memory import find_leaks, leak_count, replaced_roles, rss_growth, rss_snapshot
from shared.client import Client, ClientError
from shared.demo_model import EOS_TOKEN_ID
from shared.slab import SLAB_TAG_ENV
from shared.store import ExpertStore
from supervisor.budget import DEFAULT_KV_RESERVE_BYTES, PROCESS_ALLOWANCE_BYTES, parse_size

logger = logging.getLogger("soak")

REPO = Path(__file__).resolve().parents[1]
PROMPT_LENGTHS = (5, 11, 17, 29)  # four prompts: prefixes of the reference sentence
READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0
EXIT_FAILED, EXIT_NOT_STARTED = 1, 2


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    launcher = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--model", required=True, type=Path, metavar="DIR")
    add("--jobs", required=True, type=int, metavar="N")
    add("--clients", required=True, type=int, metavar="C")
    add("--memory-budget", type=parse_size, default=None, metavar="SIZE")
    add("--cancel-rate", type=float, default=0.0, metavar="P")
    add("--disconnect-rate", type=float, default=0.0, metavar="P")
    add("--malformed-every", type=int, default=0, metavar="K", help="every K-th job is preceded by a bad frame")
    add("--sampled-rate", type=float, default=0.1, metavar="P", help="share of jobs at temperature 0.8")
    for kind in KINDS:
        flag = kind.replace("_", "-")
        add(f"--{flag}-every", type=float, default=None, metavar="S", help="seconds between faults")
        add(f"--{flag}-at-job", type=int, action="append", default=[], metavar="N", help="when job N starts")
    add("--hang-role", choices=("any", "gpu", "io"), default="any", help="which worker a hang stops")
    add("--hang-timeout", type=float, default=30.0, metavar="S", help="for a stopped worker to be replaced")
    add("--max-tokens", type=int, default=24, metavar="T", help="jobs ask for T/2..T tokens")
    add("--job-timeout", type=float, default=120.0, metavar="S", help="no reply for S seconds: the job is lost")
    add("--seed", type=int, default=0)
    add("--log", type=Path, default=None, help="the supervisor's stderr (default: a temp file, kept on failure)")
    add("--json", action="store_true")
    args = parser.parse_args(argv)
    for name in ("jobs", "clients", "max_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("cancel_rate", "disconnect_rate", "sampled_rate"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            parser.error(f"--{name.replace('_', '-')} must be within [0, 1], got {getattr(args, name)}")
    if args.cancel_rate + args.disconnect_rate > 1.0:
        parser.error("--cancel-rate + --disconnect-rate must not exceed 1")
    return args, launcher


def launcher_args(args: argparse.Namespace, store: ExpertStore, extra: list[str]) -> tuple[list[str], int]:
    """moeslab-launch's flags and the budget asked for."""
    flags = ["--model", str(args.model)]
    budget = args.memory_budget
    if budget is None:
        per_layer = max(1, store.experts_per_layer // 4)
        slots = store.top_k + len(store.sparse_layers) * per_layer
        budget = store.dense_bytes + DEFAULT_KV_RESERVE_BYTES + slots * store.slot_bytes + PROCESS_ALLOWANCE_BYTES
        flags += ["--working-slots", str(store.top_k), "--slots-per-layer", str(per_layer)]
    if "--io-mode" not in extra:
        flags += ["--io-mode", resolve_io_mode("auto", args.model)]
    return [*flags, "--memory-budget", str(budget), *extra], budget


def eos_ids(store: ExpertStore) -> set[int]:
    eos = store.config.get("eos_token_id", EOS_TOKEN_ID)
    return set(eos) if isinstance(eos, list) else {int(eos)}


def references(model: Path, prompts: list[list[int]], tokens: int, eos: set[int]) -> list[list[int]]:
    """mlx-lm's greedy tokens per prompt, cut where the system stops (before EOS)."""
    reference = MlxLm(model)
    try:
        result = []
        for prompt in prompts:
            out = reference.run(prompt, tokens, temperature=0.0, seed=0)["tokens"]
            cut = next((i for i, token in enumerate(out) if token in eos), len(out))
            result.append(out[:cut])
        return result
    finally:
        reference.close()


def launch(flags: list[str], log_path: Path, tag: str) -> tuple[subprocess.Popen, dict[str, Any]]:
    """Start the supervisor and read its one ready line; raise RuntimeError naming why not."""
    console = Path(sys.executable).with_name("moeslab-launch")
    command = [str(console)] if console.exists() else [sys.executable, str(REPO / "scripts" / "launch.py")]
    env = dict(os.environ, **{SLAB_TAG_ENV: tag})
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [*command, *flags], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, env=env
        )
    line, deadline = b"", time.monotonic() + READY_TIMEOUT_S
    while not line.endswith(b"\n"):
        if time.monotonic() > deadline or process.poll() is not None:
            if process.poll() is None:
                process.kill()
            process.wait()
            tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
            raise RuntimeError(f"the system did not start (exit {process.returncode}): " + " | ".join(tail))
        if select.select([process.stdout], [], [], 0.5)[0]:
            line += os.read(process.stdout.fileno(), 65536)
    return process, json.loads(line)


def stop(process: subprocess.Popen) -> tuple[int | None, float]:
    """SIGTERM, then wait; SIGKILL after STOP_TIMEOUT_S (the exit code is then None)."""
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    try:
        code: int | None = process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        code = None
    process.stdout.close()
    return code, time.monotonic() - started


def warm_up(endpoint: str, prompts: list[list[int]], refs: list[list[int]], tokens: int) -> int:
    """One greedy job per prompt; the number whose tokens differ from mlx-lm's."""
    wrong = 0
    with Client(endpoint, timeout=120) as client:
        for prompt, want in zip(prompts, refs):
            done = client.generate(prompt_tokens=prompt, max_tokens=tokens).result()
            wrong += not check_tokens(list(done.tokens), done, want, tokens)
    return wrong


def soak(args: argparse.Namespace, process: subprocess.Popen, ready: dict, prompts: list, refs: list) -> dict[str, Any]:
    """Warm-up, then the load and the faults against the running system; the figures taken while it runs."""
    endpoint, book, sup_pid = ready["endpoint"], RoleBook(ready["pids"]), process.pid
    started = time.monotonic()
    with FootprintWatch(sup_pid, f"/dev/shm/{ready['slab'].lstrip('/')}") as watch:
        warm_wrong = warm_up(endpoint, prompts, refs, args.max_tokens)
        mark = 100 if args.jobs >= 200 else 0  # the RSS baseline: after the 100th job, else after the warm-up
        finished, lock, marked = [0], threading.Lock(), threading.Event()

        def job_ended(index: int) -> None:
            with lock:
                finished[0] += 1
                if finished[0] == mark:
                    marked.set()

        every = {kind: getattr(args, f"{kind}_every") for kind in KINDS}
        at_jobs = {kind: tuple(getattr(args, f"{kind}_at_job")) for kind in KINDS}
        faults = Faults(endpoint, FaultOptions(every, at_jobs, args.hang_timeout, args.seed, args.hang_role), book)
        options = LoadOptions(
            jobs=args.jobs,
            clients=args.clients,
            max_tokens=args.max_tokens,
            cancel_rate=args.cancel_rate,
            disconnect_rate=args.disconnect_rate,
            malformed_every=args.malformed_every,
            sampled_rate=args.sampled_rate,
            job_timeout=args.job_timeout,
            seed=args.seed,
        )
        load = Load(
            endpoint,
            options,
            prompts,
            refs,
            on_start=faults.job_started,
            on_end=job_ended,
            alive=lambda: process.poll() is None,
        )
        with Client(endpoint, timeout=30) as monitor:
            process_table(monitor, book)
            start = rss_snapshot(sup_pid, book.name) if not mark else {}
            faults.start()
            loader = threading.Thread(target=load.run, name="soak-load", daemon=True)
            loader.start()
            while mark and loader.is_alive() and not marked.wait(0.5):
                pass
            if mark:
                process_table(monitor, book)
                start = rss_snapshot(sup_pid, book.name)
            loader.join()
            faults.stop()
            table = process_table(monitor, book)
            end = rss_snapshot(sup_pid, book.name)
            try:
                stats = monitor.stats()
                counts = {"jobs_done": stats.jobs_done, "jobs_failed": stats.jobs_failed, "queued": stats.queued}
            except ClientError as error:  # e.g. the supervisor gave up: the report must still come out
                counts = {"error": str(error)}
    watch.sample()  # the processes alive at the end, for the leak check
    return {
        "tally": load.tally,
        "warmup_jobs": len(prompts),
        "warmup_wrong": warm_wrong,
        "faults": faults.report(),
        "restarts": {info.name: info.restarts for info in table},
        "coordinator": counts,
        "rss_start": start,
        "rss_end": end,
        "rss_growth": rss_growth(start, end),
        "rss_replaced": replaced_roles(start, end),
        "memory": memory_report(watch, ready["plan"]["budget_bytes"]),
        "seen": watch.seen,
        "seconds": round(time.monotonic() - started, 1),
    }


def memory_report(watch: FootprintWatch, budget: int) -> dict[str, Any]:
    return {
        "pss_peak_bytes": watch.peak,
        "pss_peak_parts": watch.peak_parts,
        "budget_bytes": budget,
        "over_budget": watch.peak > budget,
        "samples": watch.samples,
    }


def run(args: argparse.Namespace, extra: list[str]) -> tuple[dict[str, Any], int]:
    store = ExpertStore.open(args.model)
    prompts = [prompt_tokens(n) for n in PROMPT_LENGTHS]
    refs = references(args.model, prompts, args.max_tokens, eos_ids(store))
    flags, _ = launcher_args(args, store, extra)
    tag = secrets.token_hex(4)  # this run's /dev/shm names carry it: its leaks are told from others'
    log_path = args.log or Path(tempfile.gettempdir()) / f"soak-{tag}.log"
    try:
        process, ready = launch(flags, log_path, tag)
    except RuntimeError as error:
        return {"error": str(error), "log": str(log_path)}, EXIT_NOT_STARTED
    try:
        measured = soak(args, process, ready, prompts, refs)
    except BaseException:
        if process.poll() is None:  # never leave a system running behind a crashed soak
            stop(process)
        find_leaks({}, tag, ready["run_dir"])
        raise
    exit_code, stop_seconds = stop(process)
    leaks = find_leaks(measured.pop("seen"), tag, ready["run_dir"])
    tally = measured.pop("tally")
    counts = tally.report()
    report = {
        **{key: counts[key] for key in ("jobs", "done", "failed", "cancelled", "lost", "not_run", "wrong")},
        "wrong_partial": counts["wrong_partial"],
        "greedy_checked": counts["greedy_checked"],
        "disconnected": counts["disconnected"],
        "disconnects": disconnect_outcomes(log_path.read_text(errors="replace"), tally.disconnected),
        "malformed": counts["malformed"],
        "plan": ready["plan"],
        **measured,
        "supervisor_exit": exit_code,
        "stop_seconds": round(stop_seconds, 2),
        "leaks": leak_count(leaks),
        "leftovers": leaks,
        "examples": counts["examples"],
    }
    bad = report["lost"] or report["wrong"] or report["wrong_partial"] or report["warmup_wrong"] or report["leaks"]
    bad = bad or counts["malformed"].get("unexpected", 0) or report["not_run"]
    if bad or exit_code != 0:
        report["log"] = str(log_path)
    elif args.log is None:
        log_path.unlink(missing_ok=True)
    return report, EXIT_FAILED if bad else 0


def summary(report: dict[str, Any]) -> str:
    if "error" in report:
        return f"soak: {report['error']} (log {report['log']})"
    mib = 1 << 20
    memory = report["memory"]
    lines = [
        f"jobs {report['jobs']}: done {report['done']}, cancelled {report['cancelled']}, "
        f"disconnected {report['disconnected']}, failed {report['failed']}, lost {report['lost']}, "
        f"not run {report['not_run']}",
        f"wrong tokens: {report['wrong']} of {report['greedy_checked']} greedy jobs checked "
        f"(partial {report['wrong_partial']}, warm-up {report['warmup_wrong']})",
        f"disconnects: {report['disconnects']}",
        f"malformed frames: {report['malformed']}",
        f"faults: {report['faults']['injected']}, skipped {report['faults']['skipped']}, "
        f"hangs not detected {report['faults']['hang_not_detected']}; "
        + ", ".join(
            f"{h['role']} replaced after {h['seconds']:.1f} s" if h["detected"] else f"{h['role']} NOT replaced"
            for h in report["faults"]["hangs"]
        ),
        f"restarts: {report['restarts']}",
        f"footprint peak {memory['pss_peak_bytes'] / mib:.1f} MiB / budget {memory['budget_bytes'] / mib:.1f} MiB "
        f"({'OVER' if memory['over_budget'] else 'within'}); parts "
        + ", ".join(f"{k} {v / mib:.1f}" for k, v in memory["pss_peak_parts"].items()),
        "RSS growth (MiB): "
        + ", ".join(
            f"{k} {'n/a' if v is None else f'{v / mib:+.1f}'}{' (replaced)' if k in report['rss_replaced'] else ''}"
            for k, v in report["rss_growth"].items()
        ),
        f"shutdown: exit {report['supervisor_exit']} in {report['stop_seconds']} s; leaks {report['leaks']} "
        f"{report['leftovers'] if report['leaks'] else ''}",
    ]
    lines += [f"  {example}" for example in report["examples"]]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args, extra = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    report, code = run(args, extra)
    print(json.dumps(report) if args.json else summary(report), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
