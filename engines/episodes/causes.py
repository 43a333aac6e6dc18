"""Why an episode's try failed, by cause, and the log line that says so.

A failed try (``env_error`` once the retries are spent) has one cause:

| cause                | what                                                             |
|----------------------|------------------------------------------------------------------|
| ``connection_refused`` | the environment's server cannot be reached (nothing listens,   |
|                      | refused a session)                                               |
| ``connection_lost``  | the connection closed under the episode                          |
| ``timeout``          | no answer within ``timeout_s``                                   |
| ``protocol_error``   | an answer that is not the protocol's: not JSON, the wrong shape, |
|                      | not a ``StepResult``, an agent's reward that is not a number     |
| ``env_raised``       | the environment raised (or its server answered an error)         |
| ``agent_raised``     | the agent program raised                                         |

An environment names the cause of its own :class:`engines.envs.EnvError` (``cause=``); any
other exception is classified by :func:`cause_of`. Each episode counts its tries' causes
(``EpisodeStats.failures``, the first message of each in ``failure_messages``); the train
stage sums them into the step's record (``env_failures``) and names the top ones when a step
gives up on its dropped groups. :class:`CauseLog` writes the first failure of each cause in a
stage at WARNING with its message, then at most one WARNING a minute per cause with the count
since (the CLI shows WARNING and above), the rest at DEBUG.
"""

from __future__ import annotations

import logging
import time

__all__ = [
    "AGENT_RAISED",
    "CAUSES",
    "CONNECTION_LOST",
    "CONNECTION_REFUSED",
    "ENV_RAISED",
    "PROTOCOL_ERROR",
    "TIMEOUT",
    "CauseLog",
    "cause_of",
    "top_causes",
]

CONNECTION_REFUSED = "connection_refused"
CONNECTION_LOST = "connection_lost"
TIMEOUT = "timeout"
PROTOCOL_ERROR = "protocol_error"
ENV_RAISED = "env_raised"
AGENT_RAISED = "agent_raised"
CAUSES = (CONNECTION_REFUSED, CONNECTION_LOST, TIMEOUT, PROTOCOL_ERROR, ENV_RAISED, AGENT_RAISED)
"""Every cause, in the order of the table above."""

_BY_NAME = {  # exception class names of libraries not imported here (httpx, openai, aiohttp)
    "ConnectError": CONNECTION_REFUSED,
    "APIConnectionError": CONNECTION_REFUSED,
    "ClientConnectorError": CONNECTION_REFUSED,
    "ConnectTimeout": TIMEOUT,
    "ReadTimeout": TIMEOUT,
    "APITimeoutError": TIMEOUT,
    "JSONDecodeError": PROTOCOL_ERROR,
    "InvalidHandshake": PROTOCOL_ERROR,
    "RemoteProtocolError": PROTOCOL_ERROR,
}


def cause_of(exc: BaseException, default: str = ENV_RAISED) -> str:
    """The cause of ``exc`` (see the module docstring): an :class:`engines.envs.EnvError`'s
    own ``cause``, else what the exception or one it was raised from is (a refused or reset
    connection, a timeout, a reply that does not parse), else ``default``."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        cause = getattr(e, "cause", None)
        if isinstance(cause, str) and cause in CAUSES:
            return cause
        if isinstance(e, ConnectionRefusedError):
            return CONNECTION_REFUSED
        if isinstance(e, ConnectionResetError | BrokenPipeError | ConnectionAbortedError):
            return CONNECTION_LOST
        if isinstance(e, TimeoutError):
            return TIMEOUT
        for cls in type(e).__mro__:
            if cls.__name__ in _BY_NAME:
                return _BY_NAME[cls.__name__]
        e = e.__cause__ or e.__context__
    return default


def top_causes(counts: dict[str, int], messages: dict[str, str], n: int = 3) -> str:
    """``connection_refused x 24 (first: MESSAGE); timeout x 2 (first: MESSAGE)``: the ``n``
    most frequent causes with their count and first message."""
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n]
    return "; ".join(
        f"{cause} x {count} (first: {messages.get(cause, '?')})" for cause, count in ranked
    )


class CauseLog:
    """The failures of one stage, logged by cause (see the module docstring).

    Args:
        logger: where the lines go.
        what: what happened, for the line (``an episode's try failed``).
        every_s: after the first of a cause, at most one WARNING per cause per this long.
    """

    def __init__(self, logger: logging.Logger, what: str, every_s: float = 60.0) -> None:
        self.logger, self.what, self.every_s = logger, what, every_s
        self._last: dict[str, float] = {}
        self._since: dict[str, int] = {}

    def report(self, cause: str, message: str) -> None:
        """One failure of ``cause`` with the exception's ``message``."""
        now = time.monotonic()
        last = self._last.get(cause)
        if last is None:
            self._last[cause], self._since[cause] = now, 0
            self.logger.warning("%s (%s): %s", self.what, cause, message)
            return
        self._since[cause] += 1
        if now - last < self.every_s:
            self.logger.debug("%s (%s): %s", self.what, cause, message)
            return
        count, self._since[cause], self._last[cause] = self._since[cause], 0, now
        self.logger.warning(
            "%s (%s): %d more time(s) in the last %.0f s; the latest: %s",
            self.what,
            cause,
            count,
            now - last,
            message,
        )
