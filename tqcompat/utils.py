"""The peer's ``transfer_queue.utils.logging_utils``: ``get_logger``, which its recipes and
demos import by that path.

| peer                               | here                                               |
|------------------------------------|----------------------------------------------------|
| ``get_logger(name, default_level)`` | a ``logging`` logger at ``TQ_LOGGING_LEVEL`` (else |
|                                    | ``default_level``), with a stream handler if none  |
"""

from __future__ import annotations

import logging
import os

__all__ = ["get_logger"]

_FORMAT = "%(asctime)s - %(levelname)s - %(name)s - %(message)s"


def get_logger(name: str | None, default_level: str = "WARNING") -> logging.Logger:
    """The logger ``name`` at the level ``TQ_LOGGING_LEVEL`` names (else ``default_level``),
    given a stream handler when no handler reaches it (a Ray worker's fresh process)."""
    logger = logging.getLogger(name)
    logger.setLevel(os.environ.get("TQ_LOGGING_LEVEL", default_level))
    if not logger.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(_FORMAT))
        logger.addHandler(handler)
    return logger
