"""Shared fixtures: every test is checked for leaked processes and shm segments.

Nothing imports this module (pytest loads it); the helpers tests share live in tests/helpers/.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from pathlib import Path

import psutil
import pytest

from shared.slab import SLAB_NAME_PREFIX, SLAB_TAG_ENV
from tests.helpers.models import write_tiny_model
from tests.helpers.supervisor import stop_leftover_supervisors

SHM_DIR = Path("/dev/shm")
# Every slab this test session (and the processes it spawns) creates carries this tag,
# so concurrent runs on the same machine never look like our leaks.
SESSION_TAG = os.environ.setdefault(SLAB_TAG_ENV, secrets.token_hex(3))
OUR_PREFIX = f"{SLAB_NAME_PREFIX[1:]}{SESSION_TAG}-"
# Runs keep their usage history under $XDG_CACHE_HOME by default: point it at a
# session directory so tests never write into the user's real cache.
CACHE_HOME = os.environ.setdefault("XDG_CACHE_HOME", tempfile.mkdtemp(prefix="mltest-cache-"))


def pytest_sessionfinish(session, exitstatus):
    if CACHE_HOME.startswith(os.path.join(tempfile.gettempdir(), "mltest-cache-")):
        shutil.rmtree(CACHE_HOME, ignore_errors=True)


def _shm_entries() -> set[str]:
    if not SHM_DIR.is_dir():  # macOS has no /dev/shm listing
        return set()
    return {name for name in os.listdir(SHM_DIR) if name.startswith(OUR_PREFIX)}


@pytest.fixture(autouse=True)
def no_leaks():
    """Fail a test that leaves child processes or shared-memory segments behind."""
    me = psutil.Process()
    shm_before = _shm_entries()
    children_before = {child.pid for child in me.children(recursive=True)}
    yield
    # A supervisor a (failed) test left running is stopped first, so the check below reports the
    # failure, not its consequences.
    stop_leftover_supervisors()
    leftover_children = [child for child in me.children(recursive=True) if child.pid not in children_before]
    for child in leftover_children:
        try:
            child.wait(timeout=5)
        except psutil.TimeoutExpired:
            pass
    alive = [child for child in leftover_children if child.is_running() and child.status() != psutil.STATUS_ZOMBIE]
    for child in alive:
        child.kill()
    leaked_shm = _shm_entries() - shm_before
    assert not alive, f"test left child processes running: {[c.pid for c in alive]}"
    assert not leaked_shm, f"test left shared-memory segments: {sorted(leaked_shm)}"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """`models(family, quantized=False, layout="stacked", **options)`: each tiny model written once
    per module, on demand (`write_tiny_model`'s options)."""
    built: dict[tuple, Path] = {}

    def get(family: str, quantized: bool = False, layout: str = "stacked", **options) -> Path:
        key = (family, quantized, layout, tuple(sorted(options.items())))
        if key not in built:
            path = tmp_path_factory.mktemp(f"{family}-{'q4' if quantized else 'fp32'}-{layout}")
            built[key] = write_tiny_model(path, family=family, quantized=quantized, layout=layout, **options)
        return built[key]

    return get
