"""The decode benchmark's report: the figures of one run (what `--json` prints) and their text.

`build_report` gathers the medians over the repeats of mlx-lm, the disk measurement and each
system part, the resident run's ratio to mlx-lm (per round when interleaved) and the streaming
run's serial roofline with both compute terms; `report_lines` words it for the terminal.
`model_facts` is the report's description of the checkpoint, `model_line` its one line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from instruments.figures import MB, median, roofline
from shared.store import ExpertStore


def model_facts(store: ExpertStore, *, model_dir: Path, built: bool, build_s: float, io_mode: str) -> dict[str, Any]:
    """The report's "model" entry: the checkpoint's shape and sizes as the store reads it."""
    first = store.sparse_layers[0]
    return {
        "dir": str(model_dir),
        "built": built,
        "build_s": build_s,
        "model_type": store.config.get("model_type"),
        "sparse_layers": len(store.sparse_layers),
        "experts_per_layer": store.experts_per_layer,
        "top_k": store.top_k,
        "expert_bytes": sum(seg.length for seg in store.locate(first, 0).segments),
        "slot_bytes": store.slot_bytes,
        "routed_expert_bytes": store.expert_bytes,
        "dense_bytes": store.dense_bytes,
        "scale_dtypes": sorted({t.dtype for t in store.layout(first, 0) if not t.name.endswith(".weight")}),
        "io_mode": io_mode,
    }


def model_line(model: Mapping[str, Any]) -> str:
    """`model_facts` in one line, printed before the run starts."""
    origin = f"built in {model['build_s']:.0f} s" if model["built"] else "cached"
    return (
        f"model: {model['dir']} ({origin}): "
        f"{model['model_type']}, {model['sparse_layers']} sparse layers x {model['experts_per_layer']} experts "
        f"(top-{model['top_k']}), {model['routed_expert_bytes'] / 1e9:.2f} GB of experts "
        f"({model['expert_bytes'] / MB:.2f} MB each, scales {'/'.join(model['scale_dtypes'])}), "
        f"{model['dense_bytes'] / MB:.1f} MB dense; I/O {model['io_mode']}"
    )


def summarize_disk(disk_runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Medians of the disk measurements, with the first one's setup (empty without measurements)."""
    if not disk_runs:
        return {}
    disk = {
        k: median([run[k] for run in disk_runs])
        for k in ("MBps", "single_expert_ms", "single_MBps", "misses_per_visit")
    }
    first = disk_runs[0]
    disk.update(
        mode=first["mode"],
        batch=first["batch"],
        threads=first["threads"],
        experts=first["experts"],
        MBps_runs=[run["MBps"] for run in disk_runs],
    )
    return disk


def streaming_roofline(
    streaming: Mapping[str, Any],
    resident: Mapping[str, Any] | None,
    *,
    disk: Mapping[str, Any],
    disk_runs: Sequence[Mapping[str, Any]],
    base_tok_s: float,
    per_round: bool,
) -> dict[str, Any]:
    """The streaming run against 1 / (t_compute + miss_bytes / disk_MBps), t_compute from mlx-lm and,
    with a resident run, from it (per round too when `per_round`: each round's own resident job and
    disk figure)."""
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
        if per_round:
            roof["ratio_rounds"] = [
                got / roofline(1 / res, miss_bytes, disk_run["MBps"])
                for got, res, disk_run in zip(streaming["decode_tok_s_runs"], resident["decode_tok_s_runs"], disk_runs)
            ]
            roof["ratio_round_median"] = median(roof["ratio_rounds"])
    return roof


