"""What the benchmark scripts that start systems share: SIGTERM as an exit that unwinds, their model
and the size of one of its experts.

By default SIGTERM kills a Python process where it stands, which would leave the systems a bench
started (their processes and slabs) behind; `exit_on_sigterm` makes it unwind through the
bench's `finally` blocks, as Ctrl-C does.
"""

from __future__ import annotations

import argparse
import signal
from collections.abc import Callable
from pathlib import Path

from instruments.bench_model import model_from_arguments
from instruments.disk import resolve_io_mode
from shared.store import ExpertStore


def _exit(signum: int, _frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the cleanup short
    raise SystemExit(128 + signum)


def exit_on_sigterm() -> None:
    """From now on SIGTERM raises SystemExit(143): every `finally` runs, every started system stops."""
    signal.signal(signal.SIGTERM, _exit)


def open_model(args: argparse.Namespace, say: Callable[[str], None]) -> tuple[Path, ExpertStore, str]:
    """The model `instruments.bench_model.add_model_arguments`' flags name (built if need be, and
    said), its store and the I/O mode `args.io_mode` resolves to there."""
    model_dir, built, seconds = model_from_arguments(args)
    say(f"model {model_dir}" + (f" (built in {seconds:.0f} s)" if built else ""))
    return model_dir, ExpertStore.open(model_dir), resolve_io_mode(args.io_mode, model_dir)


def one_expert_bytes(store: ExpertStore) -> int:
    """The bytes of one routed expert (the first sparse layer's first; a model's experts share a shape)."""
    return sum(segment.length for segment in store.locate(store.sparse_layers[0], 0).segments)
