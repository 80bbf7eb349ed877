"""The expert usage profile on disk: Colibri's `.coli_usage` format, read and written safely.

One `layer expert count` row per nonzero counter. The coordinator's usage
ledger (`coordinator.usage`) keeps the live counts and flushes them here; the
supervisor reads a profile to choose startup pins (`shared.pins`) before any
process starts. `default_usage_file` is where a run keeps a model's history
when no `--usage-file` is given: `$XDG_CACHE_HOME/moeslab/<fingerprint>/usage`
(`~/.cache` by default), because the model directory may be read-only (a
shared Hugging Face cache). The fingerprint names the checkpoint by its
config.json, its files' names and sizes and a sample of their bytes, so a
moved copy keeps its history and a different checkpoint (a fine-tune of the
same shapes too) never inherits another's.

A writer killed at any instant leaves the complete old or the complete new
profile (`write_profile`: temp file, fsync, rename); the temp file it may
leave is removed by the next ledger that opens the profile
(`remove_stale_temp_files`; tests/test_ledger_crash.py kills flushes 200 times).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import secrets
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from shared.checks import require_int

if TYPE_CHECKING:
    from shared.store import ExpertStore

logger = logging.getLogger(__name__)

UINT32_MAX = 0xFFFF_FFFF
MAX_SAFE_INTEGER = 2**53 - 1  # the reference's Number.isSafeInteger bound
USAGE_FILE_NAME = "usage"
FINGERPRINT_SAMPLES, FINGERPRINT_SAMPLE_BYTES = 16, 4096

# JavaScript's `\s` (also what String.prototype.trim strips), so rows split exactly as the
# reference reader splits them; Python's str.split() differs in a few code points.
_JS_SPACE = re.compile("[\t\n\v\f\r \u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\ufeff]+")
_DECIMAL = re.compile(r"[+-]?[0-9]+")


class UsageProfileError(Exception):
    """A damaged profile row; the message names the line."""


@dataclass(frozen=True, slots=True)
class ExpertUsageCount:
    """One nonzero persistent counter."""

    layer: int
    expert_id: int
    count: int


def bounded(value: object, name: str, minimum: int, maximum: int) -> int:
    """An int in [minimum, maximum]: TypeError for non-ints, ValueError out of range."""
    number = require_int(value, name, minimum=minimum)
    if number > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {number}")
    return number


def add_profile_rows(data: bytes, counts: dict[int, np.ndarray]) -> None:
    """Add the profile's rows to `counts` (layer -> uint32 per expert, saturating); raise on the first bad row.

    Rows are validated one by one: a bad row leaves the rows before it added (the caller clears)."""
    # A UTF-8 multi-byte sequence never contains 0x0A, so splitting bytes on
    # newlines numbers lines exactly as splitting the decoded text would.
    for number, raw in enumerate(data.split(b"\n"), start=1):
        try:
            fields = [field for field in _JS_SPACE.split(raw.decode("utf-8")) if field]
        except UnicodeDecodeError as error:
            detail = f"line {number}: not valid UTF-8 ({error.reason} at byte {error.start})"
            raise UsageProfileError(detail) from None
        if not fields:
            continue
        if len(fields) != 3:
            raise UsageProfileError(f"line {number}: expected layer expert count, got {' '.join(fields)!r}")
        layer, expert_id, count = (int(f) if _DECIMAL.fullmatch(f) else None for f in fields)
        if layer is None or layer not in counts:
            raise UsageProfileError(f"line {number}: invalid layer {fields[0]!r}")
        layer_counts = counts[layer]
        if expert_id is None or not 0 <= expert_id < layer_counts.size:
            raise UsageProfileError(f"line {number}: invalid expert {fields[1]!r}")
        if count is None or not 0 <= count <= UINT32_MAX:
            raise UsageProfileError(f"line {number}: invalid count {fields[2]!r}")
        layer_counts[expert_id] = min(UINT32_MAX, int(layer_counts[expert_id]) + count)


def nonzero_rows(counts: dict[int, np.ndarray], layers: Iterable[int]) -> Iterator[tuple[int, int, int]]:
    """(layer, expert, count) for nonzero counts: layers in the order given, experts ascending."""
    for layer in layers:
        layer_counts = counts[layer]
        experts = np.flatnonzero(layer_counts)
        for expert_id, count in zip(experts.tolist(), layer_counts[experts].tolist()):
            yield layer, expert_id, count


def rank_counts(rows: Iterable[tuple[int, int, int]]) -> list[ExpertUsageCount]:
    """Nonzero counts, most frequent first; ties by layer, then expert id."""
    ranked = [ExpertUsageCount(*row) for row in rows]
    ranked.sort(key=lambda c: (-c.count, c.layer, c.expert_id))
    return ranked


def _fsync_directory(directory: str) -> None:
    """Make a rename inside `directory` durable; tolerate filesystems that cannot."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
        logger.debug("directory fsync unsupported for %s: %s", directory, error)
    finally:
        os.close(fd)