def build_report(
    *,
    sequential: bool,
    sample: Mapping[str, Any],
    prompt: Sequence[int],
    expected: Sequence[int],
    base_info: Mapping[str, Any],
    base_runs: Sequence[Mapping[str, Any]],
    disk_runs: Sequence[Mapping[str, Any]],
    summaries: Mapping[str, dict[str, Any]],
) -> dict[str, Any]:
    """The run's figures: mlx-lm's runs, the disk measurements and each part's `System.summary`.

    Interleaved (not `sequential`), each round is also compared with the same round's mlx-lm run;
    `tokens_match` holds when mlx-lm repeated itself and every job emitted mlx-lm's tokens.
    """
    base_tok_s = median([run["decode_tok_s"] for run in base_runs])
    report: dict[str, Any] = {
        "order": "sequential" if sequential else "interleaved",
        "sampling": sample,
        "prompt_tokens": len(prompt),
        "expected_tokens": len(expected),
        "tokens": expected,
        "mlx_lm": {
            **base_info,
            "decode_tok_s": base_tok_s,
            "decode_tok_s_runs": [run["decode_tok_s"] for run in base_runs],
            "prefill_s": median([run["prefill_s"] for run in base_runs]),
            "repeat_tokens_equal": all(run["tokens_equal_first"] for run in base_runs),
        },
    }
    disk = summarize_disk(disk_runs)
    report["disk"] = disk
    ok = report["mlx_lm"]["repeat_tokens_equal"]
    for part, summary in summaries.items():
        ok &= summary["tokens_match"]
        report[part] = summary
    resident, streaming = report.get("resident"), report.get("streaming")
    if resident:
        resident["vs_mlx_lm"] = resident["decode_tok_s"] / base_tok_s if base_tok_s else 0.0
        if not sequential:  # the same round's mlx-lm run
            resident["vs_mlx_lm_rounds"] = [
                r / b["decode_tok_s"] for r, b in zip(resident["decode_tok_s_runs"], base_runs)
            ]
            resident["vs_mlx_lm_round_median"] = median(resident["vs_mlx_lm_rounds"])
    if streaming and resident:
        streaming["vs_resident"] = (
            streaming["decode_tok_s"] / resident["decode_tok_s"] if resident["decode_tok_s"] else 0.0
        )
        if not sequential:  # the same round's resident job
            streaming["vs_resident_rounds"] = [
                s / r for s, r in zip(streaming["decode_tok_s_runs"], resident["decode_tok_s_runs"])
            ]
            streaming["vs_resident_round_median"] = median(streaming["vs_resident_rounds"])
    if streaming and disk:
        streaming["roofline"] = streaming_roofline(
            streaming, resident, disk=disk, disk_runs=disk_runs, base_tok_s=base_tok_s, per_round=not sequential
        )
    report["tokens_match"] = bool(ok)
    return report


