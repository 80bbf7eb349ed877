"""The routing-trace format (parser, writer) and the synthetic generator."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shared.trace import (
    Trace,
    TraceFormatError,
    generate_trace,
    measure_overlap,
    parse_trace,
    read_trace,
    write_trace,
)

REPO = Path(__file__).resolve().parents[1]


def parse(text: str) -> Trace:
    return parse_trace(io.StringIO(text), source="t.txt")


def test_parse_comments_blank_lines_any_layer_order_and_token_gaps():
    trace = parse("# header\n\n0 5 1 2\n0 3 2 7\n  # indented comment\n2 3 4 4\n2 5 0 1\n")
    assert trace.tokens.tolist() == [0, 0, 2, 2]
    assert trace.layers.tolist() == [5, 3, 3, 5]
    assert trace.experts.tolist() == [[1, 2], [2, 7], [4, 4], [0, 1]]
    assert trace.top_k == 2 and trace.num_tokens == 2 and trace.num_visits == 4
    assert trace.layer_ids == (3, 5) and trace.num_experts == 8
    assert trace.layer_rows()[3].tolist() == [[2, 7], [4, 4]]


def test_write_then_read_round_trips(tmp_path):
    trace = generate_trace(layers=3, experts=12, top_k=3, tokens=20, overlap=0.5, seed=4)
    path = tmp_path / "trace.txt"
    write_trace(path, trace, header=["made by a test", "second line"])
    text = path.read_text()
    assert text.startswith("# made by a test\n# second line\n")
    again = read_trace(path)
    for name in ("tokens", "layers", "experts"):
        assert np.array_equal(getattr(again, name), getattr(trace, name))


@pytest.mark.parametrize(
    ("text", "line", "fragment", "value"),
    [
        ("0 0 1 2\n0 1 1\n", 2, "expected 4 fields", "0 1 1"),
        ("0 0 1 2\n0 1 1 2 3\n", 2, "got 5", "0 1 1 2 3"),
        ("0 0\n", 1, "at least 3 fields", "0 0"),
        ("0 0 1 x\n", 1, "expert 2 'x' is not a non-negative integer", "x"),
        ("0 0 1 2\n1 0 1.5 2\n", 2, "expert 1 '1.5'", "1.5"),
        ("0 0 +1 2\n", 1, "'+1'", "+1"),
        ("0 0 1_0 2\n", 1, "'1_0'", "1_0"),
        ("0 0 1 -3\n", 1, "expert 2 '-3' is negative", "-3"),
        ("-1 0 1 2\n", 1, "token '-1' is negative", "-1"),
        ("0 q 1 2\n", 1, "layer 'q'", "q"),
        ("0 0 1 2 # note\n", 1, "comments must be whole lines", "#"),
        ("0 0 1\x0c2\n", 1, "separated by spaces or tabs", r"0 0 1\x0c2"),
        ("0 0 1 \u0663\n", 1, "expert 2 '\u0663' is not a non-negative integer", "\u0663"),
        ("0 0 1 2\n0 1 1 2\n0 0 3 4\n", 3, "duplicate layer 0 for token 0", "0"),
        ("0 0 1 2\n2 0 1 2\n1 0 1 2\n", 3, "token 1 is out of order", "1"),
        ("0 0 1 2\n1 0 1 2\n0 1 1 2\n", 3, "token 0 already ended, first seen on line 1", "0"),
    ],
)
def test_parse_errors_name_line_and_value(text, line, fragment, value):
    with pytest.raises(TraceFormatError) as caught:
        parse(text)
    message = str(caught.value)
    assert message.startswith(f"t.txt line {line}:"), message
    assert fragment in message
    assert caught.value.line == line
    assert value in message and caught.value.value is not None


def test_parse_refuses_a_trace_without_routing_lines():
    with pytest.raises(TraceFormatError, match="no routing lines"):
        parse("# only a comment\n\n")


def test_generator_is_deterministic_by_seed():
    params = dict(layers=4, experts=32, top_k=4, tokens=200, overlap=0.3, zipf=1.2)
    one, two = generate_trace(seed=7, **params), generate_trace(seed=7, **params)
    assert np.array_equal(one.experts, two.experts)
    assert not np.array_equal(one.experts, generate_trace(seed=8, **params).experts)


def test_generator_shape_distinct_rows_and_ranges():
    trace = generate_trace(layers=5, experts=20, top_k=6, tokens=50, overlap=0.5, seed=1)
    assert trace.num_visits == 250 and trace.top_k == 6 and trace.layer_ids == tuple(range(5))
    assert trace.tokens.tolist() == sorted(trace.tokens.tolist())
    assert trace.experts.min() >= 0 and trace.experts.max() < 20
    assert all(len(set(row)) == 6 for row in trace.experts.tolist())


@pytest.mark.parametrize(
    ("overlap", "top_k", "experts", "zipf"),
    [
        (0.0, 8, 64, 1.0),
        (0.1, 8, 64, 1.0),
        (0.4, 8, 128, 1.0),
        (0.4, 6, 16, 0.0),
        (0.55, 4, 10, 2.0),
        (0.75, 8, 32, 1.0),
        (0.93, 2, 5, 0.5),
        (1.0, 8, 16, 1.0),
    ],
)
def test_generator_hits_the_requested_overlap(overlap, top_k, experts, zipf):
    trace = generate_trace(layers=6, experts=experts, top_k=top_k, tokens=400, overlap=overlap, zipf=zipf, seed=3)
    assert abs(measure_overlap(trace) - overlap) <= 0.05


def test_each_visit_keeps_floor_or_ceil_of_the_requested_share():
    trace = generate_trace(layers=3, experts=40, top_k=8, tokens=100, overlap=0.4, seed=5)
    for rows in trace.layer_rows().values():
        kept = {len(set(a) & set(b)) for a, b in zip(rows[:-1].tolist(), rows[1:].tolist())}
        assert kept <= {3, 4}


def test_measure_overlap_by_hand():
    trace = parse("0 0 1 2\n0 1 5 6\n1 0 2 3\n1 1 5 6\n2 0 7 8\n")
    # layer 0: {1,2}->{2,3} is 1/2, {2,3}->{7,8} is 0; layer 1: {5,6}->{5,6} is 2/2
    assert measure_overlap(trace) == pytest.approx((1 + 0 + 2) / 6)


def test_zipf_skews_popularity():
    def top_share(zipf: float) -> float:
        trace = generate_trace(layers=1, experts=64, top_k=4, tokens=2000, overlap=0.0, zipf=zipf, seed=2)
        counts = np.bincount(trace.experts.ravel(), minlength=64)
        return np.sort(counts)[-8:].sum() / counts.sum()

    assert top_share(1.5) > top_share(0.0) + 0.2


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        (dict(experts=10, top_k=8, overlap=0.0), "at least 16 experts"),
        (dict(overlap=1.5), "overlap must be within"),
        (dict(zipf=-1.0), "zipf must be"),
        (dict(top_k=0), "top_k must be"),
        (dict(tokens=0), "tokens must be"),
    ],
)
def test_generator_refuses_impossible_parameters(params, fragment):
    with pytest.raises(ValueError, match=fragment):
        generate_trace(**params)


def test_make_trace_cli(tmp_path):
    out = tmp_path / "gen.txt"
    command = [
        sys.executable,
        str(REPO / "scripts" / "make_trace.py"),
        str(out),
        "--layers",
        "3",
        "--experts",
        "16",
        "--top-k",
        "4",
        "--tokens",
        "50",
        "--overlap",
        "0.5",
        "--seed",
        "9",
    ]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "measured" in done.stderr
    text = out.read_text()
    assert text.startswith("# moeslab routing trace") and "seed=9" in text
    trace = read_trace(out)
    assert trace.num_visits == 150
    expected = generate_trace(layers=3, experts=16, top_k=4, tokens=50, overlap=0.5, seed=9)
    assert np.array_equal(trace.experts, expected.experts)
    bad = subprocess.run(command[:3] + ["--experts", "4"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert bad.returncode == 2 and "make_trace:" in bad.stderr


def test_make_trace_cli_usage_profile_covers_the_earlier_tokens(tmp_path):
    out, usage = tmp_path / "late.txt", tmp_path / "usage"
    command = [
        sys.executable,
        str(REPO / "scripts" / "make_trace.py"),
        str(out),
        "--layers",
        "2",
        "--experts",
        "12",
        "--top-k",
        "3",
        "--tokens",
        "30",
        "--seed",
        "4",
        "--usage-out",
        str(usage),
        "--usage-tokens",
        "20",
    ]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=60)
    assert done.returncode == 0, done.stderr
    whole = generate_trace(layers=2, experts=12, top_k=3, tokens=50, overlap=0.4, seed=4)
    late = read_trace(out)
    assert late.tokens.tolist() == whole.tokens[whole.tokens >= 20].tolist()
    assert np.array_equal(late.experts, whole.experts[whole.tokens >= 20])
    rows = [tuple(map(int, line.split())) for line in usage.read_text().splitlines()]
    early = whole.experts[whole.tokens < 20]
    assert sum(count for _, _, count in rows) == early.size
    layer0 = np.bincount(early[whole.layers[whole.tokens < 20] == 0].ravel(), minlength=12)
    assert {(e, c) for layer, e, c in rows if layer == 0} == {(e, int(c)) for e, c in enumerate(layer0) if c}


def test_read_trace_reads_gzip_by_its_magic_not_its_name(tmp_path):
    import gzip

    trace = generate_trace(layers=2, experts=16, top_k=3, tokens=20, overlap=0.3, seed=4)
    plain = tmp_path / "t.txt"
    write_trace(plain, trace)
    for name in ("t.txt.gz", "t-no-suffix"):
        packed = tmp_path / name
        packed.write_bytes(gzip.compress(plain.read_bytes()))
        got = read_trace(packed)
        assert np.array_equal(got.experts, trace.experts) and np.array_equal(got.layers, trace.layers)
    bad = tmp_path / "bad.txt.gz"
    bad.write_bytes(gzip.compress(b"0 0 1 2\n0 0 1 2\n"))
    with pytest.raises(ValueError, match=r"bad\.txt\.gz line 2"):
        read_trace(bad)
    broken = tmp_path / "broken.gz"
    broken.write_bytes(gzip.compress(plain.read_bytes())[:40])
    with pytest.raises(ValueError, match=r"broken\.gz: the gzip stream ends early"):
        read_trace(broken)
