"""Device-time cores: how long a request takes on the emulated NeuronCore.

A real NeuronCore computes while the host CPU is free.  A model with a latency
model makes its emulated core behave the same way: the worker computes the real
outputs on the host CPU, and the answer reaches the caller only once the modelled
time since the request's start has passed (``pool.worker._modelled``; no CPU is
burnt meanwhile), so the core never answers sooner than the device would and its
busy time (neuronmp-top) is the modelled time.

    cost(rows) = FIXED + PER_ROW * rows                  ("FIXED[,PER_ROW]", us)
    cost(rows) = table[smallest size >= rows]            ({batch size: us})
               = ceil(rows / largest) * table[largest]   (above the table)

``rows`` is dim 0 of the request's first input as the worker receives it (a
DataParallel chunk of two traced batches of 32 is 64 rows).

Where a model's latency model comes from, first match wins:

    device_time_context(spec)  (placement API, active when the model loads)
    trace(..., device_time=spec)
    NEURONMP_DEVICE_TIME_US="FIXED[,PER_ROW]"  (host-wide)

Imports no torch.
"""
from __future__ import annotations

import contextlib
import math
import threading
from typing import Any, Dict, Iterator, Mapping, Optional, Tuple, Union

from ..errors import ConfigError
from . import envconfig

ENV = "NEURONMP_DEVICE_TIME_US"
#: At most 100 s per request: far beyond any real NeuronCore call.
MAX_US = 100_000_000
_ACCEPTED = ("'FIXED' or 'FIXED,PER_ROW': microseconds per request, plus per row of dim 0 "
             f"(whole or decimal numbers from 0 to {MAX_US}), such as '2000' or '500,20'")

Spec = Union[None, str, int, float, Tuple[float, float], Mapping[int, float], "DeviceTime"]


class DeviceTime:
    """A latency model: fixed + per-row microseconds, or a table by batch size."""

    __slots__ = ("fixed_us", "per_row_us", "table")

    def __init__(self, fixed_us: float = 0.0, per_row_us: float = 0.0,
                 table: Optional[Mapping[int, float]] = None):
        self.fixed_us = float(fixed_us)
        self.per_row_us = float(per_row_us)
        self.table: Tuple[Tuple[int, float], ...] = tuple(sorted(
            (int(k), float(v)) for k, v in (table or {}).items()))

    def cost_us(self, rows: int) -> float:
        """Modelled microseconds for a request of ``rows`` rows."""
        if not self.table:
            return self.fixed_us + self.per_row_us * rows
        for size, us in self.table:
            if rows <= size:
                return us
        size, us = self.table[-1]
        return math.ceil(rows / size) * us

    def wire(self) -> Tuple[int, ...]:
        """Nanosecond integers for the worker: (fixed, per row, size1, ns1, ...)."""
        flat = [round(self.fixed_us * 1000), round(self.per_row_us * 1000)]
        for size, us in self.table:
            flat += [size, round(us * 1000)]
        return tuple(flat)

    def to_meta(self) -> Dict[str, Any]:
        """JSON for a trace's metadata (``from_meta`` reads it back)."""
        return {"fixed_us": self.fixed_us, "per_row_us": self.per_row_us,
                "table": [list(row) for row in self.table]}

    @classmethod
    def from_meta(cls, meta: Optional[Mapping[str, Any]]) -> Optional[DeviceTime]:
        if not meta:
            return None
        return cls(meta["fixed_us"], meta["per_row_us"], dict(meta.get("table") or ()))

    def describe(self) -> str:
        if self.table:
            return "table " + ", ".join(f"{s}: {_num(us)} us" for s, us in self.table)
        text = f"{_num(self.fixed_us)} us"
        return text + (f" + {_num(self.per_row_us)} us per row" if self.per_row_us else "")

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, DeviceTime) and self.wire() == other.wire()

    def __hash__(self) -> int:
        return hash(self.wire())

    def __repr__(self) -> str:
        return f"DeviceTime({self.describe()})"


