"""I/O worker: reads byte ranges of manifest files into slab slots on command.

Run as `python -m ioworker ...` (see `ioworker.main.parse_args`); the
coordinator side is `coordinator.backend`.
"""

from ioworker.main import WorkerConfig, load_manifest, main, parse_args, run_io_worker, worker_arguments

__all__ = ["WorkerConfig", "load_manifest", "main", "parse_args", "run_io_worker", "worker_arguments"]
