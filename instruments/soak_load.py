"""The soak's load: C client threads sending N jobs, with cancels, disconnects and malformed frames.

Each thread owns one `shared.client.Client` (a new one after it disconnects) and, lazily, one
raw DEALER for malformed frames. Job `i`'s choices (prompt, max_tokens, greedy or sampled,
cancel / disconnect after how many tokens) come from a generator seeded by (seed, i), so a run
is the same load whatever the threads' interleaving.

Outcomes, one per job: `done` (greedy ones compared with mlx-lm's reference: a mismatch is
`wrong`), `cancelled` (a cancel we sent; a job that finished first counts as done), `failed`
by the coordinator's error code, `disconnected` (we closed the socket mid-stream without a
cancel: no terminal reply is expected; what the coordinator did is read from its log), and
`lost`: no reply for `job_timeout` seconds. Every streamed token of a greedy job, finished or
not, must be a prefix of the reference (`wrong_partial` otherwise).
"""

from __future__ import annotations

import logging
import random
import re
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

from shared.client import Client, ClientError, ClientTimeout, JobFailedError
from shared.job_messages import CANCELLED, CLIENT_ACCEPTS, Done, HealthReply, JobFailed, TokenEvent
from shared.protocol import ProtocolError, decode

logger = logging.getLogger("soak.load")

MALFORMED_REPLY_TIMEOUT_S = 20.0


@dataclass(frozen=True, slots=True)
class LoadOptions:
    jobs: int
    clients: int
    max_tokens: int
    cancel_rate: float = 0.0
    disconnect_rate: float = 0.0
    malformed_every: int = 0  # 0: never
    sampled_rate: float = 0.1  # share of jobs sampled at temperature > 0 (not compared)
    job_timeout: float = 120.0  # seconds without any reply before a job counts as lost
    seed: int = 0


@dataclass(frozen=True, slots=True)
class JobPlan:
    index: int
    prompt: int  # index into the prompts
    max_tokens: int
    temperature: float
    action: str  # "" | "cancel" | "disconnect"
    after: int  # tokens received before the action


