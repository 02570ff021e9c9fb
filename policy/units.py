"""Sizes (`512MiB`, `100MB`), durations (`300s`, `5m`) and rates (`10/s`) in rule files.

Hand-written: three tiny grammars; a library would add a dependency and accept more
spellings than we want to document.
"""

from __future__ import annotations

import re

_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_NUM_UNIT = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*")
_RATE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*/\s*(s|sec|second|m|min|minute|h|hour)\s*")
_RATE_DIV = {"s": 1, "sec": 1, "second": 1, "m": 60, "min": 60, "minute": 60,
             "h": 3600, "hour": 3600}  # fmt: skip


def _number_with_unit(value: object, units: dict[str, int], what: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a number or a string like {_example(what)}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{what} must not be negative")
        return value
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a number or a string like {_example(what)}")
    m = _NUM_UNIT.fullmatch(value)
    if not m or m.group(2).lower() not in units:
        raise ValueError(f"invalid {what} {value!r}; use e.g. {_example(what)}")
    result = float(m.group(1)) * units[m.group(2).lower()]
    if result != int(result):
        raise ValueError(f"{what} {value!r} is not a whole number of "
                         f"{'bytes' if what == 'size' else 'seconds'}")
    return int(result)


def _example(what: str) -> str:
    return "'512MiB', '1GiB', '100MB'" if what == "size" else "'300s', '5m', '1h'"


def parse_size(value: object) -> int:
    """Bytes from an int or a string with a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)."""
    return _number_with_unit(value, _SIZE_UNITS, "size")


def parse_duration(value: object) -> int:
    """Seconds from an int or a string with a unit (s, m, h, d)."""
    return _number_with_unit(value, _DURATION_UNITS, "duration")


def parse_rate(value: object) -> float:
    """Calls per second from 'N/s', 'N/min' or 'N/h'."""
    if not isinstance(value, str):
        raise ValueError("rate must be a string like '10/s' or '100/min'")
    m = _RATE.fullmatch(value)
    if not m:
        raise ValueError(f"invalid rate {value!r}; use e.g. '10/s' or '100/min'")
    rate = float(m.group(1)) / _RATE_DIV[m.group(2)]
    if rate <= 0:
        raise ValueError("rate must be positive")
    return rate
