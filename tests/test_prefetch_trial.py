"""auto's decode-step trial (coordinator/prefetch_trial.py): alternating epochs with prefetch and
without, the faster side kept, a retry after `recheck_steps`; only predicted, uninterrupted decode
steps timed; and its figures in the prefetch book's telemetry."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.prefetch import PrefetchBook, PrefetchTelemetry
from coordinator.prefetch_trial import StepTrial


def small() -> StepTrial:
    return StepTrial(epoch_steps=4, trial_epochs=2, recheck_steps=20)


def drive(trial: StepTrial, steps: int, *, with_ms: float, without_ms: float, now: float = 0.0, predict=True):
    """Run `steps` decode steps, each as long as its side takes; the sides they ran on."""
    sides = []
    for _ in range(steps):
        trial.step_started(now)
        if predict:
            trial.saw_prediction()
        sides.append(trial.prefetching)
        now += (with_ms if trial.prefetching else without_ms) / 1e3
    return sides, now


ON, OFF = [True] * 4, [False] * 4


def test_a_trial_alternates_epochs_then_keeps_prefetch_when_steps_are_faster_with_it(caplog):
    caplog.set_level("INFO", logger="coordinator.prefetch_trial")
    trial = small()
    sides, _ = drive(trial, 44, with_ms=10, without_ms=20)
    assert sides[:16] == ON + OFF + ON + OFF  # the trial: two epochs a side
    assert sides[16:36] == [True] * 20
    assert sides[36:44] == ON + OFF  # then a new trial
    assert trial.steps_without == 8 + 3  # the trials' off epochs (the last one's fourth step is still running)
    assert "prefetch kept: decode steps took 10.0 ms with it and 20.0 ms without" in caplog.text


def test_prefetch_is_paused_when_steps_are_faster_without_it_and_tried_again_later(caplog):
    caplog.set_level("INFO", logger="coordinator.prefetch_trial")
    trial = small()
    sides, now = drive(trial, 17, with_ms=30, without_ms=20)
    assert sides == ON + OFF + ON + OFF + [False] and trial.state == "off"
    assert "prefetch paused, decode is faster without it: decode steps took 30.0 ms with it and 20.0 ms" in caplog.text
    assert not trial.job_starts()  # the next job does not predict
    sides, now = drive(trial, 30, with_ms=30, without_ms=20, now=now, predict=False)  # nor does it time anything
    assert sides == [False] * 30 and trial.state == "off"
    trial.interrupted()  # the job's end
    assert trial.steps_without == 8 + 1 + 30  # the trial's off epochs, the verdict's step, the pause's steps
    assert trial.job_starts() and trial.state == "trial"  # 20 steps on: the next job tries again
    sides, _ = drive(trial, 5, with_ms=30, without_ms=20, now=now)
    assert sides == ON + [False]


def test_steps_without_a_prediction_are_neither_timed_nor_counted():
    trial = small()
    drive(trial, 100, with_ms=30, without_ms=20, predict=False)
    assert trial.state == "trial" and trial.steps_without == 0


def test_an_interruption_is_not_timed_as_a_step():
    """A prefill chunk or a job's end between two decode steps: the gap belongs to no step."""
    trial = small()
    now = 0.0
    for step in range(17):
        if step % 4 == 2 and trial.prefetching:  # a long prefill in every epoch with prefetch
            trial.interrupted()
            now += 10.0
        trial.step_started(now)
        trial.saw_prediction()
        now += 0.010 if trial.prefetching else 0.020
    assert trial.state == "on"


def test_an_epoch_with_too_few_timed_steps_says_nothing():
    trial = small()
    now = 0.0
    for _ in range(64):
        trial.interrupted()  # every step stands alone (a job of one token each)
        trial.step_started(now)
        trial.saw_prediction()
        now += 1.0
    assert trial.state == "trial"


@pytest.mark.parametrize(("epoch_steps", "trial_epochs", "recheck_steps"), [(1, 1, 1), (4, 0, 1), (4, 1, 0)])
def test_bad_trial_sizes_are_refused(epoch_steps, trial_epochs, recheck_steps):
    with pytest.raises(ValueError, match="step trial needs"):
        StepTrial(epoch_steps=epoch_steps, trial_epochs=trial_epochs, recheck_steps=recheck_steps)


@settings(max_examples=200, deadline=None)
@given(
    durations=st.lists(st.tuples(st.floats(1, 500), st.booleans(), st.booleans()), min_size=1, max_size=200),
)
def test_any_sequence_of_steps_keeps_the_trial_consistent(durations):
    """Whatever the steps' lengths, predictions and interruptions: in a verdict the side is the
    verdict's, and exactly the predicted steps run without prefetch are counted."""
    trial = small()
    now, off_predicted = 0.0, 0
    for ms, predicted, interrupted in durations:
        if interrupted:
            trial.interrupted()
        trial.step_started(now)
        side = trial.prefetching
        if predicted:
            trial.saw_prediction()
            off_predicted += not side
        if trial.state != "trial":
            assert trial.prefetching is (trial.state == "on")
        now += ms / 1e3
    trial.interrupted()
    assert trial.steps_without == off_predicted


# ---------------------------------------------------------------------------------------------
# The book


def paused_book() -> PrefetchBook:
    book = PrefetchBook(mode="auto", trial=small())
    now = 0.0
    for _ in range(17):
        book.decode_step(now)
        book.predicted(2)
        now += 0.030 if book.trial.prefetching else 0.010
    return book


def test_a_paused_book_prefetches_no_layer_and_says_so():
    book = paused_book()
    assert not book.enabled(1) and not book.job_starts()
    book.not_decoding()  # the job's end
    telemetry = book.drain()
    assert telemetry.paused and telemetry.steps_without == 8 + 1
    assert book.drain().steps_without == 0  # drained


def test_on_and_off_take_no_trial():
    for mode, enabled in (("on", True), ("off", False)):
        book = PrefetchBook(mode=mode, trial=small())
        for step in range(40):
            book.decode_step(step * 0.05)
            book.predicted(2)
        assert book.enabled(1) is enabled and book.job_starts() is enabled
        assert not book.drain().paused and book.trial.state == "trial"


def test_periods_add_steps_without_and_keep_the_later_pause():
    early, late = PrefetchTelemetry(steps_without=3, paused=True), PrefetchTelemetry(steps_without=4)
    assert (early + late).steps_without == 7 and not (early + late).paused
    assert (late + early).paused
