"""Starting and stopping I/O worker processes (reused by the supervisor).

`spawn_io_worker(config)` runs `[sys.executable, "-m", "ioworker", ...]` with
the death pipe's read end passed through, and keeps the child's last stderr
lines so a failed start can be reported with its exit code and its own words.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping

from ioworker.main import WorkerConfig, worker_arguments

logger = logging.getLogger(__name__)
STDERR_TAIL_LINES = 40


class WorkerProcess:
    """One spawned I/O worker: the Popen handle and its recent stderr lines.

    The child's stderr is forwarded line by line to the `ioworker.child` logger."""

    def __init__(self, index: int, process: subprocess.Popen[bytes]) -> None:
        self.index = index
        self.process = process
        self._tail: deque[str] = deque(maxlen=STDERR_TAIL_LINES)
        self._reader = threading.Thread(target=self._pump, name=f"ioworker-{index}-stderr", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def exit_code(self) -> int | None:
        """None while running; reaps the child once it has exited."""
        return self.process.poll()

    def stderr_tail(self, lines: int = 20) -> list[str]:
        """The last `lines` lines the child wrote to stderr."""
        if self.process.poll() is not None:
            self._reader.join(timeout=1.0)  # collect what it wrote before dying
        return list(self._tail)[-lines:]

    def describe_exit(self) -> str:
        """'I/O worker N (pid P) exited with code C' and its last stderr lines."""
        code = self.exit_code
        state = "is still running" if code is None else f"exited with code {code}"
        tail = self.stderr_tail()
        lines = "\n".join(f"  {line}" for line in tail) if tail else "  (no stderr output)"
        return f"I/O worker {self.index} (pid {self.pid}) {state}; last stderr lines:\n{lines}"

    def stop(self, *, timeout: float = 5.0) -> int:
        """SIGTERM, then SIGKILL after `timeout`; returns the exit code (reaped)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                logger.warning("I/O worker %d (pid %d) ignored SIGTERM; killing it", self.index, self.pid)
                self.process.kill()
                self.process.wait()
        self._reader.join(timeout=1.0)
        return self.process.returncode

    def _pump(self) -> None:
        stream = self.process.stderr
        assert stream is not None
        child_logger = logging.getLogger("ioworker.child")
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip()
            self._tail.append(line)
            level = next((lv for name, lv in _LEVELS if f" {name} " in line), logging.INFO)
            child_logger.log(level, "%s", line)
        stream.close()


_LEVELS = (
    ("CRITICAL", logging.CRITICAL),
    ("ERROR", logging.ERROR),
    ("WARNING", logging.WARNING),
    ("DEBUG", logging.DEBUG),
)


def io_worker_command(config: WorkerConfig, *, python: str = sys.executable) -> list[str]:
    """The argv that starts one I/O worker."""
    return [python, "-m", "ioworker", *worker_arguments(config)]


def spawn_io_worker(
    config: WorkerConfig,
    *,
    python: str = sys.executable,
    env: Mapping[str, str] | None = None,
    new_group: bool = False,
) -> WorkerProcess:
    """Start one I/O worker; it connects to `config.endpoint` and says hello.

    Only `config.death_fd` is inherited (the read end of a pipe whose write end
    the parent keeps): the child exits when that pipe reports end of file.
    """
    process = subprocess.Popen(
        io_worker_command(config, python=python),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        pass_fds=() if config.death_fd is None else (config.death_fd,),
        close_fds=True,
        env=None if env is None else dict(env),
        # Its own process group: a terminal's Ctrl-C goes to the supervisor, which stops it in order.
        process_group=0 if new_group else None,
    )
    logger.debug("spawned I/O worker %d as pid %d", config.index, process.pid)
    return WorkerProcess(config.index, process)


def wait_for_exit(workers: list[WorkerProcess], *, timeout: float) -> bool:
    """Wait up to `timeout` in all for every worker to exit; True if they all did."""
    deadline = time.monotonic() + timeout
    for worker in workers:
        try:
            worker.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return False
    return True


def stop_workers(workers: list[WorkerProcess], *, timeout: float = 5.0) -> None:
    """Wait up to `timeout` for every worker to exit, then SIGTERM / SIGKILL the rest."""
    wait_for_exit(workers, timeout=timeout)
    for worker in workers:
        worker.stop(timeout=timeout)


__all__ = [
    "STDERR_TAIL_LINES",
    "WorkerProcess",
    "io_worker_command",
    "spawn_io_worker",
    "stop_workers",
    "wait_for_exit",
]
