"""Tests for coordinator.usage: the expert usage ledger, LFRU scoring and auto-pin planning.

The reference model below is a literal transcription of the seed's one-selection-at-a-time
loops (seeds/003, usage.ts); the vectorised ledger must agree with it exactly.
"""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator import usage
from coordinator.usage import (
    ExpertLfruCandidate,
    ExpertUsageEntry,
    ExpertUsageLedger,
    ExpertUsageSnapshot,
    expert_lfru_score,
    select_expert_lfru_candidates,
)
from shared.pins import ExpertAutoPinPlan, plan_expert_auto_pins
from shared.usage_profile import UINT32_MAX, ExpertUsageCount

PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def make(path: Path | str, layers=(0, 1), experts: int = 8, **kwargs) -> ExpertUsageLedger:
    return ExpertUsageLedger.open(path, layers=list(layers), experts_per_layer=experts, **kwargs)


def state(ledger: ExpertUsageLedger) -> tuple:
    """Everything observable about a ledger, for before/after comparisons."""
    entries = tuple(
        ledger.entry(layer, expert) for layer in ledger.layers for expert in range(ledger.experts_per_layer)
    )
    return ledger.snapshot(), entries


def temp_files(directory: Path) -> list[str]:
    return sorted(name for name in os.listdir(directory) if ".tmp-" in name)


def loaded(tmp_path: Path, text: str, layers=(0, 1), experts: int = 8) -> ExpertUsageLedger:
    path = tmp_path / "profile.coli_usage"
    path.write_text(text)
    warnings: list[str] = []
    ledger = make(path, layers, experts, on_warning=warnings.append)
    assert warnings == []
    return ledger


class Reference:
    """The seed's semantics, one selection at a time, in plain Python dicts."""

    def __init__(self, layers, experts: int, clock: int = 0) -> None:
        self.experts = experts
        self.counts = {(layer, e): 0 for layer in layers for e in range(experts)}
        self.heat = dict.fromkeys(self.counts, 0)
        self.last = dict.fromkeys(self.counts, 0)
        self.clock = clock
        self.selections = 0

    def record(self, layer: int, routes) -> None:
        for row in routes:
            for expert in row:
                key = (layer, int(expert))
                self.counts[key] = min(UINT32_MAX, self.counts[key] + 1)
                self.heat[key] = min(UINT32_MAX, self.heat[key] + 1)
                self.clock = (self.clock + 1) % 2**32
                self.last[key] = self.clock
                self.selections += 1

    def decay(self) -> None:
        for key in self.heat:
            self.heat[key] >>= 1

    def score(self, layer: int, expert: int) -> int:
        return expert_lfru_score(self.heat[layer, expert], self.last[layer, expert], self.clock)

    def lfru(self, layer: int, pinned: list[int]):
        if not pinned:
            return None
        cold_slot, cold = 0, self.score(layer, pinned[0])
        for slot in range(1, len(pinned)):
            if self.score(layer, pinned[slot]) < cold:
                cold_slot, cold = slot, self.score(layer, pinned[slot])
        hot_id, hot = -1, 0
        for expert in range(self.experts):
            if expert in pinned:
                continue
            if hot_id < 0 or self.score(layer, expert) > hot:
                hot_id, hot = expert, self.score(layer, expert)
        if hot_id < 0 or hot <= cold + cold // 4 + 4 * 256:
            return None
        return ExpertLfruCandidate(layer, cold_slot, pinned[cold_slot], hot_id, cold, hot, (hot - cold) // 256)


# ---------------------------------------------------------------- construction


def test_open_without_profile_is_empty_and_flush_is_a_no_op(tmp_path: Path) -> None:
    path = tmp_path / "usage"
    ledger = make(path, layers=(4, 2), experts=3)
    assert ledger.path == str(path) and ledger.layers == (4, 2) and ledger.experts_per_layer == 3
    assert ledger.snapshot() == ExpertUsageSnapshot(0, 0, 0, 0, False)
    assert ledger.entry(4, 2) == ExpertUsageEntry(0, 0, 0)
    assert ledger.ranked_counts() == []
    ledger.flush()
    assert not path.exists()


def test_accepts_str_pathlike_and_numpy_integers(tmp_path: Path) -> None:
    ledger = ExpertUsageLedger.open(str(tmp_path / "u"), layers=np.array([3, 5]), experts_per_layer=np.int64(4))
    assert ledger.layers == (3, 5) and type(ledger.layers[0]) is int and ledger.experts_per_layer == 4
    assert isinstance(make(tmp_path / "v").path, str)


@pytest.mark.parametrize(
    ("overrides", "error", "fragment"),
    [
        ({"path": ""}, ValueError, "''"),
        ({"path": 7}, TypeError, "7"),
        ({"path": b"/tmp/x"}, TypeError, "/tmp/x"),
        ({"path": None}, TypeError, "None"),
        ({"experts_per_layer": 0}, ValueError, "0"),
        ({"experts_per_layer": 2**32}, ValueError, str(2**32)),
        ({"experts_per_layer": 8.0}, TypeError, "8.0"),
        ({"experts_per_layer": True}, TypeError, "True"),
        ({"layers": []}, ValueError, "[]"),
        ({"layers": [1, 2, 1]}, ValueError, "[1, 2, 1]"),
        ({"layers": [0, -3]}, ValueError, "-3"),
        ({"layers": [0, 1.0]}, TypeError, "1.0"),
        ({"layers": [False]}, TypeError, "False"),
        ({"layers": "01"}, TypeError, "01"),
        ({"layers": [2**53]}, ValueError, str(2**53)),
        ({"on_warning": "print"}, TypeError, "print"),
    ],
)
def test_open_rejects_invalid_arguments(tmp_path: Path, overrides: dict, error: type, fragment: str) -> None:
    kwargs = {"path": tmp_path / "u", "layers": [0, 1], "experts_per_layer": 8, **overrides}
    path = kwargs.pop("path")
    with pytest.raises(error) as raised:
        ExpertUsageLedger.open(path, **kwargs)
    assert fragment in str(raised.value)


# ---------------------------------------------------------------- record_routes


def test_record_routes_counts_every_selection_in_row_then_rank_order(tmp_path: Path) -> None:
    ledger = make(tmp_path / "u")
    ledger.record_routes(0, [[1, 2], [2, 5], [1, 1]])
    assert ledger.entry(0, 1) == ExpertUsageEntry(count=3, heat=3, last_access=6)
    assert ledger.entry(0, 2) == ExpertUsageEntry(count=2, heat=2, last_access=3)
    assert ledger.entry(0, 5) == ExpertUsageEntry(count=1, heat=1, last_access=4)
    assert ledger.entry(1, 1) == ExpertUsageEntry(0, 0, 0)
    ledger.record_routes(1, np.array([[7, 0]], dtype=np.uint8))
    assert ledger.entry(1, 0) == ExpertUsageEntry(1, 1, 8)
    assert ledger.snapshot() == ExpertUsageSnapshot(
        clock=8, route_selections=8, total_count=8, nonzero_counts=5, dirty=True
    )


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64])
def test_numpy_routes_match_list_routes(tmp_path: Path, dtype) -> None:
    rows = [[3, 1, 3], [0, 7, 1], [1, 1, 1], [6, 2, 3]]
    by_list, by_array, by_rows = make(tmp_path / "a"), make(tmp_path / "b"), make(tmp_path / "c")
    by_list.record_routes(1, rows)
    by_array.record_routes(1, np.array(rows, dtype=dtype))
    by_rows.record_routes(1, [np.array(row, dtype=dtype) for row in rows])
    assert state(by_list) == state(by_array) == state(by_rows)


