"""One worker process per reserved NeuronCore, and the coordinator feeding them.

A :class:`Pool` is owned by the session of a runtime (``neuronmp.session``), which
starts it on the first model load and closes it when the runtime shuts down.
The layers above take the pool's names from this package, never from its
modules, so the modules may be rearranged:

    Pool                                   the executor (coordinator.py)
    Answer, Destination, Joint, gather,    the answer type and what fills it;
    wake, Pending                          a blocking call's answer (answer.py)
    wakes_deferred, answers_read_ahead     device-time pacing hints (pacing.py)
    LoopAnswer, Timer, channel_for         a core owned by an event loop
                                           (loopchannel.py)

Everything loads on first use (and so torch): monitors import
``neuronmp.pool.stats`` alone and stay torch-free.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .answer import Answer, Destination, Joint, Pending, gather, wake
    from .coordinator import Pool
    from .loopchannel import LoopAnswer, Timer, channel_for
    from .pacing import answers_read_ahead, wakes_deferred

_WHERE = {
    "Pool": "coordinator",
    "Answer": "answer", "Destination": "answer", "Joint": "answer", "gather": "answer",
    "wake": "answer", "Pending": "answer",
    "wakes_deferred": "pacing", "answers_read_ahead": "pacing",
    "LoopAnswer": "loopchannel", "Timer": "loopchannel", "channel_for": "loopchannel",
}

__all__ = ["Answer", "Destination", "Joint", "LoopAnswer", "Pending", "Pool", "Timer",
           "answers_read_ahead", "channel_for", "gather", "wake", "wakes_deferred"]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
