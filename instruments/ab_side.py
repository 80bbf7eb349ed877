"""One side of `scripts/bench_ab.py`: a started system that runs a job for each `go` on stdin.

    python instruments/ab_side.py ROOT MODEL_DIR SPEC_JSON

Run by path, not as a module: it imports the system from ROOT (this checkout or another,
e.g. a worktree of an older commit), so that two sides may run two versions of the code.
SPEC_JSON holds `slots_per_layer`, `tokens`, `prompt_tokens` and `options` (keyword
arguments of `instruments.system_jobs.System`). The first stdout line is `{"ready": ...}`
(or `{"error": ...}`, exit 2); each `go` prints one JSON line (the job's figures); end of
input or `stop` stops the system.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path


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


def main(argv: list[str]) -> int:
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
