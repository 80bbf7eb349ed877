"""Spawn N I/O worker processes by their command line and connect an IOWorkerBackend to them.

For tests and the bench (`scripts/bench_io.py`); in a real system the
supervisor spawns the workers and the coordinator only binds the backend:

    with Slab.create(total_slots=..., slot_bytes=...) as slab:
        async with IOWorkerPool(slab=slab, manifest=paths, workers=2) as pool:
            pool.backend.submit_segments(slot, generation, segments)
            await pool.backend.wait(slot, generation)

A private run directory (0700) holds the manifest and the ipc socket; it and
every child process are gone when the pool closes.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
from collections.abc import Sequence

from coordinator.backend import IOWorkerBackend
from native import DEFAULT_BLOCK_SIZE, OpenMode
from native.staging import StagingRequest
from shared.checks import require_int
from shared.children import ChildProcess, spawn_child, stop_children, wait_for_exit
from shared.commands import IO_WORKER_MODULE, IOWorkerArgs, child_command, io_worker_argv
from shared.slab import Slab


class IOWorkerPool:
    """Spawn N I/O workers on a slab and serve them through an IOWorkerBackend.

    `async with IOWorkerPool(slab=..., manifest=[...]) as pool: pool.backend...`
    The run directory (manifest + ipc socket) and every child are gone on exit.
    """

    def __init__(
        self,
        *,
        slab: Slab,
        manifest: Sequence[str | os.PathLike[str]],
        workers: int = 2,
        queue_depth: int = 8,
        block_size: int = DEFAULT_BLOCK_SIZE,
        io_mode: OpenMode = "auto",
        staging: StagingRequest = "auto",
        hint_queue: int = 256,
        hint_capacity: int = 64,
        start_timeout: float = 30.0,
        log_level: str = "INFO",
        test_read_delay_ms: float = 0.0,
        replacement_grace_s: float = 0.0,
    ) -> None:
        self.slab = slab
        self.manifest = tuple(os.path.abspath(os.fspath(path)) for path in manifest)
        self.workers = require_int(workers, "workers", minimum=1)
        self._options = dict(
            queue_depth=queue_depth,
            block_size=block_size,
            io_mode=io_mode,
            staging=staging,
            hint_queue=hint_queue,
            log_level=log_level,
            test_read_delay_ms=test_read_delay_ms,
        )
        self._hint_capacity = hint_capacity
        self._grace = replacement_grace_s
        self._start_timeout = start_timeout
        self.run_dir: str | None = None
        self.processes: list[ChildProcess] = []  # by worker index
        self._backend: IOWorkerBackend | None = None
        self._watcher: asyncio.Task[None] | None = None

    @property
    def backend(self) -> IOWorkerBackend:
        if self._backend is None:
            raise RuntimeError("the pool is not started")
        return self._backend

    async def __aenter__(self) -> IOWorkerPool:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        self.run_dir = tempfile.mkdtemp(prefix="moeslab-io-")  # mode 0700
        try:
            manifest_path = os.path.join(self.run_dir, "manifest.json")
            with open(manifest_path, "w") as handle:
                json.dump(list(self.manifest), handle)
            self._backend = IOWorkerBackend(
                slab=self.slab,
                endpoint=f"ipc://{self.run_dir}/io.sock",
                workers=self.workers,
                files=len(self.manifest),
                hint_capacity=self._hint_capacity,
                replacement_grace_s=self._grace,
            )
            for index in range(self.workers):
                args = IOWorkerArgs(
                    index=index,
                    endpoint=self._backend.endpoint,
                    manifest=manifest_path,
                    slab_name=self.slab.name,
                    total_slots=self.slab.total_slots,
                    slot_bytes=self.slab.slot_bytes,
                    **self._options,
                )  # type: ignore[arg-type]
                command = child_command(IO_WORKER_MODULE, io_worker_argv(args))
                self.processes.append(spawn_child(f"I/O worker {index}", command))
            await self._backend.start(timeout=self._start_timeout, processes=self.processes)
            self._watcher = asyncio.get_running_loop().create_task(self._watch(), name="ioworker-watch")
        except BaseException:
            await self.close()
            raise

    async def close(self, *, timeout: float = 10.0) -> None:
        """Shut workers down (SIGTERM/SIGKILL after `timeout`), close the backend, remove the run dir."""
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        if self._backend is not None:
            self._backend.shutdown_workers()
        if self.processes:  # a clean shutdown first; then the death pipes stop any still starting
            await asyncio.to_thread(wait_for_exit, self.processes, timeout=min(2.0, timeout))
            for process in self.processes:
                process.close_death_pipe()
            await asyncio.to_thread(wait_for_exit, self.processes, timeout=timeout)
            await asyncio.to_thread(stop_children, self.processes, timeout=timeout)
        if self._backend is not None:
            await self._backend.aclose()
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            self.run_dir = None

    async def _watch(self) -> None:
        reported: set[int] = set()
        while True:
            await asyncio.sleep(0.2)
            for index, process in enumerate(self.processes):
                if index not in reported and process.exit_code is not None:
                    reported.add(index)
                    self.backend.worker_lost(index, process.describe())


__all__ = ["IOWorkerPool"]
