"""scripts/replay.py and its instruments: the LRU and Belady baselines, pin choice, the real manager, the CLI."""

from __future__ import annotations

import gzip
import importlib.util
import json
import subprocess
import sys
from itertools import combinations
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from instruments.cache_policies import next_uses, simulate_belady, simulate_lru, unique_rows
from instruments.replay_pins import choose_pins, plan_auto_pins, read_usage_counts
from instruments.residency_replay import Capacity, replay
from shared.config import DEFAULT_REPLACEMENT
from shared.trace import generate_trace, parse_trace, write_trace

REPO = Path(__file__).resolve().parents[1]


def brute_force_optimum(rows, capacity, initial=()):
    """Most hits of any demand-fetch schedule: after a visit keep any subset of
    (cache + requested) of at most `capacity` experts; exhaustive over states."""
    states = {frozenset(initial): 0}
    for row in rows:
        wanted = set(row)
        following: dict[frozenset, int] = {}
        for cache, score in states.items():
            gained = score + len(wanted & cache)
            pool = sorted(cache | wanted)
            for size in range(min(capacity, len(pool)) + 1):
                for kept in combinations(pool, size):
                    key = frozenset(kept)
                    if following.get(key, -1) < gained:
                        following[key] = gained
        states = following
    return max(states.values())


def test_lru_hand_worked_example():
    # capacity 2, one expert per visit: a b a c b a
    #   a miss [a]; b miss [a b]; a hit [b a]; c miss, evict b [a c];
    #   b miss, evict a [c b]; a miss, evict c [b a]
    assert simulate_lru([[1], [2], [1], [3], [2], [1]], capacity=2) == [0, 0, 1, 0, 0, 0]
    # visits of two: hits are judged before the visit; hits then misses become most recent
    #   [1 2] -> cache 1 2; [2 3]: hit 2, 3 evicts 1 -> 2 3; [1 2]: hit 2, 1 evicts 3 -> 2 1
    assert simulate_lru([[1, 2], [2, 3], [1, 2]], capacity=2) == [0, 1, 1]
    # the LRU victim is requested in the same visit: still a hit, nothing reloaded
    assert simulate_lru([[1], [2], [3, 1]], capacity=2) == [0, 0, 1]
    # initial (pinned) experts start resident, oldest first
    assert simulate_lru([[5], [6], [7], [5]], capacity=2, initial=[5]) == [1, 0, 0, 0]
    # more unique experts than capacity: keep the last `capacity` of hits-then-misses
    assert simulate_lru([[1, 2, 3], [1, 3], [2]], capacity=2) == [0, 1, 0]


def test_next_uses_backward_pass():
    following, first = next_uses([[1, 2], [2], [3, 1], [2]])
    assert following == [[2, 1], [3], [4, 4], [4]]
    assert first == {1: 0, 2: 0, 3: 2}


def test_belady_hand_worked_example():
    # capacity 2: a b c a b — MIN keeps a, b at c (c never used again)
    assert simulate_belady([[1], [2], [3], [1], [2]], capacity=2) == [0, 0, 0, 1, 1]
    # the visit's own expert may be dropped: with capacity 1, [a] [b] [a] keeps a
    assert simulate_belady([[1], [2], [1]], capacity=1) == [0, 0, 1]


visits = st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=3, unique=True), min_size=1, max_size=9)


@settings(max_examples=250, deadline=None)
@given(rows=visits, capacity=st.integers(1, 3), data=st.data())
def test_belady_equals_brute_force_and_bounds_lru(rows, capacity, data):
    initial = data.draw(st.lists(st.integers(0, 6), max_size=capacity, unique=True))
    best = brute_force_optimum(rows, capacity, initial)
    belady = sum(simulate_belady(rows, capacity=capacity, initial=initial))
    lru = sum(simulate_lru(rows, capacity=capacity, initial=initial))
    assert belady == best
    assert lru <= belady


def test_belady_is_fast_enough_for_big_traces():
    rows = unique_rows(
        generate_trace(layers=1, experts=128, top_k=8, tokens=20000, overlap=0.4, seed=0).experts.tolist()
    )
    belady = sum(simulate_belady(rows, capacity=16))
    assert sum(simulate_lru(rows, capacity=16)) <= belady <= sum(map(len, rows))