def test_numpy_routes_may_be_non_contiguous(tmp_path: Path) -> None:
    base = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int32)
    a, b = make(tmp_path / "a"), make(tmp_path / "b")
    a.record_routes(0, base.T)  # Fortran-ordered view: still row-major semantics of the view
    b.record_routes(0, base.T.tolist())
    assert state(a) == state(b)


def test_empty_routes_change_nothing(tmp_path: Path) -> None:
    ledger = make(tmp_path / "u")
    before = state(ledger)
    ledger.record_routes(0, [])
    ledger.record_routes(0, [[], []])
    ledger.record_routes(0, np.zeros((5, 0), dtype=np.int64))
    ledger.record_routes(0, np.zeros((0, 4), dtype=np.int64))
    assert state(ledger) == before and not ledger.snapshot().dirty


@pytest.mark.parametrize(
    ("layer", "routes", "error", "fragments"),
    [
        (9, [[1]], ValueError, ["layer 9"]),
        (-1, [[1]], ValueError, ["-1"]),
        (True, [[1]], TypeError, ["True"]),
        (0.0, [[1]], TypeError, ["0.0"]),
        (0, [[1, 2], [3, 8]], ValueError, ["route 1 rank 1", "8"]),
        (0, [[1, 2], [-1]], ValueError, ["route 1 rank 0", "-1"]),
        (0, [[1, 2.0]], TypeError, ["route 0 rank 1", "2.0"]),
        (0, [[True]], TypeError, ["route 0 rank 0", "True"]),
        (0, [[1], "12"], TypeError, ["route 1", "12"]),
        (0, [[1], 3], TypeError, ["route 1", "3"]),
        (0, "12", TypeError, ["12"]),
        (0, None, TypeError, ["None"]),
        (0, np.array([[1, 2], [3, 9]]), ValueError, ["route 1 rank 1", "9"]),
        (0, np.array([[1, 2], [-4, 1]]), ValueError, ["route 1 rank 0", "-4"]),
        (0, np.array([[2**64 - 1]], dtype=np.uint64), ValueError, [str(2**64 - 1)]),
        (0, np.array([[1.0, 2.0]]), TypeError, ["float64"]),
        (0, np.array([[True]]), TypeError, ["bool"]),
        (0, np.array([1, 2]), ValueError, ["(2,)"]),
        (0, [np.array([[1]])], ValueError, ["route 0", "(1, 1)"]),
        (0, np.array([[1, 2.5]], dtype=object), TypeError, ["2.5"]),
    ],
)
def test_invalid_routes_raise_and_change_nothing(tmp_path: Path, layer, routes, error, fragments) -> None:
    ledger = make(tmp_path / "u")
    ledger.record_routes(0, [[4, 4, 2]])
    ledger.flush()
    before = state(ledger)
    with pytest.raises(error) as raised:
        ledger.record_routes(layer, routes)
    for fragment in fragments:
        assert fragment in str(raised.value)
    assert state(ledger) == before


def test_counts_and_heat_saturate_at_uint32(tmp_path: Path) -> None:
    ledger = loaded(tmp_path, f"0 1 {UINT32_MAX - 2}\n")
    ledger._force_entry(0, 1, heat=UINT32_MAX - 1, last_access=0)
    ledger.record_routes(0, [[1, 1, 1, 1, 1]])
    assert ledger.entry(0, 1) == ExpertUsageEntry(UINT32_MAX, UINT32_MAX, 5)
    assert ledger.snapshot().route_selections == 5
    ledger.record_routes(0, np.ones((3, 2), dtype=np.int64))
    assert ledger.entry(0, 1) == ExpertUsageEntry(UINT32_MAX, UINT32_MAX, 11)


