"""Runs left behind by dead launchers: find them by their record, remove only those.

Every launch writes `RUN_DIR/supervisor.json` *before* it creates its slab:
the launching process's pid, a token of that process's start (so a reused pid
is not mistaken for it) and the slab's name. A run is dead when that pid is
gone, a zombie, or now a different process. Only a dead run's record may
name a segment to unlink, and only a name that is a moeslab slab name; a
segment no record names, a directory without a (readable) record and a live
run are never touched. Run directories are looked for under the default
parent (`tempfile.gettempdir()`, prefix `moeslab-`), owned by this user.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import posix_ipc
import psutil

from shared.slab import check_slab_name

logger = logging.getLogger("moeslab.rundir")

RUN_RECORD = "supervisor.json"
RUN_DIR_PREFIX = "moeslab-"
RECORD_VERSION = 1
# What a launch leaves in a run directory it was given (it never removes that directory itself).
RUN_FILES = (
    "config.json",
    "manifest.json",
    ".config.json.tmp",
    "io",
    "gpu",
    "jobs",
    RUN_RECORD,
    "processes.json",
    "processes.json.tmp",
    "curve/server.key_secret",  # a dead CURVE run's key pair (shared.curve); the empty directory stays
    "curve/server.key",
)


@dataclass(frozen=True, slots=True)
class RunRecord:
    pid: int
    start: str  # process_start(pid) when the run was created
    slab: str
    created: float  # wall-clock seconds, for people reading the file
    version: int = RECORD_VERSION


@dataclass(frozen=True, slots=True)
class StaleReport:
    removed_dirs: tuple[str, ...] = ()
    removed_segments: tuple[str, ...] = ()
    live: tuple[str, ...] = ()  # run directories of live runs, left alone
    unattributed: tuple[str, ...] = ()  # moeslab- directories without a usable record, left alone


class RunDirInUse(RuntimeError):
    """A run directory whose record names a live process."""


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def process_start(pid: int) -> str | None:
    """An opaque token of when process `pid` started; None if there is no such (living) process.

    Linux: boot id and start time in clock ticks from /proc (exact, immune to clock changes);
    elsewhere psutil's create time. A zombie counts as gone."""
    if os.path.exists("/proc/self/stat"):
        try:
            text = Path(f"/proc/{pid}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            return None  # a PermissionError propagates: that is "cannot tell", not "gone"
        fields = text[text.rindex(")") + 2 :].split()  # the name may hold spaces and parentheses
        if fields[0] in ("Z", "X"):
            return None
        return f"{_boot_id()}:{fields[19]}"  # field 22 of stat(5): starttime
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        return f"ct:{process.create_time():.6f}"
    except psutil.NoSuchProcess:
        return None


def write_run_record(run_dir: str | os.PathLike[str], slab_name: str) -> str:
    """Record this process as the owner of `run_dir` and `slab_name`; atomic, mode 0600."""
    pid = os.getpid()
    start = process_start(pid)
    assert start is not None
    record = RunRecord(pid=pid, start=start, slab=check_slab_name(slab_name), created=time.time())
    path = os.path.join(os.fspath(run_dir), RUN_RECORD)
    temp = os.path.join(os.fspath(run_dir), f".{RUN_RECORD}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(asdict(record), handle)
    os.replace(temp, path)  # a reader sees the whole record or none
    return path


def read_run_record(run_dir: str | os.PathLike[str]) -> RunRecord | None:
    """The directory's record, or None when it has none or it cannot be read as one."""
    path = os.path.join(os.fspath(run_dir), RUN_RECORD)
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        record = RunRecord(**data)
        if not (isinstance(record.pid, int) and record.pid > 0 and isinstance(record.start, str)):
            raise ValueError("bad pid or start")
        check_slab_name(record.slab)
        return record
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as error:
        logger.warning("ignoring the unreadable run record %s: %s", path, error)
        return None


def run_is_live(record: RunRecord) -> bool:
    """True while the recorded process still runs (the same process, not a reused pid)."""
    try:
        return process_start(record.pid) == record.start
    except (psutil.AccessDenied, PermissionError):
        return True  # cannot tell: assume it lives


def _unlink_segment(name: str) -> bool:
    try:
        posix_ipc.unlink_shared_memory(check_slab_name(name))
        return True
    except posix_ipc.ExistentialError:
        return False  # already gone
    except (posix_ipc.PermissionsError, ValueError) as error:
        logger.warning("cannot remove stale segment %s: %s", name, error)
        return False


def remove_run(slab_name: str | None, created: Sequence[str], owned_run_dir: str | None) -> None:
    """At a run's stop: unlink its slab, remove what its launch created (files, RUN_DIR/curve), and
    the run directory itself when the launch made it (`owned_run_dir`)."""
    if slab_name is not None:
        try:
            posix_ipc.unlink_shared_memory(slab_name)
        except posix_ipc.ExistentialError:
            pass
    for path in created:
        if path and os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        elif path and os.path.lexists(path):
            os.unlink(path)
    if owned_run_dir:
        shutil.rmtree(owned_run_dir, ignore_errors=True)


def clean_stale_runs(parent: str | os.PathLike[str] | None = None) -> StaleReport:
    """Remove the segments and run directories of dead runs under `parent` (default: the temp dir)."""
    root = os.fspath(parent) if parent is not None else tempfile.gettempdir()
    removed_dirs, segments, live, unattributed = [], [], [], []
    try:
        entries = sorted(os.scandir(root), key=lambda entry: entry.name)
    except OSError as error:
        logger.warning("cannot look for stale runs in %s: %s", root, error)
        return StaleReport()
    for entry in entries:
        try:
            if not entry.name.startswith(RUN_DIR_PREFIX) or not entry.is_dir(follow_symlinks=False):
                continue
            if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
        except OSError:
            continue  # removed meanwhile
        record = read_run_record(entry.path)
        if record is None:
            unattributed.append(entry.path)  # starting right now, or not ours to judge
        elif run_is_live(record):
            live.append(entry.path)
        else:
            if _unlink_segment(record.slab):
                segments.append(record.slab)
            shutil.rmtree(entry.path, ignore_errors=True)
            removed_dirs.append(entry.path)
            logger.warning("removed the run of dead process %d: %s (slab %s)", record.pid, entry.path, record.slab)
    return StaleReport(tuple(removed_dirs), tuple(segments), tuple(live), tuple(unattributed))


def claim_run_dir(run_dir: str | os.PathLike[str]) -> None:
    """Before reusing a given run directory: refuse a live run's, clear a dead run's leftovers.

    Only the files a launch creates are removed (the directory is the user's)."""
    path = os.fspath(run_dir)
    record = read_run_record(path) if os.path.isdir(path) else None
    if record is None:
        return
    if run_is_live(record):
        raise RunDirInUse(f"run directory {path} belongs to a live run (pid {record.pid}, slab {record.slab})")
    _unlink_segment(record.slab)
    for name in RUN_FILES:
        try:
            os.unlink(os.path.join(path, name))
        except FileNotFoundError:
            pass
    logger.warning("cleared the leftovers of dead process %d in %s (slab %s)", record.pid, path, record.slab)


__all__ = [
    "RUN_DIR_PREFIX",
    "RUN_RECORD",
    "RunDirInUse",
    "RunRecord",
    "StaleReport",
    "claim_run_dir",
    "clean_stale_runs",
    "process_start",
    "read_run_record",
    "remove_run",
    "run_is_live",
    "write_run_record",
]