def wire_cost_ns(wire: Tuple[int, ...], rows: int) -> int:
    """The worker's side of ``DeviceTime.cost_us``, on ``wire()``'s integers."""
    fixed, per_row, table = wire[0], wire[1], wire[2:]
    if not table:
        return fixed + per_row * rows
    for i in range(0, len(table), 2):
        if rows <= table[i]:
            return table[i + 1]
    return -(-rows // table[-2]) * table[-1]


def parse(spec: Spec, name: str = "device_time") -> Optional[DeviceTime]:
    """A DeviceTime from what a user may write, or None for none.

    Accepted: a DeviceTime; microseconds as a number; ``(fixed, per_row)``;
    ``"FIXED[,PER_ROW]"``; or a table ``{batch size: microseconds}``.
    """
    if spec is None or isinstance(spec, DeviceTime):
        return spec
    if isinstance(spec, str):
        return _parse_text(name, spec)
    if isinstance(spec, Mapping):
        return DeviceTime(table=_table(name, spec))
    if isinstance(spec, (tuple, list)) and len(spec) == 2:
        return DeviceTime(_us(name, spec, spec[0]), _us(name, spec, spec[1]))
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        return DeviceTime(_us(name, spec, spec))
    raise ConfigError(name, repr(spec), f"a {type(spec).__name__} is not a latency model",
                      _ACCEPTED + ", a (fixed, per_row) pair, or a {batch size: us} table")


def _parse_text(name: str, text: str) -> DeviceTime:
    parts = text.split(",")
    if len(parts) > 2:
        raise ConfigError(name, text, f"it has {len(parts)} comma-separated parts", _ACCEPTED)
    values = [envconfig.parse_decimal(name, p, 0, MAX_US, _ACCEPTED) for p in parts]
    return DeviceTime(*values)


def _us(name: str, whole: Any, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or not 0 <= value <= MAX_US:
        raise ConfigError(name, repr(whole), f"{value!r} is not a number of microseconds "
                          f"from 0 to {MAX_US}", _ACCEPTED)
    return float(value)


def _table(name: str, spec: Mapping[Any, Any]) -> Dict[int, float]:
    if not spec:
        raise ConfigError(name, repr(spec), "the table is empty",
                          "a {batch size: microseconds} table with at least one entry")
    out = {}
    for size, us in spec.items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(name, repr(spec), f"batch size {size!r} is not a whole number "
                              ">= 1", "a {batch size: microseconds} table")
        out[size] = _us(name, spec, us)
    return out


def from_env(env: Mapping[str, str]) -> Optional[DeviceTime]:
    """The host-wide latency model of ``NEURONMP_DEVICE_TIME_US`` in ``env``, or None
    when unset (the grammar; the process's value is ``settings.get("device_time")``)."""
    raw = env.get(ENV, "")
    return _parse_text(ENV, raw) if raw.strip() else None


# -- the placement API's override -------------------------------------------------------

_context = threading.local()


@contextlib.contextmanager
def device_time_context(spec: Spec) -> Iterator[Optional[DeviceTime]]:
    """Models loaded inside take this latency model, whatever their trace or the
    host-wide variable says (``None`` inside: computed time only).

        with neuronmp.device_time_context("500,20"):
            model = torch.jit.load("model.pt")   # each request: 500 us + 20 us per row
    """
    value = parse(spec)
    saved = getattr(_context, "stack", ())
    _context.stack = saved + (value,)
    try:
        yield value
    finally:
        _context.stack = saved


def choose(traced: Optional[DeviceTime], host: Optional[DeviceTime]) -> Optional[DeviceTime]:
    """The latency model a model loading now gets (see the module docstring): the
    context's, else the trace's, else ``host`` (``settings.get("device_time")``)."""
    stack = getattr(_context, "stack", ())
    if stack:
        return stack[-1]
    return traced if traced is not None else host


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"
