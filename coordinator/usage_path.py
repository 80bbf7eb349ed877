"""Where a run keeps its model's expert usage history when no `--usage-file` is given.

    usage_file = options.usage_file or default_usage_file(store)

`$XDG_CACHE_HOME/moeslab/<fingerprint>/usage` (`~/.cache` by default): the
model directory may be read-only (a shared Hugging Face cache), and the
fingerprint names the checkpoint by its config.json, its files' names and
sizes and a sample of their bytes, so a moved copy keeps its history and a
different checkpoint (a fine-tune of the same shapes too) never inherits
another's. The coordinator creates the directory when it first flushes.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from shared.store import ExpertStore

USAGE_FILE_NAME = "usage"
FINGERPRINT_SAMPLES, FINGERPRINT_SAMPLE_BYTES = 16, 4096


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


__all__ = ["USAGE_FILE_NAME", "default_usage_file", "model_fingerprint"]
