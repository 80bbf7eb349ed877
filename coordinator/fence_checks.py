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

    def __init__(self, inner: object, *, slab: Slab, scribble: bool = False, verify: bool = False) -> None:
        self._inner = inner
        self._slab = slab
        self.scribble = scribble
        self.verify = verify
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
        if self.scribble:
            view = self._slab.slot_view(slot)
            try:
                self._saved[slot] = (generation, bytes(view))
                view[:] = bytes([SCRIBBLE]) * len(view)
            finally:
                view.release()
            self.scribbles += 1

    def discard(self, slot: int, generation: int) -> None:
        self._inner.discard(slot, generation)
        self._saved.pop(slot, None)
        self._hashes.pop(slot, None)

    # ------------------------------------------------------------ helpers

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


def with_fence_checks(backend: object, hooks: Iterable[str], *, slab: Slab) -> object:
    """`backend` itself when no hook is asked for, else a FenceCheckedBackend around it."""
    names = tuple(hooks)
    unknown = [name for name in names if name not in TEST_HOOKS]
    if unknown:
        raise ValueError(f"unknown test hook(s) {unknown}; known: {list(TEST_HOOKS)}")
    if not names:
        return backend
    logger.warning("test hooks enabled: %s (never use them in a normal run)", ", ".join(names))
    return FenceCheckedBackend(backend, slab=slab, scribble="scribble_fenced" in names, verify="verify_fenced" in names)


__all__ = ["SCRIBBLE", "FenceCheckedBackend", "with_fence_checks"]
