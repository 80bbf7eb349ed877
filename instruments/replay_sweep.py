"""Hit rate against capacity: the replay of all three policies at several slots per layer, and its plot.

One capacity says little about a policy; the sweep shows where ours sits between LRU and Belady
from a starved cache to a generous one (`--plot`).
"""

from __future__ import annotations

from collections.abc import Sequence

from instruments.residency_replay import Capacity, replay
from shared.trace import Trace


def sweep_points(slots: int, sweep: str | None) -> list[int]:
    """The capacities of `--sweep` (a comma list), or about a dozen from 1 to twice `slots`."""
    if sweep:
        points = [int(text) for text in sweep.split(",") if text.strip()]
        if not points or min(points) < 1:
            raise ValueError(f"--sweep needs positive integers, got {sweep!r}")
        return sorted(set(points))
    step = max(1, (2 * slots) // 12)
    return sorted({*range(1, 2 * slots + 1, step), slots, 2 * slots})


def plot_sweep(path: str, points: list[int], curves: dict[str, list[float]], *, title: str, marked: int) -> None:
    """The curves as a PNG at `path`, the capacity asked for (`marked`) as a dotted line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for name, values in curves.items():
        axes.plot(points, values, marker="o", label=name)
    axes.axvline(marked, color="grey", linestyle=":", linewidth=1)
    axes.set_xlabel("slots per layer (lru/belady: + the layer's pins)")
    axes.set_ylabel("hit rate")
    axes.set_ylim(0, 1)
    axes.set_title(title, fontsize=9)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def sweep_hit_rates(
    trace: Trace,
    points: Sequence[int],
    *,
    working_slots: int,
    pins: tuple[tuple[int, int], ...],
    pins_source: str,
    rows: list[list[int]] | None = None,
) -> dict[str, list[float]]:
    """Each policy's hit rate at each of `points` slots per layer, the working bank and pins fixed."""
    curves: dict[str, list[float]] = {"ours": [], "lru": [], "belady": []}
    for slots in points:
        capacity = Capacity(slots_per_layer=slots, working_slots=working_slots, pins=pins, pins_source=pins_source)
        point = replay(trace, capacity, rows=rows)
        for name in curves:
            curves[name].append(point[name].hit_rate)
    return curves
