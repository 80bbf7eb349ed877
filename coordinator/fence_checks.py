"""Fence checks around the slot backend: did anyone touch a slot after, or while, it was leased?

Product code that tests (and a suspicious operator) switch on; off in normal
runs. A decorator around the slot backend, enabled by the hook names in the
run configuration's `test_hooks`:

- `scribble_fenced`: after each fenced release every fenced slot is
  overwritten with 0xFF (NaN in every float format) and its real bytes are
  kept here; they are put back right before the slot is leased again, and
  forgotten when the slot is discarded or reloaded. A GPU worker that reads a
  slot after fencing it computes with NaNs, so its tokens diverge.
- `verify_fenced`: the slot's hash is taken when its load completes; at the
  fenced release it is hashed again and compared. A difference means someone
  wrote a leased slot (or a restore went wrong).

On the shared lease path (`shared.lease_words`) a published slot is leased
again without the coordinator, so nothing could restore it: `scribble_fenced`
then scribbles a slot when it is withdrawn (discarded: no reader is in it and
none can enter), and `verify_fenced` also compares the hash there, so a slot
written while it was published shows.

A mismatch is logged and counted in `violations` / `messages`; the job front
door fails the job that saw one. Everything else passes straight through to
the wrapped backend, so the production code paths are the same ones.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Sequence

from coordinator.residency_backend import Consumer
from shared.config import TEST_HOOKS
from shared.segments import ExpertIOSegment
from shared.slab import Slab

logger = logging.getLogger(__name__)

SCRIBBLE = 0xFF


def _digest(view: memoryview) -> bytes:
    return hashlib.blake2b(view, digest_size=16).digest()


class FenceCheckedBackend:
    """Wraps an ExpertResidencyBackend (e.g. IOWorkerBackend) with the fence checks the run asks for."""

    def __init__(
        self, inner: object, *, slab: Slab, scribble: bool = False, verify: bool = False, shared_path: bool = False
    ) -> None:
        self._inner = inner
        self._slab = slab
        self.scribble = scribble
        self.verify = verify
        self.shared_path = shared_path  # scribble at withdrawal, not at the fence
        self._saved: dict[int, tuple[int, bytes]] = {}  # slot -> (generation, real bytes)
        self._hashes: dict[int, tuple[int, bytes]] = {}  # slot -> (generation, hash at load completion)
        self.violations = 0
        self.messages: list[str] = []
        self.scribbles = 0
        self.restores = 0
        self.verified = 0

    def __getattr__(self, name: str) -> object:
        # Only reached for attributes not defined here: everything else is the inner backend's.
        return getattr(self._inner, name)

    @property
    def inner(self) -> object:
        return self._inner

    # ------------------------------------------------------- wrapped calls

    def submit_segments(self, slot: int, generation: int, segments: Sequence[ExpertIOSegment]) -> None:
        self._inner.submit_segments(slot, generation, segments)
        # A reload overwrites the slot: the kept bytes and hash describe an old generation.
        self._saved.pop(slot, None)
        self._hashes.pop(slot, None)

    async def wait(self, slot: int, generation: int) -> None:
        await self._inner.wait(slot, generation)
        if self.verify and self._hashes.get(slot, (None,))[0] != generation:
            self._hashes[slot] = (generation, self._hash(slot))

    def lease(self, slot: int, generation: int, consumer: Consumer = "gpu") -> None:
        saved = self._saved.get(slot)
        if saved is not None:
            if saved[0] != generation:
                self._violation(
                    f"slot {slot}: leased at generation {generation}, but the bytes kept at its "
                    f"fence are of generation {saved[0]}"
                )
            else:
                self._write(slot, saved[1])
                self.restores += 1
        self._inner.lease(slot, generation, consumer)
        if saved is not None:
            del self._saved[slot]

    def release_gpu_fenced(self, slot: int, generation: int) -> None:
        if self.verify:
            loaded = self._hashes.get(slot)
            if loaded is None or loaded[0] != generation:
                self._violation(f"slot {slot} generation {generation} fenced without a hash of its load")
            elif self._hash(slot) != loaded[1]:
                self._violation(f"slot {slot} generation {generation} changed while it was leased")
            else:
                self.verified += 1
        self._inner.release_gpu_fenced(slot, generation)
        if self.scribble and not self.shared_path:
            self._saved[slot] = (generation, self._scribble(slot))

    def discard(self, slot: int, generation: int) -> None:
        loaded = self._hashes.get(slot)
        if self.verify and self.shared_path and loaded is not None and loaded[0] == generation:
            if self._hash(slot) != loaded[1]:
                self._violation(f"slot {slot} generation {generation} changed while it was published")
            else:
                self.verified += 1
        self._inner.discard(slot, generation)
        if self.scribble and self.shared_path:
            self._scribble(slot)
        self._saved.pop(slot, None)
        self._hashes.pop(slot, None)

    # ------------------------------------------------------------ helpers

    def _scribble(self, slot: int) -> bytes:
        """Overwrite the slot with SCRIBBLE; its bytes before."""
        view = self._slab.slot_view(slot)
        try:
            before = bytes(view)
            view[:] = bytes([SCRIBBLE]) * len(view)
        finally:
            view.release()
        self.scribbles += 1
        return before

    def _hash(self, slot: int) -> bytes:
        view = self._slab.slot_view(slot)
        try:
            return _digest(view)
        finally:
            view.release()

    def _write(self, slot: int, data: bytes) -> None:
        view = self._slab.slot_view(slot)
        try:
            view[:] = data
        finally:
            view.release()

    def _violation(self, message: str) -> None:
        self.violations += 1
        self.messages.append(message)
        logger.error("test hook violation: %s", message)


def hook_report(backend: object, job_id: int, *, since: int) -> str | None:
    """After a job: log the hooks' counts (tests read the line); the violations after the first
    `since`, as the job's problem (None: none, or no hooks)."""
    if not isinstance(backend, FenceCheckedBackend):
        return None
    logger.info(
        "test hooks after job %d: %d scribbled, %d restored, %d verified, %d violations",
        job_id,
        backend.scribbles,
        backend.restores,
        backend.verified,
        backend.violations,
    )
    violations = backend.violations - since
    if not violations:
        return None
    return f"{violations} test hook violation(s): " + "; ".join(backend.messages[-violations:][:5])


def with_fence_checks(backend: object, hooks: Iterable[str], *, slab: Slab, shared_path: bool = False) -> object:
    """`backend` itself when no hook is asked for, else a FenceCheckedBackend around it."""
    names = tuple(hooks)
    unknown = [name for name in names if name not in TEST_HOOKS]
    if unknown:
        raise ValueError(f"unknown test hook(s) {unknown}; known: {list(TEST_HOOKS)}")
    if not names:
        return backend
    logger.warning("test hooks enabled: %s (never use them in a normal run)", ", ".join(names))
    return FenceCheckedBackend(
        backend,
        slab=slab,
        scribble="scribble_fenced" in names,
        verify="verify_fenced" in names,
        shared_path=shared_path,
    )


__all__ = ["SCRIBBLE", "FenceCheckedBackend", "hook_report", "with_fence_checks"]
