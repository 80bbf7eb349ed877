"""Routing traces: the text format, its parser and writer, and a synthetic generator.

Trace format (text, UTF-8; `read_trace` also reads it gzip-compressed, e.g. `.txt.gz`)
--------------------------------------------------------------------------------------
One line per (token, sparse layer) visit::

    # comment lines start with '#'; blank lines are ignored
    token layer e1 e2 ... ek

- Fields are separated by spaces or tabs; every field is a non-negative
  decimal integer (ASCII digits only: no sign, no '_', no exponent).
- ``token`` is the position of the token in the run, ``layer`` the model's
  layer index (any non-negative ids, need not be contiguous), ``e1 … ek`` the
  router's top-k selection in router order.
- Every line has the same number of experts k (fixed by the first line); a
  line with another field count is an error.
- Lines are grouped by token, tokens strictly increasing from group to group
  (gaps allowed). Within a token the layers may come in any order, but each
  layer at most once. A token that reappears after a later token, a token
  smaller than its predecessor, or a repeated (token, layer) is an error.
- A repeated expert inside one line is accepted (a router never emits one;
  the replay counts it once, the usage ledger counts every selection).
- Comments are whole lines only; a '#' after data is an error.

Errors are `TraceFormatError` (a ValueError) naming the source, the line
number and the offending value.

Overlap (locality) definition
-----------------------------
For a visit of layer L by token t, its overlap is the fraction of its k
selections that the previous visit of layer L (the previous token that
visited L) also selected. A trace's overlap is the mean over every visit
that has a previous visit at its layer (`measure_overlap`).

Synthetic generator
-------------------
`generate_trace` draws, per layer, a fixed random popularity ranking with
Zipf weights ``w(rank) = 1 / (rank + 1) ** zipf`` (``zipf = 0`` is uniform).
The first token draws k experts without replacement by weight. Each later
token keeps ``m`` experts, a uniformly random subset of the previous token's
selection at that layer, and draws the other ``k - m`` by weight without
replacement from the experts the previous token did *not* select; so its
overlap is exactly ``m / k``. ``m`` is ``floor(overlap*k)`` plus one with
probability ``frac(overlap*k)``, which makes the expected overlap equal the
request exactly. Row order within a line is shuffled. Deterministic in
``seed``.
"""

from __future__ import annotations

import gzip
import logging
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np

log = logging.getLogger(__name__)

_DATA_LINE = re.compile(r"[0-9]+(?:[ \t]+[0-9]+)*")
_DIGITS = re.compile(r"[0-9]+")
_FIELD_NAMES = ("token", "layer")
_GZIP_MAGIC = b"\x1f\x8b"


class TraceFormatError(ValueError):
    """A trace line is malformed; `line` is 1-based, `value` the offending text."""

    def __init__(self, source: str, line: int, message: str, value: str | None = None) -> None:
        self.source = source
        self.line = line
        self.value = value
        super().__init__(f"{source} line {line}: {message}")


