"""Mutated logs for every reader tool: every field of every record kind meets every hostile value.

The paths come from the record declaration (``stepprof._fields``), so a field added there is
fuzzed without a change here: every field, nested ones included (a phase's ``wall_ms``, a sync
site's ``count``, a peak module's ``bytes_by_category``...), of every kind, optional ones too
(a path whose parent is absent or null is created).  :data:`CLASSES` are the hostile values.
:func:`cases` deals every (kind, path, class) combination to the cases, round robin, so a few
thousand cases cover them all; :func:`fuzz` writes the cases in batches of logs and runs every
tool of ``tests.readerlogs.TOOLS`` on each batch in-process, then attributes any crash to its case.

bench/fuzz.py runs it from the command line; tests/test_fuzz_readers.py runs it in CI.
"""

from __future__ import annotations

import json
import os
import random
import time
import traceback
from collections.abc import Iterator
from typing import Any

import attrs
import orjson

from stepprof._fields import FREE, RECORDS, ListOf, MapOf, Obj

from . import readerlogs

#: Steps in each case's log (past the three warm-up steps; the peak record follows the fifth).
STEPS = 8
ANY_KEY = "<key>"  # a path step into a map: one of its keys (a new one when it has none)
DELETE = object()


@attrs.frozen
class Deep:
    """A value nested ``depth`` levels deep (written as text: the json module would recurse)."""

    depth: int
    brackets: str  # "[]" or "{}"

    def text(self) -> str:
        if self.brackets == "[]":
            return "[" * self.depth + "]" * self.depth
        return '{"a":' * (self.depth - 1) + "{}" + "}" * (self.depth - 1)


ESCAPES = "\x1b]0;pwned\x07\x1b[2J\x9b31m\x7f\x85\n\r\x00"

#: The hostile value classes: name -> its values, drawn with a seeded ``random.Random``.
CLASSES: dict[str, Any] = {
    "wrong type": lambda rng: rng.choice(["7", "", [], {}, [1, "a"], {"a": 1}, True, False, None, [None]]),
    "nan": lambda rng: float("nan"),
    "infinity": lambda rng: rng.choice([float("inf"), float("-inf")]),
    "huge number": lambda rng: rng.choice([1e308, -1e308, 1e306, 1e303, 2**64 - 1, 2**63, -(2**63) - 1,
                                           2**70, 10**30, 1.7976931348623157e308]),
    "negative": lambda rng: rng.choice([-1, -1.5, -(2**62), -1e-300, -0.0]),
    "zero or empty": lambda rng: rng.choice([0, 0.0, "", [], {}]),
    "deep nesting": lambda rng: Deep(rng.randint(300, 1000), rng.choice(["[]", "{}"])),
    "huge string": lambda rng: rng.choice(["x", "\x1b", "é"]) * rng.randint(5_000, 40_000),
    "control characters": lambda rng: ESCAPES + rng.choice(["", "/../../etc/x", "/abs/path"]),
    "non-string keys": lambda rng: rng.choice([{1: 2, 2.5: "x", True: None}, {str(i): i for i in range(5000)}]),
    "big container": lambda rng: rng.choice([list(range(rng.randint(5_000, 12_000))),
                                             [{"a": i} for i in range(5_000)], [[1]] * 10_000]),
    "unhashable": lambda rng: rng.choice([["step"], {"kind": "step"}, [[]], {"a": [1]}]),
    "deleted": lambda rng: DELETE,
}


