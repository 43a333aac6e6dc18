"""Episodes: a model and an environment taking turns, recorded token by token.

| module                                 | what                                               |
|----------------------------------------|----------------------------------------------------|
| :mod:`engines.episodes.record`         | :class:`Episode`: tokens, loss mask, per-token     |
|                                        | log-probs and versions, turns, rewards, end reason |
| :mod:`engines.episodes.format`         | :class:`TurnFormat`: observation tokens between    |
|                                        | turns (the chat template's), turn text             |
| :mod:`engines.episodes.runner`         | :class:`EpisodeRunner`: the turn loop, bounds,     |
|                                        | retries, failures and timeouts                     |
| :mod:`engines.episodes.batcher`        | :class:`TurnBatcher`: turns of many episodes in    |
|                                        | few ``generate`` calls                             |

The environments themselves are in :mod:`engines.envs`. Nothing here knows TransferQueue: the
rollout adapter (``adapters.rollout``) turns episodes into columns.
"""

from engines.episodes.batcher import TurnBatcher
from engines.episodes.format import TRUNCATION_MARKER, TurnFormat
from engines.episodes.record import END_REASONS, Episode, EpisodeBuilder, token_versions
from engines.episodes.runner import (
    EpisodeLimits,
    EpisodeRunner,
    EpisodeSource,
    EpisodeStats,
    TurnGenerate,
)

__all__ = [
    "END_REASONS",
    "TRUNCATION_MARKER",
    "Episode",
    "EpisodeBuilder",
    "EpisodeLimits",
    "EpisodeRunner",
    "EpisodeSource",
    "EpisodeStats",
    "TurnBatcher",
    "TurnFormat",
    "TurnGenerate",
    "token_versions",
]
