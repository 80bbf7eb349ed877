"""Child processes: spawned with a death pipe, stderr kept and forwarded, stopped gracefully.

`spawn_child(name, argv)` starts `argv + ["--death-fd", N]`, where N is the
read end of a pipe only this process can write to: the child exits when it
reports end of file (this process closed it, or died; `shared.process`). The
child's stderr is forwarded line by line to the `moeslab.child.<name>` logger
and its last lines are kept, so a failed start can be reported in the child's
own words. `stop_children` stops a group: SIGTERM, a deadline, SIGKILL for
stragglers, then the pipes closed and the pumps joined.

Every child runs in its own process group, so a terminal's Ctrl-C reaches
only the supervisor, which then stops the children in order. `sentinel` is a
pidfd (Linux) that becomes readable when the child exits, for a select loop;
None elsewhere (the loop then polls).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path

logger = logging.getLogger("moeslab.children")

STDERR_TAIL_LINES = 40
CHILD_LOGGER = "moeslab.child"  # parent of the loggers children's stderr lines are forwarded to
_REPO = str(Path(__file__).resolve().parents[1])
_LEVELS = (
    ("CRITICAL", logging.CRITICAL),
    ("ERROR", logging.ERROR),
    ("WARNING", logging.WARNING),
    ("DEBUG", logging.DEBUG),
)


class ChildProcess:
    """One spawned child: its Popen, the write end of its death pipe, its recent stderr lines.

    Each stderr line is forwarded to the `moeslab.child.<name>` logger as it arrives."""

    def __init__(self, name: str, process: subprocess.Popen[bytes], death_w: int | None) -> None:
        self.name, self.process, self.death_w = name, process, death_w
        self._tail: deque[str] = deque(maxlen=STDERR_TAIL_LINES)
        self._reader: threading.Thread | None = None
        self._pidfd: int | None = None
        if process.stderr is not None:
            self._reader = threading.Thread(target=self._pump, name=f"{name}-stderr", daemon=True)
            self._reader.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def exit_code(self) -> int | None:
        """None while running; reaps the child once it has exited."""
        return self.process.poll()

    @property
    def sentinel(self) -> int | None:
        """A descriptor readable once the child has exited (a pidfd), or None where there is none."""
        if self._pidfd is None and hasattr(os, "pidfd_open") and self.process.returncode is None:
            try:
                self._pidfd = os.pidfd_open(self.process.pid)
            except OSError:  # already reaped, or an old kernel: the caller polls
                return None
        return self._pidfd

    def stderr_tail(self, lines: int = 20) -> list[str]:
        """The last `lines` lines the child wrote to stderr (all of them once it has exited)."""
        if self.process.poll() is not None and self._reader is not None:
            self._reader.join(timeout=1.0)  # collect what it wrote before dying
        return list(self._tail)[-lines:]

    def describe(self) -> str:
        """'NAME (pid P) exited with code C' (or the signal) and its last stderr lines."""
        code = self.exit_code
        if code is None:
            state = "is still running"
        elif code < 0:
            state = f"was killed by signal {-code} ({signal.Signals(-code).name})"
        else:
            state = f"exited with code {code}"
        tail = self.stderr_tail()
        lines = "\n".join(f"  {line}" for line in tail) if tail else "  (no stderr output)"
        return f"{self.name} (pid {self.pid}) {state}; last stderr lines:\n{lines}"

    def close_death_pipe(self) -> None:
        """The child's death pipe reports end of file: it exits on its own."""
        if self.death_w is not None:
            os.close(self.death_w)
            self.death_w = None

    def terminate(self) -> None:
        """SIGTERM, unless it has already exited."""
        if self.process.poll() is None:
            try:
                self.process.terminate()
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """SIGKILL, unless it has already exited."""
        if self.process.poll() is None:
            try:
                self.process.kill()
            except ProcessLookupError:
                pass

    def join(self) -> None:
        """Release what watches the exited child: its pidfd and its stderr pump."""
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        if self._reader is not None:
            self._reader.join(timeout=2.0)

    def _pump(self) -> None:
        stream = self.process.stderr
        assert stream is not None
        child_logger = logging.getLogger(f"{CHILD_LOGGER}.{self.name.replace(' ', '-').replace('/', '')}")
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip()
            self._tail.append(line)
            level = next((lv for word, lv in _LEVELS if f" {word} " in line), logging.INFO)
            child_logger.log(level, "%s", line)
        stream.close()


def wait_for_exit(children: Sequence[ChildProcess], *, timeout: float) -> bool:
    """Wait up to `timeout` in all for every child to exit; True if they all did."""
    deadline = time.monotonic() + timeout
    for child in children:
        try:
            child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return False
    return True


def stop_children(children: Sequence[ChildProcess], *, timeout: float) -> None:
    """SIGTERM every child, wait up to `timeout` in all, SIGKILL stragglers; then close pipes and join."""
    for child in children:
        child.terminate()
    if not wait_for_exit(children, timeout=timeout):
        for child in children:
            if child.exit_code is None:
                logger.warning("%s (pid %d) ignored SIGTERM; killing it", child.name, child.pid)
                child.kill()
    for child in children:
        child.process.wait()
        child.close_death_pipe()
        child.join()


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment (the shm tag included), the repo on PYTHONPATH, unbuffered."""
    env = dict(os.environ, **(extra or {}))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO, env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def spawn_child(
    name: str, argv: Sequence[str], *, death: bool = True, env: Mapping[str, str] | None = None
) -> ChildProcess:
    """Start `argv` + `--death-fd N` (the read end of a pipe only this process can write to)."""
    death_r, death_w = os.pipe() if death else (None, None)
    try:
        command = list(argv) + (["--death-fd", str(death_r)] if death_r is not None else [])
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            pass_fds=() if death_r is None else (death_r,),
            close_fds=True,
            env=child_env(env),
            process_group=0,
        )
    except BaseException:
        for fd in (death_r, death_w):
            if fd is not None:
                os.close(fd)
        raise
    if death_r is not None:
        os.close(death_r)  # the child holds it now
    logger.debug("spawned %s as pid %d: %s", name, process.pid, command)
    return ChildProcess(name, process, death_w)


__all__ = [
    "CHILD_LOGGER",
    "STDERR_TAIL_LINES",
    "ChildProcess",
    "child_env",
    "spawn_child",
    "stop_children",
    "wait_for_exit",
]
