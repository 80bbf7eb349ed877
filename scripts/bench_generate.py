"""Decode tok/s of the whole system against mlx-lm and against the serial streaming roofline.

    python scripts/bench_generate.py [--layers 8 --experts 128 --hidden 2048 --moe-intermediate 768
                                      --top-k 8 --bits 4 --scale-dtype float32|bfloat16]
                                     [--tokens 32 --prompt-tokens 16 --repeats 3 --temperature 0]
                                     [--sequential] [--model DIR] [--json]

What is measured (default order: interleaved):

- **mlx-lm**: `mlx_lm.utils.load_model` of the whole model (every parameter
  in memory) and its own `generate_step`, in this process, sampling as the
  GPU worker does (greedy by default).
- **resident**: the system (`shared.launch.start_system`) with every expert
  resident (slots_per_layer = experts, plus the working bank); a warm-up job
  of the same prompt loads every expert the measured jobs route to, so they
  decode from hits only (the report shows their misses: 0).
- **streaming**: slots_per_layer = experts x `--resident-fraction` (0.25);
  a warm-up job reaches the steady state, then the measured jobs.
- **disk**: `--disk-experts` random experts of the checkpoint read with the
  native O_DIRECT reader (`native.ReadPool`, the I/O workers' reader) in
  batches the size of a decode layer visit's misses (measured in the
  streaming jobs), every segment of a batch in flight on io_workers x 8
  threads, as the I/O workers read a visit's misses; plus one expert alone.
- **roofline** of the streaming run: 1 / (t_compute + miss_bytes / disk_MBps)
  with miss_bytes the bytes of the experts missed per decode token (the
  GPU worker's leases say how many of each wave were resident; prefill
  excluded), disk_MBps as above, and t_compute the resident run's time per
  decode token (`ratio`) or, stricter, mlx-lm's (`ratio_mlx_lm`).

Interleaved: mlx-lm stays loaded next to both started systems (about 8.5 GB
at the default sizes) and each of `--repeats` rounds runs mlx-lm, a resident
job, a streaming job and a disk measurement back to back, so a busy machine
slows the things compared alike; `vs_mlx_lm_rounds` pairs each round.
`--sequential`: mlx-lm first, freed (del, gc, `mx.clear_cache`) before the
systems start one after the other (for models too big to keep twice).

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
import contextlib
import gc
import hashlib
import io
import json
import logging
import math
import mmap
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

try:
    from shared.demo_model import build_model
except ImportError:  # run from a checkout without the editable install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from shared.demo_model import build_model

import mlx.core as mx

from shared.config import check_compute_lanes
from shared.demo_model import EOS_TOKEN_ID, VOCAB_SIZE, write_tokenizer

logger = logging.getLogger("bench_generate")

MB = 1e6
REPO = Path(__file__).resolve().parents[1]
FINGERPRINT_FILE = "moeslab-bench.json"
BUILDER_VERSION = 2
PROMPT_TEXT = b"The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun. "
TELEMETRY = re.compile(r"job (\d+) lease telemetry: (\{.*\})")


# ------------------------------------------------------------------------------------ the model


def bench_config(
    *,
    layers: int,
    experts: int,
    hidden: int,
    moe_intermediate: int,
    top_k: int,
    scale_dtype: str,
    heads: int | None = None,
    kv_heads: int | None = None,
) -> dict:
    """A qwen3_moe config.json (Qwen3-30B-A3B's shapes at the defaults: hidden 2048, 32 heads of
    128, 4 KV heads, 128 experts of 768, top-8). The byte tokenizer keeps the vocabulary at 260."""
    head_dim = 128 if hidden >= 1024 else 16
    heads = heads or max(1, 2 * hidden // head_dim if hidden >= 1024 else hidden // head_dim)
    kv_heads = kv_heads or max(1, min(4, heads))
    return {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": VOCAB_SIZE,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": 3 * hidden,  # dense MLP size; unused, every layer is sparse
        "moe_intermediate_size": moe_intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "eos_token_id": EOS_TOKEN_ID,
        "bos_token_id": None,
        "torch_dtype": scale_dtype,
    }


def _fingerprint(config: dict, bits: int, group_size: int, seed: int, residual_scale: float) -> str:
    blob = json.dumps(
        {
            "builder": BUILDER_VERSION,
            "config": config,
            "bits": bits,
            "group_size": group_size,
            "seed": seed,
            "residual_scale": residual_scale,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def _cached(path: Path, fingerprint: str) -> bool:
    try:
        return json.loads((path / FINGERPRINT_FILE).read_text()).get("fingerprint") == fingerprint
    except (OSError, ValueError, AttributeError):
        return False


RESIDUAL_BRANCHES = (".self_attn.o_proj.weight", ".switch_mlp.down_proj.weight", ".mlp.down_proj.weight")


def default_residual_scale(hidden: int) -> float:
    return 1.0 / math.sqrt(hidden)


def scale_residual_branches(model: Any, scale: float) -> int:
    """Multiply the weights that write into the residual stream (attention out, expert down) by `scale`.

    With mlx-lm's uniform init every attention and MoE output is ~15x the norm of a token's
    embedding at hidden 2048; the residual stream then carries mostly a context average that
    changes little from token to token, and every layer past the first routes 32 tokens to 15-36
    of 128 experts (a quarter of the experts hits 85-95%). Scaled like GPT-2's residual init, the
    token still drives the routing, as in a trained model (~100 of 128 experts over 32 tokens; an
    LRU of a quarter of them hits ~25-30%). Lazy; returns how many tensors were scaled.
    """
    from mlx.utils import tree_flatten, tree_map_with_path

    names = {name for name, _ in tree_flatten(model.parameters()) if name.endswith(RESIDUAL_BRANCHES)}
    model.update(tree_map_with_path(lambda path, value: value * scale if path in names else value, model.parameters()))
    return len(names)


def ensure_bench_model(
    config: dict,
    *,
    bits: int,
    group_size: int = 64,
    seed: int = 0,
    residual_scale: float | None = None,
    cache_dir: Path | None = None,
) -> tuple[Path, bool, float]:
    """The model directory for `config` quantized to `bits` (built unless cached); (path, built, seconds).

    mlx-lm's classes (`shared.demo_model.build_model`: seeded weights, random routers, cast to
    torch_dtype), residual branches scaled (`scale_residual_branches`; default 1/sqrt(hidden)),
    `mlx_lm.utils.quantize_model` (affine, `group_size`) and `save_model`. Built in a sibling
    temporary directory, evaluated one decoder layer at a time (the fp32 draws of one layer's
    experts are the peak), then renamed into place.
    """
    from mlx_lm.utils import quantize_model, save_config, save_model

    if residual_scale is None:
        residual_scale = default_residual_scale(config["hidden_size"])
    fingerprint = _fingerprint(config, bits, group_size, seed, residual_scale)
    root = cache_dir or REPO / ".cache"
    path = root / f"bench-model-{fingerprint[:12]}"
    if _cached(path, fingerprint):
        return path, False, 0.0
    root.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.building-", dir=root))
    try:
        staging.chmod(0o755)
        model = build_model(config, seed=seed)
        scale_residual_branches(model, residual_scale)
        with contextlib.redirect_stdout(io.StringIO()):  # quantize_model prints bits per weight
            model, quantized = quantize_model(model, config, group_size, bits)
        for layer in model.layers:  # one layer's draws at a time
            mx.eval(layer.parameters())
        mx.eval(model.parameters())
        save_model(staging, model)
        del model
        gc.collect()
        mx.clear_cache()
        save_config(quantized, config_path=staging / "config.json")
        write_tokenizer(staging)
        record = {
            "fingerprint": fingerprint,
            "builder": BUILDER_VERSION,
            "bits": bits,
            "group_size": group_size,
            "seed": seed,
            "residual_scale": residual_scale,
            "config": config,
        }
        (staging / FINGERPRINT_FILE).write_text(json.dumps(record, indent=2) + "\n")  # last: marks it complete
        if path.exists():
            shutil.rmtree(path)
        staging.rename(path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return path, True, time.perf_counter() - started


# ------------------------------------------------------------------------------------ helpers


def prompt_tokens(count: int) -> list[int]:
    """`count` byte tokens of an English sentence (repeated as needed)."""
    text = PROMPT_TEXT * (count // len(PROMPT_TEXT) + 1)
    return list(text[:count])


def until_eos(tokens: Sequence[int]) -> list[int]:
    """What the system emits of mlx-lm's tokens: it stops at EOS and does not emit it."""
    out = []
    for token in tokens:
        if token == EOS_TOKEN_ID:
            break
        out.append(int(token))
    return out


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def mount_type(path: str | os.PathLike[str]) -> str:
    target, best, kind = os.path.realpath(path), "", "unknown"
    try:
        with open("/proc/self/mounts", encoding="utf-8") as mounts:
            for line in mounts:
                fields = line.split()
                point = fields[1].replace("\\040", " ") if len(fields) > 2 else ""
                if point and (target == point or target.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
                    best, kind = point, fields[2]
    except OSError:
        pass
    return kind


class MemoryWatch:
    """Samples the machine's used memory (shared memory included) every `interval` s; keeps the peak."""

    def __init__(self, interval: float = 0.25) -> None:
        import psutil

        self._psutil, self._interval = psutil, interval
        self.peak_used = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-watch", daemon=True)

    def _used(self) -> int:
        vm = self._psutil.virtual_memory()
        return int(vm.total - vm.available)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_used = max(self.peak_used, self._used())
            self._stop.wait(self._interval)

    def __enter__(self) -> MemoryWatch:
        self.baseline_used = self._used()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def process_rss(pids: Sequence[int]) -> int:
    import psutil

    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            pass
    return total


# ------------------------------------------------------------------------------------ mlx-lm


class MlxLm:
    """mlx-lm's own model (`mlx_lm.utils.load_model`, every parameter evaluated) and generation."""

    def __init__(self, model_dir: Path) -> None:
        from mlx_lm.utils import load_model

        started = time.perf_counter()
        self.model, _ = load_model(model_dir)
        self.load_s = time.perf_counter() - started

    def run(self, prompt: list[int], tokens: int, *, temperature: float, seed: int) -> dict[str, Any]:
        """One `generate_step` generation, sampled as the GPU worker samples (`mx.random.seed(seed)`,
        `make_sampler(temperature)`; greedy at 0), so equal logits give equal tokens."""
        from mlx_lm.generate import generate_step
        from mlx_lm.sample_utils import make_sampler

        out, stamps = [], []
        mx.random.seed(seed)
        sampler = make_sampler(temperature)
        begin = time.perf_counter()
        for token, _lp in generate_step(mx.array(prompt), self.model, max_tokens=tokens, sampler=sampler):
            stamps.append(time.perf_counter())
            out.append(int(token))
        decode_s = stamps[-1] - stamps[0]
        return {
            "tokens": out,
            "prefill_s": stamps[0] - begin,
            "decode_s": decode_s,
            "decode_tok_s": (len(out) - 1) / decode_s if decode_s > 0 else 0.0,
        }

    def moe_layer_ms(self, samples: int = 10) -> float:
        """One layer's MoE block (SwitchGLU) alone on one token with random top-k experts."""
        from mlx.utils import tree_flatten
        from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

        switch = next(m for _, m in self.model.named_modules() if isinstance(m, (SwitchGLU, SwitchMLP)))
        experts = tree_flatten(switch.parameters())[0][1].shape[0]
        args = self.model.args
        rng = random.Random(1)
        x = mx.random.normal((1, 1, args.hidden_size), key=mx.random.key(1))
        times = []
        for i in range(samples + 2):
            idx = mx.array([[rng.sample(range(experts), args.num_experts_per_tok)]], dtype=mx.uint32)
            mx.eval(x, idx)
            started = time.perf_counter()
            mx.eval(switch(x, idx))
            if i >= 2:
                times.append(time.perf_counter() - started)
        return median(times) * 1e3

    def close(self) -> None:
        self.model = None
        gc.collect()
        mx.clear_cache()


# ------------------------------------------------------------------------------------ disk


def disk_bandwidth(store, *, experts: int, batch: int, threads: int, io_mode: str, seed: int = 7) -> dict[str, Any]:
    """Random experts of the checkpoint read with the native reader into a page-aligned region.

    `batch` experts at a time with all their segments in flight on `threads` native threads (a
    layer visit's misses, as the I/O workers read them), then one expert at a time (a lone miss).
    Reported MB/s count the experts' own bytes (alignment slack excluded), as `miss_bytes` does.
    """
    from native import BypassFile, ReadPool

    rng = random.Random(seed)
    pairs = [(layer, expert) for layer in store.sparse_layers for expert in range(store.experts_per_layer)]
    rng.shuffle(pairs)
    batched, single = pairs[:experts], pairs[experts : experts + max(4, experts // 4)]
    region = mmap.mmap(-1, max(batch, 1) * store.slot_bytes)
    mode = "direct" if io_mode == "direct" else "buffered"
    files = [BypassFile.open(path, mode=mode, block_size=store.block_size) for path in store.manifest]
    try:
        with ReadPool(threads=threads) as pool:

            def read(group) -> tuple[int, float]:
                ops = [
                    files[seg.file].op(seg.offset, seg.length, k * store.slot_bytes + seg.destination)
                    for k, (layer, expert) in enumerate(group)
                    for seg in store.locate(layer, expert).segments
                ]
                t0 = time.perf_counter()
                results = pool.read(region, ops, block_size=store.block_size)
                elapsed = time.perf_counter() - t0
                bad = [r.describe() for r in results if not r.ok]
                if bad:
                    raise OSError(f"disk benchmark read failed: {bad[0]}")
                return sum(r.delivered for r in results), elapsed

            read(batched[:1])  # open/first-touch costs out of the figures
            total = seconds = 0.0
            for start in range(0, len(batched), batch):
                got, elapsed = read(batched[start : start + batch])
                total, seconds = total + got, seconds + elapsed
            lone = [read([pair]) for pair in single]
    finally:
        for handle in files:
            handle.close()
        region.close()
    lone_bytes, lone_s = sum(b for b, _ in lone), sum(s for _, s in lone)
    return {
        "mode": files[0].mode if files else mode,
        "experts": len(batched),
        "batch": batch,
        "threads": threads,
        "MBps": total / seconds / MB if seconds else 0.0,
        "single_expert_ms": median([s * 1e3 for _, s in lone]),
        "single_MBps": lone_bytes / lone_s / MB if lone_s else 0.0,
    }


# ------------------------------------------------------------------------------------ the system


# ------------------------------------------------------------------------------------ the system


class TelemetryLog(logging.Handler):
    """Collects the GPU worker's `job N lease telemetry: {...}` lines (its stderr is forwarded)."""

    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.records: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        match = TELEMETRY.search(record.getMessage())
        if match:
            with self._lock:
                self.records.append({"job": int(match.group(1)), "logger": record.name, **json.loads(match.group(2))})

    def count(self) -> int:
        with self._lock:
            return len(self.records)

    def wait_for(self, count: int, timeout: float = 10.0) -> dict[str, Any] | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if len(self.records) >= count:
                    return self.records[count - 1]
            time.sleep(0.02)
        return None


def summarize_telemetry(record: dict[str, Any] | None, *, expert_bytes: int) -> dict[str, Any] | None:
    """Per-layer decode figures of one job's telemetry (means per layer visit / per token)."""
    if record is None:
        return None
    rows = [
        dict(
            zip(
                (
                    "layer",
                    "phase",
                    "visits",
                    "round_trips",
                    "wait_ms",
                    "copy_ms",
                    "experts",
                    "hits",
                    "bytes_copied",
                    "exposed_copy_ms",
                ),
                row,
            )
        )
        for row in record["layers"]
    ]
    decode = [r for r in rows if r["phase"] == "decode" and r["layer"] >= 0]
    end = [r for r in rows if r["phase"] == "decode" and r["layer"] < 0]
    visits = sum(r["visits"] for r in decode)
    passes = max((r["visits"] for r in decode), default=0)  # decode forward passes
    if not visits or not passes:
        return {"decode_passes": 0}
    misses = sum(r["experts"] - r["hits"] for r in decode)
    end_wait = sum(r["wait_ms"] for r in end)
    return {
        "decode_passes": passes,
        "compute_lanes": record.get("compute_lanes", 1),
        "ipc_wait_ms_per_layer": sum(r["wait_ms"] for r in decode) / visits,
        "copy_ms_per_layer": sum(r["copy_ms"] for r in decode) / visits,
        "round_trips_per_layer": sum(r["round_trips"] for r in decode) / visits,
        "end_step_fence_ms_per_token": end_wait / passes,
        "ipc_wait_ms_per_token": (sum(r["wait_ms"] for r in decode) + end_wait) / passes,
        "copy_ms_per_token": sum(r["copy_ms"] for r in decode) / passes,
        "exposed_copy_ms_per_token": sum(r.get("exposed_copy_ms", r["copy_ms"]) for r in decode) / passes,
        "copied_MB_per_token": sum(r["bytes_copied"] for r in decode) / passes / MB,
        "misses_per_token": misses / passes,
        "misses_per_visit": misses / visits,
        "miss_bytes_per_token": misses * expert_bytes / passes,
        "per_layer": {
            str(r["layer"]): {
                "ipc_wait_ms": r["wait_ms"] / r["visits"],
                "copy_ms": r["copy_ms"] / r["visits"],
                "misses": (r["experts"] - r["hits"]) / r["visits"],
            }
            for r in decode
            if r["visits"]
        },
    }


TELEMETRY_KEYS = (
    "ipc_wait_ms_per_layer",
    "copy_ms_per_layer",
    "round_trips_per_layer",
    "end_step_fence_ms_per_token",
    "ipc_wait_ms_per_token",
    "copy_ms_per_token",
    "exposed_copy_ms_per_token",
    "copied_MB_per_token",
    "misses_per_token",
    "misses_per_visit",
    "miss_bytes_per_token",
)


class System:
    """One started system (`shared.launch.start_system`) with `slots_per_layer` resident slots."""

    def __init__(
        self,
        store,
        *,
        name: str,
        slots_per_layer: int,
        io_workers: int,
        io_mode: str,
        working_slots: int | None,
        telemetry: TelemetryLog,
        expert_bytes: int,
        compute_lanes: int | None = None,
    ) -> None:
        from shared.launch import DEFAULT_KV_RESERVE_BYTES, start_system
        from shared.plan import DEFAULT_EXPERT_WORKING_SLOTS

        self.store, self.name, self.telemetry, self.expert_bytes = store, name, telemetry, expert_bytes
        working = DEFAULT_EXPERT_WORKING_SLOTS if working_slots is None else working_slots
        kv = DEFAULT_KV_RESERVE_BYTES
        budget = store.dense_bytes + kv + (working + len(store.sparse_layers) * slots_per_layer) * store.slot_bytes
        started = time.perf_counter()
        self.system = start_system(
            model_dir=store.model_dir,
            memory_budget=budget,
            io_workers=io_workers,
            working_slots=working,
            slots_per_layer=slots_per_layer,
            io_mode=io_mode,
            kv_reserve_bytes=kv,
            compute_lanes=compute_lanes,
        )
        self.startup_s = time.perf_counter() - started
        self.jobs: list[dict[str, Any]] = []
        self.rss = 0

    def stop(self) -> None:
        self.system.stop()

    def job(
        self,
        prompt: list[int],
        tokens: int,
        *,
        expected: list[int] | None,
        temperature: float,
        seed: int,
        warmup: bool = False,
    ) -> dict[str, Any]:
        from shared.client import Client
        from shared.job_messages import TokenEvent

        before = self.telemetry.count()
        got, done = [], None
        with Client(self.system.endpoint, timeout=600) as client:
            for event in client.generate(prompt_tokens=prompt, max_tokens=tokens, temperature=temperature, seed=seed):
                if isinstance(event, TokenEvent):
                    got.append(event.token)
                else:
                    done = event
        record = self.telemetry.wait_for(before + 1)
        self.rss = max(self.rss, process_rss(list(self.system.pids.values())))
        stats = done.stats
        # The coordinator's decode_tok_s is tokens / (time from the first token to the last): recover that
        # time and count the intervals it holds (tokens - 1), as for mlx-lm.
        decode_s = stats.generated_tokens / stats.decode_tok_s if stats.decode_tok_s else 0.0
        job = {
            "warmup": warmup,
            "tokens": list(done.tokens),
            "tokens_match": expected is None or (got == expected and list(done.tokens) == expected),
            "generated": stats.generated_tokens,
            "decode_tok_s": (stats.generated_tokens - 1) / decode_s if decode_s else 0.0,
            "coordinator_decode_tok_s": stats.decode_tok_s,
            "prefill_tok_s": stats.prefill_tok_s,
            "hits": stats.hits,
            "misses": stats.misses,
            "hit_rate": stats.hit_rate,
            "bytes_read": stats.bytes_read,
            "disk_p50_ms": stats.disk_p50_ms,
            "disk_p99_ms": stats.disk_p99_ms,
            "wait_p50_ms": stats.wait_p50_ms,
            "wait_p99_ms": stats.wait_p99_ms,
            "bytes_copied": stats.bytes_copied,
            "wrap_path": stats.wrap_path,
            "evictions": stats.evictions,
            "footprint_bytes": stats.footprint_bytes,
            "telemetry": summarize_telemetry(record, expert_bytes=self.expert_bytes),
        }
        self.jobs.append(job)
        return job

    def summary(self) -> dict[str, Any]:
        plan = self.system.plan
        measured = [job for job in self.jobs if not job["warmup"]]
        tele = [job["telemetry"] for job in measured if job["telemetry"] and job["telemetry"].get("decode_passes")]
        result = {
            "slots_per_layer": plan.slots_per_layer,
            "working_slots": plan.working_slots,
            "resident_fraction": plan.slots_per_layer / self.store.experts_per_layer,
            "budget_bytes": plan.budget_bytes,
            "slab_bytes": plan.slab_bytes,
            "startup_s": self.startup_s,
            "children_peak_rss_bytes": self.rss,
            "tokens_match": all(job["tokens_match"] for job in self.jobs),
            "decode_tok_s": median([job["decode_tok_s"] for job in measured]),
            "decode_tok_s_runs": [job["decode_tok_s"] for job in measured],
            "misses_per_job": [job["misses"] for job in measured],
            "hit_rate": median([job["hit_rate"] for job in measured]),
            "disk_p50_ms": median([job["disk_p50_ms"] for job in measured]),
            "disk_p99_ms": median([job["disk_p99_ms"] for job in measured]),
            "wait_p50_ms": median([job["wait_p50_ms"] for job in measured]),
            "wait_p99_ms": median([job["wait_p99_ms"] for job in measured]),
            "bytes_read_per_token": median([job["bytes_read"] / max(job["generated"], 1) for job in measured]),
            "jobs": [{k: v for k, v in job.items() if k != "tokens"} for job in self.jobs],
        }
        for key in TELEMETRY_KEYS:
            if tele:
                result[key] = median([t[key] for t in tele])
        if tele:
            result["per_layer"] = tele[len(tele) // 2]["per_layer"]
            result["compute_lanes"] = tele[-1]["compute_lanes"]
        return result


# ------------------------------------------------------------------------------------ main


def roofline(t_compute_s: float, miss_bytes: float, disk_MBps: float) -> float:
    """Serial roofline tok/s: compute, then the token's misses read at the disk's bandwidth."""
    seconds = t_compute_s + (miss_bytes / (disk_MBps * MB) if disk_MBps > 0 else 0.0)
    return 1.0 / seconds if seconds > 0 else 0.0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    shape = parser.add_argument_group("benchmark model (built once and cached)")
    shape.add_argument("--layers", type=int, default=8)
    shape.add_argument("--experts", type=int, default=128)
    shape.add_argument("--hidden", type=int, default=2048)
    shape.add_argument("--moe-intermediate", type=int, default=768)
    shape.add_argument("--top-k", type=int, default=8)
    shape.add_argument("--bits", type=int, default=4)
    shape.add_argument("--group-size", type=int, default=64)
    shape.add_argument(
        "--scale-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="dtype of the quantization scales/biases and every unquantized float",
    )
    shape.add_argument("--seed", type=int, default=0, help="weights seed")
    shape.add_argument(
        "--residual-scale",
        type=float,
        default=None,
        help="factor on attention-out and expert-down weights (default 1/sqrt(hidden)); see scale_residual_branches",
    )
    shape.add_argument(
        "--cache-dir", type=Path, default=None, help="where built models are cached (default <repo>/.cache)"
    )
    shape.add_argument("--model", type=Path, default=None, help="use this model directory instead")
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
        "--resident-fraction", type=float, default=0.25, help="streaming run: slots per layer = experts x this"
    )
    run.add_argument("--io-workers", type=int, default=2)
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
        "io_workers",
        "disk_experts",
    ):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 < args.resident_fraction <= 1:
        parser.error("--resident-fraction must be in (0, 1]")
    if args.top_k > args.experts:
        parser.error("--top-k must not exceed --experts")
    if args.temperature < 0:
        parser.error("--temperature must be >= 0")
    if args.compute_lanes is not None:
        try:
            check_compute_lanes(args.compute_lanes, name="--compute-lanes")
        except ValueError as error:
            parser.error(str(error))
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
        self.expert_bytes = sum(seg.length for seg in store.locate(store.sparse_layers[0], 0).segments)
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
        )
        self.systems[part] = system
        # Warm-up: the resident system loads every expert the prompt's tokens route to (the
        # measured jobs then run from hits only); the streaming one reaches its steady state.
        job = system.job(self.prompt, self.args.tokens, expected=self.expected, warmup=True, **self.sample)
        self.say(
            f"{part}: started in {system.startup_s:.1f} s ({system.system.plan.slots_per_layer} of "
            f"{store.experts_per_layer} experts per layer resident); warm-up job {job['decode_tok_s']:.3f} "
            f"tok/s, {job['misses']} misses"
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
        self.base_info = {"load_s": mlx.load_s, "moe_layer_ms": mlx.moe_layer_ms()}
        self.baseline(mlx)  # the expected tokens (and mlx-lm warmed up); not a measured round
        self.base_runs.clear()
        try:
            for part in self.parts:
                self.start(part)
            for round_ in range(self.args.repeats):
                self.baseline(mlx)
                for part in self.parts:
                    self.systems[part].job(self.prompt, self.args.tokens, expected=self.expected, **self.sample)
                self.disk()
                self.say(
                    f"round {round_ + 1}: mlx-lm {self.base_runs[-1]['decode_tok_s']:.3f} tok/s"
                    + "".join(f", {part} {self.systems[part].jobs[-1]['decode_tok_s']:.3f}" for part in self.parts)
                    + f", disk {self.disk_runs[-1]['MBps']:.0f} MB/s"
                )
        finally:
            for system in self.systems.values():
                system.stop()
            mlx.close()

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
        args = self.args
        base_tok_s = median([run["decode_tok_s"] for run in self.base_runs])
        report: dict[str, Any] = {
            "order": "sequential" if args.sequential else "interleaved",
            "sampling": self.sample,
            "prompt_tokens": len(self.prompt),
            "expected_tokens": len(self.expected),
            "tokens": self.expected,
            "mlx_lm": {
                **self.base_info,
                "decode_tok_s": base_tok_s,
                "decode_tok_s_runs": [run["decode_tok_s"] for run in self.base_runs],
                "prefill_s": median([run["prefill_s"] for run in self.base_runs]),
                "repeat_tokens_equal": all(run["tokens_equal_first"] for run in self.base_runs),
            },
        }
        disk = (
            {
                k: median([run[k] for run in self.disk_runs])
                for k in ("MBps", "single_expert_ms", "single_MBps", "misses_per_visit")
            }
            if self.disk_runs
            else {}
        )
        if self.disk_runs:
            disk.update(
                mode=self.disk_runs[0]["mode"],
                batch=self.disk_runs[0]["batch"],
                threads=self.disk_runs[0]["threads"],
                experts=self.disk_runs[0]["experts"],
                MBps_runs=[run["MBps"] for run in self.disk_runs],
            )
        report["disk"] = disk
        ok = report["mlx_lm"]["repeat_tokens_equal"]
        for part, system in self.systems.items():
            summary = system.summary()
            ok &= summary["tokens_match"]
            report[part] = summary
        resident, streaming = report.get("resident"), report.get("streaming")
        if resident:
            resident["vs_mlx_lm"] = resident["decode_tok_s"] / base_tok_s if base_tok_s else 0.0
            if not args.sequential:  # the same round's mlx-lm run
                resident["vs_mlx_lm_rounds"] = [
                    r / b["decode_tok_s"] for r, b in zip(resident["decode_tok_s_runs"], self.base_runs)
                ]
                resident["vs_mlx_lm_round_median"] = median(resident["vs_mlx_lm_rounds"])
        if streaming and disk:
            miss_bytes = streaming.get("miss_bytes_per_token", 0.0)
            t_mlx = 1 / base_tok_s
            roof: dict[str, Any] = {
                "t_compute_mlx_lm_s": t_mlx,
                "miss_bytes_per_token": miss_bytes,
                "disk_MBps": disk["MBps"],
                "disk_s_per_token": miss_bytes / (disk["MBps"] * MB) if disk["MBps"] else 0.0,
                "roofline_tok_s_mlx_lm": roofline(t_mlx, miss_bytes, disk["MBps"]),
            }
            roof["ratio_mlx_lm"] = streaming["decode_tok_s"] / roof["roofline_tok_s_mlx_lm"]
            if resident:
                t_resident = 1 / resident["decode_tok_s"]
                roof["t_compute_resident_s"] = t_resident
                roof["roofline_tok_s"] = roofline(t_resident, miss_bytes, disk["MBps"])
                roof["ratio"] = streaming["decode_tok_s"] / roof["roofline_tok_s"]
                if not args.sequential:  # each round against its own resident job and disk figure
                    roof["ratio_rounds"] = [
                        got / roofline(1 / res, miss_bytes, disk_run["MBps"])
                        for got, res, disk_run in zip(
                            streaming["decode_tok_s_runs"], resident["decode_tok_s_runs"], self.disk_runs
                        )
                    ]
                    roof["ratio_round_median"] = median(roof["ratio_rounds"])
            streaming["roofline"] = roof
        report["tokens_match"] = bool(ok)
        return report


def print_report(report: dict[str, Any], say) -> None:
    base = report["mlx_lm"]
    say(
        f"mlx-lm: {base['decode_tok_s']:.3f} tok/s decode (runs {_fmt(base['decode_tok_s_runs'])}); one layer's MoE "
        f"{base['moe_layer_ms']:.1f} ms; load {base['load_s']:.1f} s"
    )
    disk = report.get("disk")
    if disk:
        say(
            f"disk ({disk['mode']}): {disk['MBps']:.0f} MB/s (runs {_fmt(disk['MBps_runs'], 0)}) reading "
            f"{disk['experts']} random experts in batches of {disk['batch']} (a decode layer visit misses "
            f"{disk['misses_per_visit']:.2f}) on {disk['threads']} threads; one expert alone "
            f"{disk['single_expert_ms']:.2f} ms ({disk['single_MBps']:.0f} MB/s)"
        )
    for part in ("resident", "streaming"):
        s = report.get(part)
        if not s:
            continue
        head = (
            f"{part} ({s['slots_per_layer']} slots per layer, {s['resident_fraction']:.0%} of the experts, "
            f"{s.get('compute_lanes', '?')} compute lanes): "
            f"{s['decode_tok_s']:.3f} tok/s (runs {_fmt(s['decode_tok_s_runs'])})"
        )
        if part == "resident":
            head += f" = {s['vs_mlx_lm']:.3f} x mlx-lm"
            if "vs_mlx_lm_rounds" in s:
                head += f" (per round {_fmt(s['vs_mlx_lm_rounds'])})"
        say(head)
        say(
            f"  hit rate {s['hit_rate']:.3f}, misses per job {s['misses_per_job']}, "
            f"{s.get('misses_per_token', 0):.2f} misses = {s.get('miss_bytes_per_token', 0) / MB:.2f} MB per decode "
            f"token; I/O workers' disk p50/p99 {s['disk_p50_ms']:.2f}/{s['disk_p99_ms']:.2f} ms"
        )
        say(
            f"  per layer visit: IPC wait {s.get('ipc_wait_ms_per_layer', 0):.3f} ms"
            f"{' (incl. loads)' if part == 'streaming' else ''}, copy {s.get('copy_ms_per_layer', 0):.3f} ms; "
            f"end-of-step fence {s.get('end_step_fence_ms_per_token', 0):.3f} ms; per token: IPC "
            f"{s.get('ipc_wait_ms_per_token', 0):.1f} ms, copy {s.get('copy_ms_per_token', 0):.1f} ms "
            f"({s.get('exposed_copy_ms_per_token', 0):.1f} not overlapped; {s.get('copied_MB_per_token', 0):.1f} MB); "
            f"tokens {'match' if s['tokens_match'] else 'DIFFER'}"
        )
        roof = s.get("roofline")
        if roof:
            if "roofline_tok_s" in roof:
                say(
                    f"  roofline 1/(t_compute {roof['t_compute_resident_s'] * 1e3:.1f} ms [resident] + "
                    f"{roof['disk_s_per_token'] * 1e3:.1f} ms disk) = {roof['roofline_tok_s']:.3f} tok/s -> "
                    f"ratio {roof['ratio']:.3f}"
                    + (f" (per round {_fmt(roof['ratio_rounds'])})" if "ratio_rounds" in roof else "")
                )
            say(
                f"  roofline 1/(t_compute {roof['t_compute_mlx_lm_s'] * 1e3:.1f} ms [mlx-lm] + "
                f"{roof['disk_s_per_token'] * 1e3:.1f} ms disk) = {roof['roofline_tok_s_mlx_lm']:.3f} tok/s -> "
                f"ratio {roof['ratio_mlx_lm']:.3f}"
            )
    say(
        f"tokens: {'all equal to mlx-lm' if report['tokens_match'] else 'DIFFER from mlx-lm'} "
        f"({report['expected_tokens']} per job)"
    )


def _fmt(values: Sequence[float], digits: int = 3) -> str:
    return ", ".join(f"{v:.{digits}f}" for v in values)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.INFO if args.verbose else logging.WARNING)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    telemetry = TelemetryLog()
    logging.getLogger("moeslab").addHandler(telemetry)

    def say(text: str) -> None:
        if not args.json:
            print(text, flush=True)

    from shared.store import ExpertStore

    if args.model is not None:
        model_dir, built, build_s = args.model.resolve(), False, 0.0
    else:
        config = bench_config(
            layers=args.layers,
            experts=args.experts,
            hidden=args.hidden,
            moe_intermediate=args.moe_intermediate,
            top_k=args.top_k,
            scale_dtype=args.scale_dtype,
        )
        model_dir, built, build_s = ensure_bench_model(
            config,
            bits=args.bits,
            group_size=args.group_size,
            seed=args.seed,
            residual_scale=args.residual_scale,
            cache_dir=args.cache_dir,
        )
    store = ExpertStore.open(model_dir)
    io_mode = (
        args.io_mode
        if args.io_mode != "auto"
        else ("buffered" if mount_type(model_dir) in ("tmpfs", "ramfs") else "direct")
    )
    first = store.layout(store.sparse_layers[0], 0)
    scale_dtypes = sorted({t.dtype for t in first if not t.name.endswith(".weight")})
    expert_bytes = sum(seg.length for seg in store.locate(store.sparse_layers[0], 0).segments)
    say(
        f"model: {model_dir} ({f'built in {build_s:.0f} s' if built else 'cached'}): {store.config.get('model_type')}, "
        f"{len(store.sparse_layers)} sparse layers x {store.experts_per_layer} experts (top-{store.top_k}), "
        f"{store.expert_bytes / 1e9:.2f} GB of experts ({expert_bytes / MB:.2f} MB each, scales "
        f"{'/'.join(scale_dtypes)}), {store.dense_bytes / MB:.1f} MB dense; I/O {io_mode}"
    )
    bench = Bench(args, store, model_dir, io_mode, telemetry, say)
    with MemoryWatch() as memory:
        if args.sequential:
            bench.sequential()
        else:
            bench.interleaved()
    report = bench.report()
    report["argv"] = list(sys.argv[1:] if argv is None else argv)
    report["model"] = {
        "dir": str(model_dir),
        "built": built,
        "build_s": build_s,
        "model_type": store.config.get("model_type"),
        "sparse_layers": len(store.sparse_layers),
        "experts_per_layer": store.experts_per_layer,
        "top_k": store.top_k,
        "expert_bytes": expert_bytes,
        "slot_bytes": store.slot_bytes,
        "routed_expert_bytes": store.expert_bytes,
        "dense_bytes": store.dense_bytes,
        "scale_dtypes": scale_dtypes,
        "io_mode": io_mode,
    }
    report["memory"] = {
        "machine_peak_used_bytes": memory.peak_used,
        "machine_used_before_bytes": memory.baseline_used,
        "machine_total_bytes": _total_memory(),
    }
    say("")
    print_report(report, say)
    say(
        f"memory: machine peak {memory.peak_used / 2**30:.2f} GiB used (before the run "
        f"{memory.baseline_used / 2**30:.2f} GiB)"
    )
    if args.json:
        print(json.dumps(report))
    return 0 if report["tokens_match"] else 1


def _total_memory() -> int:
    import psutil

    return int(psutil.virtual_memory().total)


if __name__ == "__main__":
    sys.exit(main())
