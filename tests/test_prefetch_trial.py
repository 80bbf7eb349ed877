"""auto's decode-step trial (coordinator/prefetch_trial.py): alternating epochs with prefetch and
without, the faster side kept, a retry after `recheck_steps`; only predicted, uninterrupted decode
steps timed; and its figures in the prefetch book's telemetry."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.jobs import JobFrontDoor
from coordinator.prefetch import PrefetchBook, PrefetchTelemetry
from coordinator.prefetch_trial import StepTrial
from shared.gpu_messages import Job
from shared.job_messages import Generate
from shared.protocol import encode


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
    sides, _ = drive(trial, 52, with_ms=10, without_ms=20)
    assert sides[:20] == ON + ON + OFF + ON + OFF  # the trial: a warm-up epoch, then two epochs a side
    assert sides[20:40] == [True] * 20
    assert sides[40:52] == ON + ON + OFF  # then a new trial
    assert trial.steps_without == 8 + 3  # the trials' off epochs (the last one's fourth step is still running)
    assert "prefetch kept: decode steps took 10.0 ms with it and 20.0 ms without" in caplog.text


def test_a_trial_is_deciding_from_its_first_predicted_step_until_its_verdict():
    """`deciding` (the telemetry's `trialling`): a trial whose steps predict and has no verdict yet.
    Steps that never predict (every expert resident) leave a trial that never decides."""
    trial = small()
    _, now = drive(trial, 12, with_ms=10, without_ms=20, predict=False)
    assert trial.state == "trial" and not trial.deciding
    deciding = []
    for _ in range(30):  # the verdict comes at the 17th step, the next trial after 20 more
        _, now = drive(trial, 1, with_ms=10, without_ms=20, now=now)
        deciding.append(trial.deciding)
    assert deciding[0] and trial.state == "on"  # it started deciding at once, and reached its verdict
    verdict = deciding.index(False)
    assert all(deciding[:verdict]) and not any(deciding[verdict:])
    _, now = drive(trial, 20, with_ms=10, without_ms=20, now=now, predict=False)  # the verdict's time is up
    assert trial.state == "trial" and not trial.deciding  # a new trial, not deciding until a step predicts
    drive(trial, 1, with_ms=10, without_ms=20, now=now)
    assert trial.deciding


def test_prefetch_is_paused_when_steps_are_faster_without_it_and_tried_again_later(caplog):
    caplog.set_level("INFO", logger="coordinator.prefetch_trial")
    trial = small()
    sides, now = drive(trial, 21, with_ms=30, without_ms=20)
    assert sides == ON + ON + OFF + ON + OFF + [False] and trial.state == "off"
    assert "prefetch paused, decode is faster without it: decode steps took 30.0 ms with it and 20.0 ms" in caplog.text
    assert not trial.job_starts()  # the next job does not predict
    sides, now = drive(trial, 30, with_ms=30, without_ms=20, now=now, predict=False)  # nor does it time anything
    assert sides == [False] * 30 and trial.state == "off"
    trial.interrupted()  # the job's end
    assert trial.steps_without == 8 + 1 + 30  # the trial's off epochs, the verdict's step, the pause's steps
    assert trial.job_starts() and trial.state == "trial"  # 20 steps on: the next job tries again
    sides, _ = drive(trial, 9, with_ms=30, without_ms=20, now=now)
    assert sides == ON + ON + [False]


def test_a_machine_slowing_down_during_the_trial_does_not_decide_it():
    """Prefetch costs 6% here, and the machine slows by 10% an epoch: compared side against side
    (medians), the earlier epochs with prefetch would look faster; compared epoch against the
    adjacent one, the drift nearly cancels and prefetch is paused."""
    trial, now = StepTrial(epoch_steps=4, trial_epochs=3, recheck_steps=20), 0.0
    for step in range(29):
        trial.step_started(now)
        trial.saw_prediction()
        now += 0.010 * (1.06 if trial.prefetching else 1.0) * (1 + 0.025 * step)
    assert trial.state == "off"


def test_prefetch_is_kept_unless_it_is_clearly_slower():
    trial, now = small(), 0.0
    for _ in range(21):
        trial.step_started(now)
        trial.saw_prediction()
        now += 0.0101 if trial.prefetching else 0.0100  # 1% slower with it: within the margin
    assert trial.state == "on"


def test_steps_without_a_prediction_are_neither_timed_nor_counted():
    trial = small()
    drive(trial, 100, with_ms=30, without_ms=20, predict=False)
    assert trial.state == "trial" and trial.steps_without == 0


def test_an_interruption_is_not_timed_as_a_step():
    """A prefill chunk or a job's end between two decode steps: the gap belongs to no step."""
    trial = small()
    now = 0.0
    for step in range(21):
        if step % 4 == 2 and trial.prefetching:  # a long prefill in every epoch with prefetch
            trial.interrupted()
            now += 10.0
        trial.step_started(now)
        trial.saw_prediction()
        now += 0.010 if trial.prefetching else 0.020
    assert trial.state == "on"


@pytest.mark.parametrize("steps_per_job", [1, 2])
def test_jobs_too_short_to_time_keep_prefetching(steps_per_job):
    """An epoch of 4 steps needs 2 timed steps to count; a job's last step is never timed (its end
    is no next step's start). Epochs that say nothing do not switch sides: jobs of one or two
    steps never reach a verdict and keep prefetching, all of their steps."""
    trial = small()
    now, sides = 0.0, []
    for step in range(64):
        if step % steps_per_job == 0:
            trial.interrupted()  # a job's end and the next one's prefill
        trial.step_started(now)
        trial.saw_prediction()
        sides.append(trial.prefetching)
        now += 1.0
    assert trial.state == "trial" and all(sides) and trial.steps_without == 0


def test_jobs_of_three_steps_are_timed_enough_to_reach_a_verdict():
    trial = small()
    now = 0.0
    for step in range(200):
        if step % 3 == 0:
            trial.interrupted()
        trial.step_started(now)
        trial.saw_prediction()
        now += 0.010 if trial.prefetching else 0.020
    assert trial.state == "on"


@pytest.mark.parametrize(
    ("epoch_steps", "trial_epochs", "recheck_steps", "early_epochs"),
    [(1, 1, 1, 1), (4, 0, 1, 1), (4, 1, 0, 1), (4, 1, 1, 0)],
)
def test_bad_trial_sizes_are_refused(epoch_steps, trial_epochs, recheck_steps, early_epochs):
    with pytest.raises(ValueError, match="step trial needs"):
        StepTrial(
            epoch_steps=epoch_steps, trial_epochs=trial_epochs, recheck_steps=recheck_steps, early_epochs=early_epochs
        )


@pytest.mark.parametrize(
    ("with_ms", "without_ms", "state"), [(10.0, 20.0, "on"), (10.0, 11.5, "on"), (25.0, 20.0, "off")]
)
def test_a_clear_difference_ends_the_trial_after_two_epochs_a_side(caplog, with_ms, without_ms, state):
    """Four epochs a side, but 13% or more either way is clear after two: the trial spends 8
    steps without prefetch, not 16."""
    caplog.set_level("INFO", logger="coordinator.prefetch_trial")
    trial = StepTrial(epoch_steps=4, trial_epochs=4, recheck_steps=100)
    sides, _ = drive(trial, 21, with_ms=with_ms, without_ms=without_ms)
    assert sides[:20] == ON + ON + OFF + ON + OFF and trial.state == state
    assert trial.steps_without == 8  # the verdict's step (the 21st) is still running
    assert "early, beyond 1.10 either way" in caplog.text


def test_a_difference_within_the_clear_ratio_takes_the_whole_trial(caplog):
    caplog.set_level("INFO", logger="coordinator.prefetch_trial")
    trial = StepTrial(epoch_steps=4, trial_epochs=4, recheck_steps=100)
    sides, _ = drive(trial, 37, with_ms=10.0, without_ms=10.8)  # 7% faster with it
    assert sides[:36] == ON + ON + OFF + ON + OFF + ON + OFF + ON + OFF and trial.state == "on"
    assert trial.steps_without == 16 and "early" not in caplog.text


@settings(max_examples=200, deadline=None)
@given(
    durations=st.lists(st.tuples(st.floats(1, 500), st.booleans(), st.booleans()), min_size=1, max_size=200),
)
def test_any_sequence_of_steps_keeps_the_trial_consistent(durations):
    """Whatever the steps' lengths, predictions and interruptions: in a verdict the side is the
    verdict's, and exactly the predicted steps run without prefetch are counted."""
    trial = small()
    now, without = 0.0, 0
    for ms, predicted, interrupted in durations:
        if interrupted:
            trial.interrupted()
        trial.step_started(now)
        if predicted:
            trial.saw_prediction()
        # A step runs without prefetch on the trial's off side when it predicted, and always in a pause.
        without += not trial.prefetching and (predicted or trial.state == "off")
        if trial.state != "trial":
            assert trial.prefetching is (trial.state == "on")
        now += ms / 1e3
    trial.interrupted()
    assert trial.steps_without == without


def test_a_pause_counts_its_unpredicted_steps_too():
    """The example hypothesis found rarely: after a verdict to pause, a step that predicted
    nothing still ran without prefetch."""
    trial = small()
    drive(trial, 21, with_ms=30, without_ms=10)
    assert trial.state == "off"
    before = trial.steps_without
    trial.step_started(1.0)  # no prediction in this one
    trial.interrupted()
    assert trial.steps_without == before + 2  # the verdict's step and this one


# ---------------------------------------------------------------------------------------------
# The book


def paused_book() -> PrefetchBook:
    book = PrefetchBook(mode="auto", trial=small())
    now = 0.0
    for _ in range(21):
        book.decode_step(now)
        book.predicted(2, 1)
        now += 0.030 if book.trial.prefetching else 0.010
    return book


def test_a_paused_book_prefetches_no_layer_and_says_so():
    book = paused_book()
    assert not book.enabled(1) and not book.job_starts()
    book.not_decoding()  # the job's end
    telemetry = book.drain()
    assert telemetry.paused and telemetry.steps_without == 8 + 1
    assert book.drain().steps_without == 0  # drained


def test_a_stopped_layers_predictions_do_not_make_a_step_count():
    """A layer the per-layer judge stopped is read neither way: its predictions alone leave a
    step out of the trial."""
    book = PrefetchBook(mode="auto", window=4, trial=small())
    for _ in range(4):
        book.wasted(1, 10)  # layer 1 stops
    assert not book.enabled(1) and book.enabled(2)
    now = 0.0
    for _ in range(40):
        book.decode_step(now)
        book.predicted(2, 1)
        now += 0.030 if book.trial.prefetching else 0.010
    book.not_decoding()
    assert book.trial.state == "trial" and book.drain().steps_without == 0
    for _ in range(40):  # a live layer's predictions do
        book.decode_step(now)
        book.predicted(2, 2)
        now += 0.030 if book.trial.prefetching else 0.010
    assert book.trial.state == "off"


def test_the_books_telemetry_says_whether_auto_is_still_deciding():
    book = PrefetchBook(mode="auto", trial=small())
    assert not book.drain().trialling  # nothing predicted yet
    now = 0.0
    trialling = []
    for _ in range(30):
        book.decode_step(now)
        book.predicted(2, 1)
        now += 0.010 if book.trial.prefetching else 0.030
        trialling.append(book.drain().trialling)
    verdict = trialling.index(False)
    assert verdict > 0 and all(trialling[:verdict]) and not any(trialling[verdict:])
    assert book.trial.state == "on"


def test_on_and_off_take_no_trial():
    for mode, enabled in (("on", True), ("off", False)):
        book = PrefetchBook(mode=mode, trial=small())
        for step in range(40):
            book.decode_step(step * 0.05)
            book.predicted(2, 1)
        assert book.enabled(1) is enabled and book.job_starts() is enabled
        telemetry = book.drain()
        assert not telemetry.paused and not telemetry.trialling and book.trial.state == "trial"


def test_periods_add_steps_without_and_keep_the_later_pause():
    early, late = PrefetchTelemetry(steps_without=3, paused=True), PrefetchTelemetry(steps_without=4)
    assert (early + late).steps_without == 7 and not (early + late).paused
    assert (late + early).paused
    deciding = PrefetchTelemetry(trialling=True)
    assert (early + deciding).trialling and not (deciding + early).trialling


class _Host:
    """Just what the front door needs to start a job."""

    def __init__(self, predicts: bool) -> None:
        self.predicts, self.gpu = predicts, []

    def ready(self) -> bool:
        return True

    def begin_job(self, job_id: int) -> None:
        pass

    def job_predicts(self) -> bool:
        return self.predicts

    def send_gpu(self, message) -> bool:
        self.gpu.append(message)
        return True

    def send_client(self, identity, message) -> bool:
        return True


@pytest.mark.parametrize("predicts", [True, False])
def test_the_front_door_tells_each_job_whether_to_predict(predicts):
    host = _Host(predicts)
    door = JobFrontDoor(host=host)
    asyncio.run(door.handle_client([b"client", encode(Generate(id="a", prompt_tokens=(1, 2), max_tokens=4))]))
    assert [type(m) for m in host.gpu] == [Job] and host.gpu[0].predict is predicts


def _trial_starts(trial: StepTrial, steps: int, *, with_ms, without_ms) -> list[int]:
    """The steps at which a trial (after the first) began."""
    starts, now, before = [], 0.0, trial.state
    for step in range(steps):
        trial.step_started(now)
        trial.saw_prediction()
        if trial.state == "trial" and before != "trial":
            starts.append(step)
        before = trial.state
        ms = with_ms(step) if callable(with_ms) else with_ms
        now += (ms if trial.prefetching else without_ms) / 1e3
    return starts


def test_a_verdict_the_trials_keep_reaching_holds_longer_each_time_up_to_a_bound(caplog):
    """Each trial costs steps without prefetch: a verdict repeated doubles its hold (20, 40, 80,
    then 8 x 20 = 160 at most); the log says how long each one holds, and the trials come so."""
    caplog.set_level("INFO", logger="coordinator.prefetch_trial")
    trial = small()
    starts = _trial_starts(trial, 900, with_ms=10, without_ms=20)
    held = [int(line.rsplit("after ", 1)[1].split()[0]) for line in caplog.messages if "tried again after" in line]
    assert held[:6] == [20, 40, 80, 160, 160, 160]
    gaps = [b - a for a, b in itertools.pairwise(starts)]  # a trial's own steps plus the hold before the next
    assert [gap - gaps[0] for gap in gaps[:5]] == [0, 40, 120, 120, 120]


def test_a_changed_verdict_brings_the_hold_back_to_recheck_steps(caplog):
    """Prefetch wins twice (holds 20, then 40), then loses: that verdict holds 20 steps again."""
    caplog.set_level("INFO", logger="coordinator.prefetch_trial")
    trial = small()
    # Steps with prefetch are fast for the first 100 steps, slow after.
    starts = _trial_starts(trial, 200, with_ms=lambda step: 10 if step < 100 else 40, without_ms=20)
    held = [int(line.rsplit("after ", 1)[1].split()[0]) for line in caplog.messages if "tried again after" in line]
    assert held[:3] == [20, 40, 20]
    assert "paused, decode is faster without it" in caplog.messages[2]
    assert starts  # the trials did run
