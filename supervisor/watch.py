"""The supervisor's watch loop: restart dead children within a budget, check restarted ones become ready.

- a dead I/O worker is restarted with its index (the coordinator's backend
  has already re-submitted its in-flight loads to a live worker);
- a dead GPU worker is restarted (the coordinator has failed its job);
- a dead HTTP front is restarted on the same port (its clients' requests
  died with it; the door cancels their jobs when it cannot reach it);
- a dead coordinator takes every session with it: all children restart;
- each child may be restarted at most `--max-restarts` times per
  `--restart-window` seconds, with a growing pause; one more death stops the
  system with a message naming the child (exit 1);
- a restarted child that is not ready within `--start-timeout` is killed
  (which counts as another death);
- a coordinator that answers no health probe (asked every second) for
  `--hang-timeout` seconds is hung: it is killed, which is a death like any
  other (every child restarts with it). Its event loop answers health even
  while it waits on I/O, so silence means it is stopped or stuck, not busy.

The loop sleeps in `select` on the children's exit sentinels and the
supervisor's wake pipe (stop signals), so it reacts at once to either.
"""

from __future__ import annotations

import logging
import select
import signal
import time
from collections import deque
from dataclasses import dataclass, replace

import zmq

from shared.children import ChildProcess
from shared.curve import client_curve
from shared.job_messages import CLIENT_ACCEPTS, HealthReply, HealthRequest
from shared.process import ProcessLife
from shared.protocol import ProtocolError, decode, encode
from shared.sockets import open_socket
from supervisor.http_child import HTTP_FRONT
from supervisor.options import SupervisorOptions
from supervisor.readiness import COORDINATOR, GPU_WORKER, LaunchCancelled, LaunchError
from supervisor.system import RunningSystem

logger = logging.getLogger("moeslab.supervisor")

EXIT_OK, EXIT_FAILED = 0, 1
HEALTH_INTERVAL_S = 0.5  # while a restarted child is not ready yet
PROBE_INTERVAL_S = 1.0  # otherwise: the coordinator's liveness probe
# After this long the coordinator has noticed a dead child (its watchdogs look every 0.1-0.5 s).
READY_SETTLE_S = 1.5


@dataclass(frozen=True, slots=True)
class _Unready:
    deadline: float  # killed (a death like any other) if not ready by then
    since: float  # when it was restarted
    seen_down: bool = False  # health has shown it not ready since the restart


