"""neuron-monitor's configuration file, read and checked: which metric groups, how often, for
which applications.

    {"period": "1s",                                    root: every group's default
     "neuron_runtimes": [{"tag_filter": "^app_",        a regex searched in each tag
                          "period": "2s",               this entry's groups' default
                          "metrics": [{"type": "neuroncore_counters", "period": "500ms"}]}],
     "system_metrics": [{"type": "vcpu_usage"}]}

A group's period is its own, else its runtime entry's, else the root's, else 5 s.
Periods are Go durations, as neuron-monitor (a Go program) reads them: a number and a
unit, repeated (``1s``, ``500ms``, ``1m30s``).  A tag filter is searched anywhere in the
tag (Go's ``regexp.MatchString``), so ``.*`` and ``^app_1$`` mean what they do there;
an application is monitored by the first entry whose filter matches.  Without a file:
every group of both kinds, 5 s, every application.

Anything else is a ``MonitorConfigError`` naming the field by its path in the file,
the value, and what is accepted.  Imports no torch.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, List, Optional, Pattern, Tuple

from ..errors import MonitorConfigError

#: the application-level metric groups, in the order neuron-monitor reports them
RUNTIME_GROUPS = ("neuroncore_counters", "execution_stats", "memory_used",
                  "neuron_runtime_vcpu_usage")
#: the system-wide metric groups
SYSTEM_GROUPS = ("neuron_hw_counters", "vcpu_usage", "memory_info")
DEFAULT_PERIOD = 5.0
MIN_PERIOD = 0.01   # seconds: a shorter one would be a busy loop, not a report stream
_UNITS = {"ns": 1e-9, "us": 1e-6, "\u00b5s": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0,
          "h": 3600.0}
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|\u00b5s|ms|s|m|h)")
_PERIOD_ACCEPTED = (f"a Go duration string of at least {MIN_PERIOD * 1000:.0f}ms: a number "
                    "and a unit (ns, us, ms, s, m, h), repeated, such as \"1s\", \"500ms\", "
                    "\"1m30s\"")
_ROOT_KEYS = ("period", "neuron_runtimes", "system_metrics")
_RUNTIME_KEYS = ("tag_filter", "period", "metrics", "address")   # address: older files
_GROUP_KEYS = ("type", "period")


@dataclass(frozen=True)
class Group:
    """One metric group to collect: its type and period (seconds)."""

    type: str
    period: float


@dataclass(frozen=True)
class RuntimeEntry:
    """The applications one ``neuron_runtimes`` entry selects, and their groups."""

    tag_filter: Optional[Pattern[str]]
    groups: Tuple[Group, ...]

    def matches(self, tag: str) -> bool:
        return self.tag_filter is None or self.tag_filter.search(tag) is not None


@dataclass(frozen=True)
class MonitorConfig:
    """What to collect: per application (the first matching entry) and system-wide."""

    runtimes: Tuple[RuntimeEntry, ...]
    system: Tuple[Group, ...]
    period: float = DEFAULT_PERIOD   # the root's: how often a file with no group reports

    def entry_for(self, tag: str) -> Optional[int]:
        """The index of the runtime entry that monitors ``tag``, or None."""
        for i, entry in enumerate(self.runtimes):
            if entry.matches(tag):
                return i
        return None


def default() -> MonitorConfig:
    """Every group, 5 s, every application: neuron-monitor without ``-c``."""
    return MonitorConfig(
        (RuntimeEntry(None, tuple(Group(t, DEFAULT_PERIOD) for t in RUNTIME_GROUPS)),),
        tuple(Group(t, DEFAULT_PERIOD) for t in SYSTEM_GROUPS))


def load(path: str) -> MonitorConfig:
    """The configuration in file ``path``; OSError when it cannot be read,
    MonitorConfigError when it is not a valid configuration."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise MonitorConfigError(path, "(the file)", text[:60], f"it is not JSON ({exc})",
                                 "a JSON object as the neuron-monitor user guide shows") from None
    return parse(doc, path)


