"""A stepprof log as a pandas DataFrame with the right dtypes: :func:`frame`."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ._errors import MissingExtraError, warn
from ._fields import BOOL, FLOAT, INT, RECORDS, STR, MapOf, Obj, Scalar
from ._log import read
from ._validate import check_frame_kind, check_logs

if TYPE_CHECKING:  # pragma: no cover
    import pandas

__all__ = ["frame"]

#: Fields kept whole, as one object column: field -> reason, not a figure.
_KEPT_WHOLE = frozenset({"unavailable"})

_INT64 = (-(2**63), 2**63 - 1)

#: Columns a frame holds at most, in the order first seen: a field first seen past them is left
#: out (one warning counts them), so a log whose records each bring new phase names costs at
#: most rows x COLUMNS_KEPT cells.
COLUMNS_KEPT = 1024
#: Distinct names left out that are counted one by one.
_LEFT_OUT_COUNTED = 100_000


def _pandas() -> Any:
    try:
        import pandas  # optional and heavy: only frame() needs it
    except ImportError as e:
        raise MissingExtraError(
            "stepprof.frame needs pandas, which is not installed. "
            "Install it with: pip install 'stepprof[frame]'"
        ) from e
    return pandas


def _flatten(record: dict[str, Any], kind: str) -> dict[str, Any]:
    """One row: nested objects spread over dotted columns.

    A step's ``phases`` become ``phase.<name>.<field>`` (a phase that is not an object has
    none) and its ``syncs`` their count; ``unavailable`` stays one dict; lists stay as they are.
    """
    row: dict[str, Any] = {}
    for key, value in record.items():
        if key in _KEPT_WHOLE or type(value) is not dict:
            row[key] = value
        elif kind == "step" and key == "phases":
            for name, phase in value.items():
                if type(phase) is dict:
                    _spread(row, f"phase.{name}", phase)
        elif kind == "step" and key == "syncs":
            row["syncs"] = value.get("count")
        else:
            _spread(row, key, value)
    return row


def _spread(row: dict[str, Any], prefix: str, value: dict[str, Any]) -> None:
    """``value``'s items as ``prefix.key`` columns (a record as read nests a few levels at most)."""
    for key, inner in value.items():
        if type(inner) is dict:
            _spread(row, f"{prefix}.{key}", inner)
        else:
            row[f"{prefix}.{key}"] = inner


def _declared(kind: str, column: str) -> Scalar | None:
    """The declared type (``_fields.RECORDS``) of a frame column of ``kind``, or None when the
    column is no declared scalar (a newer version's field, a list, ``FREE`` data).

    The column is the dotted path :func:`_flatten` made: ``phase.<name>.<field>`` is the
    step's ``phases`` item, a step's ``syncs`` its count, a key of a :class:`MapOf` any key
    (a phase name may hold dots itself).
    """
    if column == "log":
        return STR
    if kind == "step" and column == "syncs":
        return INT  # the step's syncs object, as its count
    parts = column.split(".")
    if kind == "step" and parts[0] == "phase":
        parts[0] = "phases"
    return _walk(Obj(RECORDS[kind].fields), parts)


def _walk(t: Any, parts: list[str]) -> Scalar | None:
    if not parts:
        return t if type(t) is Scalar else None
    if type(t) is MapOf:  # a key the writer chose, of one part or more
        for k in range(1, len(parts) + 1):
            found = _walk(t.value, parts[k:])
            if found is not None:
                return found
        return None
    if type(t) is not Obj:
        return None
    head, rest = parts[0], parts[1:]
    for f in t.fields:
        if f.name == head:
            return _walk(f.type, rest)
    return None


def _column(pd: Any, declared: Scalar | None, values: list[Any]) -> Any:
    """A Series of ``values`` with the dtype of the declared type: float64 (NaN for null), int64
    (Int64 with nulls; float64 for an int past int64, a FLOP count), bool (boolean with nulls),
    else object.  An undeclared column takes the dtype its values fit, the same way."""
    types = set(map(type, values))
    nulls = type(None) in types
    types.discard(type(None))
    if declared is None:  # what the values fit
        declared = (BOOL if types == {bool} else INT if types == {int}
                    else FLOAT if types and types <= {int, float} else None)
    if declared is BOOL and types <= {bool}:
        return pd.Series(values, dtype="boolean" if nulls or not types else bool)
    if declared is INT and types <= {int}:
        if not types:
            return pd.Series(values, dtype="Int64")
        present = [v for v in values if v is not None]
        if _INT64[0] <= min(present) and max(present) <= _INT64[1]:
            return pd.Series(values, dtype="Int64" if nulls else "int64")
        declared = FLOAT  # an int past int64 (FLOPs) only fits a float
    if declared in (INT, FLOAT) and types <= {int, float}:
        return pd.Series(values, dtype="float64")
    return pd.Series(values, dtype=object)


