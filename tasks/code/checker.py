"""Verdicts of code tasks, computed in the harness process from the sandbox runner's authenticated report.

The runner (``sandbox_runner.py``) reports what the model code returned or printed for each input; nothing it says
is a verdict. This module checks the report's HMACs (:func:`parse_report`), decodes outputs from tagged JSON into
plain Python values (:func:`decode`; JSON only, nothing is unpickled and no class of the program exists here) and
compares them with the ground truth by evalplus's and lcb_runner's rules.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

from opd_harness.tasks.code import sandbox_runner as rt

MAX_COLLIDING = 32  # distinct values sharing one hash in a decoded set / dict (more: refused, it would be quadratic)


# ---------------------------------------------------------------- the report


@dataclass
class Record:
    """One authenticated record: its JSON header and its payload (``None`` when it has none)."""

    header: dict
    payload: str | None


@dataclass
class Report:
    """What the runner said: ``started`` (its key line came first) and the records whose HMAC verified."""

    started: bool
    records: list[Record] = field(default_factory=list)
    rejected: int = 0  # record-like lines whose HMAC did not verify (forgeries, or lines cut by the output cap)

    @property
    def done(self) -> bool:
        return any(r.header.get("done") for r in self.records)


def parse_report(stdout: str) -> Report:
    """Read the key from the first line and keep the records it authenticates (see ``sandbox_runner``)."""
    first, _, rest = stdout.partition("\n")
    prefix = rt.KEY_PREFIX.decode()
    hex_key = first[len(prefix) :]
    if not first.startswith(prefix) or len(hex_key) != 64:
        return Report(started=False)
    try:
        key = bytes.fromhex(hex_key)
    except ValueError:
        return Report(started=False)
    report = Report(started=True)
    rec = rt.RECORD_PREFIX.decode()
    for line in rest.split("\n"):
        if not line.startswith(rec):
            continue
        mac, _, body = line[len(rec) :].partition(" ")
        expected = hmac.new(key, body.encode("utf-8", "surrogateescape"), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(mac, expected):
            report.rejected += 1
            continue
        head, sep, payload = body.partition(rt.SEPARATOR)
        report.records.append(Record(json.loads(head), payload if sep else None))
    return report


# ---------------------------------------------------------------- decoding


class Opaque:
    """A value of a type the encoding does not carry (a user class, a generator, ...): equal to nothing, itself included."""

    __slots__ = ("type_name",)

    def __init__(self, type_name: str) -> None:
        self.type_name = type_name

    def __eq__(self, other: object) -> bool:
        return False

    def __ne__(self, other: object) -> bool:
        return True

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"<opaque {self.type_name}>"


def _guarded(items: list) -> list:
    """``items`` unchanged, after refusing more than MAX_COLLIDING distinct values with one hash (a hash-flooding DoS)."""
    groups: dict[int, list] = {}
    for item in items:
        reps = groups.setdefault(hash(item), [])
        if not any(item is r or item == r for r in reps):
            reps.append(item)
            if len(reps) > MAX_COLLIDING:
                raise ValueError(f"more than {MAX_COLLIDING} distinct values share one hash")
    return items


def _from_tagged(x: Any) -> Any:
    if isinstance(x, list):
        return [_from_tagged(v) for v in x]
    if not isinstance(x, dict):
        return x
    tag, v = x["__t"], x["v"]
    if tag == "tuple":
        return tuple(_from_tagged(i) for i in v)
    if tag == "dict":
        pairs = [(_from_tagged(k), _from_tagged(val)) for k, val in v]
        _guarded([k for k, _ in pairs])
        return dict(pairs)
    if tag in ("set", "frozenset"):
        items = _guarded([_from_tagged(i) for i in v])
        return set(items) if tag == "set" else frozenset(items)
    if tag == "complex":
        return complex(float(v[0]), float(v[1]))
    if tag == "bytes":
        return bytes.fromhex(v)
    if tag == "int":
        return int(v, 16)
    if tag == "opaque":
        return Opaque(str(v))
    raise ValueError(f"unknown tag {tag!r}")


def decode(text: str) -> Any:
    """A value from the runner's tagged JSON text. Raises ValueError / TypeError / RecursionError when malformed."""
    return _from_tagged(json.loads(text))


# ---------------------------------------------------------------- evalplus


def is_floats(x: Any) -> bool:
    """evalplus ``is_floats``: a float, or a non-empty list / tuple of floats."""
    if isinstance(x, float):
        return True
    return isinstance(x, (list, tuple)) and bool(x) and all(isinstance(i, float) for i in x)