def test_clock_wraps_at_2_pow_32(tmp_path: Path) -> None:
    # Reaching 2**32 selections for real takes hours: the documented test hook sets the clock.
    ledger = make(tmp_path / "u", experts=4)
    ledger._force_clock(UINT32_MAX - 1)
    ledger.record_routes(0, np.array([[1, 2, 3]]))
    snap = ledger.snapshot()
    assert snap.clock == 1 and snap.route_selections == 3
    assert [ledger.entry(0, e).last_access for e in (1, 2, 3)] == [UINT32_MAX, 0, 1]
    # The recency bonus survives the wrap: expert 1 (selected at 2**32 - 1) is 2 ticks old.
    assert expert_lfru_score(1, UINT32_MAX, 1) == 256 + 253
    ledger._force_entry(0, 0, heat=0, last_access=0)
    with pytest.raises(ValueError, match=str(2**32)):
        ledger._force_clock(2**32)


def test_entry_validates_arguments(tmp_path: Path) -> None:
    ledger = make(tmp_path / "u")
    with pytest.raises(ValueError, match="layer 5"):
        ledger.entry(5, 0)
    with pytest.raises(ValueError, match="8"):
        ledger.entry(0, 8)
    with pytest.raises(ValueError, match="-1"):
        ledger.entry(0, -1)
    with pytest.raises(TypeError, match=r"1\.0"):
        ledger.entry(0, 1.0)
    with pytest.raises(TypeError, match="None"):
        ledger.entry(None, 1)
    assert ledger.entry(np.int32(1), np.uint8(7)) == ExpertUsageEntry(0, 0, 0)


def test_snapshot_total_count_does_not_saturate(tmp_path: Path) -> None:
    ledger = loaded(tmp_path, f"0 0 {UINT32_MAX}\n1 7 {UINT32_MAX}\n0 3 2\n")
    snap = ledger.snapshot()
    assert snap.total_count == 2 * UINT32_MAX + 2 and snap.nonzero_counts == 3
    assert snap.route_selections == 0 and snap.clock == 0 and not snap.dirty


def test_ranked_counts_order(tmp_path: Path) -> None:
    ledger = loaded(tmp_path, "3 5 2\n1 4 9\n3 0 9\n1 0 2\n1 6 2\n", layers=(3, 1))
    assert ledger.ranked_counts() == [
        ExpertUsageCount(1, 4, 9),
        ExpertUsageCount(3, 0, 9),
        ExpertUsageCount(1, 0, 2),
        ExpertUsageCount(1, 6, 2),
        ExpertUsageCount(3, 5, 2),
    ]


def test_decay_heat_halves_heat_only(tmp_path: Path) -> None:
    ledger = make(tmp_path / "u")
    ledger.record_routes(0, [[1, 1, 1, 1, 1], [2, 3, 3]])
    ledger._force_entry(1, 7, heat=UINT32_MAX, last_access=3)
    ledger.flush()
    ledger.decay_heat()
    assert ledger.entry(0, 1) == ExpertUsageEntry(count=5, heat=2, last_access=5)
    assert ledger.entry(0, 2) == ExpertUsageEntry(count=1, heat=0, last_access=6)
    assert ledger.entry(0, 3) == ExpertUsageEntry(count=2, heat=1, last_access=8)
    assert ledger.entry(1, 7).heat == UINT32_MAX >> 1
    assert not ledger.snapshot().dirty  # heat is session state: nothing to persist


# ---------------------------------------------------------------- the .coli_usage file


def test_flush_writes_the_exact_colibri_format(tmp_path: Path) -> None:
    path = tmp_path / "u"
    ledger = make(path, layers=(3, 1), experts=8)
    ledger.record_routes(1, [[7, 0], [7, 7]])
    ledger.record_routes(3, [[5, 1]])
    ledger.flush()
    assert path.read_bytes() == b"3 1 1\n3 5 1\n1 0 1\n1 7 3\n"
    assert not ledger.snapshot().dirty
    assert temp_files(tmp_path) == []


def test_round_trip_through_flush_and_open(tmp_path: Path) -> None:
    path = tmp_path / "u"
    ledger = make(path, experts=16)
    ledger.record_routes(0, np.random.default_rng(7).integers(0, 16, size=(200, 4)))
    ledger.record_routes(1, [[15, 15, 0]])
    ledger.flush()
    again = make(path, experts=16)
    assert again.ranked_counts() == ledger.ranked_counts()
    assert again.snapshot() == ExpertUsageSnapshot(0, 0, 803, ledger.snapshot().nonzero_counts, False)
    assert again.entry(0, 3).heat == 0  # heat and recency are not persisted
    mtime = path.stat().st_mtime_ns
    again.flush()  # not dirty: the file is left alone
    assert path.stat().st_mtime_ns == mtime


@pytest.mark.parametrize("umask", [0o022, 0o000, 0o077])
def test_flush_creates_the_file_with_mode_0600(tmp_path: Path, umask: int) -> None:
    previous = os.umask(umask)
    try:
        ledger = make(tmp_path / "u")
        ledger.record_routes(0, [[1]])
        ledger.flush()
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "u").stat().st_mode) == 0o600


