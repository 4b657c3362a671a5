"""The BatchingServer's configuration: what each argument accepts, checked once.

    BatchingServer(model, max_batch_size, max_queue_delay_ms, max_queue_size=...,
                   timeout=..., batches_per_core=..., preferred_batch_size=...,
                   priority_levels=..., default_priority_level=...,
                   priority_queue_policy={level: QueuePolicy})
        │ each checked here: a ValueError/TypeError naming the argument, the value
        ▼ and what is accepted, raised in the caller's constructor call
    Rules: the checked batching rules every path's queue follows (queue.py), one
    QueuePolicy per priority level

Owns :class:`QueuePolicy` (Triton's ``ModelQueuePolicy``), :class:`Rules` and the
argument checks; no state, no threads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Sequence, Tuple

__all__ = ["QueuePolicy", "Rules", "check_default_level", "check_int", "check_number",
           "check_policies", "check_preferred", "check_priority", "traced_batch"]


@dataclass(frozen=True)
class QueuePolicy:
    """The queue policy of one priority level (Triton's ``ModelQueuePolicy``).

    ``max_queue_size``: requests that may wait at this level (None: no bound; a request
    beyond it is refused with QueueFullError at once).  ``timeout``: the level's default
    per-request deadline in seconds (None: none; RequestTimeoutError past it).
    """

    max_queue_size: Optional[int] = None
    timeout: Optional[float] = None


@dataclass(frozen=True)
class Rules:
    """The batching rules of one server, checked: what every path's queue applies.

    ``delay`` is ``max_queue_delay_ms`` in seconds; ``preferred`` the sorted preferred
    sizes; ``policies`` one QueuePolicy per queue (level 1 first; one without
    levels); ``default_index`` the queue of a request that names no level."""

    max_batch_size: int
    delay: float
    preferred: Tuple[int, ...]
    wait_when_idle: bool
    levels: int
    default_level: int
    default_index: int
    policies: Tuple[QueuePolicy, ...]


def traced_batch(model: Any) -> int:
    """The model's traced batch (the dim-0 size its inputs share), or a ValueError."""
    if not model.batch:
        raise ValueError(
            "BatchingServer needs a model whose traced inputs share their dim-0 (batch) "
            f"size; this one was traced with {model.describe_signature()}"
        )
    return int(model.batch)


def check_int(name: str, value: Any, low: int, default: Optional[int] = None) -> int:
    if value is None and default is not None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"BatchingServer: {name} must be an int >= {low}, got {value!r}")
    return value


def check_preferred(sizes: Sequence[int], max_batch_size: int) -> Tuple[int, ...]:
    if isinstance(sizes, int) or not isinstance(sizes, (list, tuple)):
        raise ValueError("BatchingServer: preferred_batch_size must be a list of row "
                         f"counts, got {sizes!r}")
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int) or \
                not 1 <= size <= max_batch_size:
            raise ValueError(f"BatchingServer: preferred_batch_size {size!r} is not a row "
                             f"count in 1..max_batch_size ({max_batch_size})")
    return tuple(sorted(set(sizes)))


def check_default_level(level: Optional[int], levels: int) -> int:
    if level is None:
        return levels            # the lowest level (0 without levels)
    if not levels:
        if level != 0:
            raise ValueError(f"BatchingServer: default_priority_level {level!r} needs "
                             "priority_levels >= 1; without levels it is 0")
        return 0
    if isinstance(level, bool) or not isinstance(level, int) or not 1 <= level <= levels:
        raise ValueError(f"BatchingServer: default_priority_level must be in 1..{levels} "
                         f"(priority_levels), got {level!r}")
    return level


def check_policies(given: Optional[Mapping[int, QueuePolicy]], levels: int,
                    default: QueuePolicy) -> List[QueuePolicy]:
    """One policy per queue: the level's own, else the default one."""
    given = dict(given or {})
    for level, policy in given.items():
        if not levels or isinstance(level, bool) or not isinstance(level, int) or \
                not 1 <= level <= levels:
            raise ValueError(f"BatchingServer: priority_queue_policy level {level!r} is not "
                             f"one of the priority levels 1..{levels}")
        if not isinstance(policy, QueuePolicy):
            raise TypeError("BatchingServer: priority_queue_policy values must be "
                            f"QueuePolicy, got {type(policy).__name__} for level {level}")
        if policy.max_queue_size is not None:
            check_int(f"priority_queue_policy[{level}].max_queue_size",
                       policy.max_queue_size, 1)
        if policy.timeout is not None:
            check_number(f"priority_queue_policy[{level}].timeout", policy.timeout)
    return [given.get(k + 1, default) for k in range(max(1, levels))]


def check_number(name: str, value: Any, allow_zero: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (
        value >= 0 if allow_zero else value > 0) and value == value and value != float("inf")
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"BatchingServer: {name} must be a finite number {bound}, "
                         f"got {value!r}")
    return float(value)



def check_priority(priority: Any, levels: int, default: int) -> int:
    """The queue index (0 = level 1, the highest) of a request's ``priority``: 1..levels,
    or None/0 for the ``default`` level; a ValueError naming the accepted ones."""
    if priority is None or priority == 0:
        return default - 1 if levels else 0
    if isinstance(priority, bool) or not isinstance(priority, int) or \
            not 1 <= priority <= levels:
        accepted = (f"1 (highest) .. {levels}, or 0/None for the default level {default}"
                    if levels else "0 or None: this server has no priority_levels")
        raise ValueError(f"BatchingServer: priority {priority!r} is not a level; "
                         f"accepted: {accepted}")
    return priority - 1
