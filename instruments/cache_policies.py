"""The baselines of the residency replay: per-layer LRU and Belady's MIN, both with a scratch bank.

The replay compares the real residency manager with these two at the same per-layer capacity:
LRU is what a plain cache would do, Belady's MIN the optimum of every demand-fetch policy (the
upper bound no policy can beat). Both take one layer's visits, each a deduplicated row of
experts (`unique_rows`), and return the hits of each visit.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence


def unique_rows(rows: Sequence[Sequence[int]]) -> list[list[int]]:
    """Each row's experts, first occurrences only, in row order."""
    return [list(dict.fromkeys(row)) for row in rows]


def simulate_lru(rows: Sequence[Sequence[int]], *, capacity: int, initial: Sequence[int] = ()) -> list[int]:
    """Plain per-layer LRU; returns the hits of each visit (rows must be deduplicated).

    A visit's hits are decided against the cache as it stood before the
    visit; then its experts become most recent, hits first and misses after,
    each group in row order, evicting the least recent (`initial` starts
    resident, oldest first). A visit with more experts than `capacity` ends
    holding the last `capacity` of that order.
    """
    cache: OrderedDict[int, None] = OrderedDict((expert, None) for expert in initial)
    if len(cache) > capacity:
        raise ValueError(f"{len(cache)} initial experts exceed capacity {capacity}")
    out = []
    for row in rows:
        misses = [expert for expert in row if expert not in cache]
        for expert in row:
            if expert in cache:
                cache.move_to_end(expert)
        for expert in misses:
            cache[expert] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
        out.append(len(row) - len(misses))
    return out


def next_uses(rows: Sequence[Sequence[int]]) -> tuple[list[list[int]], dict[int, int]]:
    """For each (visit, expert) the index of that expert's next visit (len(rows) if none),
    and each expert's first visit; one backward pass."""
    never = len(rows)
    following: dict[int, int] = {}
    out: list[list[int]] = [[]] * len(rows)
    for index in range(len(rows) - 1, -1, -1):
        row = rows[index]
        out[index] = [following.get(expert, never) for expert in row]
        for expert in row:
            following[expert] = index
    return out, following


def simulate_belady(rows: Sequence[Sequence[int]], *, capacity: int, initial: Sequence[int] = ()) -> list[int]:
    """Belady's MIN for one layer with a scratch bank; hits per visit (rows deduplicated).

    After each visit the cache keeps the `capacity` experts of (cache before
    the visit) + (the visit's experts) whose next use is soonest; experts
    never used again go first. The visit's own experts are candidates too:
    they have been served from the scratch bank, so keeping them is a choice.

    Why this is the optimum of every demand-fetch policy with this capacity
    and start (ours included: it loads only requested experts, and after a
    visit its resident set at the layer is a subset of its set before plus
    the visit's experts, of at most capacity): a visit's hits are the
    requested experts resident at its start, and after it any subset of
    (before + requested) of size <= capacity is reachable. Take an optimal
    schedule OPT that agrees with MIN up to visit t and differs after it:
    MIN keeps y, OPT does not (if OPT keeps fewer than capacity, adding y
    costs nothing). OPT keeps some x that MIN dropped, so next(y) <= next(x).
    Let OPT' keep y instead of x and copy OPT's choices (minus x) from then
    on. Up to next(y) neither x nor y is requested, so the hits agree; at
    next(y) OPT' hits y where OPT misses it (or both hit, when next(x) ==
    next(y)); afterwards OPT' holds OPT's set minus at most x and loses at
    most x's hit at next(x), where it can take OPT's set again. So OPT' is
    optimal and agrees with MIN one visit longer; by induction MIN is
    optimal. The tests compare it with an exhaustive search over every
    reachable cache state.
    """
    following, first = next_uses(rows)
    never = len(rows)
    cache: dict[int, int] = {expert: first.get(expert, never) for expert in initial}
    if len(cache) > capacity:
        raise ValueError(f"{len(cache)} initial experts exceed capacity {capacity}")
    heap = [(-use, expert) for expert, use in cache.items()]
    heapq.heapify(heap)
    out = []
    for row, uses in zip(rows, following):
        out.append(sum(1 for expert in row if expert in cache))
        for expert, use in zip(row, uses):
            cache[expert] = use
            heapq.heappush(heap, (-use, expert))
        while len(cache) > capacity:
            use, expert = heapq.heappop(heap)
            if cache.get(expert) == -use:  # else a stale entry: the expert was used again
                del cache[expert]
        if len(heap) > 4 * capacity + 64:  # drop stale entries, keep the heap O(capacity)
            heap = [(-use, expert) for expert, use in cache.items()]
            heapq.heapify(heap)
    return out
