"""The main job: launch moeslab on the demo model, run one generation job, shut down.

Builds the deterministic demo model once (cached under .cache/demo-model; its
routed experts are 4x the demo memory budget), starts the supervisor
(`scripts/launch.py`) under that budget, streams one job's text through the
client, prints its stats, and stops the supervisor with SIGTERM — which must
leave no process, segment or socket behind.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from a clone without the editable install
    sys.path.insert(0, str(ROOT))

from instruments.memory_watch import FootprintWatch  # noqa: E402
from shared.cli_send import format_stats  # noqa: E402
from shared.client import Client, JobFailedError  # noqa: E402
from shared.demo_model import ensure_demo_model  # noqa: E402

READY_TIMEOUT_S = 300.0
# What the GPU worker grows by beyond its dense weights: the KV cache (tiny
# here), MLX's buffers and the per-wave copies of leased experts (~50 MB
# measured). The launcher's default reserve is sized for real models.
DEMO_KV_RESERVE = "64MiB"


def read_ready_line(process: subprocess.Popen[str], *, timeout: float) -> dict:
    """The supervisor's one JSON ready line, or an error with its exit code."""
    assert process.stdout is not None
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not selector.select(timeout=0.5):
                if process.poll() is not None:
                    break
                continue
            line = process.stdout.readline()
            if not line:
                break
            event = json.loads(line)
            if event.get("event") == "ready":
                return event
    finally:
        selector.close()
    try:
        code = process.wait(timeout=5)  # it closed stdout: give it a moment to exit
    except subprocess.TimeoutExpired:
        code = None
    if code is not None:
        raise RuntimeError(f"supervisor exited with code {code} before it was ready (its log is above)")
    raise RuntimeError(f"supervisor did not become ready within {timeout:.0f} s")


def stop(process: subprocess.Popen[str], *, timeout: float = 60.0) -> int:
    """SIGTERM the supervisor and wait; it owns every child and the slab."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", default="Mixture-of-Experts models route each token to ")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--memory-budget", type=int, default=None, help="bytes (default: the demo's budget)")
    parser.add_argument("--log-level", default="WARNING")
    parser.add_argument("--compute-lanes", default="auto", help="the launcher's --compute-lanes (N or auto)")
    args = parser.parse_args(argv)

    model = ensure_demo_model()
    if args.memory_budget is None:
        args.memory_budget = model.budget_bytes
    print(
        f"demo model {model.path}: {model.sizes.dense_bytes / 2**20:.1f} MiB dense, "
        f"{model.sizes.expert_bytes / 2**20:.0f} MiB of experts; budget "
        f"{args.memory_budget / 2**20:.0f} MiB",
        flush=True,
    )
    command = [
        sys.executable,
        str(ROOT / "scripts" / "launch.py"),
        "--model",
        str(model.path),
        "--memory-budget",
        str(args.memory_budget),
        # A bank of 2 x top-k serves decode and short prompts; the rest of the
        # budget goes to resident slots (the launcher's default bank is 64).
        "--working-slots",
        str(2 * model.sizes.top_k),
        "--kv-reserve",
        DEMO_KV_RESERVE,
        "--log-level",
        args.log_level,
        "--compute-lanes",
        args.compute_lanes,
    ]
    supervisor = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        ready = read_ready_line(supervisor, timeout=READY_TIMEOUT_S)
        plan, memory = ready["plan"], ready["memory"]
        print(
            f"ready at {ready['endpoint']}: the processes use {memory['baseline_bytes'] / 2**20:.0f} MiB of the "
            f"{memory['budget_bytes'] / 2**20:.0f} MiB budget, the KV reserve {memory['kv_reserve_bytes'] / 2**20:.0f}"
            f" MiB, room for the kernel compiler {memory['compiler_bytes'] / 2**20:.0f} MiB, the slab"
            f" {plan['total_slots']} slots of {plan['slot_bytes']} bytes "
            f"({plan['slots_per_layer']} resident per layer, {plan['working_slots']} working)",
            flush=True,
        )
        # The whole system's memory, measured from outside every 50 ms: every process's PSS, the slab once.
        watch = FootprintWatch(supervisor.pid, f"/dev/shm/{ready['slab'].lstrip('/')}")
        with watch, Client(ready["endpoint"], timeout=120.0) as client:
            stream = client.generate(args.prompt, max_tokens=args.max_tokens)
            sys.stdout.write(args.prompt)
            for event in stream:
                text = getattr(event, "text", "")
                if text and hasattr(event, "token"):
                    sys.stdout.write(text)
                    sys.stdout.flush()
            done = stream.result()
        print()
        print(f"(random weights: the text is noise; token ids {list(done.tokens[:8])}...)")
        print(format_stats(done))
        verdict = "within" if watch.peak <= memory["budget_bytes"] else "OVER"
        print(f"whole system, sampled every 50 ms: {watch.describe()}; {verdict} the budget")
        if watch.peak > memory["budget_bytes"]:
            raise RuntimeError(f"the system used {watch.peak} bytes, over its budget {memory['budget_bytes']}")
    except (JobFailedError, RuntimeError, TimeoutError) as error:
        print(f"demo: {error}", file=sys.stderr)
        return 1
    finally:
        code = stop(supervisor)
    if code != 0:
        print(f"demo: supervisor exited with code {code}", file=sys.stderr)
        return 1
    print("supervisor stopped cleanly (exit 0)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
