"""Who serves now: the supervisor's record of every process of a run, read by the coordinator.

The supervisor alone starts and restarts processes, so it alone knows each
role's current pid and how many times it was restarted. It rewrites
`RUN_DIR/processes.json` (atomically: a reader sees the old or the new table,
never half of one) whenever a child is started, and the coordinator reads it
to answer `health` and `stats`. A missing or unreadable table yields an empty
one: health must still answer (it is how a launch is seen to be ready).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping

from shared.job_messages import ProcessInfo

logger = logging.getLogger(__name__)

PROCESS_TABLE = "processes.json"


def role_key(name: str) -> str:
    """A child's name as a table key: `I/O worker 0` -> `io_worker_0`, `GPU worker` -> `gpu_worker`."""
    return name.lower().replace("i/o worker ", "io_worker_").replace(" ", "_")


def write_process_table(run_dir: str, pids: Mapping[str, int], restarts: Mapping[str, int]) -> str:
    """Replace the table with `pids` (role -> pid) and their restart counts; returns its path."""
    table = {name: {"pid": pid, "restarts": restarts.get(name, 0)} for name, pid in pids.items()}
    path = os.path.join(run_dir, PROCESS_TABLE)
    temp = f"{path}.tmp"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(table, handle)
    os.replace(temp, path)  # readers see the old table or the new one
    return path


def read_process_table(run_dir: str) -> tuple[ProcessInfo, ...]:
    """The table as `ProcessInfo`s in its order; () when there is none or it cannot be read."""
    path = os.path.join(run_dir, PROCESS_TABLE)
    try:
        with open(path, encoding="utf-8") as handle:
            table = json.load(handle)
        return tuple(
            ProcessInfo(name=str(name), pid=int(entry["pid"]), restarts=int(entry["restarts"]))
            for name, entry in table.items()
        )
    except FileNotFoundError:
        return ()
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as error:
        logger.warning("process table %s unreadable: %s", path, error)
        return ()


__all__ = ["PROCESS_TABLE", "read_process_table", "role_key", "write_process_table"]