def test_flush_replaces_an_existing_file_with_mode_0600(tmp_path: Path) -> None:
    path = tmp_path / "u"
    path.write_text("0 1 1\n")
    path.chmod(0o644)
    ledger = make(path)
    ledger.record_routes(0, [[2]])
    ledger.flush()
    assert path.read_text() == "0 1 1\n0 2 1\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", {}),
        ("\n\n  \n", {}),
        ("0 1 5", {(0, 1): 5}),  # no trailing newline
        ("0 1 5\r\n1 2 3\r\n", {(0, 1): 5, (1, 2): 3}),
        ("\t0\t 1  5 \n\n   1 2 3\n", {(0, 1): 5, (1, 2): 3}),
        ("0\u00a01\u30005\n", {(0, 1): 5}),  # JavaScript \s includes NBSP and ideographic space
        ("\ufeff0 1 5\n", {(0, 1): 5}),  # ... and U+FEFF, which JS trim() strips
        ("+0 007 +5\n", {(0, 7): 5}),
        ("-0 -0 -0\n0 0 0\n", {}),
        ("0 1 5\n0 1 6\n", {(0, 1): 11}),
        (f"0 1 {UINT32_MAX}\n0 1 {UINT32_MAX}\n", {(0, 1): UINT32_MAX}),
    ],
)
def test_valid_profiles_load(tmp_path: Path, text: str, expected: dict) -> None:
    ledger = loaded(tmp_path, text)
    counts = {(c.layer, c.expert_id): c.count for c in ledger.ranked_counts()}
    assert counts == expected and not ledger.snapshot().dirty


@pytest.mark.parametrize(
    ("content", "line", "fragment"),
    [
        (b"0 1\n", 1, "expected layer expert count"),
        (b"0 1 2 3\n", 1, "expected layer expert count"),
        (b"0 1 2\n\n0 1 2 x\n", 3, "expected layer expert count"),
        (b"5 1 2\n", 1, "invalid layer '5'"),
        (b"x 1 2\n", 1, "invalid layer 'x'"),
        (b"1.0 1 2\n", 1, "invalid layer '1.0'"),
        (b"0 8 2\n", 1, "invalid expert '8'"),
        (b"0 -1 2\n", 1, "invalid expert '-1'"),
        (b"0 1_0 2\n", 1, "invalid expert '1_0'"),
        (b"0 1 -1\n", 1, "invalid count '-1'"),
        (b"0 1 4294967296\n", 1, "invalid count '4294967296'"),
        (b"0 1 2.5\n", 1, "invalid count '2.5'"),
        (b"0 1 1e3\n", 1, "invalid count '1e3'"),
        (b"0 1 0x10\n", 1, "invalid count '0x10'"),
        ("0 1 \u0665\n".encode(), 1, "invalid count"),  # a non-ASCII digit
        (b"0 1 2\n1 2 \xff\n", 2, "not valid UTF-8"),
        (b"\xfe\xff\n", 1, "not valid UTF-8"),
        (b"0 1 2\n0 3 4\n1 0 nope\n", 3, "invalid count 'nope'"),
        (b"0\x1c1 5\n", 1, "expected layer expert count"),  # \x1c: whitespace to Python, not to JS
        ("0 1\u0085 5\n".encode(), 1, "invalid expert"),  # likewise U+0085
    ],
)
def test_damaged_profiles_are_reported_and_ignored(tmp_path: Path, content: bytes, line: int, fragment: str) -> None:
    path = tmp_path / "u"
    path.write_bytes(content)
    warnings: list[str] = []
    ledger = make(path, on_warning=warnings.append)
    assert len(warnings) == 1
    assert str(path) in warnings[0] and f"line {line}:" in warnings[0] and fragment in warnings[0]
    assert ledger.snapshot() == ExpertUsageSnapshot(0, 0, 0, 0, False)  # earlier valid rows discarded too
    ledger.flush()  # not dirty: the damaged file is left for inspection
    assert path.read_bytes() == content
    ledger.record_routes(1, [[2]])
    ledger.flush()  # the next real flush replaces it
    assert path.read_bytes() == b"1 2 1\n"


def test_damaged_profile_without_callback_is_logged(tmp_path: Path, caplog) -> None:
    path = tmp_path / "u"
    path.write_text("0 1 2\n0 1\n")
    with caplog.at_level(logging.WARNING, logger="coordinator.usage"):
        ledger = make(path)
    assert ledger.snapshot().total_count == 0
    assert any(str(path) in record.getMessage() and "line 2" in record.getMessage() for record in caplog.records)


def test_unreadable_profile_is_reported_and_ignored(tmp_path: Path) -> None:
    (tmp_path / "u").mkdir()
    warnings: list[str] = []
    ledger = make(tmp_path / "u", on_warning=warnings.append)
    assert len(warnings) == 1 and str(tmp_path / "u") in warnings[0]
    assert ledger.snapshot().total_count == 0


# ---------------------------------------------------------------- atomic flush


def dirty_ledger_over_old_file(tmp_path: Path) -> tuple[ExpertUsageLedger, Path]:
    path = tmp_path / "u"
    path.write_text("0 1 1\n")
    ledger = make(path)
    ledger.record_routes(0, [[2, 3]] * 50)
    return ledger, path


@pytest.mark.parametrize("stage", ["open", "write", "fsync", "replace"])
def test_failed_flush_keeps_the_old_file_and_leaves_no_temp_file(tmp_path: Path, monkeypatch, stage: str) -> None:
    ledger, path = dirty_ledger_over_old_file(tmp_path)
    real_write = os.write

    def crash_mid_write(fd: int, data) -> int:
        real_write(fd, bytes(data[:7]))  # part of the payload reaches the temp file
        raise OSError(28, "No space left on device")

    def fail(*args, **kwargs):
        raise OSError(5, f"injected {stage} failure")

    monkeypatch.setattr(os, stage, crash_mid_write if stage == "write" else fail)
    with pytest.raises(OSError):
        ledger.flush()
    monkeypatch.undo()
    assert path.read_text() == "0 1 1\n"
    assert temp_files(tmp_path) == []
    assert ledger.snapshot().dirty  # nothing was persisted, so a later flush retries
    ledger.flush()
    assert path.read_text() == "0 1 1\n0 2 50\n0 3 50\n"


