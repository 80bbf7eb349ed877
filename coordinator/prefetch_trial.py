"""auto's end-to-end judge: is decode faster with prefetch than without it?

The per-layer book (`coordinator.prefetch`) judges a prediction by how many of
its reads were used. That is not the whole cost: every read takes CPU in the
coordinator and an I/O worker however good the prediction was, and where the
computation already takes every core (a CPU host; many layers of small
experts, where a read is mostly per-read overhead) an overlapped read delays
the token about as much as a demand read does. Measured on a 2-vCPU host, 48
layers x 64 small experts at 25% residency: 69% of the prefetched experts used,
and decode still 7% slower than without prefetch.

So auto also times whole decode steps, in alternating epochs with prefetch and
without (after a warm-up epoch with it), and keeps prefetch unless steps are
`KEEP_MARGIN` slower with it; after `early_epochs` a side the trial ends early
when the sides already differ by `CLEAR_RATIO` either way (a clear win spends no
more epochs without prefetch). After `recheck_steps` it tries again, as the load
and what is resident change; while trials keep reaching the same verdict, the wait
doubles, up to `MAX_HOLD_FACTOR` times `recheck_steps` (every trial spends steps
without prefetch: at least 16 of every 512 were a steady tax where it wins), and a
changed verdict brings it back to `recheck_steps`. Only steps that carried a prediction
are timed (with nothing predicted both sides are the same). The first step of
an epoch is not timed: it runs on what the other side left resident. While
prefetch is paused the GPU worker predicts nothing either (`job_starts`: each
job is told whether to predict), so a pause costs nothing per layer; the next
trial starts with the first job after the pause's `recheck_steps` (a verdict
reached in the middle of a job pauses the reads at once, the predictions from
the next job on). In the trial's epochs without prefetch the GPU worker still
predicts, so they pay the router calls a pause does not: the comparison leans,
slightly, towards keeping prefetch.
"""

from __future__ import annotations

import itertools
import logging
import math
import statistics
from dataclasses import dataclass, field
from typing import Literal

logger = logging.getLogger(__name__)

EPOCH_STEPS = 8  # decode steps per epoch
TRIAL_EPOCHS = 4  # epochs per side in a trial; adjacent epochs of the two sides are compared
RECHECK_STEPS = 512  # decode steps a verdict holds before the next trial
MAX_HOLD_FACTOR = 8  # a verdict the trials keep repeating holds up to this many times as long
# Prefetch is paused only when steps are this much slower with it: a wrong pause costs what
# prefetch saves (11% on this host's default benchmark, far more where decode waits for the disk),
# a wrong keep only what its reads cost (a few percent on a CPU host's many small experts).
KEEP_MARGIN = 1.02
# A trial ends early, after `early_epochs` a side, when the sides already differ by this much either
# way: epochs of 8 steps vary by a few percent here, so a 10% difference is no noise, and every
# epoch without prefetch that a clear win spends costs the user what prefetch saves.
CLEAR_RATIO = 1.10
EARLY_EPOCHS = 2