def test_choose_pins_from_trace_and_from_usage_file(tmp_path):
    trace = parse_trace(["0 0 1 2\n", "0 1 3 4\n", "1 0 1 5\n", "1 1 3 4\n", "2 0 1 2\n"])
    pins, source = choose_pins(trace, count=3, usage_file=None)
    # counts: (0,1) 3; (0,2) (1,3) (1,4) 2 each; (0,5) 1 — the tie goes to the smaller pair
    assert pins == ((0, 1), (0, 2), (1, 3)) and "oracle" in source
    usage = tmp_path / "usage"
    usage.write_text("0 5 100\n1 4 7\n0 2 7\n1 3 0\n")
    pins, source = choose_pins(trace, count=2, usage_file=str(usage))
    assert pins == ((0, 2), (0, 5)) and "usage file" in source  # tie -> smaller pair
    with pytest.raises(ValueError, match="only 3 candidate"):
        choose_pins(trace, count=4, usage_file=str(usage))
    # The file is read by the real ledger; what it would ignore is an error here.
    usage.write_text("0 5 100\n9 1 1000\n")
    with pytest.raises(ValueError, match="line 2: invalid layer '9'"):
        choose_pins(trace, count=1, usage_file=str(usage))
    usage.write_text("0 5\n")
    with pytest.raises(ValueError, match="line 1: expected layer expert count"):
        read_usage_counts(usage, trace)
    usage.write_text("0 5 1\n0 x 1\n")
    with pytest.raises(ValueError, match="line 2: invalid expert 'x'"):
        read_usage_counts(usage, trace)


def test_auto_pins_share_the_resident_tier(tmp_path):
    trace = generate_trace(layers=2, experts=16, top_k=2, tokens=200, overlap=0.4, seed=3)
    usage = tmp_path / "usage"
    usage.write_text("".join(f"{layer} {e} {10000 - e}\n" for layer in (0, 1) for e in range(16)))
    pins, source = plan_auto_pins(trace, str(usage), slots_per_layer=4, slot_bytes=100, min_pin_budget=0)
    # history 319,760 selections >= full confidence: pins get half the 800-byte tier (4 slots),
    # capped by tier - mandatory (800 - 200): 4 pins, the highest counts first.
    assert pins == ((0, 0), (0, 1), (1, 0), (1, 1)), source
    assert "confidence 1.00" in source
    none, _ = plan_auto_pins(trace, str(usage), slots_per_layer=4, slot_bytes=100, min_pin_budget=10**9)
    assert none == ()


manager_required = pytest.mark.skipif(
    importlib.util.find_spec("coordinator.residency") is None, reason="coordinator.residency not available"
)


@manager_required
def test_ours_without_pins_is_plain_lru_when_a_visit_fits():
    trace = generate_trace(layers=3, experts=24, top_k=4, tokens=300, overlap=0.4, seed=11)
    for slots in (4, 6, 10):
        results = replay(trace, Capacity(slots_per_layer=slots, working_slots=4, pins=(), pins_source="none"))
        assert results["ours"].hits == results["lru"].hits
        assert results["ours"].extra["manager"]["hits"] == sum(results["ours"].hits.values())


@manager_required
@pytest.mark.parametrize("seed", range(6))
def test_ours_and_lru_never_beat_belady(seed):
    rng = np.random.default_rng(seed)
    top_k = int(rng.integers(2, 5))
    trace = generate_trace(
        layers=3,
        experts=int(rng.integers(2 * top_k, 20)),
        top_k=top_k,
        tokens=120,
        overlap=float(rng.random()),
        zipf=float(rng.random() * 2),
        seed=seed,
    )
    for slots in (1, 2, top_k, 2 * top_k):
        pins, source = choose_pins(trace, count=int(rng.integers(0, 5)), usage_file=None)
        results = replay(trace, Capacity(slots_per_layer=slots, working_slots=top_k + 1, pins=pins, pins_source=source))
        belady = results["belady"]
        for name in ("ours", "lru"):
            for layer, hits in results[name].hits.items():
                assert hits <= belady.hits[layer], (name, layer, slots, pins)
            assert results[name].all_resident <= belady.visits