def write_profile(path: str, rows: Iterable[tuple[int, int, int]]) -> int:
    """Replace the profile at `path` with `rows` atomically; the bytes written.

    Same-directory temp file (0600, created exclusively), written fully, fsynced,
    renamed over the profile, directory fsynced. On any failure the temp file is
    removed, the old profile is intact and the error propagates.
    """
    payload = memoryview("".join(f"{layer} {expert} {count}\n" for layer, expert, count in rows).encode("ascii"))
    temp = f"{path}.tmp-{os.getpid()}-{time.monotonic_ns()}-{secrets.token_hex(4)}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    fd: int | None = None
    try:
        fd = os.open(temp, flags, 0o600)
        written = 0
        while written < len(payload):
            step = os.write(fd, payload[written:])
            if step <= 0:
                raise OSError(errno.EIO, f"write made no progress at byte {written}", temp)
            written += step
        os.fsync(fd)
        closing, fd = fd, None
        os.close(closing)
        os.replace(temp, path)
        _fsync_directory(os.path.dirname(os.path.abspath(path)))
    except BaseException:
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    return len(payload)


def _writer_alive(pid: int) -> bool:
    """True unless no process `pid` exists (0 and below name no writer; os.kill would mean groups)."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def remove_stale_temp_files(path: str) -> list[str]:
    """Remove what writers of `path` killed mid-flush left behind (`PATH.tmp-PID-...`); the paths removed.

    Such a temp file is never renamed into place, so without this each kill would leave one for
    good. Only temps whose writer pid is gone are removed: a live process (another run flushing
    the same profile right now) keeps its own."""
    directory, name = os.path.split(os.path.abspath(path))
    prefix = f"{name}.tmp-"
    try:
        entries = os.listdir(directory)
    except OSError:
        return []
    removed = []
    for entry in entries:
        pid = entry[len(prefix) :].split("-", 1)[0] if entry.startswith(prefix) else ""
        if not pid.isdigit() or _writer_alive(int(pid)):
            continue
        temp = os.path.join(directory, entry)
        try:
            os.unlink(temp)
        except FileNotFoundError:
            continue  # another reader removed it first
        except OSError as error:
            logger.warning("cannot remove the stale usage profile temp file %s: %s", temp, error)
            continue
        removed.append(temp)
    return removed


def read_profile(path: str, counts: dict[int, np.ndarray], *, on_warning: Callable[[str], None] | None = None) -> None:
    """Add the profile at `path` to `counts`; a missing one adds nothing, silently.

    A damaged or unreadable profile is reported through `on_warning` (or the log)
    and ignored: `counts` are all zero afterwards. The profile is derived state."""
    try:
        with open(path, "rb") as file:
            add_profile_rows(file.read(), counts)
    except (FileNotFoundError, NotADirectoryError):
        return
    except (OSError, UsageProfileError) as error:
        for layer_counts in counts.values():
            layer_counts.fill(0)
        (on_warning or logger.warning)(f"ignoring invalid expert usage profile {path}: {error}")


@dataclass(frozen=True, slots=True)
class UsageProfile:
    """A profile's counts, read once (the supervisor's view: no heat, no clock, nothing written)."""

    layers: tuple[int, ...]
    counts: dict[int, np.ndarray]

    @classmethod
    def open(
        cls,
        path: str,
        *,
        layers: Iterable[int],
        experts_per_layer: int,
        on_warning: Callable[[str], None] | None = None,
    ) -> UsageProfile:
        tracked = tuple(layers)
        counts = {layer: np.zeros(experts_per_layer, np.uint32) for layer in tracked}
        read_profile(path, counts, on_warning=on_warning)
        return cls(tracked, counts)

    @property
    def total_count(self) -> int:
        """The exact (unsaturated) sum of all counts: the selections of history."""
        return sum(int(counts.sum(dtype=np.uint64)) for counts in self.counts.values())

    def ranked_counts(self) -> list[ExpertUsageCount]:
        return rank_counts(nonzero_rows(self.counts, self.layers))


def model_fingerprint(store: ExpertStore) -> str:
    """16 hex digits naming a checkpoint: its config.json, its files' names and sizes, and a sample
    of each file's bytes (a fine-tune has the base model's shapes but not its weights or routing)."""
    digest = hashlib.sha256()
    digest.update((Path(store.model_dir) / "config.json").read_bytes())
    for path in sorted(store.manifest, key=os.path.basename):
        size = os.path.getsize(path)
        digest.update(f"\0{os.path.basename(path)}\0{size}\0".encode())
        with open(path, "rb") as file:  # a few KiB per file, wherever the checkpoint is
            for index in range(FINGERPRINT_SAMPLES):
                file.seek(size * index // FINGERPRINT_SAMPLES)
                digest.update(file.read(FINGERPRINT_SAMPLE_BYTES))
    return digest.hexdigest()[:16]


def default_usage_file(store: ExpertStore, *, cache_home: str | os.PathLike[str] | None = None) -> str:
    """The usage profile of `store` when none is given (its directory is not created here)."""
    root = cache_home or os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.fspath(root), "moeslab", model_fingerprint(store), USAGE_FILE_NAME)


__all__ = [
    "MAX_SAFE_INTEGER",
    "UINT32_MAX",
    "USAGE_FILE_NAME",
    "ExpertUsageCount",
    "UsageProfile",
    "UsageProfileError",
    "add_profile_rows",
    "bounded",
    "default_usage_file",
    "model_fingerprint",
    "nonzero_rows",
    "rank_counts",
    "read_profile",
    "remove_stale_temp_files",
    "write_profile",
]