@dataclass(slots=True)
class StepTrial:
    """Decode steps timed with prefetch and without; `prefetching` says which side the current step is on."""

    epoch_steps: int = EPOCH_STEPS
    trial_epochs: int = TRIAL_EPOCHS
    recheck_steps: int = RECHECK_STEPS
    early_epochs: int = EARLY_EPOCHS  # epochs a side after which a clear difference decides
    state: Literal["trial", "on", "off"] = "trial"
    prefetching: bool = True  # the side of the step in progress (and of the next one, until it starts)
    steps_without: int = 0  # decode steps run without prefetch: a trial's (predicted) and a pause's; drained
    _epochs: list[tuple[bool, float]] = field(default_factory=list)  # (prefetching, mean ms per step), in order
    _epoch: list[float] = field(default_factory=list)  # this epoch's timed steps
    _index: int = -1  # the step in progress within its epoch (negative: the trial's warm-up)
    _started: float | None = None  # when the decode step in progress started (None: none is)
    _predicted: bool = False  # the step in progress carried a prediction
    _held: int = 0  # decode steps since the verdict
    _hold: int = 0  # decode steps the current verdict holds (recheck_steps, doubled while verdicts repeat)
    _last_verdict: str | None = None
    _trial_predicted: bool = False  # a step of the trial in progress carried a prediction

    def __post_init__(self) -> None:
        if self.epoch_steps < 2 or self.trial_epochs < 1 or self.recheck_steps < 1 or self.early_epochs < 1:
            raise ValueError(
                f"step trial needs epoch_steps >= 2, trial_epochs >= 1, recheck_steps >= 1, early_epochs >= 1; "
                f"got {self.epoch_steps}, {self.trial_epochs}, {self.recheck_steps}, {self.early_epochs}"
            )
        self._index = self._warmup_index()
        self._hold = self.recheck_steps

    def _warmup_index(self) -> int:
        """A trial begins with an epoch of untimed steps with prefetch: the first trial runs while
        the slab is still cold, and a later one on what a pause left resident."""
        return -1 - self.epoch_steps

    @property
    def deciding(self) -> bool:
        """A trial is under way on steps that predict: its verdict is still to come. (A system whose
        steps never predict, every expert resident, stays in `trial` without ever deciding.)"""
        return self.state == "trial" and self._trial_predicted

    def saw_prediction(self) -> None:
        """The step in progress carried a prediction."""
        self._predicted = True
        self._trial_predicted = self._trial_predicted or self.state == "trial"

    def job_starts(self) -> bool:
        """A job is about to start: whether its decode steps are to predict (not while paused).
        A pause whose time is up ends here, so that the trial after it runs on predicting steps."""
        if self.state == "off" and self._held >= self._hold:
            self._retry()
        return self.state != "off"

    def step_started(self, now: float) -> None:
        """A decode step began (its first layer was routed) at `now` (seconds, monotonic)."""
        self._close(now)
        self._started, self._predicted = now, False
        if self.state != "trial":
            return
        self._index += 1
        if self._index == self.epoch_steps:  # the epoch is over: record it, switch sides
            recorded = len(self._epoch) * 2 >= self.epoch_steps - 1  # enough of it was timed to say something
            if recorded:
                self._epochs.append((self.prefetching, statistics.fmean(self._epoch)))
            self._epoch.clear()
            self._index = 0
            sides = [side for side, _ in self._epochs]
            per_side = min(sides.count(True), sides.count(False))
            if per_side >= self.trial_epochs:
                self._verdict()
            elif recorded and per_side >= self.early_epochs and abs(math.log(self._ratio())) >= math.log(CLEAR_RATIO):
                self._verdict(early=True)
            elif recorded:
                self.prefetching = not self.prefetching
            # else: the same side again. Jobs too short to time (one or two steps each) never reach
            # a verdict, and stay on the side the trial started with, prefetching.

    def interrupted(self) -> None:
        """What follows is no continuation of the step in progress (a prefill chunk, a job's end)."""
        self._close(None)
        self._started, self._predicted = None, False

    # -- internals ---------------------------------------------------------

    def _close(self, now: float | None) -> None:
        """The step in progress ended at `now` (None: its end is not a next step's start)."""
        if self._started is None:
            return
        if not self.prefetching and (self._predicted or self.state == "off"):
            self.steps_without += 1
        if self.state != "trial":
            self._held += 1
            if self.state == "on" and self._held >= self._hold:
                self._retry()  # the steps predict: the trial can start with the next one
        elif self._predicted and now is not None and self._index > 0:
            self._epoch.append((now - self._started) * 1e3)

    def _ratios(self) -> list[float]:
        # Each epoch against the one after it (of the other side): a machine that slows down or
        # speeds up over the trial moves both epochs of a pair alike, and the pairs alternate
        # which side came first, so a steady drift nearly cancels in their geometric mean.
        return [
            (a if a_with else b) / (b if a_with else a)
            for (a_with, a), (b_with, b) in itertools.pairwise(self._epochs)
            if a_with != b_with and a > 0 and b > 0
        ]

    def _ratio(self, ratios: list[float] | None = None) -> float:
        """Steps with prefetch over steps without: the geometric mean of adjacent epochs' ratios."""
        ratios = self._ratios() if ratios is None else ratios
        return math.exp(statistics.fmean(math.log(r) for r in ratios)) if ratios else 1.0

    def _verdict(self, *, early: bool = False) -> None:
        ratios = self._ratios()
        ratio = self._ratio(ratios)
        self.prefetching = ratio <= KEEP_MARGIN
        self.state = "on" if self.prefetching else "off"
        self._held = 0
        repeated = self._last_verdict == self.state
        self._hold = min(2 * self._hold, MAX_HOLD_FACTOR * self.recheck_steps) if repeated else self.recheck_steps
        self._last_verdict = self.state
        with_ms = statistics.median(ms for prefetching, ms in self._epochs if prefetching)
        without_ms = statistics.median(ms for prefetching, ms in self._epochs if not prefetching)
        logger.info(
            "prefetch %s: decode steps took %.1f ms with it and %.1f ms without (medians of epochs of %d steps; "
            "with / without %.3f over %d adjacent epochs%s); tried again after %d decode steps",
            "kept" if self.prefetching else "paused, decode is faster without it",
            with_ms,
            without_ms,
            self.epoch_steps,
            ratio,
            len(ratios),
            f"; early, beyond {CLEAR_RATIO:.2f} either way" if early else "",
            self._hold,
        )

    def _retry(self) -> None:
        self.state, self.prefetching = "trial", True
        self._trial_predicted = False
        self._epochs.clear()
        self._epoch.clear()
        self._index = self._warmup_index()


__all__ = [
    "CLEAR_RATIO",
    "EARLY_EPOCHS",
    "EPOCH_STEPS",
    "KEEP_MARGIN",
    "MAX_HOLD_FACTOR",
    "RECHECK_STEPS",
    "TRIAL_EPOCHS",
    "StepTrial",
]