@manager_required
def test_replay_handles_sparse_layer_ids_token_gaps_and_repeated_experts():
    trace = parse_trace(["# c\n", "3 7 1 2\n", "3 3 4 4\n", "9 3 4 5\n", "9 7 2 6\n", "12 7 2 1\n"])
    results = replay(trace, Capacity(slots_per_layer=2, working_slots=2, pins=(), pins_source="none"))
    # layer 7: [1 2] [2 6] [2 1] -> hits 0, 1 (2), 1 (2; 1 was evicted by 6); layer 3: [4] [4 5] -> 0, 1
    for name in ("ours", "lru", "belady"):
        assert results[name].lookups == {3: 3, 7: 6}
    assert results["ours"].hits == results["lru"].hits == {3: 1, 7: 2}
    assert results["belady"].hits == {3: 1, 7: 3}
    assert results["belady"].all_resident == 1 and results["ours"].all_resident == 0  # [2 1] at layer 7


@manager_required
def test_replay_refuses_a_working_bank_smaller_than_a_visit():
    trace = parse_trace(["0 0 1 2 3\n"])
    with pytest.raises(ValueError, match="--working-slots 2 < 3"):
        replay(trace, Capacity(slots_per_layer=4, working_slots=2, pins=(), pins_source="none"))


def run_cli(*args, timeout=120):
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "replay.py"), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
    )


@pytest.fixture
def small_trace(tmp_path):
    path = tmp_path / "small.txt"
    write_trace(path, generate_trace(layers=4, experts=32, top_k=4, tokens=250, overlap=0.4, seed=2))
    return path


@manager_required
@pytest.mark.parametrize("extra", [[], ["--pinned", "6"], ["--pinned", "3", "--usage-file", "USAGE"]])
def test_cli_json_end_to_end(small_trace, tmp_path, extra):
    usage = tmp_path / "usage"
    usage.write_text("0 1 50\n1 2 40\n2 3 30\n3 4 20\n")
    extra = [str(usage) if arg == "USAGE" else arg for arg in extra]
    done = run_cli(small_trace, "--slots-per-layer", 6, "--working-slots", 8, "--json", *extra)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert any(line.startswith("belady") for line in lines)
    report = json.loads(lines[-1])
    assert {"capacity", "ours", "lru", "belady"} <= set(report)
    assert report["capacity"]["slots_per_layer"] == 6 and report["capacity"]["working_slots"] == 8
    pinned = int(extra[1]) if extra else 0
    assert report["capacity"]["pinned"] == pinned
    assert sum(report["capacity"]["pinned_per_layer"].values()) == pinned
    for name in ("ours", "lru", "belady"):
        assert set(report[name]) >= {"hit_rate", "per_layer", "all_resident"}
        assert set(report[name]["per_layer"]) == {"0", "1", "2", "3"}
        assert 0.0 <= report[name]["hit_rate"] <= 1.0
    assert report["ours"]["hit_rate"] <= report["belady"]["hit_rate"]
    assert report["lru"]["hit_rate"] <= report["belady"]["hit_rate"]
    assert report["ours"]["all_resident"] <= report["belady"]["all_resident"] + 1e-12 or pinned