def test_interrupted_flush_cleans_up_too(tmp_path: Path, monkeypatch) -> None:
    ledger, path = dirty_ledger_over_old_file(tmp_path)

    def interrupt(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", interrupt)
    with pytest.raises(KeyboardInterrupt):
        ledger.flush()
    assert path.read_text() == "0 1 1\n" and temp_files(tmp_path) == []


def test_short_writes_are_completed(tmp_path: Path, monkeypatch) -> None:
    ledger, path = dirty_ledger_over_old_file(tmp_path)
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, bytes(data[:3])))
    ledger.flush()
    assert path.read_text() == "0 1 1\n0 2 50\n0 3 50\n"


def test_write_without_progress_fails_cleanly(tmp_path: Path, monkeypatch) -> None:
    ledger, path = dirty_ledger_over_old_file(tmp_path)
    monkeypatch.setattr(os, "write", lambda fd, data: 0)
    with pytest.raises(OSError, match="no progress"):
        ledger.flush()
    assert path.read_text() == "0 1 1\n" and temp_files(tmp_path) == []


def test_flush_uses_a_same_directory_temp_file_and_fsyncs_file_and_directory(tmp_path: Path, monkeypatch) -> None:
    ledger, path = dirty_ledger_over_old_file(tmp_path)
    opened: list[tuple[str, int]] = []
    synced: list[str] = []
    real_open, real_fsync = os.open, os.fsync

    def spy_open(name, flags, *args, **kwargs):
        opened.append((os.fspath(name), flags))
        return real_open(name, flags, *args, **kwargs)

    def spy_fsync(fd: int) -> None:
        synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(os, "open", spy_open)
    monkeypatch.setattr(os, "fsync", spy_fsync)
    ledger.flush()
    temp, flags = opened[0]
    assert temp.startswith(f"{path}.tmp-{os.getpid()}-")
    assert flags & os.O_EXCL and flags & os.O_CREAT
    assert synced == ["file", "dir"]
    assert opened[1][0] == str(tmp_path)


def test_directory_fsync_unsupported_is_tolerated(tmp_path: Path, monkeypatch) -> None:
    ledger, path = dirty_ledger_over_old_file(tmp_path)
    real_fsync = os.fsync

    def no_dir_fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(22, "Invalid argument")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", no_dir_fsync)
    ledger.flush()
    assert path.read_text() == "0 1 1\n0 2 50\n0 3 50\n" and not ledger.snapshot().dirty


def test_flush_into_a_missing_directory_raises(tmp_path: Path) -> None:
    ledger = make(tmp_path / "missing" / "u")
    ledger.record_routes(0, [[1]])
    with pytest.raises(FileNotFoundError):
        ledger.flush()
    assert ledger.snapshot().dirty


def test_a_hard_crash_mid_flush_leaves_the_old_profile_intact(tmp_path: Path) -> None:
    path = tmp_path / "u"
    path.write_text("0 1 1\n")
    child = textwrap.dedent(
        f"""
        import os
        from coordinator.usage import ExpertUsageLedger
        ledger = ExpertUsageLedger.open({str(path)!r}, layers=[0, 1], experts_per_layer=8)
        ledger.record_routes(0, [[2, 3]])
        os.fsync = lambda fd: os._exit(3)  # the process dies between write and rename
        ledger.flush()
        """
    )
    env = {**os.environ, "PYTHONPATH": str(Path(usage.__file__).resolve().parents[1])}
    result = subprocess.run([sys.executable, "-c", child], env=env, timeout=60, capture_output=True)
    assert result.returncode == 3, result.stderr
    assert path.read_text() == "0 1 1\n"
    assert len(temp_files(tmp_path)) == 1  # a real crash cannot clean up; the stray temp is harmless
    assert make(path).ranked_counts() == [ExpertUsageCount(0, 1, 1)]


# ---------------------------------------------------------------- LFRU


def test_expert_lfru_score() -> None:
    assert expert_lfru_score(0, 10, 10) == 255
    assert expert_lfru_score(3, 10, 11) == 3 * 256 + 254
    assert expert_lfru_score(3, 0, 254) == 3 * 256 + 1
    assert expert_lfru_score(3, 0, 255) == 3 * 256
    assert expert_lfru_score(3, 0, 10**6) == 3 * 256
    assert expert_lfru_score(UINT32_MAX, 0, 0) == UINT32_MAX * 256 + 255


def test_expert_lfru_score_age_wraps_at_2_pow_32() -> None:
    assert expert_lfru_score(1, UINT32_MAX, 0) == 256 + 254  # one tick across the wrap
    assert expert_lfru_score(1, UINT32_MAX - 253, 0) == 256 + 1
    assert expert_lfru_score(1, UINT32_MAX - 254, 0) == 256
    assert expert_lfru_score(0, 5, 4) == 0  # last access "after" the clock: age 2**32 - 1


@pytest.mark.parametrize(
    ("args", "error"),
    [((1.0, 0, 0), TypeError), ((0, True, 0), TypeError), ((0, 0, None), TypeError), ((-1, 0, 0), ValueError)],
)
def test_expert_lfru_score_validates(args, error) -> None:
    with pytest.raises(error):
        expert_lfru_score(*args)


def test_lfru_hysteresis_boundary_from_real_routes(tmp_path: Path) -> None:
    # Expert 1 gets heat 4, then ages while pinned expert 2 is selected: at age 255 its score is
    # exactly the threshold for a cold score of 0 (0 + 0 + 4*256), so no repin; at age 254 it is one above.
    for age, expected in [(255, None), (254, ExpertLfruCandidate(0, 0, 0, 1, 0, 1025, 4))]:
        ledger = make(tmp_path / f"u{age}", experts=4)
        ledger.record_routes(0, [[1]] * 4)
        ledger.record_routes(0, np.full((age, 1), 2))
        assert ledger.lfru_candidate(0, [0, 2]) == expected


