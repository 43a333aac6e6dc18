"""Token budgets: samples packed into micro-batches, and shared across data-parallel ranks.

Called by the train and reference adapters on the samples of one leased batch, with each
sample's token count (prompt + response), before any forward pass; pure functions of the
lengths, so that every rank could compute the same answer.

| function                  | splits into                         | guarantee                  |
|---------------------------|-------------------------------------|----------------------------|
| :func:`pack_by_tokens`    | micro-batches of at most            | never over the budget, but |
|                           | ``max_tokens`` tokens (first-fit    | a sample longer than it,   |
|                           | decreasing)                         | alone                      |
| :func:`balance_by_tokens` | ``parts`` shares, one per rank      | heaviest share at most     |
|                           |                                     | ``max(l1, mean + (1 -      |
|                           |                                     | 1/parts) * l[parts+1])``   |

For :func:`balance_by_tokens`, ``l1 >= l2 >= ...`` are the sample lengths in decreasing order
and ``mean`` the total over ``parts``. The bound is that of longest-processing-time-first
assignment (each sample, longest first, to the lightest share): the heaviest share's last
sample ``p`` joined it when it was the lightest, at most ``(total - p) / parts``, and a share
with more than one sample received its last one after the first ``parts`` samples, so
``p <= l[parts+1]``. Improving moves and swaps between the heaviest share and the others
follow, and never raise the heaviest. So no share exceeds ``1.1 * mean`` whenever
``l1 <= 1.1 * mean`` and ``l[parts+1] <= 0.1 * mean * parts / (parts - 1)`` (for two ranks:
the third-longest sample holds at most a tenth of the tokens): the items allow it. Where one
sample is longer than ``1.1 * mean`` no split can do better than ``l1``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["balance_by_tokens", "pack_by_tokens"]


def _lengths(lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if arr.size and int(arr.min()) < 0:
        raise ValueError(
            f"token counts must be >= 0, got {int(arr.min())} (an unknown length header?)"
        )
    return arr


def pack_by_tokens(lengths: Sequence[int] | np.ndarray, max_tokens: int) -> list[np.ndarray]:
    """Positions ``0..n-1`` in micro-batches of at most ``max_tokens`` summed lengths.

    First-fit decreasing: longest first, each into the first micro-batch with room, else a
    new one (at most 11/9 of the fewest possible micro-batches, plus one); similar lengths
    share a micro-batch, which keeps the padding of engines that pad small. A sample longer
    than ``max_tokens`` gets a micro-batch of its own. Each micro-batch's positions are in
    ascending order; micro-batches go heaviest first.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    lens = _lengths(lengths)
    bins: list[list[int]] = []
    room: list[int] = []
    for pos in np.argsort(-lens, kind="stable").tolist():
        size = int(lens[pos])
        for b, left in enumerate(room):
            if size <= left:
                bins[b].append(pos)
                room[b] -= size
                break
        else:
            bins.append([pos])
            room.append(max_tokens - size)
    return [np.sort(np.asarray(b, dtype=np.int64)) for b in bins]


def balance_by_tokens(lengths: Sequence[int] | np.ndarray, parts: int) -> list[np.ndarray]:
    """Positions ``0..n-1`` in ``parts`` shares of near-equal summed lengths (see the module
    docstring for the bound). Every share gets a sample while there are at least ``parts``;
    the row counts may differ. Positions ascending within each share."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    lens = _lengths(lengths)
    shares: list[list[int]] = [[] for _ in range(parts)]
    load = [0] * parts
    for pos in np.argsort(-lens, kind="stable").tolist():
        r = min(range(parts), key=lambda i: (load[i], len(shares[i]), i))
        shares[r].append(pos)
        load[r] += int(lens[pos])
    for _ in range(4 * int(lens.size) + 4):  # each round lowers the sorted loads: finite
        if not _improve(shares, load, lens):
            break
    return [np.sort(np.asarray(s, dtype=np.int64)) for s in shares]


def _improve(shares: list[list[int]], load: list[int], lens: np.ndarray) -> bool:
    """One move (a sample from the heaviest share to another) or swap (a longer sample of the
    heaviest for a shorter one of another) that lowers the larger of the two loads below the
    heaviest; the best such, or False. A share is never left empty."""
    heavy = max(range(len(load)), key=lambda i: (load[i], -i))
    top = load[heavy]
    best: tuple[int, int, int, int] | None = None  # (new max of the pair, other, a, b or -1)
    for other in range(len(load)):
        if other == heavy:
            continue
        for a in shares[heavy]:
            la = int(lens[a])
            if len(shares[heavy]) > 1:
                pair = max(top - la, load[other] + la)
                if pair < top and (best is None or pair < best[0]):
                    best = (pair, other, a, -1)
            for b in shares[other]:
                lb = int(lens[b])
                if la <= lb:
                    continue
                pair = max(top - la + lb, load[other] + la - lb)
                if pair < top and (best is None or pair < best[0]):
                    best = (pair, other, a, b)
    if best is None:
        return False
    _, other, a, b = best
    shares[heavy].remove(a)
    shares[other].append(a)
    delta = int(lens[a])
    if b >= 0:
        shares[other].remove(b)
        shares[heavy].append(b)
        delta -= int(lens[b])
    load[heavy] -= delta
    load[other] += delta
    return True
