"""The peer's samplers, mapped to ours by ``init`` (``controller.sampler``).

| peer sampler                 | here                                                        |
|------------------------------|-------------------------------------------------------------|
| ``SequentialSampler``        | our ``fifo`` sampler (arrival order, no duplicates per task)|
| ``GRPOGroupNSampler``        | refused at ``init`` (yet): use our ``group`` sampler        |
| ``SeqlenBalancedSampler``    | refused at ``init`` (yet): use our ``balanced`` sampler     |
| ``RankAwareSampler``         | refused at ``init`` (yet): use ``transferqueue``'s dataset  |
| a user ``BaseSampler``       | refused at ``init`` (yet): register a ``transferqueue``     |
|                              | ``Sampler`` with ``register_sampler``                       |

The classes exist so that peer code that imports and subclasses them keeps importing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

__all__ = [
    "BaseSampler",
    "GRPOGroupNSampler",
    "RankAwareSampler",
    "SeqlenBalancedSampler",
    "SequentialSampler",
    "native_sampler",
]


class BaseSampler(ABC):
    """The peer's sampler seam: ``sample(ready_indexes, batch_size, **sampling_config)``
    returns ``(sampled, consumed)``. Subclass it as with the peer; see the module for which
    ones this store runs."""

    native: ClassVar[str | None] = None
    """Our sampler that serves this one (None: none yet)."""
    instead = "register a transferqueue.Sampler subclass with transferqueue.register_sampler"

    def __init__(self) -> None:
        self._states: dict[Any, Any] = {}

    @abstractmethod
    def sample(
        self, ready_indexes: list[int], batch_size: int, *args: Any, **kwargs: Any
    ) -> tuple[list[int], list[int]]:
        """``(sampled, consumed)`` global indexes out of ``ready_indexes``."""

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[list[int], list[int]]:
        return self.sample(*args, **kwargs)

    def native_options(self) -> dict[str, Any]:
        """Options of our sampler equivalent to this one's settings."""
        return {}


class SequentialSampler(BaseSampler):
    """Ready rows in arrival order, each consumed once per task: our ``fifo``."""

    native: ClassVar[str | None] = "fifo"

    def sample(
        self, ready_indexes: list[int], batch_size: int, *args: Any, **kwargs: Any
    ) -> tuple[list[int], list[int]]:
        picked = list(ready_indexes[:batch_size])
        return picked, list(picked)


class GRPOGroupNSampler(SequentialSampler):
    """Whole groups of ``n_samples_per_prompt`` consecutive rows (not served yet)."""

    native = None
    instead = "use transferqueue's 'group' sampler (rows put with group= ids, group_size=N)"

    def __init__(self, n_samples_per_prompt: int = 1) -> None:
        super().__init__()
        if n_samples_per_prompt < 1:
            raise ValueError(f"n_samples_per_prompt must be > 0, got {n_samples_per_prompt}")
        self.n_samples_per_prompt = n_samples_per_prompt


class SeqlenBalancedSampler(GRPOGroupNSampler):
    """Length-balanced parts across ``dp_size`` ranks (not served yet)."""

    instead = "use transferqueue's 'balanced' sampler (dp_size=, rows put with length=)"

    def __init__(self, n_samples_per_prompt: int = 1, dp_size: int = 1) -> None:
        super().__init__(n_samples_per_prompt)
        if dp_size <= 0:
            raise ValueError(f"dp_size must be positive, got {dp_size}")
        self.dp_size = dp_size


class RankAwareSampler(SequentialSampler):
    """Ranks of one data-parallel group receive the same rows (not served yet)."""

    native = None
    instead = "use transferqueue.client.dataset.StreamingDataset (one leader per DP group)"


def native_sampler(spec: Any) -> tuple[str, dict[str, Any]]:
    """Our sampler name and options for the peer's ``controller.sampler`` setting: a name
    (``"SequentialSampler"``), a class or an instance. One we do not serve is a
    ``NotImplementedError`` naming it and what to use instead."""
    known = {
        c.__name__: c
        for c in (SequentialSampler, GRPOGroupNSampler, SeqlenBalancedSampler, RankAwareSampler)
    }
    if isinstance(spec, str):
        if spec not in known:
            raise ValueError(f"Could not find sampler {spec} (known: {sorted(known)})")
        spec = known[spec]
    if isinstance(spec, type) and issubclass(spec, BaseSampler):
        cls: type[BaseSampler] = spec
        instance = None
    elif isinstance(spec, BaseSampler):
        cls, instance = type(spec), spec
    else:
        raise ValueError(
            f"controller.sampler must be a sampler name, a BaseSampler subclass or instance, "
            f"got {spec!r}"
        )
    if cls.native is None or cls.sample is not SequentialSampler.sample:
        raise NotImplementedError(
            f"sampler {cls.__name__} is not served by the transfer_queue facade over "
            f"transferqueue: {cls.instead}"
        )
    return cls.native, (instance.native_options() if instance is not None else {})
