"""Autoscaling the rollout while a run goes on (``rollout.autoscale={min: 1, max: 8}``).

The policy reads the step records the driver writes anyway: over a window of
``window_steps`` steps (each weighted by its time), the share of time the trainer waited for
data (``stages.train.idle``) and the share the generators were busy (``stages.rollout.busy``,
averaged over the instances).

| over the window                                                | decision                 |
|----------------------------------------------------------------|--------------------------|
| trainer idle >= ``grow_train_idle`` and generators busy >=     | one instance more, up to |
| ``grow_rollout_busy``: the trainer starves on busy generators  | ``max``                  |
| generators busy <= ``shrink_rollout_busy``: capacity unused    | one instance less, down  |
| (the trainer, or the staleness bound, sets the pace)           | to ``min``               |
| anything between (the hysteresis)                              | none                     |

After a change the window starts again once ``cooldown_steps`` steps have passed (the new
count's own steps only), so that one decision is judged by its effect before the next. The
change itself is the same as ``asyncflow scale OUTPUT_DIR rollout=N`` (:mod:`asyncflow.deploy.
ray_scale`): a new instance is placed by Ray as at start (Ray is asked for the resources of
``max`` instances' worth as the count grows, so that Ray's autoscaler can add nodes), loads
the newest weights and takes batches within the staleness bound; one that leaves drains. A
grow that finds no resources within ``deploy.start_timeout_s`` is logged and the run goes on.
Every decision is logged (WARNING: it changes the run) with its reason and put into that
step's record (``autoscale``: ``from``, ``to``, ``reason``, the two shares); each record
carries ``instances``.
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from asyncflow.config import AutoscaleConfig
from asyncflow.control import ControlError
from asyncflow.supervisor import Job

__all__ = ["Autoscaler", "decide"]

log = logging.getLogger(__name__)


def decide(
    cfg: AutoscaleConfig, n: int, train_idle: float, rollout_busy: float
) -> tuple[int, str] | None:
    """The instance count for ``n`` instances over a window with these shares, and why; None
    to keep ``n`` (see the module doc)."""
    shares = f"the trainer waited for data {train_idle:.0%} of the window, the generators "
    shares += f"were busy {rollout_busy:.0%}"
    if train_idle >= cfg.grow_train_idle and rollout_busy >= cfg.grow_rollout_busy:
        if n < cfg.max:
            why = f"{shares} (grow at >= {cfg.grow_train_idle:.0%} and >= "
            return n + 1, why + f"{cfg.grow_rollout_busy:.0%})"
        return None
    if rollout_busy <= cfg.shrink_rollout_busy and n > cfg.min:
        return n - 1, f"{shares} (shrink at <= {cfg.shrink_rollout_busy:.0%})"
    return None


class Autoscaler:
    """Observes each step record (:meth:`observe`) and changes the rollout's instances by
    :func:`decide`; ``scale(n)`` sets the count (returns the count before), ``spawn`` runs
    the change as a supervised job while the run goes on."""

    def __init__(
        self,
        cfg: AutoscaleConfig,
        scale: Callable[[int], Awaitable[int]],
        spawn: Callable[[str, Job], None],
    ) -> None:
        self.cfg = cfg
        self._scale = scale
        self._spawn = spawn
        self._window: deque[tuple[float, float, float]] = deque(maxlen=cfg.window_steps)
        self._cooldown = 0
        self._changing = False
        self.decisions: list[dict[str, Any]] = []
        """Every decision made: ``step``, ``from``, ``to``, ``reason``, the shares, and
        ``done`` (False while the change runs, None when it failed)."""

    def observe(self, record: dict[str, Any]) -> dict[str, Any] | None:
        """Take one step's record; the decision made on it (also put into the record as
        ``autoscale``), or None."""
        if self._changing:  # (the window restarts once the change is done)
            return None
        if self._cooldown:
            self._cooldown -= 1
            return None
        stages = record.get("stages", {})
        train = stages.get("train", {}).get("idle")
        rollout = stages.get("rollout", {}).get("busy")
        if train is None or rollout is None:
            return None
        self._window.append((max(float(record["step_s"]), 1e-9), float(train), float(rollout)))
        if len(self._window) < self.cfg.window_steps:
            return None
        total = sum(w for w, _, _ in self._window)
        train_idle = sum(w * t for w, t, _ in self._window) / total
        rollout_busy = sum(w * r for w, _, r in self._window) / total
        n = int(record["instances"]["rollout"])
        verdict = decide(self.cfg, n, train_idle, rollout_busy)
        if verdict is None:
            return None
        target, reason = verdict
        decision: dict[str, Any] = {
            "step": record["step"],
            "from": n,
            "to": target,
            "reason": reason,
            "train_idle": round(train_idle, 3),
            "rollout_busy": round(rollout_busy, 3),
            "done": False,
        }
        self.decisions.append(decision)
        record["autoscale"] = {k: v for k, v in decision.items() if k != "done"}
        log.warning(
            "autoscale after step %d: rollout %d -> %d instances: %s",
            record["step"],
            n,
            target,
            reason,
        )
        self._changing = True
        self._window.clear()
        try:
            self._spawn(f"autoscale/{record['step']}", functools.partial(self._change, decision))
        except RuntimeError:  # (the run is stopping: its last steps)
            self._changing, decision["done"] = False, None
        return decision

    async def _change(self, decision: dict[str, Any]) -> None:
        try:
            await self._scale(decision["to"])
            decision["done"] = True
        except ControlError as e:  # (no resources in time, ...: the run goes on as it is)
            decision["done"] = None
            log.warning(
                "autoscale: rollout %d -> %d instances failed, the run goes on with %d: %s",
                decision["from"],
                decision["to"],
                decision["from"],
                e,
            )
        finally:
            self._changing = False
            self._cooldown = self.cfg.cooldown_steps
