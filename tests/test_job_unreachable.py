"""A job whose send finds the GPU worker gone (before the pid watch says so) waits in the queue for
the next worker: it is neither failed nor answered, and no other job is started meanwhile (the soak
saw a whole queue drain into `worker_failed` in the moment before the loss was handled)."""

from __future__ import annotations

import asyncio

from coordinator.jobs import JobFrontDoor
from shared.gpu_messages import Job
from shared.job_messages import Generate
from shared.protocol import encode


class _Host:
    """The front door's host with a GPU worker that can be unreachable (sends fail)."""

    def __init__(self) -> None:
        self.reachable, self.gpu, self.clients = False, [], []

    def ready(self) -> bool:
        return True  # as the service is until its send fails: the loss is not handled yet

    def begin_job(self, job_id: int) -> None:
        pass

    def job_predicts(self) -> bool:
        return False

    def send_gpu(self, message) -> bool:
        if self.reachable:
            self.gpu.append(message)
        return self.reachable

    def send_client(self, identity, message) -> bool:
        self.clients.append(message)
        return True


def test_a_job_the_worker_cannot_take_waits_at_the_head_of_the_queue():
    host = _Host()
    door = JobFrontDoor(host=host)

    async def run() -> None:
        for name in ("a", "b", "c"):
            await door.handle_client([b"client", encode(Generate(id=name, prompt_tokens=(1, 2), max_tokens=4))])

    asyncio.run(run())
    assert host.gpu == [] and host.clients == []  # nothing failed, nothing answered
    assert door.queued == 3 and door.active == ()
    host.reachable = True  # the next worker is ready
    door.poke()
    assert [type(m) for m in host.gpu] == [Job]  # one running at a time (the door's default)
    assert door.queued == 2 and len(door.active) == 1 and host.clients == []
