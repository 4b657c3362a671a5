"""The grammars of numeric settings: settings.py parses every variable with these.

    os.environ[name] --strip--> empty? ------------------------------> default
                                 |
                                 +--> grammar (ASCII only, <= MAX_CHARS) --> number
                                                                     |
                                 ConfigError(name, value, reason,    |
                                             accepted) <-- out of [low, high]

Every function names the variable, quotes the value and says what is accepted
when it refuses one, so a typo fails at start-up with a message the user can
act on, not as a bare ValueError (or a MemoryError) somewhere below.

Grammars, deliberately narrow:

    integer       [0-9]+                       whole numbers, no sign
    seconds       [0-9]+(.[0-9]*)? | .[0-9]+   decimal; no exponent, inf or nan
    microseconds  as seconds, in microseconds
    size          [0-9]+ (KiB|MiB|GiB)?        bytes; binary units only, since
                                               '8M' or '8MB' could mean 10**6 or 2**20

``str.isdigit`` and ``int`` accept far more ('²', '٣', '1_000'), so nothing here
uses them on raw text.  Values longer than MAX_CHARS are refused before any
conversion: Python refuses ints of over 4300 digits with a ValueError of its own.
An empty (or all-blank) value means "unset" and gives the default.

Imports no torch.
"""
from __future__ import annotations

import os
import re
from typing import Mapping, Optional, Type

from ..errors import ConfigError

#: Longest value (after stripping blanks) looked at; far above any sensible setting.
MAX_CHARS = 32
#: Default upper bound of a duration: about 115 days, well inside what
#: time.sleep and threading waits accept (a larger value raises OverflowError there).
MAX_SECONDS = 1e7

_INTEGER = re.compile(r"[0-9]+")
_DECIMAL = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)")
_SIZE = re.compile(r"([0-9]+)\s*(KiB|MiB|GiB)?")
_UNITS = {None: 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
_NOT_FINITE = {"inf", "+inf", "-inf", "infinity", "+infinity", "-infinity", "nan", "+nan", "-nan"}


def integer(name: str, default: int, low: int, high: int, *,
            environ: Optional[Mapping[str, str]] = None, accepted: Optional[str] = None) -> int:
    """Whole number ``low <= n <= high`` from variable ``name`` (``default`` when unset)."""
    raw = _raw(name, environ)
    return default if raw is None else parse_integer(name, raw, low, high, accepted=accepted)


def seconds(name: str, default: float, low: float = 0.0, high: float = MAX_SECONDS, *,
            environ: Optional[Mapping[str, str]] = None,
            accepted: Optional[str] = None) -> float:
    """Seconds ``low <= s <= high`` from variable ``name`` (``default`` when unset)."""
    raw = _raw(name, environ)
    if raw is None:
        return default
    return parse_decimal(name, raw, low, high, accepted or _range(low, high, "seconds"))


def microseconds(name: str, default: float, low: float = 0.0, high: float = 1e6, *,
                 environ: Optional[Mapping[str, str]] = None,
                 accepted: Optional[str] = None) -> float:
    """Microseconds ``low <= us <= high`` from variable ``name``, as microseconds."""
    raw = _raw(name, environ)
    if raw is None:
        return default
    return parse_decimal(name, raw, low, high, accepted or _range(low, high, "microseconds"))


def size(name: str, default: int, low: int, high: int, *,
         environ: Optional[Mapping[str, str]] = None, accepted: Optional[str] = None) -> int:
    """Bytes ``low <= b <= high`` from variable ``name``: '8388608' or '8MiB'."""
    raw = _raw(name, environ)
    return default if raw is None else parse_size(name, raw, low, high, accepted=accepted)


# -- the same on a value in hand (for callers that take strings, not the environment) --


def parse_integer(name: str, value: str, low: int, high: int, *, accepted: Optional[str] = None,
                  error: Type[ConfigError] = ConfigError) -> int:
    """``value`` as a whole number in ``[low, high]``, or ``error`` naming ``name``."""
    accepted = accepted or _range(low, high, "a whole number")
    text = _checked_text(name, value, accepted, error)
    if not _INTEGER.fullmatch(text):
        raise error(name, value, "it is not a whole number (digits 0-9 only)", accepted)
    return _bounded(name, value, int(text), low, high, accepted, error)


def parse_decimal(name: str, value: str, low: float, high: float, accepted: str,
                  error: Type[ConfigError] = ConfigError) -> float:
    """``value`` as a plain decimal number in ``[low, high]``."""
    text = _checked_text(name, value, accepted, error)
    if text.lower() in _NOT_FINITE:
        raise error(name, value, "it must be a finite number", accepted)
    if text.startswith("-") and _DECIMAL.fullmatch(text[1:]):
        raise error(name, value, f"it must be >= {_num(low)}", accepted)
    if not _DECIMAL.fullmatch(text):
        raise error(name, value, "it is not a number (digits with an optional decimal point)",
                    accepted)
    return _bounded(name, value, float(text), low, high, accepted, error)


def parse_size(name: str, value: str, low: int, high: int, *, accepted: Optional[str] = None,
               error: Type[ConfigError] = ConfigError) -> int:
    """``value`` as a byte count in ``[low, high]``: digits, optionally KiB, MiB or GiB."""
    accepted = accepted or (
        f"a number of bytes from {_bytes(low)} to {_bytes(high)}: digits, optionally "
        "followed by KiB, MiB or GiB (such as 8388608 or 8MiB)")
    text = _checked_text(name, value, accepted, error)
    m = _SIZE.fullmatch(text)
    if not m:
        raise error(name, value, "it is not a byte count", accepted)
    return _bounded(name, value, int(m.group(1)) * _UNITS[m.group(2)], low, high, accepted, error)


# -- helpers ----------------------------------------------------------------------------


def _raw(name: str, environ: Optional[Mapping[str, str]]) -> Optional[str]:
    raw = (os.environ if environ is None else environ).get(name)
    return None if raw is None or not raw.strip() else raw


def _checked_text(name: str, value: str, accepted: str, error) -> str:
    text = value.strip(" \t\r\n")
    if not text:
        raise error(name, value, "the value is empty", accepted)
    if len(text) > MAX_CHARS:
        # quote only the start: the message must stay readable whatever was set
        raise error(name, value[:MAX_CHARS] + "...",
                    f"it is {len(text)} characters long; at most {MAX_CHARS} are read",
                    accepted)
    if not text.isascii():
        raise error(name, value, "it has characters other than ASCII digits", accepted)
    return text


def _bounded(name, value, number, low, high, accepted, error):
    if number < low:
        raise error(name, value, f"it must be >= {_num(low)}", accepted)
    if number > high:
        raise error(name, value, f"it must be <= {_num(high)}", accepted)
    return number


def _range(low, high, what: str) -> str:
    return f"{what} from {_num(low)} to {_num(high)}"


def _num(x) -> str:
    # 10000000 rather than 1e+07: people compare these with what they typed
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e16 else f"{x:g}"


def _bytes(n: int) -> str:
    for unit in ("GiB", "MiB", "KiB"):
        if n >= _UNITS[unit] and n % _UNITS[unit] == 0:
            return f"{n // _UNITS[unit]}{unit}"
    return str(n)
