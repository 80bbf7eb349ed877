"""Where an expert's bytes are: segments of manifest files and where they land in a slot.

The coordinator plans loads with them, the wire carries them, and the I/O
workers read them; `check_segments` is the one validation all of them use, so
a bad segment is refused with the same message wherever it shows up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from shared.checks import require_int


@dataclass(frozen=True, slots=True)
class ExpertIOSegment:
    """One byte range of a manifest file that lands at `destination` in a slot."""

    file: int
    offset: int
    length: int
    destination: int


@dataclass(frozen=True, slots=True)
class ExpertIOHintSegment:
    """An advisory readahead range: warm the page cache, move nothing."""

    file: int
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class ExpertResidencyLocation:
    """Where one expert's bytes live; `hint_segments` may be a subset for readahead."""

    layer: int
    expert_id: int
    segments: tuple[ExpertIOSegment, ...]
    hint_segments: tuple[ExpertIOHintSegment, ...] | None = None

    def __post_init__(self) -> None:
        # Accept lists from callers but keep the value immutable.
        object.__setattr__(self, "segments", tuple(self.segments))
        if self.hint_segments is not None:
            object.__setattr__(self, "hint_segments", tuple(self.hint_segments))


class SegmentError(ValueError):
    """A segment no load or hint may use; the message names the segment and the value."""


class SizedFile(Protocol):
    """A manifest file as a reader has it open (native.BypassFile)."""

    @property
    def path(self) -> str: ...

    @property
    def size(self) -> int: ...


def check_segments(
    segments: Sequence[ExpertIOSegment] | Sequence[ExpertIOHintSegment],
    *,
    slot_bytes: int | None,
    manifest: int | Sequence[SizedFile] | None = None,
) -> tuple:
    """`segments` as a tuple, or an error naming the first bad segment and value.

    Load segments (`slot_bytes` given) must land inside a slot of `slot_bytes`;
    hint segments (`slot_bytes` None) have no destination. `manifest` is the
    number of manifest files, or the open files themselves (then a range beyond
    a file's end is refused too); None checks no file index. TypeError for a
    value that is not an integer, SegmentError for one out of range."""
    checked = tuple(segments)
    if not checked:
        raise SegmentError("no segments")
    kind = ExpertIOHintSegment if slot_bytes is None else ExpertIOSegment
    names = ("file", "offset", "length") if slot_bytes is None else ("file", "offset", "length", "destination")
    files = None if manifest is None or isinstance(manifest, int) else manifest
    count = manifest if isinstance(manifest, int) else None if files is None else len(files)
    for index, segment in enumerate(checked):
        where = f"segment {index}"
        if not isinstance(segment, kind):
            raise TypeError(f"{where} must be an {kind.__name__}, got {segment!r}")
        for name in names:
            value = getattr(segment, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"{where} {name} must be an integer, got {value!r} ({type(value).__name__})")
        if segment.file < 0 or (count is not None and segment.file >= count):
            raise SegmentError(f"{where}: file index {segment.file} is not in the manifest of {count} files")
        if segment.offset < 0:
            raise SegmentError(f"{where}: offset {segment.offset} is negative")
        if segment.length <= 0:  # a zero-length advice would mean "to the end of the file"
            raise SegmentError(f"{where}: length {segment.length} must be positive")
        end = segment.offset + segment.length
        if files is not None and end > files[segment.file].size:
            file = files[segment.file]
            raise SegmentError(
                f"{where}: range [{segment.offset}, {end}) of file {segment.file} ({file.path}) "
                f"is beyond its size {file.size}"
            )
        if slot_bytes is not None and (segment.destination < 0 or segment.destination + segment.length > slot_bytes):
            raise SegmentError(
                f"{where}: destination [{segment.destination}, {segment.destination + segment.length}) is outside "
                f"the slot of {slot_bytes} bytes"
            )
    return checked


def build_expert_hint_segments(
    segments: Sequence[ExpertIOSegment], scale_offset: int, no_cache: bool
) -> list[ExpertIOHintSegment]:
    """Readahead ranges for an expert.

    Buffered demand may warm the whole expert; cache-bypassing demand warms
    only the tail from `scale_offset` on (the scales), because warming weight
    pages would be wasted by the O_DIRECT read that follows.
    """
    scale = require_int(scale_offset, "scale_offset")
    if not no_cache:
        return [ExpertIOHintSegment(s.file, s.offset, s.length) for s in segments]
    hints = []
    for segment in segments:
        skip = max(0, scale - segment.destination)
        if skip < segment.length:
            hints.append(ExpertIOHintSegment(segment.file, segment.offset + skip, segment.length - skip))
    return hints


__all__ = [
    "ExpertIOHintSegment",
    "ExpertIOSegment",
    "ExpertResidencyLocation",
    "SegmentError",
    "SizedFile",
    "build_expert_hint_segments",
    "check_segments",
]
