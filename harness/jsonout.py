"""Strict JSON for everything the harness prints or writes as JSON: NaN and ±inf become ``null``.

Python's ``json`` writes ``NaN`` by default, which no other JSON parser accepts; an undefined metric
(e.g. Avg@k when every sample errored) is ``null`` instead.
"""

from __future__ import annotations

import json
import math
import numbers
from typing import Any


def finite_or_null(value: Any) -> Any:
    """``value`` with every non-finite float (at any depth of dicts, lists and tuples) replaced by None."""
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):  # float, numpy floats
        return float(value) if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_or_null(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_null(item) for item in value]
    return value


def to_json(value: Any, *, indent: int | None = 2, **kwargs: Any) -> str:
    """``json.dumps`` that never emits NaN/Infinity (``allow_nan=False`` would raise on one that slipped through)."""
    return json.dumps(finite_or_null(value), indent=indent, allow_nan=False, **kwargs)


def json_object_line(path: object, line_no: int, line: str, error: type[Exception] = ValueError) -> dict:
    """One line of a JSON-lines file as an object; a line that is not one raises ``error("path:line: ...")``."""
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise error(f"{path}:{line_no}: not valid JSON ({exc.msg})") from None
    if not isinstance(item, dict):
        raise error(f"{path}:{line_no}: expected a JSON object")
    return item
