"""What ``bench.load`` checks and reports the same way for our service and for the peer's
(``bench/load_peer.py`` runs in the peer's virtualenv: standard library only here)."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from typing import Any, TypeVar

K = TypeVar("K", bound=Hashable)


def exactly_once(
    written: set[tuple[int, ...]], stamps: Iterable[tuple[int, ...]]
) -> dict[str, int]:
    """How the rows read (``stamps``, one per read) compare with the rows ``written``: each
    must be read once, none twice, missing or unknown."""
    seen: dict[tuple[int, ...], int] = {}
    for stamp in stamps:
        seen[stamp] = seen.get(stamp, 0) + 1
    return {
        "written": len(written),
        "twice": sum(1 for v in seen.values() if v > 1),
        "missing": len(written - set(seen)),
        "extra": len(set(seen) - written),
    }


def servers_memory(
    before: Mapping[K, Mapping[str, float]],
    connected: Mapping[K, Mapping[str, float]],
    roles: Mapping[str, K],
    clients: int,
) -> dict[str, dict[str, Any]]:
    """Each server's memory and descriptors with every client connected, and its memory per
    client (``roles``: role -> the key of its figures in ``before`` / ``connected``)."""
    return {
        role: {
            "rss_mb_before_clients": before[key]["rss_mb"],
            "rss_mb": connected[key]["rss_mb"],
            "fds": connected[key]["fds"],
            "kb_per_client": (connected[key]["rss_mb"] - before[key]["rss_mb"]) * 1024 / clients,
        }
        for role, key in roles.items()
    }