def test_lfru_hysteresis_boundary_with_a_warm_cold_pin(tmp_path: Path) -> None:
    ledger = make(tmp_path / "u", experts=4)
    ledger._force_clock(1000)
    ledger._force_entry(0, 2, heat=40, last_access=0)  # cold pin: 40 * 256 = 10240
    threshold = 10240 + 10240 // 4 + 4 * 256  # 13824 == 54 * 256
    ledger._force_entry(0, 1, heat=54, last_access=0)
    assert ledger.lfru_candidate(0, [2]) is None  # exactly at the threshold
    ledger._force_entry(0, 1, heat=54, last_access=1000 - 254)
    assert ledger.lfru_candidate(0, [2]) == ExpertLfruCandidate(
        layer=0,
        cold_slot=0,
        cold_expert_id=2,
        hot_expert_id=1,
        cold_score=10240,
        hot_score=threshold + 1,
        gain=(threshold + 1 - 10240) // 256,
    )


def test_lfru_ties_first_cold_slot_and_lowest_hot_id_win(tmp_path: Path) -> None:
    ledger = make(tmp_path / "u", experts=8)
    ledger._force_clock(10_000)
    for expert in (2, 6):
        ledger._force_entry(0, expert, heat=100, last_access=0)
    for expert in (5, 3, 1):
        ledger._force_entry(0, expert, heat=7, last_access=0)
    candidate = ledger.lfru_candidate(0, [5, 3, 1, 3])  # duplicates are allowed, as in the seed
    assert candidate is not None
    assert (candidate.cold_slot, candidate.cold_expert_id, candidate.hot_expert_id) == (0, 5, 2)
    assert candidate.gain == (100 - 7) * 256 // 256


def test_lfru_candidate_none_cases(tmp_path: Path) -> None:
    ledger = make(tmp_path / "u", experts=3)
    ledger.record_routes(0, [[1]] * 50)
    assert ledger.lfru_candidate(0, []) is None
    assert ledger.lfru_candidate(0, np.array([], dtype=np.int64)) is None
    assert ledger.lfru_candidate(77, []) is None  # as in the seed: empty pins short-circuit validation
    assert ledger.lfru_candidate(0, [0, 1, 2]) is None  # nothing unpinned
    assert ledger.lfru_candidate(0, [1]) is None  # the pin is the hottest
    assert ledger.lfru_candidate(0, np.array([0])) == ExpertLfruCandidate(
        0, 0, 0, 1, 205, 50 * 256 + 255, 50
    )  # never-used 0 is 50 ticks "old"


@pytest.mark.parametrize(
    ("layer", "pinned", "error"),
    [
        (5, [1], ValueError),
        (0, [1, 3], ValueError),
        (0, [-1], ValueError),
        (0, [1.0], TypeError),
        (0, "01", TypeError),
        (0, None, TypeError),
        (None, [1], TypeError),
    ],
)
def test_lfru_candidate_validates(tmp_path: Path, layer, pinned, error) -> None:
    ledger = make(tmp_path / "u", experts=3)
    ledger.record_routes(0, [[1, 2]])
    before = state(ledger)
    with pytest.raises(error):
        ledger.lfru_candidate(layer, pinned)
    assert state(ledger) == before


def candidate(layer: int, hot: int, gain: int) -> ExpertLfruCandidate:
    return ExpertLfruCandidate(layer, 0, 0, hot, 0, gain * 256, gain)


def test_select_expert_lfru_candidates_orders_and_limits() -> None:
    items = [
        candidate(2, 5, 3),
        candidate(1, 9, 7),
        candidate(0, 4, 3),
        candidate(2, 1, 3),
        candidate(0, 2, 1),
        candidate(3, 0, 9),
    ]
    original = list(items)
    assert select_expert_lfru_candidates(items) == [items[5], items[1], items[2], items[3]]
    assert select_expert_lfru_candidates(items, limit=100) == [
        items[5],
        items[1],
        items[2],
        items[3],
        items[0],
        items[4],
    ]
    assert select_expert_lfru_candidates(items, limit=np.int64(1)) == [items[5]]
    assert select_expert_lfru_candidates([]) == []
    assert items == original


@pytest.mark.parametrize(
    ("limit", "error"),
    [(0, ValueError), (-2, ValueError), (2**53, ValueError), (1.5, TypeError), (True, TypeError), ("4", TypeError)],
)
def test_select_expert_lfru_candidates_validates_limit(limit, error) -> None:
    with pytest.raises(error, match=repr(limit) if error is TypeError else str(limit)):
        select_expert_lfru_candidates([candidate(0, 1, 1)], limit=limit)


# ---------------------------------------------------------------- auto-pin planning


MB = 1_000_000


def history(tmp_path: Path, counts: dict[tuple[int, int], int]) -> ExpertUsageLedger:
    return loaded(tmp_path, "".join(f"{layer} {e} {c}\n" for (layer, e), c in counts.items()))


def test_auto_pins_need_enough_history(tmp_path: Path) -> None:
    ledger = history(tmp_path, {(0, 1): 4999})
    plan = plan_expert_auto_pins(
        ledger=ledger, resident_tier_budget_bytes=100_000 * MB, mandatory_resident_bytes=0, slot_bytes=lambda layer: MB
    )
    assert plan.pins == () and plan.planned_bytes == 0 and plan.history_selections == 4999
    assert plan.confidence == 4999 / 200_000
    assert plan.requested_budget_bytes == int(100_000 * MB * 0.5 * (4999 / 200_000))
    plan = plan_expert_auto_pins(
        ledger=ledger,
        resident_tier_budget_bytes=100_000 * MB,
        mandatory_resident_bytes=0,
        slot_bytes=lambda layer: MB,
        min_history_selections=4999,
    )
    assert plan.pins == (ExpertUsageCount(0, 1, 4999),) and plan.planned_bytes == MB


