"""Samplers: how a consumer task's batches are chosen (a registry of small classes).

| name       | hands out                                              | options               |
|------------|--------------------------------------------------------|-----------------------|
| fifo       | oldest version first, arrival order within a version   |                       |
| group      | whole groups of ``group_size`` rows only               | group_size            |
| balanced   | a batch split into ``dp_size`` length-balanced parts   | dp_size, group_size?  |

Add one with ``@register_sampler("name")`` on a :class:`Sampler` subclass.
"""

from transferqueue.controller.samplers.balanced import BalancedSampler
from transferqueue.controller.samplers.base import HeaderView, Sampler, Selection
from transferqueue.controller.samplers.fifo import FifoSampler
from transferqueue.controller.samplers.group import GroupSampler
from transferqueue.controller.samplers.registry import get_sampler, register_sampler, sampler_names

__all__ = [
    "BalancedSampler",
    "FifoSampler",
    "GroupSampler",
    "HeaderView",
    "Sampler",
    "Selection",
    "get_sampler",
    "register_sampler",
    "sampler_names",
]