class Watcher:
    """Restarts dead children within the restart budget; checks that restarted ones become ready."""

    def __init__(
        self, system: RunningSystem, options: SupervisorOptions, life: ProcessLife, context: zmq.Context
    ) -> None:
        self.system, self.options, self.life = system, options, life
        self.deaths: dict[str, deque[float]] = {}
        self.restart_at: dict[str, float] = {}  # name -> when its dead child is restarted
        self.unready: dict[str, _Unready] = {}  # restarted children not known to be ready yet
        curve = client_curve(system.curve_public_key)  # the front door may be a CURVE server
        self.health = open_socket(context, zmq.DEALER, connect=system.endpoint, unbounded=False, curve=curve)
        self.next_health = 0.0
        self.sent = 0
        self.asked: dict[str, float] = {}  # health request id -> when it was sent
        self.answered = time.monotonic()  # the coordinator's last health reply (or its last start)

    def run(self) -> int:
        while True:
            self._wait()
            if self.life.stop_requested:
                logger.info("%s: stopping", signal.Signals(self.life.stop_signal or 0).name)
                return EXIT_OK
            now = time.monotonic()
            for child in list(self.system.children):
                if child.exit_code is not None and child.name not in self.restart_at:
                    if COORDINATOR in self.restart_at:
                        continue  # every child is restarted with it
                    if not self._died(child, now):
                        return EXIT_FAILED
            for name, due in sorted(self.restart_at.items(), key=lambda item: item[1]):
                # A coordinator restart clears the others' entries: every child starts anew.
                if name in self.restart_at and due <= now and not self._restart(name):
                    return EXIT_FAILED
            self._probe(time.monotonic())

    def _wait(self) -> None:
        sentinels = [child.sentinel for child in self.system.children if child.exit_code is None]
        timeout = 0.2 if None in sentinels else 1.0
        wakeups = [*self.restart_at.values(), self.next_health]
        soonest = min(wakeups, default=None)
        if soonest is not None:
            timeout = min(timeout, max(0.0, soonest - time.monotonic()))
        select.select([self.life.wake_fd, *(fd for fd in sentinels if fd is not None)], [], [], timeout)
        self.life.drain()

    def _died(self, child: ChildProcess, now: float) -> bool:
        """Schedule the restart of a dead child; False when its restart budget is spent."""
        policy = self.options.restart
        deaths = self.deaths.setdefault(child.name, deque())
        deaths.append(now)
        while deaths and deaths[0] < now - policy.window_s:
            deaths.popleft()
        self.unready.pop(child.name, None)
        logger.error("%s", child.describe())
        if len(deaths) > policy.max_restarts:
            logger.error(
                "%s died %d times within %g s (at most %d restarts allowed); stopping the system",
                child.name,
                len(deaths),
                policy.window_s,
                policy.max_restarts,
            )
            return False
        delay = policy.backoff(len(deaths))
        self.restart_at[child.name] = now + delay
        what = "every child (the coordinator holds all their sessions)" if child.name == COORDINATOR else child.name
        logger.warning(
            "restarting %s%s (restart %d of at most %d per %g s)",
            what,
            f" in {delay:g} s" if delay else "",
            len(deaths),
            policy.max_restarts,
            policy.window_s,
        )
        return True

    def _restart(self, name: str) -> bool:
        del self.restart_at[name]
        try:
            if name == COORDINATOR:
                self.unready.clear()
                self.restart_at.clear()  # the others' deaths are moot: every child starts again
                self.system.restart_all(cancel=lambda: self.life.stop_requested)
                self.answered = time.monotonic()  # it was ready, just now
                self.asked.clear()
                return True
            child = next(c for c in self.system.children if c.name == name)
            replacement = self.system.respawn(child)
        except LaunchCancelled:
            return True  # a signal arrived; the loop stops next
        except (LaunchError, OSError) as error:
            logger.error("could not restart %s: %s", name, error)
            return False
        now = time.monotonic()
        self.unready[name] = _Unready(deadline=now + self.options.start_timeout, since=now)
        logger.info("%s restarted as pid %d; waiting for it to be ready", name, replacement.pid)
        return True

    def _probe(self, now: float) -> None:
        """Read health replies, kill a coordinator that stopped answering, ask again when due."""
        replies = []
        while self.health.poll(0):
            try:
                reply = decode(self.health.recv(), CLIENT_ACCEPTS)
            except ProtocolError:
                continue
            asked = self.asked.pop(reply.id, None) if isinstance(reply, HealthReply) else None
            if asked is not None:
                self.answered = now
                replies.append((reply, asked))
        self._check_ready(now, replies)
        coordinator = next((c for c in self.system.children if c.name == COORDINATOR), None)
        if coordinator is not None and coordinator.exit_code is None and COORDINATOR not in self.restart_at:
            silent = now - self.answered
            if self.asked and silent > self.options.hang_timeout:
                logger.error(
                    "the coordinator (pid %d) answered no health probe for %.1f s (--hang-timeout %g): it is "
                    "hung; killing it",
                    coordinator.pid,
                    silent,
                    self.options.hang_timeout,
                )
                self.asked.clear()
                coordinator.process.kill()  # its exit is seen next loop: a death, so everything restarts
                return
        if now >= self.next_health:
            self.sent += 1
            request = f"supervisor-{self.sent}"
            try:
                self.health.send(encode(HealthRequest(id=request)), zmq.NOBLOCK)
                self.asked[request] = now
            except zmq.Again:  # no coordinator connected right now (dead, or restarting): nothing to ask
                pass
            self.next_health = now + (HEALTH_INTERVAL_S if self.unready else PROBE_INTERVAL_S)

    def _check_ready(self, now: float, replies: list[tuple[HealthReply, float]]) -> None:
        """Note restarted children that health shows ready; kill one that stalls.

        A reply may still describe the dead child (the coordinator notices a death by its own
        watchdog), so "ready" counts only once health has shown the child down, or in a reply
        to a request sent READY_SETTLE_S after the restart. Erring this way can only miss a stall,
        never kill a healthy child."""
        if not self.unready:
            return
        front = self.system.http
        if HTTP_FRONT in self.unready and front is not None:  # ready when it listens, whatever health says
            child = next(c for c in self.system.children if c.name == HTTP_FRONT)
            if front.ready(child.pid):
                del self.unready[HTTP_FRONT]
                logger.info("%s is ready again at %s", HTTP_FRONT, front.url)
        for reply, asked in replies:
            for name, state in list(self.unready.items()):
                if name == HTTP_FRONT:
                    continue
                up = reply.gpu_worker if name == GPU_WORKER else reply.io_workers == self.system.io_workers
                if not up:
                    self.unready[name] = replace(state, seen_down=True)
                elif state.seen_down or asked >= state.since + READY_SETTLE_S:
                    del self.unready[name]
                    logger.info("%s is ready again", name)
        for name, state in list(self.unready.items()):
            if now > state.deadline:
                child = next(c for c in self.system.children if c.name == name)
                logger.error(
                    "%s (pid %d) was not ready %g s after its restart; killing it",
                    name,
                    child.pid,
                    self.options.start_timeout,
                )
                del self.unready[name]
                child.process.kill()

    def close(self) -> None:
        self.health.close(linger=0)


__all__ = ["EXIT_FAILED", "EXIT_OK", "Watcher"]