@dataclass(frozen=True, eq=False)
class Trace:
    """Visits in file order: ``tokens[i]`` visited ``layers[i]`` selecting ``experts[i]``."""

    tokens: np.ndarray  # (V,) int64
    layers: np.ndarray  # (V,) int64
    experts: np.ndarray  # (V, k) int64

    def __post_init__(self) -> None:
        if self.experts.ndim != 2 or self.experts.shape[1] < 1:
            raise ValueError(f"experts must be (visits, k) with k >= 1, got shape {self.experts.shape}")
        if not (self.tokens.shape == self.layers.shape == (self.experts.shape[0],)):
            raise ValueError("tokens, layers and experts must have one entry per visit")

    @property
    def top_k(self) -> int:
        return int(self.experts.shape[1])

    @property
    def num_visits(self) -> int:
        return int(self.experts.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(np.unique(self.tokens).size)

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return tuple(int(layer) for layer in np.unique(self.layers))

    @property
    def num_experts(self) -> int:
        """One more than the largest expert id seen (0 for an empty trace)."""
        return int(self.experts.max()) + 1 if self.experts.size else 0

    def layer_rows(self) -> dict[int, np.ndarray]:
        """Per layer, its visits' selections in trace order, shape (visits_of_layer, k)."""
        return {layer: self.experts[self.layers == layer] for layer in self.layer_ids}


def _field_error(source: str, number: int, index: int, text: str) -> TraceFormatError:
    name = _FIELD_NAMES[index] if index < 2 else f"expert {index - 1}"
    if text.startswith("-") and _DIGITS.fullmatch(text[1:]):
        return TraceFormatError(source, number, f"{name} {text!r} is negative", text)
    if "#" in text:
        return TraceFormatError(source, number, f"{name} {text!r}: comments must be whole lines", text)
    return TraceFormatError(source, number, f"{name} {text!r} is not a non-negative integer", text)


def parse_trace(lines: Iterable[str], *, source: str = "<trace>") -> Trace:
    """Parse trace text (an iterable of lines); raise `TraceFormatError` on the first bad line."""
    tokens: list[int] = []
    layers: list[int] = []
    rows: list[list[int]] = []
    width: int | None = None
    width_line = 0
    current_token = -1
    seen_layers: set[int] = set()
    seen_tokens_line: dict[int, int] = {}
    for number, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if _DATA_LINE.fullmatch(line):
            values = [int(field) for field in line.split()]
        else:
            fields = line.split()
            for index, text in enumerate(fields):
                if not (text.isascii() and _DIGITS.fullmatch(text)):
                    raise _field_error(source, number, index, text)
            raise TraceFormatError(source, number, f"fields must be separated by spaces or tabs: {line!r}", line)
        if width is None:
            if len(values) < 3:
                raise TraceFormatError(
                    source,
                    number,
                    f"expected 'token layer e1 ... ek' (at least 3 fields), got {len(values)}: {line!r}",
                    line,
                )
            width, width_line = len(values), number
        elif len(values) != width:
            raise TraceFormatError(
                source,
                number,
                f"expected {width} fields (token, layer and {width - 2} experts, as on line "
                f"{width_line}), got {len(values)}: {line!r}",
                line,
            )
        token, layer = values[0], values[1]
        if token != current_token:
            if token < current_token:
                earlier = seen_tokens_line.get(token)
                where = f" (token {token} already ended, first seen on line {earlier})" if earlier else ""
                raise TraceFormatError(
                    source,
                    number,
                    f"token {token} is out of order: it follows token {current_token}{where}; "
                    f"lines must be grouped by token in increasing order",
                    str(token),
                )
            current_token = token
            seen_layers = set()
            seen_tokens_line[token] = number
        if layer in seen_layers:
            raise TraceFormatError(source, number, f"duplicate layer {layer} for token {token}", str(layer))
        seen_layers.add(layer)
        tokens.append(token)
        layers.append(layer)
        rows.append(values[2:])
    if width is None:
        raise TraceFormatError(source, 0, "no routing lines (only comments or blank lines)")
    trace = Trace(
        tokens=np.asarray(tokens, dtype=np.int64),
        layers=np.asarray(layers, dtype=np.int64),
        experts=np.asarray(rows, dtype=np.int64).reshape(len(rows), width - 2),
    )
    log.debug("parsed %s: %d visits, %d tokens, k=%d", source, trace.num_visits, trace.num_tokens, trace.top_k)
    return trace


def read_trace(path: str | Path) -> Trace:
    """Read and parse a trace file, gzip-compressed or not (told by its first two bytes, not its name)."""
    path = Path(path)
    with path.open("rb") as probe:
        compressed = probe.read(2) == _GZIP_MAGIC
    if compressed:
        try:
            with gzip.open(path, "rt", encoding="utf-8") as handle:
                return parse_trace(handle, source=str(path))
        except EOFError:
            raise ValueError(f"{path}: the gzip stream ends early (a truncated file?)") from None
    with path.open("r", encoding="utf-8") as handle:
        return parse_trace(handle, source=str(path))


def format_trace(trace: Trace, *, header: Sequence[str] = ()) -> Iterable[str]:
    """The trace as text lines (each ending in a newline), `header` as '#' comments first."""
    for text in header:
        for part in str(text).splitlines() or [""]:
            yield f"# {part}".rstrip() + "\n"
    for token, layer, row in zip(trace.tokens.tolist(), trace.layers.tolist(), trace.experts.tolist()):
        yield f"{token} {layer} " + " ".join(map(str, row)) + "\n"


def write_trace(destination: str | Path | IO[str], trace: Trace, *, header: Sequence[str] = ()) -> None:
    """Write `trace` to a path or an open text file; `parse_trace` reads it back unchanged."""
    if isinstance(destination, (str, Path)):
        with Path(destination).open("w", encoding="utf-8") as handle:
            handle.writelines(format_trace(trace, header=header))
    else:
        destination.writelines(format_trace(trace, header=header))


def measure_overlap(trace: Trace) -> float:
    """Mean fraction of a visit's k selections also chosen by the previous visit of its layer.

    NaN when no layer is visited twice.
    """
    matched = 0
    counted = 0
    for rows in trace.layer_rows().values():
        if rows.shape[0] < 2:
            continue
        previous, current = rows[:-1], rows[1:]
        matched += int((current[:, :, None] == previous[:, None, :]).any(axis=2).sum())
        counted += current.size
    return matched / counted if counted else math.nan


def _require(value: int, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def generate_trace(
    *,
    layers: int = 8,
    experts: int = 64,
    top_k: int = 8,
    tokens: int = 2000,
    overlap: float = 0.4,
    zipf: float = 1.0,
    seed: int = 0,
) -> Trace:
    """A synthetic trace of `tokens` tokens each visiting layers 0..layers-1 (see module doc)."""
    layers = _require(layers, "layers", 1)
    experts = _require(experts, "experts", 1)
    top_k = _require(top_k, "top_k", 1)
    tokens = _require(tokens, "tokens", 1)
    if not (0.0 <= float(overlap) <= 1.0):
        raise ValueError(f"overlap must be within [0, 1], got {overlap!r}")
    if not (math.isfinite(float(zipf)) and zipf >= 0):
        raise ValueError(f"zipf must be a finite number >= 0, got {zipf!r}")
    base = math.floor(overlap * top_k + 1e-12)
    frac = overlap * top_k - base
    needed = top_k if tokens == 1 else 2 * top_k - base
    if experts < needed:
        raise ValueError(
            f"{experts} experts cannot give top-{top_k} selections with overlap {overlap}: "
            f"each fresh draw avoids the previous token's {top_k}, so at least {needed} experts are needed"
        )
    rng = np.random.default_rng(seed)
    ranks = np.argsort(rng.random((layers, experts)), axis=1).argsort(axis=1)
    log_weight = -float(zipf) * np.log1p(ranks.astype(np.float64))
    out = np.empty((tokens, layers, top_k), dtype=np.int64)
    rows = np.arange(layers)[:, None]
    position = np.arange(top_k)[None, :]
    previous: np.ndarray | None = None
    for token in range(tokens):
        keys = log_weight + rng.gumbel(size=(layers, experts))
        if previous is None:
            keep = np.zeros((layers, 1), dtype=np.int64)
        else:
            keep = (base + (rng.random(layers) < frac)).astype(np.int64)[:, None]
            keys[rows, previous] = -np.inf
        top = np.argpartition(-keys, top_k - 1, axis=1)[:, :top_k]
        fresh = np.take_along_axis(top, np.argsort(-np.take_along_axis(keys, top, axis=1), axis=1), axis=1)
        if previous is None:
            chosen = fresh
        else:
            kept = np.take_along_axis(previous, np.argsort(rng.random((layers, top_k)), axis=1), axis=1)
            from_fresh = np.take_along_axis(fresh, np.clip(position - keep, 0, top_k - 1), axis=1)
            chosen = np.where(position < keep, kept, from_fresh)
        chosen = np.take_along_axis(chosen, np.argsort(rng.random((layers, top_k)), axis=1), axis=1)
        out[token] = chosen
        previous = chosen
    trace = Trace(
        tokens=np.repeat(np.arange(tokens, dtype=np.int64), layers),
        layers=np.tile(np.arange(layers, dtype=np.int64), tokens),
        experts=out.reshape(tokens * layers, top_k),
    )
    log.debug("generated %d tokens x %d layers, requested overlap %.3f", tokens, layers, overlap)
    return trace
