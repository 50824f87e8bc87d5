"""Regexes for JSON integers and numbers within bounds (outlines-core ignores minimum/maximum).

Integers are matched exactly. Numbers use integer bounds inside the real ones (ceil of the
minimum, floor of the maximum) and no exponent, so every match is within bounds, though a
few valid values (e.g. 2.7 under maximum 2.9) cannot be generated.
"""

from __future__ import annotations

import math

FRACTION = r"(\.[0-9]+)?"
ZERO_FRACTION = r"(\.0+)?"


class EmptyRangeError(ValueError):
    """The bounds admit no value the generator can write."""


def _same_length(low: str, high: str) -> str:
    """Digit strings of one length between low and high (inclusive)."""
    if low == high:
        return low
    if set(low) == {"0"} and set(high) == {"9"}:
        return f"[0-9]{{{len(low)}}}" if len(low) > 1 else "[0-9]"
    if len(low) == 1:
        return f"[{low}-{high}]"
    if low[0] == high[0]:
        return low[0] + _same_length(low[1:], high[1:])
    rest = len(low) - 1
    parts = [low[0] + _same_length(low[1:], "9" * rest)]
    first, last = int(low[0]) + 1, int(high[0]) - 1
    if first <= last:
        digit = str(first) if first == last else f"[{first}-{last}]"
        parts.append(digit + (f"[0-9]{{{rest}}}" if rest > 1 else "[0-9]"))
    parts.append(high[0] + _same_length("0" * rest, high[1:]))
    return "(" + "|".join(parts) + ")"


def digits_between(low: int, high: int | None) -> str:
    """Non-negative integers low..high without leading zeros (high None: no upper bound)."""
    assert low >= 0 and (high is None or high >= low)
    parts = []
    top_length = len(str(high)) if high is not None else len(str(low))
    for length in range(len(str(low)), top_length + 1):
        start = low if length == len(str(low)) else 10 ** (length - 1)
        end = high if high is not None and length == top_length else 10**length - 1
        parts.append(_same_length(str(start), str(end)))
    if high is None:
        parts.append(f"[1-9][0-9]{{{len(str(low))},}}")
    return parts[0] if len(parts) == 1 else "(" + "|".join(parts) + ")"


def integer_range_regex(low: int | None, high: int | None) -> str:
    if low is not None and high is not None and low > high:
        raise EmptyRangeError(f"minimum {low} is above maximum {high}")
    parts = []
    if high is None or high >= 0:
        parts.append(digits_between(max(low, 0) if low is not None else 0, high))
    if low is None or low < 0:
        smallest = max(1, -high) if high is not None else 1
        parts.append("-" + digits_between(smallest, -low if low is not None else None))
    return "(" + "|".join(parts) + ")"


def _integer_bounds(schema: dict) -> tuple[int | None, int | None]:
    """The integer bounds that hold every value the schema's numeric bounds allow through."""
    low = high = None
    if isinstance(schema.get("minimum"), (int, float)):
        low = math.ceil(schema["minimum"])
    if isinstance(schema.get("exclusiveMinimum"), (int, float)):
        candidate = math.floor(schema["exclusiveMinimum"]) + 1
        low = candidate if low is None else max(low, candidate)
    if isinstance(schema.get("maximum"), (int, float)):
        high = math.floor(schema["maximum"])
    if isinstance(schema.get("exclusiveMaximum"), (int, float)):
        candidate = math.ceil(schema["exclusiveMaximum"]) - 1
        high = candidate if high is None else min(high, candidate)
    if low is not None and high is not None and low > high:
        raise EmptyRangeError(f"no {'integer' if schema.get('type') == 'integer' else 'value'} lies within the bounds")
    return low, high


def number_range_regex(low: int | None, high: int | None) -> str:
    """Decimals in [low, high] (integer bounds): fractions allowed except at the bounds themselves."""
    parts = []
    if high is None or high >= 0:
        start = max(low, 0) if low is not None else 0
        if high is None:
            parts.append(digits_between(start, None) + FRACTION)
        else:
            if start <= high - 1:
                parts.append(digits_between(start, high - 1) + FRACTION)
            parts.append(str(high) + ZERO_FRACTION)
    if low is None or low < 0:
        # -(m + f): at least -high when high < 0; at most -low, reached only with a zero fraction.
        smallest = max(-high, 0) if high is not None else 0
        if low is None:
            parts.append("-" + digits_between(smallest, None) + FRACTION)
        else:
            if smallest <= -low - 1:
                parts.append("-" + digits_between(smallest, -low - 1) + FRACTION)
            parts.append("-" + str(-low) + ZERO_FRACTION)
    return "(" + "|".join(parts) + ")"


def bounded_numeric_regex(schema: dict) -> str:
    """The regex for an integer or number schema node that carries bounds."""
    low, high = _integer_bounds(schema)
    if schema.get("type") == "integer":
        return integer_range_regex(low, high)
    return number_range_regex(low, high)


NUMERIC_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")

__all__ = ["EmptyRangeError", "NUMERIC_BOUNDS", "bounded_numeric_regex", "digits_between", "integer_range_regex", "number_range_regex"]
