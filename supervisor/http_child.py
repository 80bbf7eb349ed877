"""The HTTP front as the supervisor runs it: `--http HOST:PORT [--api-key KEY]`, its files, its readiness.

The front (`python -m httpfront`) is a client of the job front door, supervised like the other
children: started by its command line with a death pipe, restarted when it dies, stopped with them.
It is started first and waited for, so that it is already running (its libraries loaded) when the
coordinator measures the processes the slab is sized after. It is ready when its ready file
(`RUN_DIR/http.json`: its pid and URL) names its pid: the port then accepts connections, and a
port 0 has become a real one, which every restart reuses (clients were told that URL).

A host other machines can reach (anything but loopback: `shared.config.endpoint_exposed`) is
refused without an API key. The key travels in a file (`RUN_DIR/http_api_key`, 0600), never on a
command line (which every user of the machine can read).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.children import ChildProcess
from shared.commands import HTTP_FRONT_MODULE, HttpFrontArgs, child_command, http_front_argv, split_host_port
from shared.config import RunConfig, endpoint_exposed
from supervisor.readiness import LaunchCancelled, LaunchError

HTTP_FRONT = "HTTP front"  # the child's name (process table role: http_front)
READY_FILE = "http.json"
API_KEY_FILE = "http_api_key"
POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class HttpServing:
    """Where the HTTP front listens, and the bearer token every request must carry (None: none)."""

    host: str
    port: int
    api_key: str | None = field(default=None, repr=False)

    @property
    def listen(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def check_http(listen: str, api_key: str | None = None) -> HttpServing:
    """`HOST:PORT` checked: ValueError naming it when it is malformed, or reachable from other
    machines without an API key."""
    host, port = split_host_port(listen)
    if api_key is not None and (not api_key.strip() or any(c.isspace() for c in api_key)):
        raise ValueError("--api-key must be a non-empty token without spaces")
    if endpoint_exposed(f"tcp://{listen}") and api_key is None:
        raise ValueError(
            f"--http {listen} refused: other machines can reach it, and without an API key anyone there could "
            "use the model; pass --api-key KEY (clients then send 'Authorization: Bearer KEY'), or serve on "
            "loopback (127.0.0.1:PORT)"
        )
    return HttpServing(host=host, port=port, api_key=api_key)


class HttpFrontChild:
    """The front's files in the run directory, its command line, and whether it is ready."""

    def __init__(self, serving: HttpServing, run_dir: str) -> None:
        self.serving = serving
        self.port = serving.port  # the real port once the first start has resolved a port 0
        self.url: str | None = None
        self.ready_file = os.path.join(run_dir, READY_FILE)
        self._key_file = os.path.join(run_dir, API_KEY_FILE) if serving.api_key is not None else None

    def prepare(self) -> list[str]:
        """Write the API key file; the paths the run must remove at its stop."""
        if self._key_file is not None:
            fd = os.open(self._key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(f"{self.serving.api_key}\n")
        return [path for path in (self._key_file, self.ready_file, f"{self.ready_file}.tmp") if path]

    def command(self, run: RunConfig, *, server_key: str | None, python: str) -> list[str]:
        """`python -m httpfront ...` for this run (`server_key`: the jobs endpoint's CURVE key)."""
        args = HttpFrontArgs(
            listen=HttpServing(self.serving.host, self.port).listen,
            jobs_endpoint=run.endpoints.jobs,
            model_id=os.path.basename(os.path.normpath(run.model_dir)),
            ready_file=self.ready_file,
            server_key=server_key,
            api_key_file=self._key_file,
            log_level=run.log_level,
        )
        return child_command(HTTP_FRONT_MODULE, http_front_argv(args), python=python)

    def ready(self, pid: int) -> bool:
        """Whether the ready file names `pid` (then `url` and `port` are what it listens on)."""
        try:
            with open(self.ready_file, encoding="utf-8") as handle:
                record = json.load(handle)
        except (OSError, ValueError):
            return False
        if not isinstance(record, dict) or record.get("pid") != pid or not isinstance(record.get("url"), str):
            return False
        self.url = record["url"]
        self.port = int(self.url.rpartition(":")[2])
        return True

    def wait_ready(self, child: ChildProcess, *, timeout: float, cancel: Callable[[], bool] | None) -> None:
        """Return once `child` listens; LaunchError when it exits first or the time runs out."""
        deadline = time.monotonic() + timeout
        while not self.ready(child.pid):
            if cancel is not None and cancel():
                raise LaunchCancelled("stopped while the system was starting")
            if child.exit_code is not None:
                said = [line for line in child.stderr_tail() if line.strip()]
                last = said[-1].split(": ", 1)[-1] if said else "(no stderr output)"
                raise LaunchError(
                    f"the system failed to start:\n{child.describe()}",
                    summary=f"the system failed to start: {HTTP_FRONT} (pid {child.pid}) exited: {last}",
                )
            if time.monotonic() > deadline:
                message = f"the {HTTP_FRONT} (pid {child.pid}) was not listening after {timeout:g} s"
                raise LaunchError(f"{message}:\n{child.describe()}", summary=message)
            time.sleep(POLL_S)


__all__ = ["API_KEY_FILE", "HTTP_FRONT", "READY_FILE", "HttpFrontChild", "HttpServing", "check_http"]