def report_lines(report: Mapping[str, Any]) -> list[str]:
    """`report` in words, one line per figure group: mlx-lm, the disk, each part and its roofline."""
    lines: list[str] = []
    base = report["mlx_lm"]
    lines.append(
        f"mlx-lm: {base['decode_tok_s']:.3f} tok/s decode (runs {_fmt(base['decode_tok_s_runs'])}); one layer's MoE "
        f"{base['moe_layer_ms']:.1f} ms; load {base['load_s']:.1f} s"
    )
    disk = report.get("disk")
    if disk:
        lines.append(
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
            f"{s.get('compute_lanes', '?')} compute lanes, I/O workers {s.get('io_workers', '?')}): "
            f"{s['decode_tok_s']:.3f} tok/s (runs {_fmt(s['decode_tok_s_runs'])})"
        )
        if part == "resident":
            head += f" = {s['vs_mlx_lm']:.3f} x mlx-lm"
            if "vs_mlx_lm_rounds" in s:
                head += f" (per round {_fmt(s['vs_mlx_lm_rounds'])})"
        elif "vs_resident" in s:
            head += f" = {s['vs_resident']:.3f} x resident"
            if "vs_resident_rounds" in s:
                head += f" (per round {_fmt(s['vs_resident_rounds'])})"
            if len(s.get("vs_resident_pass_medians", ())) > 1:
                head += f" (per pass, medians {_fmt(s['vs_resident_pass_medians'])})"
        lines.append(head)
        prefetch = s.get("prefetch", {})
        if prefetch.get("issued_per_token") or prefetch.get("steps_without"):
            lines.append(
                f"  prefetch ({prefetch['mode']}): {prefetch.get('distance', 1)} sparse layer(s) ahead; prediction "
                f"recall {prefetch['prediction_recall']:.3f} of the "
                f"routed experts; recall {prefetch['recall']:.3f} of would-be decode misses, precision "
                f"{prefetch['precision']:.3f}; per token {prefetch['issued_per_token']:.2f} reads "
                f"({prefetch['bytes_per_token'] / MB:.1f} MB), {prefetch['useful_per_token']:.2f} useful, "
                f"{prefetch['wasted_per_token']:.2f} wasted; demand waited on {prefetch['waits_per_token']:.2f} "
                f"in flight ({prefetch['wait_ms_per_token']:.1f} ms); layers stopped {prefetch['disabled_layers']}; "
                f"decode steps without it (auto's timing) {prefetch.get('steps_without', 0)}, jobs ending paused "
                f"{prefetch.get('paused_jobs', 0)}, on trial {prefetch.get('trialling_jobs', 0)} "
                f"(after {s.get('warmup_jobs', 1)} warm-up job(s))"
            )
        lines.append(
            f"  hit rate {s['hit_rate']:.3f}, misses per job {s['misses_per_job']}, "
            f"{s.get('misses_per_token', 0):.2f} misses = {s.get('miss_bytes_per_token', 0) / MB:.2f} MB per decode "
            f"token; I/O workers' disk p50/p99 {s['disk_p50_ms']:.2f}/{s['disk_p99_ms']:.2f} ms, "
            f"decode's {s.get('decode_disk_p50_ms', 0):.2f}/{s.get('decode_disk_p99_ms', 0):.2f} ms "
            f"(its waves' wait {s.get('decode_wait_p50_ms', 0):.2f}/{s.get('decode_wait_p99_ms', 0):.2f} ms)"
        )
        lines.append(
            f"  per layer visit: IPC wait {s.get('ipc_wait_ms_per_layer', 0):.3f} ms"
            f"{' (incl. loads)' if part == 'streaming' else ''}, copy {s.get('copy_ms_per_layer', 0):.3f} ms; "
            f"end-of-step fence {s.get('end_step_fence_ms_per_token', 0):.3f} ms; per token: IPC "
            f"{s.get('ipc_wait_ms_per_token', 0):.1f} ms, copy {s.get('copy_ms_per_token', 0):.1f} ms "
            f"({s.get('exposed_copy_ms_per_token', 0):.1f} not overlapped; {s.get('copied_MB_per_token', 0):.1f} MB); "
            f"tokens {'match' if s['tokens_match'] else 'DIFFER'}"
        )
        if s.get("copy_ahead_visit_fraction"):
            lines.append(
                f"  copy ahead: {s['copy_ahead_visit_fraction']:.2f} of the routed experts were in visits it served; "
                f"{s['copy_ahead_found_fraction']:.2f} of those found copied already; precision "
                f"{s['copy_ahead_precision']:.2f}"
            )
        for key, what in (
            ("cpu_ms_per_token", "CPU per generated token (the whole job, prefill included)"),
            ("decode_cpu_ms_per_token", "CPU per decode token (from the first token on)"),
        ):
            cpu = s.get(key)
            if cpu:
                lines.append(
                    f"  {what}: GPU worker {cpu['gpu_worker']:.1f} ms, "
                    f"coordinator {cpu['coordinator']:.1f} ms, I/O workers {cpu['io_workers']:.1f} ms"
                )
        compute = s.get("compute_thread")
        if compute:
            lines.append(
                f"  GPU worker's compute thread per decode token: ran {compute['run_ms_per_token']:.1f} ms, "
                f"waited {compute['wait_ms_per_token']:.1f} ms for a free CPU (all its threads "
                f"{compute['threads_wait_ms_per_token']:.1f} ms), preempted {compute['preempted_per_token']:.1f} times"
            )
        roof = s.get("roofline")
        if roof:
            if "roofline_tok_s" in roof:
                lines.append(
                    f"  roofline 1/(t_compute {roof['t_compute_resident_s'] * 1e3:.1f} ms [resident] + "
                    f"{roof['disk_s_per_token'] * 1e3:.1f} ms disk) = {roof['roofline_tok_s']:.3f} tok/s -> "
                    f"ratio {roof['ratio']:.3f}"
                    + (f" (per round {_fmt(roof['ratio_rounds'])})" if "ratio_rounds" in roof else "")
                )
            lines.append(
                f"  roofline 1/(t_compute {roof['t_compute_mlx_lm_s'] * 1e3:.1f} ms [mlx-lm] + "
                f"{roof['disk_s_per_token'] * 1e3:.1f} ms disk) = {roof['roofline_tok_s_mlx_lm']:.3f} tok/s -> "
                f"ratio {roof['ratio_mlx_lm']:.3f}"
            )
    lines.append(
        f"tokens: {'all equal to mlx-lm' if report['tokens_match'] else 'DIFFER from mlx-lm'} "
        f"({report['expected_tokens']} per job)"
    )
    return lines


def _fmt(values: Sequence[float], digits: int = 3) -> str:
    return ", ".join(f"{v:.{digits}f}" for v in values)