def plan_job(options: LoadOptions, index: int, prompts: int) -> JobPlan:
    rng = random.Random(f"{options.seed}:{index}")
    max_tokens = rng.randint(max(1, options.max_tokens // 2), options.max_tokens)
    temperature = 0.8 if rng.random() < options.sampled_rate else 0.0
    roll = rng.random()
    action = ""
    if max_tokens > 1 and roll < options.cancel_rate:
        action = "cancel"
    elif max_tokens > 1 and roll < options.cancel_rate + options.disconnect_rate:
        action = "disconnect"
    return JobPlan(index, rng.randrange(prompts), max_tokens, temperature, action, rng.randint(1, max_tokens - 1 or 1))


@dataclass
class Tally:
    """What happened to the jobs (every field guarded by `lock`)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    jobs: int = 0
    done: int = 0
    greedy_checked: int = 0
    wrong: int = 0
    wrong_partial: int = 0
    cancelled: int = 0
    lost: int = 0
    not_run: int = 0  # jobs never sent because the supervisor had exited
    failed: Counter = field(default_factory=Counter)
    disconnected: dict[str, int] = field(default_factory=dict)  # request id -> tokens received before closing
    malformed: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)  # the first few wrong / lost jobs, for the report

    def note(self, text: str) -> None:
        if len(self.examples) < 10:
            self.examples.append(text)

    def report(self) -> dict[str, Any]:
        with self.lock:
            return {
                "jobs": self.jobs,
                "done": self.done,
                "greedy_checked": self.greedy_checked,
                "wrong": self.wrong,
                "wrong_partial": self.wrong_partial,
                "cancelled": self.cancelled,
                "lost": self.lost,
                "not_run": self.not_run,
                "failed": dict(self.failed),
                "disconnected": len(self.disconnected),
                "malformed": dict(self.malformed),
                "examples": list(self.examples),
            }


def check_tokens(got: Sequence[int], done: Done | None, want: Sequence[int], max_tokens: int) -> bool:
    """Streamed (and, when done, final) tokens against mlx-lm's reference cut at EOS."""
    expected = list(want[:max_tokens])
    if list(got) != expected[: len(got)]:
        return False
    if done is None:
        return True
    stop = "stop" if len(expected) < max_tokens else "length"
    return list(done.tokens) == list(got) == expected and done.finish_reason == stop


# Malformed frames and the error code each must be answered with ("" = no reply: not msgpack,
# dropped; a health asked right after must then be the next reply).
def _malformed(index: int) -> tuple[list[bytes], str]:
    rid = f"bad-{index}"
    pack = msgpack.packb
    cases: list[tuple[list[bytes], str]] = [
        ([pack([1, 2, 3])], "bad_message"),
        ([pack({"op": "generate", "id": rid, "prompt_tokens": [1, "a"]})], "bad_field"),
        ([pack({"op": "launch_missiles", "id": rid})], "unknown_op"),
        ([pack({"op": "generate", "id": rid, "prompt_tokens": [1, 2], "max_tokens": "many"})], "bad_field"),
        ([pack({"op": "health", "id": rid})] * 2, "bad_request"),
        ([b"\xc1 garbage, not msgpack"], ""),
    ]
    return cases[index % len(cases)]


class Load:
    """Run the jobs from `clients` threads; `on_start(i)` / `on_end(i)` are called around job i."""

    def __init__(
        self,
        endpoint: str,
        options: LoadOptions,
        prompts: Sequence[Sequence[int]],
        references: Sequence[Sequence[int]],
        *,
        on_start: Callable[[int], None] = lambda index: None,
        on_end: Callable[[int], None] = lambda index: None,
        alive: Callable[[], bool] = lambda: True,
    ) -> None:
        self.endpoint, self.options = endpoint, options
        self.prompts, self.references = [list(p) for p in prompts], [list(r) for r in references]
        self.on_start, self.on_end, self.alive = on_start, on_end, alive
        self.tally = Tally()
        self._next = 0
        self._lock = threading.Lock()

    def run(self) -> Tally:
        threads = [
            threading.Thread(target=self._client_thread, name=f"soak-client-{n}", daemon=True)
            for n in range(self.options.clients)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return self.tally

    def _take(self) -> int | None:
        with self._lock:
            if self._next >= self.options.jobs:
                return None
            if not self.alive():  # the system is gone: each job would only wait out its timeout
                with self.tally.lock:
                    self.tally.not_run = self.options.jobs - self._next
                return None
            self._next += 1
            return self._next - 1

    def _client_thread(self) -> None:
        client = Client(self.endpoint, timeout=self.options.job_timeout)
        raw: zmq.Socket | None = None
        context = zmq.Context()
        try:
            while (index := self._take()) is not None:
                self.on_start(index)
                every = self.options.malformed_every
                if every and (index + 1) % every == 0:
                    if raw is None:
                        raw = context.socket(zmq.DEALER)
                        raw.setsockopt(zmq.LINGER, 0)
                        raw.connect(self.endpoint)
                    if not self._send_malformed(raw, index):  # a late reply would confuse the next check
                        raw.close(linger=0)
                        raw = None
                job = plan_job(self.options, index, len(self.prompts))
                try:
                    if self._job(client, job):  # the client closed its socket: a new connection
                        client = Client(self.endpoint, timeout=self.options.job_timeout)
                except Exception as error:  # a bug here must not hang the soak: the job counts as lost
                    logger.exception("job %d: unexpected %r", index, error)
                    with self.tally.lock:
                        self.tally.lost += 1
                        self.tally.note(f"job {index}: unexpected {error!r}")
                self.on_end(index)
        finally:
            client.close()
            if raw is not None:
                raw.close(linger=0)
            context.term()

    def _job(self, client: Client, job: JobPlan) -> bool:
        """One job; True when it disconnected (the client is closed)."""
        tally, greedy = self.tally, job.temperature == 0.0
        want = self.references[job.prompt]
        got: list[int] = []
        with tally.lock:
            tally.jobs += 1
        stream = client.generate(
            prompt_tokens=self.prompts[job.prompt],
            max_tokens=job.max_tokens,
            temperature=job.temperature,
            seed=job.index,
        )
        outcome, done = "", None
        try:
            for event in stream:
                if isinstance(event, TokenEvent):
                    got.append(event.token)
                    if len(got) == job.after and job.action == "cancel":
                        client.cancel(stream.id)
                    elif len(got) == job.after and job.action == "disconnect":
                        client.close()  # no cancel: the coordinator must notice on its own
                        outcome = "disconnected"
                        break
                else:
                    done, outcome = event, "done"
        except JobFailedError as error:
            outcome = "cancelled" if error.code == CANCELLED and job.action == "cancel" else f"failed:{error.code}"
        except ClientTimeout:
            outcome = "lost"
            stream.close()
        except ClientError as error:
            outcome = f"failed:client_error:{type(error).__name__}"
        with tally.lock:
            if greedy and not check_tokens(got, done, want, job.max_tokens):
                if done is not None:
                    tally.wrong += 1
                else:
                    tally.wrong_partial += 1
                tally.note(f"job {job.index} ({outcome}) prompt {job.prompt}: got {got}, want {want[: job.max_tokens]}")
            if outcome == "done":
                tally.done += 1
                tally.greedy_checked += greedy
            elif outcome == "cancelled":
                tally.cancelled += 1
            elif outcome == "disconnected":
                tally.disconnected[stream.id] = len(got)
            elif outcome == "lost":
                tally.lost += 1
                tally.note(f"job {job.index} ({stream.id}): no reply within {self.options.job_timeout:g} s")
            else:
                tally.failed[outcome.removeprefix("failed:")] += 1
        return outcome == "disconnected"

    def _send_malformed(self, raw: zmq.Socket, index: int) -> bool:
        frames, code = _malformed(index)
        raw.send_multipart(frames)
        if not code:  # dropped unanswered: the door must still answer the next request first
            raw.send(msgpack.packb({"op": "health", "id": f"after-bad-{index}"}))
        reply = None
        if raw.poll(MALFORMED_REPLY_TIMEOUT_S * 1000):
            try:
                reply = decode(raw.recv(), CLIENT_ACCEPTS)
            except ProtocolError as error:
                reply = error
        expected = isinstance(reply, HealthReply) if not code else isinstance(reply, JobFailed) and reply.code == code
        with self.tally.lock:
            self.tally.malformed["sent"] += 1
            self.tally.malformed["answered" if expected else "unexpected"] += 1
            if not expected:
                self.tally.note(f"malformed frame {frames[0][:40]!r}: expected {code or 'no reply'}, got {reply!r}")
        return expected


def disconnect_outcomes(log: str, disconnected: dict[str, int]) -> dict[str, Any]:
    """What the coordinator did with each job whose client vanished, from its log lines
    (`coordinator/jobs.py`): stopped while running (the first token it could not deliver),
    dropped from the queue, finished before it noticed (its `done` went nowhere), or failed before
    it noticed (a killed or hung GPU worker fails every job it runs; its `error` went nowhere)."""
    outcome: dict[str, int] = {
        "stopped_running": 0,
        "dropped_queued": 0,
        "finished": 0,
        "failed": 0,
        "unaccounted": 0,
    }
    extra = []
    dropped = set(re.findall(r"'([^']+)'", " ".join(re.findall(r"of a disconnected client: (\[.*?\])", log))))
    for request_id, received in disconnected.items():
        ended = re.search(rf"\('{re.escape(request_id)}'\) ended after its client disconnected: (\d+) tokens", log)
        if ended:
            outcome["stopped_running"] += 1
            extra.append(int(ended.group(1)) - received)
        elif request_id in dropped:
            outcome["dropped_queued"] += 1
        elif re.search(rf"\('{re.escape(request_id)}'\) done:", log):
            outcome["finished"] += 1
        elif re.search(rf"\('{re.escape(request_id)}'\) failed: worker_(failed|hung):", log):
            outcome["failed"] += 1
        else:
            outcome["unaccounted"] += 1
    outcome["max_tokens_relayed_after_close"] = max(extra, default=0)
    return outcome


__all__ = ["JobPlan", "Load", "LoadOptions", "Tally", "check_tokens", "disconnect_outcomes", "plan_job"]