def frame(
    log: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], kind: str = "step"
) -> pandas.DataFrame:
    """The records of one kind in one or more logs, as a pandas DataFrame.

    One row per record, in file order (the logs one after another), with a first
    column ``log`` naming the file it came from (it replaces a summary's own ``log``
    field).  Columns have the dtypes of their figures: ``step`` int64, ``wall_ms`` and ``gpu_ms`` float64 (NaN where null), ``warmup``
    bool; other integers int64, or the nullable Int64 where some are null.  Nested
    objects are spread over dotted columns: a step's phases as
    ``phase.<name>.wall_ms``, ``phase.<name>.gpu_ms``, ``phase.<name>.peak_allocated_bytes``...,
    its ``syncs`` as their count and its ``allocator`` as ``allocator.<counter>``, a
    summary's ``wall_ms_percentiles`` as ``wall_ms_percentiles.median``...  ``unavailable``
    is kept as one column of dicts (figure -> why it is null), and lists stay lists.
    Records are read as :func:`stepprof.read` reads them (a value of the wrong type is null).
    At most :data:`COLUMNS_KEPT` columns, in the order first seen: a field first seen after
    them is left out, with one warning.  Needs pandas (``pip install 'stepprof[frame]'``).

    Args:
        log: a log's path, or a list of paths (the ``<stem>.rank<R>.jsonl`` logs of a
            distributed run, whose rows carry ``rank``).
        kind: the record kind, one of ``step``, ``summary``, ``memory``, ``flops``,
            ``ranks``, ``sweep_point`` and ``sweep_result``.

    Raises:
        ConfigError: ``log`` is not a path or a list of paths, or ``kind`` is not a kind.
        MissingExtraError: pandas is not installed.

    Example:
        >>> import stepprof, tempfile, os
        >>> log = os.path.join(tempfile.mkdtemp(), "run.jsonl")
        >>> with stepprof.Profiler(log) as prof:
        ...     for _ in range(2):
        ...         with prof.step(batch_size=8):
        ...             with prof.measure("forward"):
        ...                 pass
        >>> df = stepprof.frame(log)
        >>> df["step"].tolist(), str(df["wall_ms"].dtype), "phase.forward.wall_ms" in df
        ([0, 1], 'float64', True)
    """
    paths = check_logs(log)
    check_frame_kind(kind)
    pd = _pandas()
    # Built column by column as the rows come (a row's missing fields padded with None), so the
    # work is the cells that the frame holds, whatever fields each record brings.
    columns: dict[str, list[Any]] = {"log": []}
    left_out: set[str] = set()
    n = 0
    for path in paths:
        name = os.fspath(path)
        for record in read(path, kind=kind):
            row = _flatten(record, kind)
            row["log"] = name
            for key, value in row.items():
                col = columns.get(key)
                if col is None:
                    if len(columns) >= COLUMNS_KEPT:
                        if len(left_out) < _LEFT_OUT_COUNTED:
                            left_out.add(key)
                        continue
                    col = columns[key] = [None] * n
                elif len(col) < n:
                    col.extend([None] * (n - len(col)))
                col.append(value)
            n += 1
    if left_out:
        more = "+" if len(left_out) >= _LEFT_OUT_COUNTED else ""
        warn(f"stepprof.frame: left out {len(left_out):,}{more} field(s) first seen after the first "
             f"{COLUMNS_KEPT:,} columns (phase names that change from step to step, say)", stacklevel=2)
    # A field that is an object in some rows and null in the others lives in its dotted
    # columns (allocator.num_device_alloc...); its own column would be null throughout.
    spread = {key.split(".", 1)[0] for key in columns if "." in key}
    data = {}
    for key in list(columns):
        values = columns.pop(key)  # each list freed once its column is made
        if len(values) < n:
            values.extend([None] * (n - len(values)))
        if key not in spread or any(v is not None for v in values):
            data[key] = _column(pd, _declared(kind, key), values)
    return pd.DataFrame(data)
