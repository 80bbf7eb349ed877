"""Decode tok/s of the whole system against mlx-lm and against the serial streaming roofline.

    python scripts/bench_generate.py [--layers 8 --experts 128 --hidden 2048 --moe-intermediate 768
                                      --top-k 8 --bits 4 --scale-dtype float32|bfloat16]
                                     [--tokens 32 --prompt-tokens 16 --repeats 3 --passes 1 --temperature 0]
                                     [--sequential] [--model DIR] [--json]

What is measured (default order: interleaved):

- **mlx-lm**: `mlx_lm.utils.load_model` of the whole model (every parameter
  in memory) and its own `generate_step`, in this process, sampling as the
  GPU worker does (greedy by default).
- **resident**: the system (`supervisor.system.start_system`) with every expert
  resident (slots_per_layer = experts, plus the working bank); a warm-up job
  of the same prompt loads every expert the measured jobs route to, so they
  decode from hits only (the report shows their misses: 0).
- **streaming**: slots_per_layer = experts x `--resident-fraction` (0.25);
  warm-up jobs reach the steady state (with auto prefetch, until its first
  trial has a verdict, at most MAX_WARMUP_JOBS), then the measured jobs.
- **disk**: `--disk-experts` random experts read with the I/O workers' native
  O_DIRECT reader in batches of a decode layer visit's misses (measured in the
  streaming jobs), each batch's segments in flight at once; plus one alone.
- **roofline** of the streaming run: 1 / (t_compute + miss_bytes / disk_MBps)
  with miss_bytes the bytes of the experts missed per decode token (the
  GPU worker's leases say how many of each wave were resident; prefill
  excluded), disk_MBps as above, and t_compute the resident run's time per
  decode token (`ratio`) or, stricter, mlx-lm's (`ratio_mlx_lm`).

Interleaved: mlx-lm stays loaded next to both started systems (about 8.5 GB
at the default sizes) and each of `--repeats` rounds runs mlx-lm, a resident
job, a streaming job and a disk measurement back to back, so a busy machine
slows the things compared alike; `vs_mlx_lm_rounds` pairs each round. A
started system can stay a few percent faster than another for its whole life:
`--passes N` starts both afresh N times (`vs_resident_pass_medians`).
`--sequential`: mlx-lm first, freed before the systems start one by one.

Every job's tokens must equal mlx-lm's (the script exits 1 otherwise). The
GPU worker's per-layer lease telemetry (IPC wait = lease round trips,
copy = slot -> mx arrays) comes from its end-of-job log line. Figures are
medians over the repeats; decode tok/s is (tokens - 1) / (time from the first
token to the last), the same definition for mlx-lm and for the system.

The benchmark model is built once with mlx-lm's own classes, quantize and
save functions (qwen3_moe, Qwen3-30B-A3B's expert and attention shapes by
default: 2.95 MB per 4-bit expert with fp32 scales, 3.0 GB of experts at 8
layers) and cached under `<repo>/.cache/bench-model-<fingerprint>`. Its
residual branches are scaled down (`scale_residual_branches`) so that, as in
a trained model, routing follows the token: with mlx-lm's plain random init
every layer past the first sends a whole generation to a few dozen experts. MLX's CPU kernels run
bf16 several times slower than fp32, so on CPU the default keeps the
quantization scales (and every other float) in float32; `--scale-dtype
bfloat16` builds the bf16 variant. `--json`: the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

try:
    from instruments.bench_model import add_model_arguments, model_from_arguments
except ImportError:  # run from a checkout without the editable install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from instruments.bench_model import add_model_arguments, model_from_arguments

from instruments.bench_cli import exit_on_sigterm, one_expert_bytes
from instruments.bench_report import build_report, model_facts, model_line, report_lines
from instruments.disk import disk_bandwidth, resolve_io_mode
from instruments.figures import median
from instruments.lease_telemetry import TelemetryLog
from instruments.machine import MemoryWatch, pin_processes, split_cpus, total_memory
from instruments.mlx_reference import MlxLm, prompt_tokens, until_eos
from instruments.system_jobs import System
from shared.config import COPY_AHEAD_MODES, LEASE_PATHS, check_compute_lanes, check_prefetch_distance
from shared.scheduling import HELPER_SCHEDULING, resolve_io_workers
from shared.store import ExpertStore

MAX_WARMUP_JOBS = 4  # auto prefetch's first trial takes 40-72 decode steps (prefetch_trial.py)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    run = parser.add_argument_group("the run")
    run.add_argument("--tokens", type=int, default=32, help="tokens generated per job")
    run.add_argument("--prompt-tokens", type=int, default=16)
    run.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature of every job (0: greedy); mlx-lm samples the same way",
    )
    run.add_argument("--sample-seed", type=int, default=0, help="the jobs' sampling seed (same for mlx-lm)")
    run.add_argument("--repeats", type=int, default=3, help="measured rounds; medians reported")
    run.add_argument(
        "--passes",
        type=int,
        default=1,
        help="times both systems are started afresh for --repeats rounds each (interleaved order)",
    )
    run.add_argument(
        "--resident-fraction", type=float, default=0.25, help="streaming run: slots per layer = experts x this"
    )
    run.add_argument("--io-workers", type=int, default=None, help="default: the system's auto choice")
    run.add_argument(
        "--io-mode",
        choices=("auto", "direct", "buffered"),
        default="auto",
        help="auto: buffered where the model is on tmpfs, else direct",
    )
    run.add_argument("--working-slots", type=int, default=None)
    run.add_argument(
        "--compute-lanes", type=int, default=None, help="the GPU worker's --compute-lanes (default: its auto choice)"
    )
    run.add_argument(
        "--prefetch", choices=("auto", "on", "off"), default="auto", help="the systems' next-layer prefetch"
    )
    run.add_argument(
        "--prefetch-margin",
        type=int,
        default=None,
        help="experts predicted per layer beyond top-k (default: the system's, a quarter of top-k)",
    )
    run.add_argument(
        "--prefetch-distance", type=int, default=1, help="sparse layers ahead a prefetch predicts (default 1)"
    )
    run.add_argument(
        "--io-staging", choices=("auto", "on", "off"), default="auto", help="the I/O workers' huge-page staging"
    )
    run.add_argument(
        "--lease-path", choices=LEASE_PATHS, default="shared", help="how the GPU worker leases resident experts"
    )
    run.add_argument(
        "--copy-ahead",
        choices=COPY_AHEAD_MODES,
        default="on",
        help="copy the next layer's predicted experts while a layer computes (copy path)",
    )
    run.add_argument(
        "--helper-scheduling",
        choices=HELPER_SCHEDULING,
        default="auto",
        help="the coordinator's and I/O workers' Linux scheduling class or CPU (shared/scheduling.py)",
    )
    run.add_argument(
        "--pin-helpers",
        action="store_true",
        help="an experiment (Linux): every thread of the coordinator and the I/O workers on this "
        "process's last CPU, the GPU worker's on the others, so the helpers never take the "
        "computation's cores (with 2 CPUs, add --compute-lanes 1)",
    )
    run.add_argument(
        "--max-sequences",
        type=int,
        default=None,
        help="the systems' --max-sequences (default: the system's, 4; 1 decodes without mlx-lm's BatchGenerator)",
    )
    run.add_argument("--disk-experts", type=int, default=64, help="experts read per disk measurement")
    run.add_argument("--skip", default="", help="comma-separated parts to skip: resident,streaming")
    run.add_argument(
        "--sequential",
        action="store_true",
        help="mlx-lm first (then freed), then each system alone; default: mlx-lm stays loaded "
        "and every round runs mlx-lm, the resident job and the streaming job back to back, "
        "so a noisy machine slows all three alike",
    )
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    parser.add_argument("-v", "--verbose", action="store_true", help="show the children's log lines")
    args = parser.parse_args(argv)
    for name in (
        "layers",
        "experts",
        "hidden",
        "moe_intermediate",
        "top_k",
        "tokens",
        "prompt_tokens",
        "repeats",
        "passes",
        "disk_experts",
    ):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 < args.resident_fraction <= 1:
        parser.error("--resident-fraction must be in (0, 1]")
    if args.passes > 1 and args.sequential:
        parser.error("--passes needs the interleaved order (not --sequential)")
    if args.top_k > args.experts:
        parser.error("--top-k must not exceed --experts")
    if args.temperature < 0:
        parser.error("--temperature must be >= 0")
    try:
        if args.compute_lanes is not None:
            check_compute_lanes(args.compute_lanes, name="--compute-lanes")
        check_prefetch_distance(args.prefetch_distance, name="--prefetch-distance")
        args.io_workers = resolve_io_workers(args.io_workers)[0]  # the disk figure's readers too
    except ValueError as error:
        parser.error(str(error))
    if args.pin_helpers:
        try:
            args.cpus = split_cpus()  # (GPU worker's, helpers')
        except ValueError as error:
            parser.error(f"--pin-helpers: {error}")
    unknown = {p.strip() for p in args.skip.split(",") if p.strip()} - {"resident", "streaming"}
    if unknown:
        parser.error(f"--skip: unknown parts {sorted(unknown)}")
    return args


class Bench:
    """The measurements of one run; `report` is what --json prints."""

    def __init__(
        self, args: argparse.Namespace, store, model_dir: Path, io_mode: str, telemetry: TelemetryLog, say
    ) -> None:
        self.args, self.store, self.model_dir, self.io_mode = args, store, model_dir, io_mode
        self.telemetry, self.say = telemetry, say
        self.prompt = prompt_tokens(args.prompt_tokens)
        self.expert_bytes = one_expert_bytes(store)
        self.sample = dict(temperature=args.temperature, seed=args.sample_seed)
        skip = {p.strip() for p in args.skip.split(",") if p.strip()}
        self.parts = [part for part in ("resident", "streaming") if part not in skip]
        self.base_runs: list[dict[str, Any]] = []
        self.disk_runs: list[dict[str, Any]] = []
        self.systems: dict[str, System] = {}
        self.expected: list[int] = []
        self.base_info: dict[str, Any] = {}

    # -- pieces

    def start(self, part: str) -> System:
        store = self.store
        slots = (
            store.experts_per_layer
            if part == "resident"
            else max(1, round(store.experts_per_layer * self.args.resident_fraction))
        )
        system = System(
            store,
            name=part,
            slots_per_layer=slots,
            io_workers=self.args.io_workers,
            io_mode=self.io_mode,
            working_slots=self.args.working_slots,
            telemetry=self.telemetry,
            expert_bytes=self.expert_bytes,
            compute_lanes=self.args.compute_lanes,
            prefetch=self.args.prefetch,
            io_staging=self.args.io_staging,
            lease_path=self.args.lease_path,
            max_sequences=self.args.max_sequences,
            copy_ahead=self.args.copy_ahead,
            prefetch_margin=self.args.prefetch_margin,
            prefetch_distance=self.args.prefetch_distance,
            helper_scheduling=self.args.helper_scheduling,
        )
        self.systems[part] = system
        # Warm-up: the resident system loads every expert the prompt's tokens route to (the
        # measured jobs then run from hits only); the streaming one reaches its steady state, which
        # includes auto prefetch's first verdict: its trial runs epochs of decode steps without
        # prefetch (coordinator/prefetch_trial.py) once per 512 decode steps, and a measured round of
        # 32 tokens that held them would count that cost sixteen times over.
        try:
            if self.args.pin_helpers:
                gpu_worker, helpers = self.args.cpus
                system.pinning = pin_processes(system.system.pids, gpu_worker=gpu_worker, helpers=helpers)
                self.say(f"{part}: pinned {system.pinning}")
            for _ in range(MAX_WARMUP_JOBS):
                job = system.job(self.prompt, self.args.tokens, expected=self.expected, warmup=True, **self.sample)
                self.say(f"{part}: warm-up job {job['decode_tok_s']:.3f} tok/s, {job['misses']} misses")
                if not job["prefetch"]["trialling"]:
                    break
        except BaseException:  # the caller never gets the system to stop (e.g. SIGTERM in the warm-up)
            del self.systems[part]
            system.stop()
            raise
        self.say(
            f"{part}: started in {system.startup_s:.1f} s ({system.system.plan.slots_per_layer} of "
            f"{store.experts_per_layer} experts per layer resident); {len(system.jobs)} warm-up job(s)"
            + ("; auto prefetch still on trial" if job["prefetch"]["trialling"] else "")
        )
        return system

    def baseline(self, mlx: MlxLm) -> None:
        run = mlx.run(self.prompt, self.args.tokens, **self.sample)
        if not self.expected:
            self.expected = until_eos(run["tokens"])
        run["tokens_equal_first"] = until_eos(run["tokens"]) == self.expected
        self.base_runs.append(run)

    def disk(self) -> None:
        streaming = self.systems.get("streaming")
        per_visit = (
            median(
                [
                    job["telemetry"]["misses_per_visit"]
                    for job in streaming.jobs
                    if job["telemetry"] and job["telemetry"].get("decode_passes")
                ]
            )
            if streaming
            else 0.0
        )
        batch = max(1, round(per_visit)) if streaming else self.store.top_k
        result = disk_bandwidth(
            self.store,
            experts=self.args.disk_experts,
            batch=batch,
            threads=self.args.io_workers * 8,
            io_mode=self.io_mode,
            seed=7 + len(self.disk_runs),
        )  # other experts each time
        result["misses_per_visit"] = per_visit
        self.disk_runs.append(result)

    # -- the two orders

    def interleaved(self) -> None:
        mlx = MlxLm(self.model_dir)
        try:
            self.base_info = {"load_s": mlx.load_s, "moe_layer_ms": mlx.moe_layer_ms()}
            self.baseline(mlx)  # the expected tokens (and mlx-lm warmed up); not a measured round
            self.base_runs.clear()
            for index in range(self.args.passes):
                self.one_pass(index, mlx)
        finally:
            mlx.close()

    def one_pass(self, index: int, mlx: MlxLm) -> None:
        """Both systems started afresh, `--repeats` rounds, both stopped. A part's jobs of earlier
        passes go before its new system's, whose summary then pools every pass's rounds."""
        earlier = {part: system.jobs for part, system in self.systems.items()}
        self.systems.clear()
        try:
            for part in self.parts:
                self.start(part).jobs[:0] = earlier.get(part, [])
            for round_ in range(self.args.repeats):
                self.baseline(mlx)
                for part in self.parts:
                    self.systems[part].job(self.prompt, self.args.tokens, expected=self.expected, **self.sample)
                self.disk()
                self.say(
                    f"pass {index + 1}, round {round_ + 1}: mlx-lm {self.base_runs[-1]['decode_tok_s']:.3f} tok/s"
                    + "".join(f", {part} {self.systems[part].jobs[-1]['decode_tok_s']:.3f}" for part in self.parts)
                    + f", disk {self.disk_runs[-1]['MBps']:.0f} MB/s"
                )
        finally:
            for system in self.systems.values():
                system.stop()

    def sequential(self) -> None:
        mlx = MlxLm(self.model_dir)
        try:
            self.base_info = {"load_s": mlx.load_s, "moe_layer_ms": mlx.moe_layer_ms()}
            self.baseline(mlx)
            self.base_runs.clear()
            for _ in range(self.args.repeats):
                self.baseline(mlx)
        finally:
            mlx.close()  # freed before any system starts
        for part in self.parts:
            system = self.start(part)
            try:
                for _ in range(self.args.repeats):
                    system.job(self.prompt, self.args.tokens, expected=self.expected, **self.sample)
                if part == "streaming":
                    for _ in range(self.args.repeats):
                        self.disk()
            finally:
                system.stop()
        if "streaming" not in self.parts:
            self.disk()

    # -- the figures

    def report(self) -> dict[str, Any]:
        """What --json prints (`instruments.bench_report.build_report`), less the argv, model and memory."""
        report = build_report(
            sequential=self.args.sequential,
            sample=self.sample,
            prompt=self.prompt,
            expected=self.expected,
            base_info=self.base_info,
            base_runs=self.base_runs,
            disk_runs=self.disk_runs,
            summaries={part: system.summary() for part, system in self.systems.items()},
        )
        report["passes"] = self.args.passes
        rounds, each = report.get("streaming", {}).get("vs_resident_rounds"), self.args.repeats
        if rounds:  # each pass's median: a difference between started systems shows between passes
            report["streaming"]["vs_resident_pass_medians"] = [
                median(rounds[k : k + each]) for k in range(0, len(rounds), each)
            ]
        return report


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM ends the bench as Ctrl-C does: on the way out every started system is stopped and its
    # slab unlinked (by default the signal would kill the process and leave both slabs behind).
    exit_on_sigterm()
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.INFO if args.verbose else logging.WARNING)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    telemetry = TelemetryLog()
    logging.getLogger("moeslab").addHandler(telemetry)

    def say(text: str) -> None:
        if not args.json:
            print(text, flush=True)

    model_dir, built, build_s = model_from_arguments(args)
    store = ExpertStore.open(model_dir)
    io_mode = resolve_io_mode(args.io_mode, model_dir)
    model = model_facts(store, model_dir=model_dir, built=built, build_s=build_s, io_mode=io_mode)
    say(model_line(model))
    bench = Bench(args, store, model_dir, io_mode, telemetry, say)
    with MemoryWatch() as memory:
        if args.sequential:
            bench.sequential()
        else:
            bench.interleaved()
    report = bench.report()
    report["argv"] = list(sys.argv[1:] if argv is None else argv)
    report["model"] = model
    report["memory"] = {
        "machine_peak_used_bytes": memory.peak_used,
        "machine_used_before_bytes": memory.baseline_used,
        "machine_total_bytes": total_memory(),
    }
    say("")
    for line in report_lines(report):
        say(line)
    say(
        f"memory: machine peak {memory.peak_used / 2**30:.2f} GiB used (before the run "
        f"{memory.baseline_used / 2**30:.2f} GiB)"
    )
    if args.json:
        print(json.dumps(report))
    return 0 if report["tokens_match"] else 1


if __name__ == "__main__":
    sys.exit(main())
