"""The instruments' logic: what `scripts/bench_generate.py` and `scripts/replay.py` measure and how.

The scripts are entry points (command line, orchestration, printing); the modules here do the work.

The decode benchmark (`scripts/bench_generate.py`):

- `bench_model`: the benchmark model's config, its build with mlx-lm's classes and its cache.
- `mlx_reference`: mlx-lm's own generation (the reference tokens and tok/s) and the prompt.
- `system_jobs`: one started system and its jobs, each job's figures.
- `lease_telemetry`: the GPU worker's lease telemetry log line, collected and summarized.
- `disk`: the checkpoint's read bandwidth with the native reader, and the I/O mode for its mount.
- `machine`: the machine's used memory and the children's RSS.
- `figures`: units, medians and the serial streaming roofline.
- `bench_report`: the report (what `--json` prints, the model's description included) and its text.

The residency replay (`scripts/replay.py`):

- `cache_policies`: the LRU and Belady (MIN) baselines.
- `replay_pins`: which experts are pinned (usage file, trace frequency or auto-pin planning).
- `residency_replay`: the real residency manager over a trace, next to the baselines.
- `replay_sweep`: hit rate against capacity, and its plot.
"""