def test_cli_reports_bad_input(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("0 0 1 2\n0 0 1 2\n")
    done = run_cli(bad, "--slots-per-layer", 2)
    assert done.returncode == 2
    assert "bad.txt line 2: duplicate layer 0 for token 0" in done.stderr
    done = run_cli(bad, "--slots-per-layer", 2, "--usage-file", bad)
    assert done.returncode == 2 and "--pinned" in done.stderr


def test_cli_help_documents_the_format():
    done = run_cli("--help")
    assert done.returncode == 0
    assert "token layer e1" in done.stdout and "--slots-per-layer" in done.stdout and "Belady" in done.stdout


@manager_required
def test_cli_plot_writes_png(small_trace, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "sweep.png"
    done = run_cli(small_trace, "--slots-per-layer", 4, "--plot", out, "--sweep", "1,4,8", "--json")
    assert done.returncode == 0, done.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sweep = json.loads(done.stdout.strip().splitlines()[-1])["sweep"]
    assert sweep["slots_per_layer"] == [1, 4, 8]
    assert all(o <= b and lru <= b for o, lru, b in zip(sweep["ours"], sweep["lru"], sweep["belady"]))


# -- replacement policies, gzip traces, the sweep ------------------------------------------------


@manager_required
@pytest.mark.parametrize("seed", range(4))
def test_every_policy_stays_under_belady_and_lru_is_the_seed(seed):
    rng = np.random.default_rng(100 + seed)
    top_k = int(rng.integers(2, 5))
    trace = generate_trace(
        layers=2, experts=int(rng.integers(2 * top_k, 20)), top_k=top_k, tokens=150, zipf=1.0, seed=seed
    )
    for slots in (1, top_k, 2 * top_k):
        pins, source = choose_pins(trace, count=int(rng.integers(0, 4)), usage_file=None)
        capacity = Capacity(slots_per_layer=slots, working_slots=top_k, pins=pins, pins_source=source)
        results = replay(trace, capacity, replacements=["lrfu", "lru", "lrfu:2"])
        assert results["ours"] is results["ours:lrfu"]
        assert results["ours:lru"].extra["replacement"] == "lru"
        for name in ("ours:lrfu", "ours:lru", "ours:lrfu:2"):
            for layer, hits in results[name].hits.items():
                assert hits <= results["belady"].hits[layer], (name, layer, slots, pins)
        if not pins and slots >= top_k:  # the manager's LRU is the baseline's when a visit fits the layer
            assert results["ours:lru"].hits == results["lru"].hits


@manager_required
def test_cli_reads_gzip_and_sweeps_every_policy_named(small_trace, tmp_path):
    packed = tmp_path / "small.txt.gz"
    packed.write_bytes(gzip.compress(small_trace.read_bytes()))
    done = run_cli(packed, "--slots-per-layer", 4, "--replacement", "lrfu,lru", "--sweep", "2,4,8", "--json")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    report = json.loads(lines[-1])
    assert report["replacement"] == ["lrfu", "lru"]
    for name in ("ours", "lru", "belady"):
        assert 0.0 <= report[name]["hit_rate"] <= report["belady"]["hit_rate"]
    assert report["ours"] == report["policies"]["lrfu"] and report["ours"]["replacement"] == "lrfu"
    assert report["policies"]["lru"]["replacement"] == "lru"
    sweep = report["sweep"]
    assert sweep["slots_per_layer"] == [2, 4, 8] and set(sweep["policies"]) == {"lrfu", "lru"}
    assert sweep["ours"] == sweep["policies"]["lrfu"]
    for curve in (sweep["ours"], sweep["lru"], *sweep["policies"].values()):
        assert len(curve) == 3 and all(rate <= best for rate, best in zip(curve, sweep["belady"]))
    # the printed table: a header naming every curve and a row per capacity, in percent
    header = next(index for index, line in enumerate(lines) if line.split()[:1] == ["slots"])
    assert lines[header].split() == ["slots", "ours:lrfu", "ours:lru", "lru", "belady"]
    rows = [lines[header + i].split() for i in (1, 2, 3)]
    assert [row[0] for row in rows] == ["2", "4", "8"]
    assert float(rows[1][3]) == pytest.approx(100 * report["lru"]["hit_rate"], abs=0.01)
    # the plain file gives the same figures
    plain = run_cli(small_trace, "--slots-per-layer", 4, "--replacement", "lrfu,lru", "--json")
    assert json.loads(plain.stdout.strip().splitlines()[-1])["ours"] == report["ours"]


def test_cli_refuses_an_unknown_policy(small_trace):
    done = run_cli(small_trace, "--slots-per-layer", 2, "--replacement", "lru,mru")
    assert done.returncode == 2 and "unknown replacement policy 'mru'" in done.stderr
    done = run_cli(small_trace, "--slots-per-layer", 2, "--replacement", "lrfu:0")
    assert done.returncode == 2 and "positive integer" in done.stderr


def test_cli_defaults_to_the_system_policy(small_trace):
    done = run_cli(small_trace, "--slots-per-layer", 2, "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["replacement"] == [DEFAULT_REPLACEMENT]