def test_auto_pins_need_a_minimum_pin_budget(tmp_path: Path) -> None:
    ledger = history(tmp_path, {(0, 1): 200_000})
    at_minimum = plan_expert_auto_pins(
        ledger=ledger, resident_tier_budget_bytes=1000 * MB, mandatory_resident_bytes=0, slot_bytes=lambda layer: MB
    )
    assert at_minimum.requested_budget_bytes == 500 * MB and len(at_minimum.pins) == 1
    below = plan_expert_auto_pins(
        ledger=ledger, resident_tier_budget_bytes=1000 * MB - 2, mandatory_resident_bytes=0, slot_bytes=lambda layer: MB
    )
    assert below.requested_budget_bytes == 500 * MB - 1 and below.pins == () and below.planned_bytes == 0


def test_auto_pin_confidence_ramps_and_caps(tmp_path: Path) -> None:
    for total, confidence in [(50_000, 0.25), (100_000, 0.5), (200_000, 1.0), (900_000, 1.0)]:
        ledger = history(tmp_path, {(0, 0): total // 2, (1, 3): total - total // 2})
        plan = plan_expert_auto_pins(
            ledger=ledger,
            resident_tier_budget_bytes=16_000 * MB,
            mandatory_resident_bytes=0,
            slot_bytes=lambda layer: 10 * MB,
        )
        assert plan.confidence == confidence and isinstance(plan.confidence, float)
        assert plan.requested_budget_bytes == int(16_000 * MB * 0.5 * confidence)
        assert plan.usable_budget_bytes == plan.requested_budget_bytes


def test_auto_pins_are_greedy_and_skip_what_does_not_fit(tmp_path: Path) -> None:
    ledger = history(tmp_path, {(0, 0): 90_000, (1, 0): 80_000, (0, 1): 70_000, (1, 1): 60_000, (1, 2): 50_000})
    sizes = {0: 300 * MB, 1: 150 * MB}
    plan = plan_expert_auto_pins(
        ledger=ledger, resident_tier_budget_bytes=1200 * MB, mandatory_resident_bytes=0, slot_bytes=sizes.__getitem__
    )
    # usable 600 MB: 300 (0,0) + 150 (1,0) = 450; (0,1) would make 750: skipped; (1,1) fits: 600; (1,2) not.
    assert plan.usable_budget_bytes == 600 * MB
    assert [(p.layer, p.expert_id) for p in plan.pins] == [(0, 0), (1, 0), (1, 1)]
    assert plan.planned_bytes == 600 * MB and isinstance(plan, ExpertAutoPinPlan)


def test_auto_pin_budget_is_capped_by_mandatory_bytes(tmp_path: Path) -> None:
    ledger = history(tmp_path, {(0, e): 100_000 for e in range(8)})
    plan = plan_expert_auto_pins(
        ledger=ledger,
        resident_tier_budget_bytes=2000 * MB,
        mandatory_resident_bytes=1700 * MB,
        slot_bytes=lambda layer: 100 * MB,
    )
    assert plan.requested_budget_bytes == 1000 * MB and plan.usable_budget_bytes == 300 * MB
    assert len(plan.pins) == 3 and plan.planned_bytes == 300 * MB
    none_left = plan_expert_auto_pins(
        ledger=ledger,
        resident_tier_budget_bytes=2000 * MB,
        mandatory_resident_bytes=3000 * MB,
        slot_bytes=lambda layer: 100 * MB,
    )
    assert none_left.usable_budget_bytes == 0 and none_left.pins == ()


def test_auto_pin_custom_share_and_history_sum_is_unsaturated(tmp_path: Path) -> None:
    ledger = history(tmp_path, {(0, 0): UINT32_MAX, (0, 1): UINT32_MAX})
    plan = plan_expert_auto_pins(
        ledger=ledger,
        resident_tier_budget_bytes=4000 * MB,
        mandatory_resident_bytes=0,
        slot_bytes=lambda layer: MB,
        pin_share=1,
        min_pin_budget_bytes=0,
    )
    assert plan.history_selections == 2 * UINT32_MAX and plan.requested_budget_bytes == 4000 * MB


@pytest.mark.parametrize(
    ("slot_bytes", "error", "fragment"),
    [
        (lambda layer: 0, ValueError, "slot_bytes(0)"),
        (lambda layer: -5, ValueError, "-5"),
        (lambda layer: 4096.0, TypeError, "4096.0"),
        (lambda layer: True, TypeError, "True"),
        (lambda layer: None, TypeError, "None"),
        (4096, TypeError, "4096"),
    ],
)
def test_auto_pin_rejects_bad_slot_bytes(tmp_path: Path, slot_bytes, error, fragment) -> None:
    ledger = history(tmp_path, {(0, 0): 300_000})
    with pytest.raises(error) as raised:
        plan_expert_auto_pins(
            ledger=ledger, resident_tier_budget_bytes=2000 * MB, mandatory_resident_bytes=0, slot_bytes=slot_bytes
        )
    assert fragment in str(raised.value)


def test_auto_pin_slot_bytes_is_only_consulted_when_pinning(tmp_path: Path) -> None:
    ledger = history(tmp_path, {(0, 0): 10})  # below min history: as in the seed, slot_bytes is never called
    plan = plan_expert_auto_pins(
        ledger=ledger, resident_tier_budget_bytes=2000 * MB, mandatory_resident_bytes=0, slot_bytes=lambda layer: 0
    )
    assert plan.pins == ()


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        ({"ledger": None}, TypeError),
        ({"resident_tier_budget_bytes": -1}, ValueError),
        ({"resident_tier_budget_bytes": 1.5e9}, TypeError),
        ({"mandatory_resident_bytes": -1}, ValueError),
        ({"mandatory_resident_bytes": 2**53}, ValueError),
        ({"min_history_selections": 0}, ValueError),
        ({"full_confidence_selections": 0}, ValueError),
        ({"full_confidence_selections": 2.0}, TypeError),
        ({"pin_share": 0}, ValueError),
        ({"pin_share": 1.01}, ValueError),
        ({"pin_share": float("nan")}, ValueError),
        ({"pin_share": float("inf")}, ValueError),
        ({"pin_share": True}, TypeError),
        ({"pin_share": "0.5"}, TypeError),
        ({"min_pin_budget_bytes": -1}, ValueError),
        ({"min_pin_budget_bytes": None}, TypeError),
    ],
)
def test_auto_pin_validates_arguments(tmp_path: Path, overrides: dict, error: type) -> None:
    ledger = history(tmp_path, {(0, 0): 300_000})
    before = state(ledger)
    kwargs = {
        "ledger": ledger,
        "resident_tier_budget_bytes": 2000 * MB,
        "mandatory_resident_bytes": 0,
        "slot_bytes": lambda layer: MB,
        **overrides,
    }
    with pytest.raises(error):
        plan_expert_auto_pins(**kwargs)
    assert state(ledger) == before


