"""Names of the policy objectives (``train.loss``), without torch: the config checks them
before anything loads torch (:mod:`engines.loss` computes them)."""

__all__ = ["OBJECTIVES"]

OBJECTIVES = ("tis", "decoupled")
"""``tis``: truncated importance weights; ``decoupled``: a proximal policy (see
:mod:`engines.loss`)."""