def evalplus_match(dataset: str, entry_point: str, inp: Callable[[], Sequence], out: Any, exp: Any, atol: float) -> float:
    """evalplus ``unsafe_execute``'s check of one output; raises on a mismatch; returns the atol to keep.

    ``inp`` gives the (deserialised) input, needed only by the special oracles.
    """
    exact_match = out == exp
    if dataset == "mbpp":
        if entry_point == "are_equivalent":  # Mbpp/164
            exact_match = True
        elif entry_point == "sum_div":  # Mbpp/295
            exact_match = exact_match or out == 0
        elif entry_point == "surface_Area":  # Mbpp/581
            exact_match = exact_match or abs(out - rt.surface_area_oracle(*inp())) <= atol
        elif entry_point == "digit_distance_nums":  # Mbpp/558
            exact_match = exact_match or out == rt.digit_distance_oracle(*inp())
        elif entry_point in rt.MBPP_OUTPUT_SET_EQ_TASKS:
            exact_match = set(_guarded(list(out))) == set(exp)
        elif entry_point in rt.MBPP_OUTPUT_NOT_NONE_TASKS:
            exact_match = out == exp if isinstance(out, bool) else exp == (out is not None)
    if dataset == "humaneval" and entry_point == "find_zero":
        assert abs(rt.poly(*inp(), out)) <= atol, "find_zero: not a root"
        return atol
    if atol == 0 and is_floats(exp):
        atol = 1e-6  # evalplus enforces this (and keeps it for the following inputs)
    if not exact_match and atol != 0:
        import numpy as np

        assert type(out) == type(exp), f"type {type(out).__name__} != {type(exp).__name__}"  # noqa: E721 - as evalplus
        if isinstance(exp, (list, tuple)):
            assert len(out) == len(exp), "length differs"
        assert np.allclose(out, exp, rtol=1e-07, atol=atol), "not close"
    else:
        assert exact_match, "wrong output"
    return atol


SPECIAL_ORACLES = {"are_equivalent", "sum_div", "surface_Area", "digit_distance_nums", "find_zero",
                   *rt.MBPP_OUTPUT_SET_EQ_TASKS, *rt.MBPP_OUTPUT_NOT_NONE_TASKS}


def same_text_is_equal(entry_point: str, text: str) -> bool:
    """Whether byte-identical encodings may be taken as a match without decoding (no NaN, opaque value or oracle)."""
    return entry_point not in SPECIAL_ORACLES and "NaN" not in text and "opaque" not in text


class NeedOutputs(Exception):
    """A digest record's output differs from the expected text (or identical text may not mean equal): only the
    output itself can say whether it matches (float tolerance, set order, special oracles)."""


def digest(text: str) -> str:
    """SHA-256 of an output's tagged JSON text, as the sandbox runner computes it for large outputs."""
    return hashlib.sha256(text.encode("ascii", "backslashreplace")).hexdigest()


@dataclass
class PhaseVerdict:
    status: str  # pass, fail, timeout
    error: str | None = None
    failed_input: int | None = None


def phase_records(report: Report, phase: str) -> tuple[dict[int, Record], Record | None]:
    """The per-input records of one phase by index, and its end record (None when missing)."""
    inputs, end = {}, None
    for r in report.records:
        if r.header.get("phase") != phase:
            continue
        if "end" in r.header:
            end = end or r
        elif isinstance(r.header.get("i"), int) and (r.payload is not None or isinstance(r.header.get("sha256"), str)):
            inputs.setdefault(r.header["i"], r)  # an output, or the digest of a large one (payload None)
    return inputs, end


def check_outputs(n: int, got: dict[int, Record], end: Record | None, match: Callable[[int, str], None],
                  sandbox_status: str = "ok") -> PhaseVerdict:
    """Fast check in input order: the first input without a matching output decides; all n matching is a pass.

    ``match(i, text)`` raises when output ``i`` (tagged JSON text; None for a digest record) is wrong, or
    ``NeedOutputs`` when a digest cannot decide it (the caller then grades again with full outputs).
    """
    for i in range(n):
        record = got.get(i)
        if record is None:
            return _missing(end, i, sandbox_status)
        try:
            match(i, record.payload)
        except NeedOutputs:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of a comparison (AssertionError included) is a failing test
            return PhaseVerdict("fail", f"{type(exc).__name__}: {exc}"[:500], i)
    if end is None or end.header.get("end") != "ok":
        return _missing(end, n, sandbox_status)
    return PhaseVerdict("pass")


def _missing(end: Record | None, i: int, sandbox_status: str) -> PhaseVerdict:
    """Why there is no output for input ``i``: the runner's end record, else the sandbox run's status."""
    if end is not None and end.header.get("end") not in (None, "ok"):
        kind = end.header["end"]
        at = end.header.get("at")
        return PhaseVerdict("timeout" if kind == "timeout" else "fail", f"{kind}: {end.header.get('error')}", at if at is not None else i)
    if sandbox_status == "timeout":
        return PhaseVerdict("timeout", "the sandbox run hit its wall-clock limit", i)
    return PhaseVerdict("fail", f"no output reported for input {i} (sandbox status {sandbox_status})", i)


def stdout_matches(pred: str, gold: str) -> bool:
    """lcb_runner: same number of stripped lines; each equal, or token-wise equal as Decimal."""
    p, g = _lines(pred), _lines(gold)
    if len(p) != len(g):
        return False
    for a, b in zip(p, g):
        if a == b:
            continue
        try:
            if [Decimal(t) for t in a.split()] != [Decimal(t) for t in b.split()]:
                return False
        except (InvalidOperation, ValueError):
            return False
    return True


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.strip().split("\n")]