def parse(doc: Any, path: str = "<config>") -> MonitorConfig:
    """A configuration from its JSON document (``path`` names it in errors)."""
    check = _Checker(path)
    root = check.mapping(doc, "(root)", _ROOT_KEYS)
    period = check.period(root.get("period"), "period", DEFAULT_PERIOD)
    runtimes = []
    for i, raw in enumerate(check.array(root.get("neuron_runtimes", []), "neuron_runtimes")):
        where = f"neuron_runtimes[{i}]"
        entry = check.mapping(raw, where, _RUNTIME_KEYS)
        regex = check.regex(entry.get("tag_filter"), f"{where}.tag_filter")
        own = check.period(entry.get("period"), f"{where}.period", period)
        groups = check.groups(entry.get("metrics", []), f"{where}.metrics", RUNTIME_GROUPS, own)
        runtimes.append(RuntimeEntry(regex, groups))
    system = check.groups(root.get("system_metrics", []), "system_metrics", SYSTEM_GROUPS,
                          period)
    return MonitorConfig(tuple(runtimes), system, period)


def parse_period(text: str) -> Optional[float]:
    """Seconds of a Go duration string (``1s``, ``1m30s``, ``250ms``), or None."""
    if not isinstance(text, str) or not text:
        return None
    pos, total = 0, 0.0
    while pos < len(text):
        m = _DURATION.match(text, pos)
        if m is None:
            return None
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    return total


class _Checker:
    """Checks one document's fields, naming each by its path in the file."""

    def __init__(self, path: str):
        self.path = path

    def fail(self, field: str, value: Any, reason: str, accepted: str) -> MonitorConfigError:
        return MonitorConfigError(self.path, field, value, reason, accepted)

    def mapping(self, value: Any, field: str, keys: Tuple[str, ...]) -> dict:
        if not isinstance(value, dict):
            raise self.fail(field, value, "it is not a JSON object",
                            f"an object with the fields {', '.join(keys)}")
        for key in value:
            if key not in keys:
                where = key if field == "(root)" else f"{field}.{key}"
                raise self.fail(where, value[key], "unknown field",
                                f"the fields {', '.join(keys)}")
        return value

    def array(self, value: Any, field: str) -> list:
        if not isinstance(value, list):
            raise self.fail(field, value, "it is not a JSON array", "an array of objects")
        return value

    def period(self, value: Any, field: str, inherited: float) -> float:
        if value is None:
            return inherited
        seconds = parse_period(value)
        if seconds is None:
            raise self.fail(field, value, "it is not a duration", _PERIOD_ACCEPTED)
        if seconds < MIN_PERIOD:
            raise self.fail(field, value, "the period is too short", _PERIOD_ACCEPTED)
        return seconds

    def regex(self, value: Any, field: str) -> Optional[Pattern[str]]:
        if value is None:
            return None
        if not isinstance(value, str):
            raise self.fail(field, value, "it is not a string", "a regular expression string")
        try:
            return re.compile(value)
        except re.error as exc:
            raise self.fail(field, value, f"it is not a regular expression ({exc})",
                            "a regular expression (such as \".*\" or \"^my_app_[0-9]+$\")") \
                from None

    def groups(self, value: Any, field: str, known: Tuple[str, ...],
               period: float) -> Tuple[Group, ...]:
        out: List[Group] = []
        for i, raw in enumerate(self.array(value, field)):
            where = f"{field}[{i}]"
            group = self.mapping(raw, where, _GROUP_KEYS)
            kind = group.get("type")
            if kind not in known:
                other = SYSTEM_GROUPS if known is RUNTIME_GROUPS else RUNTIME_GROUPS
                reason = ("a system metric group, not an application's" if kind in other
                          and known is RUNTIME_GROUPS else
                          "an application's metric group, not a system one" if kind in other
                          else "unknown metric group")
                raise self.fail(f"{where}.type", kind, reason, ", ".join(known))
            if any(g.type == kind for g in out):
                raise self.fail(f"{where}.type", kind, "the group is listed twice",
                                "each metric group once per entry")
            out.append(Group(kind, self.period(group.get("period"), f"{where}.period",
                                               period)))
        return tuple(out)
