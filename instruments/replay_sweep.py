"""Hit rate against capacity: the replay of every policy at several slots per layer, as a table and a plot.

One capacity says little about a policy; the sweep shows where ours (under each replacement
policy named) sits between LRU and Belady from a starved cache to a generous one (`--sweep`,
`--plot`).
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


def format_sweep(points: Sequence[int], curves: dict[str, list[float]]) -> list[str]:
    """The sweep as text lines: one row per capacity, one column per curve (hit rates in %)."""
    width = max(8, *(len(name) for name in curves))
    lines = [f"{'slots':>5} " + " ".join(f"{name:>{width}}" for name in curves)]
    for index, slots in enumerate(points):
        lines.append(f"{slots:>5} " + " ".join(f"{100 * values[index]:>{width}.2f}" for values in curves.values()))
    return lines


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
    replacements: Sequence[str] = ("lru",),
    rows: list[list[int]] | None = None,
) -> dict[str, list[float]]:
    """Each policy's hit rate at each of `points` slots per layer, the working bank and pins fixed:
    "ours:NAME" for every replacement policy named, then "lru" and "belady"."""
    curves: dict[str, list[float]] = {}
    for slots in points:
        capacity = Capacity(slots_per_layer=slots, working_slots=working_slots, pins=pins, pins_source=pins_source)
        point = replay(trace, capacity, replacements=replacements, rows=rows)
        for name, result in point.items():
            if name != "ours":  # the first policy's alias
                curves.setdefault(name, []).append(result.hit_rate)
    return curves