# ---------------------------------------------------------------- properties against the reference


START_CLOCKS = st.one_of(st.sampled_from([0, 1, UINT32_MAX - 3, UINT32_MAX]), st.integers(0, UINT32_MAX))


@st.composite
def scenarios(draw):
    experts = draw(st.integers(1, 6))
    layers = draw(st.lists(st.integers(0, 9), min_size=1, max_size=3, unique=True))
    batches = []
    for _ in range(draw(st.integers(0, 6))):
        layer = draw(st.sampled_from(layers))
        width = draw(st.integers(0, 4))
        rows = draw(st.lists(st.lists(st.integers(0, experts - 1), min_size=width, max_size=width), max_size=8))
        as_array = draw(st.sampled_from([None, np.int64, np.uint8, np.int16]))
        pinned = draw(st.lists(st.integers(0, experts - 1), max_size=4))
        decay = draw(st.booleans())
        batches.append((layer, width, rows, as_array, pinned, decay))
    preload = draw(
        st.dictionaries(
            st.tuples(st.sampled_from(layers), st.integers(0, experts - 1)),
            st.one_of(st.integers(1, 50), st.integers(UINT32_MAX - 40, UINT32_MAX)),
        )
    )
    # Session state set directly (heat, age at start) so LFRU proposals and ties are common.
    forced = draw(
        st.dictionaries(
            st.tuples(st.sampled_from(layers), st.integers(0, experts - 1)),
            st.tuples(st.integers(0, 12), st.integers(0, 300)),
        )
    )
    return experts, layers, draw(START_CLOCKS), preload, forced, batches


@PROPERTY
@given(scenarios())
def test_ledger_matches_the_reference_model(scenario) -> None:
    import tempfile

    experts, layers, clock, preload, forced, batches = scenario
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "u"
        path.write_text("".join(f"{layer} {e} {c}\n" for (layer, e), c in preload.items()))
        ledger = make(path, layers, experts)
        reference = Reference(layers, experts, clock)
        reference.counts.update(preload)
        ledger._force_clock(clock)
        for (layer, e), (heat, age) in forced.items():
            reference.heat[layer, e], reference.last[layer, e] = heat, (clock - age) % 2**32
            ledger._force_entry(layer, e, heat=heat, last_access=reference.last[layer, e])
        for layer, width, rows, as_array, pinned, decay in batches:
            routes = np.array(rows, dtype=as_array).reshape(len(rows), width) if as_array else rows
            ledger.record_routes(layer, routes)
            reference.record(layer, rows)
            assert ledger.lfru_candidate(layer, pinned) == reference.lfru(layer, pinned)
            if decay:
                ledger.decay_heat()
                reference.decay()
        for (layer, e), count in reference.counts.items():
            assert ledger.entry(layer, e) == ExpertUsageEntry(count, reference.heat[layer, e], reference.last[layer, e])
        snap = ledger.snapshot()
        assert snap.clock == (clock + reference.selections) % 2**32 == reference.clock
        assert snap.route_selections == reference.selections
        assert snap.total_count == sum(reference.counts.values())
        assert snap.dirty == (reference.selections > 0)
        ledger.flush()
        again = make(path, layers, experts)
        expected = sorted(((-c, layer, e) for (layer, e), c in reference.counts.items() if c))
        assert [(-c.count, c.layer, c.expert_id) for c in again.ranked_counts()] == expected


@PROPERTY
@given(st.integers(0, UINT32_MAX), st.integers(0, UINT32_MAX), st.integers(0, UINT32_MAX))
def test_vectorised_scores_match_expert_lfru_score(heat: int, last: int, clock: int) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        ledger = make(Path(directory) / "u", layers=(0,), experts=2)
        ledger._force_clock(clock)
        ledger._force_entry(0, 1, heat=heat, last_access=last)
        assert int(ledger._scores(0)[1]) == expert_lfru_score(heat, last, clock)
        age = (clock - last) % 2**32
        assert expert_lfru_score(heat, last, clock) == heat * 256 + max(0, 255 - age)
