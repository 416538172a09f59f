"""Records read from a log, made safe for the readers: :func:`sanitise`, driven by ``stepprof._fields``.

A log is untrusted input (logs travel: they are attached to bug reports), so every record
the JSON parser gives passes through here before a reader sees it (``stepprof._log.scan``,
which ``stepprof.read`` and every tool use):

- a declared field whose value has the wrong type, or a number outside its unit's range
  (``stepprof._fields.UNITS``; negative where the field is not signed), is read as null,
  and the record's ``unavailable`` says that the log held an invalid value there (an int
  field takes an integral float as its int: JSON has one kind of number);
- a record whose ``kind`` is not a string, or without a usable value in a required field
  (a step's ``step``), is dropped;
- strings are cut to :data:`STR_MAX` characters, keys to :data:`KEY_MAX`; a container
  over its declared size is invalid;
- fields this version does not declare are kept as scalars and containers at most
  :data:`FREE_DEPTH` levels deep with at most :data:`FREE_ITEMS` items each, else null, so
  nothing deeper than :data:`MAX_DEPTH` levels below the record reaches a reader.

The pass changes the record in place and recurses only along the declaration, whose depth
is fixed, so no input makes it recurse without bound.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from . import _native
from ._fields import (
    FLOAT_GREATEST, FOREIGN, FREE, INT64_MAX, RECORDS, UNITS, Field, ListOf, MapOf, Obj, Scalar, Type,
)

__all__ = ["FREE_DEPTH", "FREE_ITEMS", "INVALID", "KEY_MAX", "MAX_DEPTH", "STR_MAX", "sanitise"]

#: Characters kept of a string value (the writer cuts error messages at 2000), and of a key.
STR_MAX: Final = 4096
KEY_MAX: Final = 256
#: Container levels below the record that a reader may meet, and that an undeclared field may hold.
MAX_DEPTH: Final = 4
FREE_DEPTH: Final = 2
#: Items kept in a container of an undeclared field.
FREE_ITEMS: Final = 256
#: The start of the reason a field read as null because the log held an invalid value there.
INVALID: Final = "the log held an invalid value here"

_INT_MIN = -INT64_MAX - 1
_FLOAT, _INT, _STR, _BOOL, _NEST = range(5)
# (code, least, greatest, container check, container type, reason key, what was expected)
_Spec = tuple[int, float, float, Any, Any, str, str]
_Bad = list[tuple[str, str, Any]]  # (reason key, what was expected, the value)


def _cut(s: str, n: int = STR_MAX) -> str:
    return s[: n - 1] + "…"


def _free(v: Any, depth: int) -> Any:
    """An undeclared value: itself if it is a scalar in range or a container at most ``depth``
    levels deep of at most :data:`FREE_ITEMS` items each (long strings and keys cut), else None."""
    out = _kept(v, depth)
    return None if out is _TOO_BIG else out


_TOO_BIG = object()


def _kept(v: Any, depth: int) -> Any:
    t = type(v)
    if t is str:
        return v if len(v) <= STR_MAX else _cut(v)
    if t is float:
        return v if -FLOAT_GREATEST <= v <= FLOAT_GREATEST else None
    if t is int:
        return v if _INT_MIN <= v <= INT64_MAX else None
    if t is list or t is dict:
        if depth <= 0 or len(v) > FREE_ITEMS:
            return _TOO_BIG
        if t is list:
            items = [_kept(x, depth - 1) for x in v]
            return _TOO_BIG if any(x is _TOO_BIG for x in items) else items
        out = {k if len(k) <= KEY_MAX else _cut(k, KEY_MAX): _kept(x, depth - 1) for k, x in v.items()}
        return _TOO_BIG if any(x is _TOO_BIG for x in out.values()) else out
    return v  # None or a bool: JSON holds nothing else


def _spec(f: Field, t: Type, key: str, depth: int) -> _Spec:
    """How to check a value of type ``t`` in field ``f`` (``key``: its reason key), ``depth`` levels down."""
    unit = UNITS[f.unit] if f.unit is not None else None
    if isinstance(t, Scalar):
        if t.name in ("int", "float"):
            hi = unit.greatest if unit is not None else INT64_MAX if t.name == "int" else FLOAT_GREATEST
            lo = -hi if f.signed else 0
            if t.name == "int":
                lo, hi = max(lo, _INT_MIN), min(hi, INT64_MAX)
                return (_INT, lo, hi, None, None, key, f"an int from {lo:,} to {hi:,}")
            return (_FLOAT, lo, hi, None, None, key, f"a number from {lo:g} to {hi:g}")
        code = _STR if t.name == "str" else _BOOL
        return (code, 0, 0, None, None, key, f"a {t.name}")
    if t is FREE:
        return (_NEST, 0, 0, None, None, key, f"at most {FREE_DEPTH} levels of at most {FREE_ITEMS} items")
    check, ctype, expected = _container(f, t, key, depth)
    return (_NEST, 0, 0, check, ctype, key, expected)


def _container(f: Field, t: Type, key: str, depth: int) -> tuple[Callable[[Any, _Bad], bool], type, str]:
    if isinstance(t, Obj):
        return _obj(t.fields, key + ".", depth), dict, "an object"
    if isinstance(t, MapOf):
        return _map(f, t, key, depth), dict, f"an object of at most {t.max_items:,} entries"
    assert isinstance(t, ListOf)
    return _list(f, t, key, depth), list, f"a list of at most {t.max_items:,} items"


def _value(spec: _Spec, v: Any, bad: _Bad) -> Any:
    """``v`` checked against ``spec``: itself, cut, or None (noted in ``bad``) when invalid."""
    if v is None:
        return v
    code, lo, hi, sub, ctype, key, expected = spec
    t = type(v)
    if code == _FLOAT:
        if (t is float or t is int) and lo <= v <= hi:
            return v
    elif code == _INT:
        if t is int and lo <= v <= hi:
            return v
        if t is float and lo <= v <= hi and v.is_integer():  # JSON has one kind of number: 4096.0 is 4096
            return int(v)
    elif code == _STR:
        if t is str:
            return v if len(v) <= STR_MAX else _cut(v)
    elif code == _BOOL:
        if t is bool:
            return v
    elif sub is None:  # free-form (a calibration): kept unless too deep or too large
        w = _free(v, FREE_DEPTH)
        if w is not None:
            return w
    elif t is ctype and sub(v, bad):
        return v
    bad.append((key, expected, v))
    return None


class _Odd(Exception):
    """A value the fast check cannot pass (of another type, out of range, undeclared): check slowly."""


def _obj(fields: tuple[Field, ...], prefix: str, depth: int) -> Callable[[dict[str, Any], _Bad], bool]:
    """The check of an object with ``fields`` (in place; keys it does not declare kept as :func:`_free`)."""
    specs = {f.name: _spec(f, f.type, prefix + f.name, depth + 1) for f in fields}
    free_depth = min(FREE_DEPTH, MAX_DEPTH - depth - 1)
    # The common case (every key declared, every value of its type and in range) is tested in one
    # loop on a table per type; the first value it cannot pass sends the object to the full check.
    floats = {k: s[2] for k, s in specs.items() if s[0] == _FLOAT}
    ints = {k: s[2] for k, s in specs.items() if s[0] in (_FLOAT, _INT)}
    strs = {k: STR_MAX for k, s in specs.items() if s[0] == _STR}
    bools = frozenset(k for k, s in specs.items() if s[0] == _BOOL)
    known = frozenset(specs)
    dicts = {k: s[3] for k, s in specs.items() if s[4] is dict}
    lists = {k: s[3] for k, s in specs.items() if s[4] is list}

    def full(d: dict[str, Any], bad: _Bad) -> None:
        for k in list(d):
            spec = specs.get(k)
            v = d[k]
            if spec is None:
                if len(k) > KEY_MAX:
                    del d[k]
                elif v is not None:
                    d[k] = _free(v, free_depth)
                continue
            w = _value(spec, v, bad)
            if w is not v:
                d[k] = w

    def check(d: dict[str, Any], bad: _Bad) -> bool:
        try:
            for k, v in d.items():
                t = type(v)
                if t is float:
                    if 0.0 <= v <= floats[k]:
                        continue
                elif t is int:
                    if 0 <= v <= ints[k]:
                        continue
                elif v is None:
                    if k in known:
                        continue
                elif t is str:
                    if len(v) <= strs[k]:
                        continue
                elif t is dict:
                    if not v and k in dicts or dicts[k](v, bad):
                        continue
                elif t is list:
                    if not v and k in lists or lists[k](v, bad):
                        continue
                elif k in bools:
                    continue
                raise _Odd
        except (_Odd, KeyError):
            full(d, bad)  # a container checked above is checked again: it is valid by now
        return True

    return check


def _map(f: Field, t: MapOf, key: str, depth: int) -> Callable[[dict[str, Any], _Bad], bool]:
    spec = _spec(f, t.value, key, depth + 1)
    limit = t.max_items
    strs = spec[0] == _STR
    sub, ctype = spec[3], spec[4]

    def check(d: dict[str, Any], bad: _Bad) -> bool:
        if len(d) > limit:
            return False
        long_keys = False
        for k, v in d.items():
            if len(k) > KEY_MAX:
                long_keys = True
            if v is None or strs and type(v) is str and len(v) <= STR_MAX:
                continue
            if type(v) is ctype and sub(v, bad):
                continue
            w = _value(spec, v, bad)
            if w is not v:
                d[k] = w
        if long_keys:  # cut, in order; a key that cutting makes equal to an earlier one is left out
            items = list(d.items())
            d.clear()
            for k, v in items:
                d.setdefault(k if len(k) <= KEY_MAX else _cut(k, KEY_MAX), v)
        return True

    return check


def _list(f: Field, t: ListOf, key: str, depth: int) -> Callable[[list[Any], _Bad], bool]:
    spec = _spec(f, t.item, key, depth + 1)
    limit = t.max_items
    code, lo, hi, sub, ctype = spec[:5]

    def check(items: list[Any], bad: _Bad) -> bool:
        if len(items) > limit:
            return False
        for i, v in enumerate(items):
            if v is None:
                continue
            if code == _FLOAT:
                if (type(v) is float or type(v) is int) and lo <= v <= hi:
                    continue
            elif code == _INT:
                if type(v) is int and lo <= v <= hi:
                    continue
            elif code == _STR:
                if type(v) is str and len(v) <= STR_MAX:
                    continue
            elif type(v) is ctype and sub(v, bad):
                continue
            w = _value(spec, v, bad)
            if w is not v:
                items[i] = w
        return True

    return check


_CHECKS = {kind: _obj(r.fields, "", 0) for kind, r in RECORDS.items()}
_FOREIGN = _obj(FOREIGN.fields, "", 0)
_REQUIRED = {kind: tuple(f.name for f in r.fields if f.required and f.name != "kind") for kind, r in RECORDS.items()}


def _shown(v: Any) -> str:
    """A short description of an invalid value (never its whole text: it may be huge)."""
    t = type(v)
    if t is bool:
        return "true" if v else "false"
    if t is int or t is float:
        return f"{v:g}" if t is float or abs(v) < 10**15 else f"{v:.6g}"
    if t is str:
        return "a string"
    return f"a list of {len(v):,} items" if t is list else f"an object of {len(v):,} entries"


def _c_tables() -> tuple[list[tuple[int, float, float, int, int]], list[dict[str, int]], dict[str, Any]]:
    """The declaration as ``_fold.c``'s ``valid_as_is`` reads it: specs (code, least, greatest,
    most items, sub), the objects' fields (key -> spec), the kinds (-> their object, required keys)."""
    specs: list[tuple[int, float, float, int, int]] = []
    objs: list[dict[str, int]] = []
    codes = {_FLOAT: 0, _INT: 1, _STR: 2, _BOOL: 3}

    def spec(f: Field, t: Type, depth: int) -> int:
        if isinstance(t, Scalar):
            code, lo, hi = _spec(f, t, "", depth)[:3]
            specs.append((codes[code], float(lo), float(hi), 0, -1))
        elif t is FREE:
            specs.append((7, 0.0, 0.0, 0, -1))
        elif isinstance(t, Obj):
            specs.append((4, 0.0, 0.0, 0, obj(t.fields, depth)))
        elif isinstance(t, MapOf):
            specs.append((5, 0.0, 0.0, t.max_items, spec(f, t.value, depth + 1)))
        else:
            assert isinstance(t, ListOf)
            specs.append((6, 0.0, 0.0, t.max_items, spec(f, t.item, depth + 1)))
        return len(specs) - 1

    def obj(fields: tuple[Field, ...], depth: int) -> int:
        table = {f.name: spec(f, f.type, depth + 1) for f in fields}
        objs.append(table)
        return len(objs) - 1

    kinds = {kind: (obj(r.fields, 0), _REQUIRED[kind]) for kind, r in RECORDS.items()}
    return specs, objs, kinds


