"""The HTTP front process: `python -m httpfront --listen HOST:PORT --jobs-endpoint E --model-id ID
--ready-file F [--server-key K] [--api-key-file F] [--death-fd N]`.

One entry function, `run_http_front`: setup (the listening socket, bound here so port 0 resolves to
a real port and a port in use fails the start with one clear line; the door's client; the app),
uvicorn's serve loop, and a `finally` that cancels the jobs still open at the door, closes the
client's socket and context, and removes the ready file. The ready file (JSON: pid, url) is written
once the port accepts connections: that is how the supervisor sees this child ready and learns the
port. SIGTERM/SIGINT and the parent's death (`shared.process.ProcessLife`) end the serve loop
gracefully: open streams get a few seconds to finish. uvicorn installs no signal handlers of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import sys
from collections.abc import Iterator, Sequence

import uvicorn

from httpfront.app import Front, build_app
from httpfront.jobs_client import JobsClient
from shared.commands import HttpFrontArgs, parse_http_front_argv, split_host_port
from shared.process import ProcessLife

logger = logging.getLogger("httpfront")

EXIT_OK, EXIT_FAILED = 0, 1
GRACEFUL_S = 3.0  # after a stop request, how long open requests may still finish
STARTUP_POLL_S = 0.01


class _Server(uvicorn.Server):
    """uvicorn without its signal handling: this process's ProcessLife owns the stop signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # uvicorn >= 0.29
        yield

    def install_signal_handlers(self) -> None:  # older uvicorn
        pass


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: a free one); OSError names the address."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as error:
        raise OSError(f"cannot resolve {host!r}: {error}") from None
    sock = socket.socket(family, kind, proto)
    try:
        # A restarted front takes its port back at once (the old one's connections may linger in TIME_WAIT).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as error:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    return sock


def http_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _write_ready(path: str, url: str) -> None:
    """Atomically (temp file + rename, 0600): the supervisor never reads half of it."""
    temp = f"{path}.tmp"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump({"pid": os.getpid(), "url": url}, handle)
    os.replace(temp, path)


def _remove_ready(path: str) -> None:
    """Remove the ready file if it is this process's (a successor's must stay)."""
    try:
        with open(path, encoding="utf-8") as handle:
            mine = json.load(handle).get("pid") == os.getpid()
    except (OSError, ValueError, AttributeError):
        return
    if mine:
        os.unlink(path)


def _api_key(path: str | None) -> str | None:
    if path is None:
        return None
    with open(path, encoding="utf-8") as handle:
        key = handle.read().strip()
    if not key:
        raise ValueError(f"the API key file {path} is empty")
    return key


async def run_http_front(args: HttpFrontArgs) -> int:
    """Serve until SIGTERM/SIGINT or the parent's death; the exit code."""
    loop = asyncio.get_running_loop()
    life = ProcessLife(death_fd=args.death_fd)
    server: _Server | None = None
    stopping: list[str] = []

    def on_stop(reason: str) -> None:
        stopping.append(reason)
        if reason.startswith("parent"):
            logger.warning("%s; exiting", reason)
        if server is not None:
            server.should_exit = True

    life.watch_loop(loop, on_stop)
    sock = jobs = None
    try:
        host, port = split_host_port(args.listen)
        api_key = _api_key(args.api_key_file)
        sock = listen(host, port)
        url = http_url(host, sock.getsockname()[1])
        jobs = JobsClient(args.jobs_endpoint, server_key=args.server_key)
        app = build_app(Front(jobs=jobs, model_id=args.model_id), api_key=api_key)
        config = uvicorn.Config(
            app, lifespan="off", log_config=None, access_log=False, timeout_graceful_shutdown=GRACEFUL_S
        )
        server = _Server(config)
        server.should_exit = bool(stopping)  # a stop that came during setup
        serving = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started and not serving.done():
            await asyncio.sleep(STARTUP_POLL_S)
        if server.started:
            _write_ready(args.ready_file, url)
            logger.info(
                "serving %s at %s (jobs: %s)%s",
                args.model_id,
                url,
                args.jobs_endpoint,
                " with an API key" * bool(api_key),
            )
        await serving
        return EXIT_OK
    except (OSError, ValueError) as error:
        logger.error("%s", error)
        return EXIT_FAILED
    finally:
        if jobs is not None:
            await jobs.aclose()
        if sock is not None:
            sock.close()
        _remove_ready(args.ready_file)
        life.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_http_front_argv(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s http_front[%(process)d] %(levelname)s %(name)s: %(message)s",
    )
    if args.log_level.upper() != "DEBUG":  # uvicorn's start and stop lines repeat this process's own
        logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
    return asyncio.run(run_http_front(args))


__all__ = ["http_url", "listen", "main", "run_http_front"]
