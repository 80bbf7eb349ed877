"""One side of `scripts/bench_ab.py`: a started system that runs a job for each `go` on stdin.

    python instruments/ab_side.py ROOT MODEL_DIR SPEC_JSON

Run by path, not as a module: it imports the system from ROOT (this checkout or another,
e.g. a worktree of an older commit), so that two sides may run two versions of the code.
`Side` is the driver's handle on such a process (scripts/bench_ab.py, scripts/bench_floor.py).
SPEC_JSON holds `slots_per_layer`, `tokens`, `prompt_tokens` and `options` (keyword
arguments of `instruments.system_jobs.System`). The first stdout line is `{"ready": ...}`
(or `{"error": ...}`, exit 2); each `go` prints one JSON line (the job's figures); end of
input or `stop` stops the system, and so does SIGTERM (exit 143), which a side gets with its
driver's process group (`timeout`, a shell's job control).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

SIDE = Path(__file__).resolve()


class Side:
    """The driver's handle on one side's process (this file, run by path): a job per `run`."""

    def __init__(self, name: str, root: Path, model_dir: Path, spec: dict[str, Any]) -> None:
        self.name = name
        self.process = subprocess.Popen(
            [sys.executable, str(SIDE), str(root), str(model_dir), json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.jobs: list[dict[str, Any]] = []

    def _line(self) -> dict[str, Any]:
        """The side's next JSON object (anything else a library printed on its stdout is skipped)."""
        while line := self.process.stdout.readline():
            try:
                reply = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(reply, dict):
                return reply
        raise RuntimeError(f"side {self.name} exited (code {self.process.wait()})")

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


def _job_line(job: dict) -> dict:
    telemetry = job["telemetry"] or {}
    return {
        "decode_tok_s": job["decode_tok_s"],
        "tokens": job["tokens"],
        "misses": job["misses"],
        "ipc_wait_ms_per_token": telemetry.get("ipc_wait_ms_per_token", 0.0),
        "decode_cpu_ms_per_token": job["decode_cpu_ms_per_token"],
        "prefetch": {key: job["prefetch"].get(key) for key in ("trialling", "paused", "issued", "useful", "recall")},
    }


def _exit(signum: int, _frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the cleanup short
    raise SystemExit(128 + signum)


def main(argv: list[str]) -> int:
    # SIGTERM unwinds, so that the system stops and its slab and run directory go, whether it is
    # starting (start_system stops what it started) or serving. Not instruments.bench_cli's
    # exit_on_sigterm: importing this checkout's `instruments` would shadow ROOT's.
    signal.signal(signal.SIGTERM, _exit)
    root, model_dir, spec = Path(argv[0]).resolve(), Path(argv[1]), json.loads(argv[2])
    sys.path.insert(0, str(root))  # the side's code, before this checkout's
    os.chdir(root)
    from instruments.lease_telemetry import TelemetryLog
    from instruments.mlx_reference import prompt_tokens
    from instruments.system_jobs import System
    from shared.store import ExpertStore

    logging.basicConfig(level=logging.WARNING, format="%(processName)s %(name)s: %(message)s")
    telemetry = TelemetryLog()  # the GPU worker's end-of-job line, which the job's figures read
    log = logging.getLogger("moeslab")
    log.addHandler(telemetry)
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        store = ExpertStore.open(model_dir)
        # Not instruments.bench_cli.one_expert_bytes: ROOT may be an older checkout without it.
        expert_bytes = sum(segment.length for segment in store.locate(store.sparse_layers[0], 0).segments)
        system = System(
            store,
            name=f"ab-{os.getpid()}",
            slots_per_layer=spec["slots_per_layer"],
            telemetry=telemetry,
            expert_bytes=expert_bytes,
            **spec["options"],
        )
    except Exception as error:  # a bad option or a root without these names: the driver says which
        print(json.dumps({"error": f"{type(error).__name__}: {error}"}), flush=True)
        return 2
    prompt = prompt_tokens(spec["prompt_tokens"])
    try:
        print(json.dumps({"ready": True, "pids": system.system.pids}), flush=True)
        for line in sys.stdin:
            if line.strip() != "go":
                break
            job = system.job(prompt, spec["tokens"], expected=None, temperature=0.0, seed=0)
            print(json.dumps(_job_line(job)), flush=True)
    finally:
        system.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
