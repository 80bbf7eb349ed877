"""What the tests share, by job. Test modules import helpers from here, never from one another.

- `models`: tiny random mlx-lm MoE models of every family, in memory and on disk.
- `oracle`: mlx-lm's own greedy generation on the fully loaded model (tokens, log-probabilities,
  optionally every router selection), the reference every streamed or system result must match.
- `system`: the whole system started in process with the tests' defaults, its jobs and budgets.
- `supervisor`: the supervisor's command line (`scripts/launch.py`) in a subprocess, its ready
  line, and what a stopped run may leave behind.
- `footprint`: a running system's memory footprint measured from outside with psutil.
- `raw_client`: a bare DEALER for frames the real client refuses to send.
- `residency`: async test bodies and one-byte-slot plans for the residency manager's unit tests.
"""