def _paths(fields: tuple[Any, ...], prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    for f in fields:
        path = (*prefix, f.name)
        yield path
        yield from _inner(f.type, path)


def _inner(t: Any, path: tuple[Any, ...]) -> Iterator[tuple[Any, ...]]:
    if isinstance(t, Obj):
        yield from _paths(t.fields, path)
    elif isinstance(t, MapOf):
        yield (*path, ANY_KEY)
        yield from _inner(t.value, (*path, ANY_KEY))
    elif isinstance(t, ListOf):
        yield (*path, 0)
        yield from _inner(t.item, (*path, 0))
    elif t is FREE:
        yield (*path, ANY_KEY)


#: Every path into every record kind, by kind.
PATHS = {kind: list(_paths(r.fields)) for kind, r in RECORDS.items()}
#: Every (kind, path, class): what :func:`cases` deals out.
COMBOS = [(kind, path, cls) for kind, paths in PATHS.items() for path in paths for cls in CLASSES]
#: The kinds each plot draws from.
PLOT_KINDS = {"plot": ("step", "memory", "flops", "summary"), "plot --peak": ("peak",),
              "plot --sweep": ("sweep_point", "sweep_result")}


@attrs.frozen
class Mutation:
    kind: str
    path: tuple[Any, ...]
    cls: str
    seed: int  # draws the value: it is made when the mutation is applied, not held by the case
    which: str  # "all", "first", "last" or "one" of the records of the kind

    @property
    def value(self) -> Any:
        return CLASSES[self.cls](random.Random(self.seed))

    def describe(self) -> str:
        v = self.value
        shown = "DELETE" if v is DELETE else repr(v) if len(repr(v)) < 60 else f"{type(v).__name__} ({len(repr(v)):,} chars)"
        return f"{self.kind}.{'.'.join(map(str, self.path))} = {shown} [{self.cls}, {self.which}]"


def _mutation(rng: random.Random, kind: str, path: tuple[Any, ...], cls: str) -> Mutation:
    return Mutation(kind, path, cls, rng.getrandbits(32), rng.choice(["all", "first", "last", "one"]))


def cases(n: int, seed: int) -> list[list[Mutation]]:
    """``n`` cases of at least two mutations each (and a random extra one in a case out of three):
    the combinations of :data:`COMBOS`, shuffled by ``seed``, dealt round robin, so every one is
    dealt when ``n`` is at least a half of them."""
    per_case = max(2, -(-len(COMBOS) // max(n, 1)))
    rng = random.Random(seed)
    combos = COMBOS[:]
    rng.shuffle(combos)
    out = []
    for i in range(n):
        picked = [combos[(i * per_case + j) % len(combos)] for j in range(per_case)]
        if rng.random() < 1 / 3:
            picked.append(rng.choice(combos))
        out.append([_mutation(rng, *c) for c in picked])
    return out


def plot_cases(tool: str, n: int, seed: int) -> list[list[Mutation]]:
    """``n`` cases for one plot: every (path, class) of the kinds it draws, shuffled by path and
    dealt with the classes in turn (so a few cases show it every class), one to four a case."""
    rng = random.Random(seed)
    classes = list(CLASSES)
    paths = [(k, p) for k in PLOT_KINDS[tool] for p in PATHS[k]]
    rng.shuffle(paths)
    combos = [(*paths[(i // len(classes)) % len(paths)], classes[i % len(classes)])
              for i in range(len(paths) * len(classes))]
    per_case = min(4, max(1, -(-len(combos) // max(n, 1))))
    return [[_mutation(rng, *combos[(i * per_case + j) % len(combos)]) for j in range(per_case)] for i in range(n)]


# -- applying and writing -----------------------------------------------------------------------


def _apply(records: list[dict[str, Any]], m: Mutation, rng: random.Random) -> None:
    targets = [r for r in records if r.get("kind") == m.kind]
    if not targets:
        return
    if m.which == "first":
        targets = targets[:1]
    elif m.which == "last":
        targets = targets[-1:]
    elif m.which == "one":
        targets = [rng.choice(targets)]
    for r in targets:
        value = m.value  # drawn afresh for each record: later mutations may change it in place
        node: Any = r
        for step, after in zip(m.path, (*m.path[1:], None), strict=True):
            key = _key(node, step)
            if after is None:
                _set(node, key, value)
                break
            child = node[key] if _has(node, key) else None
            if type(child) not in (dict, list):  # absent, null or a scalar: make the parent
                child = [None] if type(after) is int else {}
                _set(node, key, child)
            node = child


def _key(node: Any, step: Any) -> Any:
    if step == ANY_KEY:
        return next(iter(node), "x") if type(node) is dict else 0
    return step


def _has(node: Any, key: Any) -> bool:
    return (type(node) is dict and key in node) or (type(node) is list and type(key) is int and key < len(node))


def _set(node: Any, key: Any, value: Any) -> None:
    if type(node) is list:
        if type(key) is not int:
            return
        while len(node) <= key:
            node.append(None)
        if value is DELETE:
            del node[key]
        else:
            node[key] = value
    elif value is DELETE:
        node.pop(key, None)
    else:
        node[key] = value


def _dumps(record: dict[str, Any]) -> str:
    """The record as the json module writes it (NaN and Infinity as their non-JSON literals,
    ints of any size); a :class:`Deep` value as its text."""
    deep: list[Deep] = []

    def default(v: Any) -> Any:
        if isinstance(v, Deep):
            deep.append(v)
            return f"@@deep{len(deep) - 1}@@"
        raise TypeError(type(v))

    text = json.dumps(record, default=default)
    for i, d in enumerate(deep):
        text = text.replace(f'"@@deep{i}@@"', d.text(), 1)
    return text


_BASE = orjson.dumps(readerlogs.every_kind(rank=0, steps=STEPS))


def case_records(index: int, mutations: list[Mutation], seed: int) -> list[dict[str, Any]]:
    """The base log of every kind, with its own ids (``index``), and ``mutations`` applied."""
    records = orjson.loads(_BASE)  # a fresh copy, fast
    for r in records:
        r["run_id"] = f"5eed{index:08x}" if r["kind"] in ("sweep_point", "sweep_result") else f"{index:012x}"
    rng = random.Random(f"{seed}/{index}")
    for m in mutations:
        _apply(records, m, rng)
    return records


def write_case_log(path: str, batch: list[tuple[int, list[Mutation]]], seed: int) -> str:
    with open(path, "w") as f:
        for index, mutations in batch:
            for r in case_records(index, mutations, seed):
                f.write(_dumps(r) + "\n")
    return path


# -- running ------------------------------------------------------------------------------------


@attrs.define
class ToolStats:
    calls: int = 0
    cases: int = 0
    crashes: list[dict[str, Any]] = attrs.Factory(list)
    refused: int = 0  # exit status 2: a ConfigError naming the log (no steps to export, say)
    max_s: float = 0.0
    total_s: float = 0.0


def _call(tool: str, logs: list[str], out: str, stats: ToolStats) -> BaseException | None:
    t0 = time.perf_counter()
    try:
        result = readerlogs.run_tool(tool, logs, out)
    except Exception as e:  # noqa: BLE001 - what the fuzzer looks for
        return e
    finally:
        took = time.perf_counter() - t0
        stats.calls += 1
        stats.total_s += took
        stats.max_s = max(stats.max_s, took)
    codes = result if isinstance(result, list) and tool.startswith("plot") else [result]
    stats.refused += sum(1 for c in codes if c == 2)
    return None


def _crash(tool: str, index: int, mutations: list[Mutation], error: BaseException) -> dict[str, Any]:
    tb = traceback.extract_tb(error.__traceback__)
    site = next((f"{os.path.relpath(fr.filename)}:{fr.lineno}" for fr in reversed(tb) if "stepprof" in fr.filename), "?")
    return {"tool": tool, "case": index, "error": f"{type(error).__name__}: {str(error)[:300]}", "site": site,
            "mutations": [m.describe() for m in mutations],
            "traceback": "".join(traceback.format_exception(error))[-4000:]}


def fuzz(workdir: str, n_cases: int, seed: int, *, batch_size: int = 100, plot_n: int = 60,
         tools: tuple[str, ...] = readerlogs.TOOLS) -> dict[str, Any]:
    """Run every tool on ``n_cases`` mutated logs (and each plot on ``plot_n`` of its own); the results."""
    stats = {tool: ToolStats() for tool in tools}
    clean = readerlogs.every_kind(rank=1)
    clean_log = os.path.join(workdir, "clean.rank1.jsonl")
    with open(clean_log, "w") as f:
        f.writelines(_dumps(r) + "\n" for r in clean)
    all_cases = list(enumerate(cases(n_cases, seed)))
    covered: set[tuple[str, str, str]] = set()
    for m in (m for _, ms in all_cases for m in ms):
        covered.add((m.kind, ".".join(map(str, m.path)), m.cls))
    batch_tools = [t for t in tools if not t.startswith("plot")]
    for b in range(0, len(all_cases), batch_size):
        batch = all_cases[b:b + batch_size]
        log = write_case_log(os.path.join(workdir, f"batch{b // batch_size}.jsonl"), batch, seed)
        for tool in batch_tools:
            out = _fresh(workdir, f"out-{tool.replace(' ', '')}")
            error = _call(tool, [log, clean_log], out, stats[tool])
            stats[tool].cases += len(batch)
            if error is not None:  # which case: each alone
                _blame(tool, batch, seed, workdir, clean_log, stats[tool], error)
        os.unlink(log)
    plot_classes: dict[str, set[str]] = {}
    for tool in (t for t in tools if t.startswith("plot")):
        plot_classes[tool] = set()
        for i, mutations in enumerate(plot_cases(tool, plot_n, seed)):
            index = n_cases + i
            plot_classes[tool].update(m.cls for m in mutations)
            log = write_case_log(os.path.join(workdir, "plot.jsonl"), [(index, mutations)], seed)
            out = _fresh(workdir, "out-plot")
            stats[tool].cases += 1
            error = _call(tool, [log], out, stats[tool])
            if error is not None:
                stats[tool].crashes.append(_crash(tool, index, mutations, error))
    return {
        "cases": n_cases, "seed": seed, "plot_cases": plot_n,
        "combos": len(COMBOS), "combos_covered": len(covered),
        "plot_classes": {t: sorted(c) for t, c in plot_classes.items()},
        "tools": {t: attrs.asdict(s) for t, s in stats.items()},
    }


def _blame(tool: str, batch: list[tuple[int, list[Mutation]]], seed: int, workdir: str, clean_log: str,
           stats: ToolStats, error: BaseException) -> None:
    found = False
    for index, mutations in batch:
        log = write_case_log(os.path.join(workdir, "one.jsonl"), [(index, mutations)], seed)
        e = _call(tool, [log, clean_log], _fresh(workdir, "out-one"), ToolStats())
        if e is not None:
            stats.crashes.append(_crash(tool, index, mutations, e))
            found = True
    if not found:  # only the batch as a whole breaks it
        stats.crashes.append(_crash(tool, -1, [], error))


def _fresh(workdir: str, name: str) -> str:
    import shutil

    path = os.path.join(workdir, name)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path