#: ``_fold.c``'s ``valid_as_is`` once it is built and configured (:func:`use_native`), or None.
_valid_as_is: Callable[[dict[str, Any]], bool] | None = None


def use_native(on: bool = True) -> None:
    """Pass records that are valid as they are through ``_fold.c``'s check (``on=False``: never)."""
    global _valid_as_is
    mod = _native.module() if on else None
    if mod is not None:
        mod.configure_sanitise(*_c_tables(), STR_MAX, KEY_MAX)
    _valid_as_is = mod.valid_as_is if mod is not None else None


def sanitise(record: dict[str, Any]) -> dict[str, Any] | None:
    """``record``, as the JSON parser gave it, made safe for the readers (in place); None to drop it.

    Example:
        >>> r = sanitise({"kind": "step", "step": 3, "wall_ms": 1e306, "unavailable": {}})
        >>> r["wall_ms"], r["unavailable"]["wall_ms"][:34]
        (None, 'the log held an invalid value here')
        >>> sanitise({"kind": ["step"]}) is None
        True
    """
    valid = _valid_as_is
    if valid is not None and valid(record):  # (the usual record: nothing to change or note)
        return record
    kind = record.get("kind")
    if type(kind) is not str:
        return None
    check = _CHECKS.get(kind)
    bad: _Bad = []
    if check is None:
        if len(kind) > STR_MAX:
            record["kind"] = _cut(kind)
        _FOREIGN(record, bad)
    else:
        check(record, bad)
        for name in _REQUIRED[kind]:
            if record.get(name) is None:
                return None
    if bad:
        _note(record, bad)
    return record


def _note(record: dict[str, Any], bad: _Bad) -> None:
    """Say in the record's ``unavailable`` which fields held an invalid value."""
    reasons = record.get("unavailable")
    for key, expected, v in bad:
        if key.startswith("unavailable"):
            continue  # a reason that was not a string: no reason to give for a reason
        if type(reasons) is not dict:
            reasons = record["unavailable"] = {}
        reasons[key] = f"{INVALID} ({_shown(v)}; expected {expected})"


_native.use(use_native)
