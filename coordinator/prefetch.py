"""Prefetch bookkeeping: is a layer's prediction worth its reads, and what did prefetch do for a job.

The GPU worker predicts the next sparse layer's experts with that layer's own
router (`gpuworker.prediction`) and sends them with a layer's `routes`; the
residency manager loads the predicted experts that are not resident into the
layer's reclaimable slots (`coordinator.residency_prefetch`). This book counts
what became of each prefetched expert: *useful* when a demand lease took it
before it was evicted (waiting for it if its read was still in flight),
*wasted* when it was evicted, cancelled or failed first.

Adaptive (`auto`): a useful prefetch saves a demand read on the critical path
(the layer waits for it); a wasted one costs disk time off the critical path,
read while a layer computes, and delays a demand read only when the disk is
still busy with it. So a prefetch pays even when most of a layer's reads are
wasted, as long as the disk has the time: break-even is well below one half.
A layer whose prefetches, over the last `window` of them, were used less often
than `break_even` (a quarter) stops being prefetched, and the log says so.
Used reads are not yet a faster decode (a read costs CPU however good the
prediction): auto also times decode steps with prefetch and without and keeps
the faster (`coordinator.prefetch_trial`).
`on` never stops; `off` never predicts.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import asdict, dataclass, field, fields
from typing import Literal

from coordinator.prefetch_trial import StepTrial
from shared.config import PREFETCH_MODES
from shared.gpu_messages import MAX_PREFETCH

logger = logging.getLogger(__name__)

PrefetchMode = Literal["auto", "on", "off"]
# Prefetched experts per layer the usefulness is judged over: long enough that a layer whose
# prediction is fair (Colibri: 72% of a real model's picks) never falls below break-even by chance
# (at 70% useful, 32 outcomes put 25% more than five standard deviations away), short enough that
# a layer whose prediction is no better than chance stops within a few tokens' reads.
WINDOW = 32
BREAK_EVEN = 0.25  # below this share of useful prefetches a layer's prediction costs more than it saves


def prefetch_count(mode: str, top_k: int, margin: int | None) -> int:
    """How many experts the GPU worker predicts per decode step: top-k plus a margin (0 when off).

    The default margin is a quarter of top-k, rounded up: a few more reads for the experts
    ranked just below the cut, which the next layer often picks."""
    if mode not in PREFETCH_MODES:
        raise ValueError(f"prefetch must be one of {PREFETCH_MODES}, got {mode!r}")
    if mode == "off":
        return 0
    return min(MAX_PREFETCH, top_k + (-(-top_k // 4) if margin is None else margin))


def welcome_prefetch(config, store) -> int:
    """How many experts the GPU worker predicts per layer (its welcome says): none when `auto` finds
    every expert resident (every layer's slots hold all its experts: a prediction could only cost)."""
    plan, mode = config.plan, config.prefetch
    if mode == "auto" and plan.slots_per_layer >= store.experts_per_layer:
        logger.info("prefetch off: every expert of every layer fits its layer's slots")
        return 0
    return prefetch_count(mode, store.top_k, config.prefetch_margin)


def welcome_copy_ahead(config, store) -> int:
    """How many predicted experts the GPU worker copies ahead per decode layer (its welcome says;
    0: none). Copy ahead only reads what is resident, so it predicts whatever the prefetch mode."""
    return prefetch_count("on", store.top_k, config.prefetch_margin) if config.copy_ahead == "on" else 0


@dataclass(frozen=True, slots=True)
class PrefetchTelemetry:
    """What prefetch did over a period (a job, or the run)."""

    predicted: int = 0  # experts the GPU worker predicted
    issued: int = 0  # ... of them not resident, read into a slot
    useful: int = 0  # issued and then leased by demand before eviction
    wasted: int = 0  # issued and evicted, cancelled or failed before any demand
    issued_bytes: int = 0
    wasted_bytes: int = 0
    waits: int = 0  # demand leases that waited for a prefetch still reading
    wait_ms: float = 0.0  # ... and how long they waited in all
    predicted_routed: int = 0  # decode selections that were in the layer's prediction
    routed: int = 0  # decode selections of predicted layers
    disabled_layers: tuple[int, ...] = ()  # layers whose prefetch stopped itself (so far in the run)
    steps_without: int = 0  # decode steps auto ran without prefetch (its trial's, predicted; a pause's)
    paused: bool = False  # auto's step timing had found decode faster without prefetch (at the period's end)
    trialling: bool = False  # auto's step timing was still deciding at the period's end (its steps predict)

    @property
    def precision(self) -> float:
        return self.useful / self.issued if self.issued else 0.0

    @property
    def prediction_recall(self) -> float:
        """The share of a predicted layer's decode selections its prediction named (Colibri's measure)."""
        return self.predicted_routed / self.routed if self.routed else 0.0

    def recall(self, demand_misses: int) -> float:
        """The share of would-be demand misses a prefetch avoided or shortened (`demand_misses`:
        those of the visits it could have served, decode steps')."""
        avoided = self.useful + demand_misses
        return self.useful / avoided if avoided else 0.0

    def __add__(self, other: PrefetchTelemetry) -> PrefetchTelemetry:
        """Two periods' counts together (the later one's disabled layers, pause and trial)."""
        summed = {name: getattr(self, name) + getattr(other, name) for name in _COUNTED}
        return PrefetchTelemetry(
            **summed, disabled_layers=other.disabled_layers, paused=other.paused, trialling=other.trialling
        )


_STATES = ("disabled_layers", "paused", "trialling")  # the period's end, not summed
_COUNTED = tuple(f.name for f in fields(PrefetchTelemetry) if f.name not in _STATES)


@dataclass(slots=True)
class _Counts:
    predicted: int = 0
    issued: int = 0
    useful: int = 0
    wasted: int = 0
    issued_bytes: int = 0
    wasted_bytes: int = 0
    waits: int = 0
    wait_ms: float = 0.0
    predicted_routed: int = 0
    routed: int = 0


@dataclass(slots=True)
class PrefetchBook:
    """Per-layer usefulness (adaptive mode) and the counters of the current period."""

    mode: PrefetchMode = "auto"
    window: int = WINDOW
    break_even: float = BREAK_EVEN
    _outcomes: dict[int, deque[bool]] = field(default_factory=dict)
    _disabled: set[int] = field(default_factory=set)
    _counts: _Counts = field(default_factory=_Counts)
    trial: StepTrial = field(default_factory=StepTrial)  # auto's decode-step timing

    def __post_init__(self) -> None:
        if self.mode not in PREFETCH_MODES:
            raise ValueError(f"prefetch must be one of {PREFETCH_MODES}, got {self.mode!r}")

    def enabled(self, layer: int) -> bool:
        if self.mode != "auto":
            return self.mode == "on"
        return layer not in self._disabled and self.trial.prefetching

    def predicted(self, count: int, layer: int) -> None:
        self._counts.predicted += count
        if count and layer not in self._disabled:  # a stopped layer's prediction is read neither way
            self.trial.saw_prediction()

    def job_starts(self) -> bool:
        """A job is about to start: whether the GPU worker is to predict in it (off, or auto paused: no)."""
        if self.mode != "auto":
            return self.mode == "on"
        return self.trial.job_starts()

    def decode_step(self, now: float) -> None:
        """A decode step began at `now` (`time.perf_counter()`): auto's trial times the one before."""
        if self.mode == "auto":
            self.trial.step_started(now)

    def not_decoding(self) -> None:
        """A prefill chunk or a job's end: no decode step continues the one in progress."""
        self.trial.interrupted()

    def scored(self, named: int, routed: int) -> None:
        """A predicted layer was visited: `named` of its `routed` decode selections were predicted."""
        self._counts.predicted_routed += named
        self._counts.routed += routed

    def issued(self, nbytes: int) -> None:
        self._counts.issued += 1
        self._counts.issued_bytes += nbytes

    def useful(self, layer: int, waited_ms: float | None) -> None:
        self._counts.useful += 1
        if waited_ms is not None:
            self._counts.waits += 1
            self._counts.wait_ms += waited_ms
        self._judge(layer, True)

    def wasted(self, layer: int, nbytes: int) -> None:
        self._counts.wasted += 1
        self._counts.wasted_bytes += nbytes
        self._judge(layer, False)

    def drain(self) -> PrefetchTelemetry:
        """The counters since the last drain (they restart at zero); the disabled layers so far."""
        counts, self._counts = self._counts, _Counts()
        return PrefetchTelemetry(
            **asdict(counts),
            disabled_layers=tuple(sorted(self._disabled)),
            steps_without=self._drain_steps_without(),
            paused=self.mode == "auto" and self.trial.state == "off",
            trialling=self.mode == "auto" and self.trial.deciding,
        )

    def _drain_steps_without(self) -> int:
        steps, self.trial.steps_without = self.trial.steps_without, 0
        return steps

    def _judge(self, layer: int, useful: bool) -> None:
        outcomes = self._outcomes.setdefault(layer, deque(maxlen=self.window))
        outcomes.append(useful)
        if self.mode != "auto" or layer in self._disabled or len(outcomes) < self.window:
            return
        share = sum(outcomes) / len(outcomes)
        if share < self.break_even:
            self._disabled.add(layer)
            # INFO, not WARNING: stopping is the designed answer (the job's stats count the
            # stopped layers, and moeslab-send prints them), not a fault to act on.
            logger.info(
                "prefetch for layer %d stopped: %d of its last %d prefetched experts were used before eviction "
                "(%.0f%%, below the break-even %.0f%%); --prefetch on keeps it",
                layer,
                sum(outcomes),
                len(outcomes),
                100 * share,
                100 * self.break_even,
            )


__all__ = [
    "BREAK_EVEN",
    "WINDOW",
    "PrefetchBook",
    "PrefetchMode",
    "PrefetchTelemetry",
    "prefetch_count",
    "welcome_prefetch",
]
