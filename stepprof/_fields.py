"""Every field of every record kind a log holds: its type, unit, meaning and whether it may be absent.

The log's record contract, declared once as data.  ``RECORDS[kind]`` is a :class:`Record`: the
kind's :class:`Field`\\ s in the order the writer puts them (then :data:`WRITER_FIELDS`, which the
log writer adds to every record).  A field's type is a :class:`Scalar` or the shape of what it
nests (:class:`Obj`, :class:`MapOf`, :class:`ListOf`, :data:`FREE`); its unit names a
:data:`UNITS` entry, the range a real measurement lies in.  The readers check every record read
from a log against this (``stepprof._sanitise``); docs/reference/schema.md is generated from it
(``python -m stepprof._schema_doc``; tests/test_fields.py checks it).  Pure data: no torch, no I/O.

Example:
    >>> from stepprof._fields import RECORDS
    >>> wall = RECORDS["step"].field("wall_ms")
    >>> wall.type.name, wall.unit, wall.nullable
    ('float', 'ms', False)
"""

from __future__ import annotations

from typing import Final, Union

import attrs

__all__ = [
    "BOOL", "FLOAT", "FLOAT_GREATEST", "FOREIGN", "FREE", "INT", "INT64_MAX", "REASONS", "RECORDS", "STR",
    "UNITS", "WRITER_FIELDS", "Field", "Free", "ListOf", "MapOf", "Obj", "Record", "Scalar", "Type", "Unit",
]

INT64_MAX: Final = 2**63 - 1


@attrs.frozen
class Unit:
    """A unit, and the range of values a real record holds in it (a signed field also down to ``-greatest``)."""

    name: str
    greatest: float
    meaning: str


#: The units, by name.  A value beyond ``greatest`` is no measurement: 1e12 ms is 31 years.
UNITS: Final = {u.name: u for u in (
    Unit("ms", 1e12, "milliseconds"),
    Unit("us", 1e15, "microseconds"),
    Unit("s", 1e10, "seconds"),
    Unit("unix_s", 1e11, "seconds since the Unix epoch"),
    Unit("bytes", INT64_MAX, "bytes"),
    Unit("samples", INT64_MAX, "samples (a batch's size)"),
    Unit("samples/s", 1e18, "samples per second"),
    Unit("tokens", INT64_MAX, "tokens (of a step's batches)"),
    Unit("tokens/s", 1e18, "tokens per second"),
    Unit("ratio", 1e6, "a ratio"),
    Unit("FLOPs", 1e24, "floating-point operations"),
    Unit("TFLOP/s", 1e12, "10^12 floating-point operations per second"),
    Unit("J", 1e12, "joules"),
    Unit("W", 1e9, "watts"),
    Unit("samples/J", 1e18, "samples per joule"),
)}
#: The range of a field without a unit: an int within int64, a float up to this magnitude.
FLOAT_GREATEST: Final = 1e24


@attrs.frozen
class Scalar:
    """A JSON scalar: ``int``, ``float``, ``str`` or ``bool``.  JSON has one kind of number, so
    an int is a float too, and an integral float (``4096.0``) is read as an int."""

    name: str


INT, FLOAT, STR, BOOL = Scalar("int"), Scalar("float"), Scalar("str"), Scalar("bool")


@attrs.frozen
class Free:
    """Any JSON that something other than stepprof wrote (a calibration file, a newer field):
    kept as scalars and containers at most two levels deep."""


FREE: Final = Free()


@attrs.frozen
class Obj:
    """A nested object with declared fields; other keys it holds are kept as a newer version's."""

    fields: tuple[Field, ...]


@attrs.frozen
class MapOf:
    """An object whose keys the writer chose (phase names, field names), each value a ``value``."""

    value: Type
    key: str  # what a key names
    max_items: int


@attrs.frozen
class ListOf:
    """A list of ``item``\\ s."""

    item: Type
    max_items: int


Type = Union[Scalar, Obj, MapOf, ListOf, Free]


@attrs.frozen
class Field:
    """One field of a record (or of an object nested in one).

    Attributes:
        name: the JSON key.
        type: its type, or the shape of what it nests.
        unit: a :data:`UNITS` name (for a container: of the numbers in it), or None.
        meaning: one line.
        nullable: may be null (a figure that was not measured; ``unavailable`` says why).
        optional: may be absent ("absent" in docs/reference/schema.md).
        required: a record without a usable value here is no record: the readers skip it.
        signed: may be negative (else a negative number is invalid).
    """

    name: str
    type: Type
    unit: str | None
    meaning: str
    nullable: bool = False
    optional: bool = False
    required: bool = False
    signed: bool = False


@attrs.frozen
class Record:
    """One record kind: what a line of it is, and its fields in the writer's order."""

    kind: str
    meaning: str
    fields: tuple[Field, ...]

    def field(self, name: str) -> Field:
        """The field called ``name`` (KeyError if the kind has none)."""
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"{self.kind!r} records have no field {name!r}")


def _f(name: str, type: Type, unit: str | None, meaning: str, **kw: bool) -> Field:
    return Field(name, type, unit, meaning, **kw)


_NULL = {"nullable": True}
_OPT = {"optional": True}
_OPT_NULL = {"optional": True, "nullable": True}

#: Field name -> why it is null.
REASONS = MapOf(STR, "field name (dotted for a nested one)", 512)
_NOTES = ListOf(STR, 256)

_HEAD = (
    _f("schema_version", INT, None, "version of the record schema (stepprof.SCHEMA_VERSION)"),
    _f("kind", STR, None, "the record kind", required=True),
)

#: Added by the log writer to every record, after the record's own fields.
WRITER_FIELDS: Final = (
    _f("run_id", STR, None, "the writer's id: one per Profiler, one per stepprof.sweep() call", **_OPT),
    _f("rank", INT, None, "this process's rank (distributed runs)", **_OPT),
    _f("local_rank", INT, None, "this process's local rank (distributed runs)", **_OPT),
    _f("world_size", INT, None, "the world size (distributed runs)", **_OPT),
    _f("encoding_replaced", ListOf(STR, 1024), None,
       "dotted paths of the values the writer replaced to write them as JSON", **_OPT),
)

# -- step -------------------------------------------------------------------------------------

_PHASE = Obj((
    _f("wall_ms", FLOAT, "ms", "host time from phase entry to exit, summed over its runs"),
    _f("gpu_ms", FLOAT, "ms", "span between the phase's CUDA events, summed over its runs", **_NULL),
    _f("peak_allocated_bytes", INT, "bytes", "high-water mark of allocated bytes in the phase", **_NULL),
    _f("count", INT, None, "how many times the phase ran in the step"),
    _f("syncs", INT, None, "sync points inside the phase, over its runs", **_NULL),
    _f("start_ms", FLOAT, "ms", "when its first run began, from the step's start", **_OPT),
))
_SITE = Obj((
    _f("where", STR, None, "the user's file:line that waited"),
    _f("kind", STR, None, "what kind of sync it was (item, tolist, ...)"),
    _f("code", STR, None, "the source line", **_NULL),
    _f("count", INT, None, "sync points there in the step"),
    _f("waits", INT, None, "of those, the ones where the host waited on the device"),
))
_SYNCS = Obj((
    _f("count", INT, None, "sync points in the step"),
    _f("waits", INT, None, "of those, the ones where the host waited on the device"),
    _f("sites", ListOf(_SITE, 1024), None, "each site's sync points, busiest first"),
    _f("other_threads", INT, None, "sync points on other threads during the step"),
    _f("mechanism", STR, None, "how syncs were detected: warn or trace"),
))
_ALLOCATOR = Obj(tuple(
    _f(name, INT, None, f"the step's change of the caching allocator's {name}", signed=True)
    for name in ("num_alloc_retries", "num_sync_all_streams", "num_device_alloc", "num_device_free")
))
_ERROR = Obj((
    _f("type", STR, None, "the exception's class name"),
    _f("message", STR, None, "its message (at most 2000 characters)"),
))

_STEP = (
    *_HEAD,
    _f("step", INT, None, "0-based index of the step in its Profiler", required=True),
    _f("name", STR, None, "the step's name"),
    _f("warmup", BOOL, None, "one of the first warmup steps"),
    _f("device", STR, None, "where it was measured: cuda:N or cpu"),
    _f("start_unix_s", FLOAT, "unix_s", "when the step started"),
    _f("wall_ms", FLOAT, "ms", "host wall time of the step body"),
    _f("gpu_ms", FLOAT, "ms", "device-side span of the step (two CUDA events)", **_NULL),
    _f("gpu_busy", FLOAT, "ratio", "gpu_ms / wall_ms", **_NULL),
    _f("peak_allocated_bytes", INT, "bytes", "high-water mark of allocated bytes in the step", **_NULL),
    _f("reserved_bytes", INT, "bytes", "bytes the caching allocator holds at step exit", **_NULL),
    _f("batch_size", INT, "samples", "samples in the step", **_NULL),
    _f("samples_per_s", FLOAT, "samples/s", "batch_size over the longer of wall_ms and gpu_ms", **_NULL),
    _f("data_wait_ms", FLOAT, "ms", "host time from the previous step's exit to this one's entry, "
       "plus data_wait_in_step_ms", **_NULL),
    _f("phases", MapOf(_PHASE, "phase name (outer/inner when nested)", 4096), None,
       "each phase's figures, in the order they first finished"),
    _f("overhead_us", FLOAT, "us", "stepprof's own time for the step"),
    _f("error", _ERROR, None, "the exception that left the step", **_NULL),
    _f("syncs", _SYNCS, None, "the step's sync points", **_NULL),
    _f("allocator", _ALLOCATOR, None, "per-step deltas of the caching allocator's counters", **_NULL),
    _f("unavailable", REASONS, None, "field -> why it is null"),
    _f("host_rss_bytes", INT, "bytes", "resident set size of the process at step exit (CPU steps)", **_OPT_NULL),
    _f("thread", STR, None, "the name of the thread that ran it, when not the training thread", **_OPT),
    _f("sampled", BOOL, None, "under overhead_budget: measured in full", **_OPT),
    _f("data_ms", FLOAT, "ms", "time in the loader's __next__ (stepprof.iterate), part of data_wait_ms", **_OPT),
    _f("data_wait_in_step_ms", FLOAT, "ms", "waits between the step's micro-batches (add_batch(wait_s=)), "
       "in data_wait_ms and wall_ms", **_OPT),
    _f("peak_phase", STR, None, "the innermost phase that reached the step's peak", **_OPT_NULL),
    _f("global_step", INT, None, "the framework's step number, as its loggers use it (begin_step(global_step=))",
       **_OPT),
    _f("tokens", INT, "tokens", "the tokens it trained on: tokens=N, or counted in its batch (unmasked ones)",
       **_OPT_NULL),
    _f("tokens_per_s", FLOAT, "tokens/s", "tokens over the longer of wall_ms and gpu_ms", **_OPT_NULL),
    _f("flops", FLOAT, "FLOPs", "the FLOPs of one step", **_OPT_NULL),
    _f("tflops_per_s", FLOAT, "TFLOP/s", "flops over the longer of wall_ms and gpu_ms", **_OPT_NULL),
    _f("mfu", FLOAT, "ratio", "the time the FLOPs need at the calibrated rate, over the step's", **_OPT_NULL),
    _f("mfu_datasheet", FLOAT, "ratio", "the time the FLOPs need at the GPU's published dense peak, over the "
       "step's", **_OPT_NULL),
    _f("flops_counted", BOOL, None, "the step ran under FlopCounterMode", **_OPT),
    _f("explained", BOOL, None, "the step explain_peak explained", **_OPT),
    _f("energy_j", FLOAT, "J", "the GPU's energy over energy_span_ms", **_OPT_NULL),
    _f("energy_span_ms", FLOAT, "ms", "the span energy_j covers", **_OPT_NULL),
    _f("compiles", INT, None, "torch.compile frame compilations in the step", **_OPT),
    _f("recompiles", INT, None, "of those, recompilations", **_OPT),
    _f("compile_ms", FLOAT, "ms", "host time inside compile events in the step", **_OPT),
    _f("graph_breaks", INT, None, "graph breaks dynamo counted in the step", **_OPT_NULL),
    _f("recompile_reasons", ListOf(STR, 64), None, "the failed guard of each recompile", **_OPT),
    _f("compiled", BOOL, None, "the step did compile work", **_OPT),
)

# -- memory -----------------------------------------------------------------------------------


def _bytes(name: str, meaning: str, **kw: bool) -> Field:
    return _f(name, INT, "bytes", meaning, nullable=True, **kw)


_MEMORY = (
    *_HEAD,
    _f("trigger", STR, None, "why it was written: after_warmup, periodic, close or on_demand"),
    _f("step", INT, None, "the latest step begun before the readings", **_NULL),
    _f("device", STR, None, "cuda:N, or cpu"),
    _f("unix_s", FLOAT, "unix_s", "when the readings were taken"),
    _bytes("allocated_bytes", "live tensors"),
    _bytes("peak_allocated_bytes", "the high-water mark of live tensors"),
    _bytes("reserved_bytes", "what the caching allocator holds from the driver"),
    _bytes("fragmentation_bytes", "reserved_bytes - allocated_bytes: blocks cached for reuse"),
    _bytes("inactive_split_bytes", "cached pieces of split segments"),
    _bytes("nvml_process_bytes", "what nvidia-smi shows for this process"),
    _bytes("nvml_device_used_bytes", "NVML's used bytes for the whole device"),
    _bytes("mem_get_info_used_bytes", "total - free from torch.cuda.mem_get_info()"),
    _bytes("total_bytes", "the device's total memory"),
    _bytes("residual_bytes", "the CUDA context and memory allocated outside PyTorch", signed=True),
    _bytes("context_baseline_bytes", "the residual when stepprof first saw CUDA in the process"),
    _f("num_ooms", INT, None, "out-of-memory errors since the process started", **_NULL),
    _f("num_alloc_retries", INT, None, "cudaMalloc retries since the process started", **_NULL),
    _f("basis", STR, None, "process, or device (assumes exclusive GPU)", **_NULL),
    _f("explanation", STR, None, "one plain-language paragraph"),
    _f("notes", _NOTES, None, "what needs attention"),
    _f("unavailable", REASONS, None, "field -> why it is null"),
    _f("power_limit_w", FLOAT, "W", "the GPU's enforced power limit", **_NULL),
    _f("other_processes", INT, None, "compute processes on the GPU other than this one", **_NULL),
)

# -- summary ----------------------------------------------------------------------------------

_PERCENTILES_MS = Obj(tuple(
    _f(name, FLOAT, "ms", f"the {what} of the steps' figure") for name, what in
    (("median", "median"), ("p10", "10th percentile"), ("p90", "90th percentile"))
))
_PHASE_FIGURES = Obj((
    _f("steps", INT, None, "measured steps in which the phase ran"),
    _f("runs_per_step", FLOAT, None, "its count, summed, over steps", **_NULL),
    _f("wall_ms_median", FLOAT, "ms", "median of its per-step wall_ms", **_NULL),
    _f("wall_ms_p90", FLOAT, "ms", "90th percentile of its per-step wall_ms", **_NULL),
    _f("gpu_ms_median", FLOAT, "ms", "median of its per-step gpu_ms", **_NULL),
    _f("gpu_ms_p90", FLOAT, "ms", "90th percentile of its per-step gpu_ms", **_NULL),
    _f("peak_allocated_bytes_max", INT, "bytes", "its largest peak_allocated_bytes", **_NULL),
    _f("syncs_per_step", FLOAT, None, "its syncs, summed, over the steps that counted them", **_NULL),
))

_SUMMARY = (
    *_HEAD,
    _f("steps", INT, None, "steps whose record was written"),
    _f("warmup_steps", INT, None, "of those, warm-up steps"),
    _f("error_steps", INT, None, "steps past warm-up whose error is set"),
    _f("measured_steps", INT, None, "steps past warm-up without an error"),
    _f("device", STR, None, "the backend's device at close, or none"),
    _f("wall_ms_percentiles", _PERCENTILES_MS, None, "median, p10 and p90 of the steps' wall_ms", **_NULL),
    _f("gpu_ms_percentiles", _PERCENTILES_MS, None, "median, p10 and p90 of the steps' gpu_ms", **_NULL),
    _f("gpu_busy_median", FLOAT, "ratio", "median of the steps' gpu_busy", **_NULL),
    _f("peak_allocated_bytes_max", INT, "bytes", "the largest peak_allocated_bytes of a measured step", **_NULL),
    _f("samples_per_s_median", FLOAT, "samples/s", "median of the steps' samples_per_s", **_NULL),
    _f("tokens_per_s_median", FLOAT, "tokens/s", "median of the steps' tokens_per_s", **_NULL),
    _f("overhead_us_median", FLOAT, "us", "median of the steps' overhead_us", **_NULL),
    _f("log", STR, None, "the log's path as given to the Profiler", **_NULL),
    _f("syncs_per_step_median", FLOAT, None, "median of the steps' syncs.count", **_NULL),
    _f("sync_mechanism", STR, None, "how syncs were detected: warn or trace", **_NULL),
    _f("syncs_outside_steps", INT, None, "waits on a thread with no open step", **_NULL),
    _f("tflops_per_s_median", FLOAT, "TFLOP/s", "median of the steps' tflops_per_s", **_NULL),
    _f("mfu_median", FLOAT, "ratio", "median of the steps' mfu", **_NULL),
    _f("mfu_datasheet_median", FLOAT, "ratio", "median of the steps' mfu_datasheet", **_NULL),
    _f("phases", MapOf(_PHASE_FIGURES, "phase name", 4096), None, "each phase's figures over the measured steps"),
    _f("ended_by", STR, None, "how the run ended: close, exception, exit, SIGTERM or SIGINT", **_NULL),
    _f("overhead_us_mean", FLOAT, "us", "mean of the steps' overhead_us", **_NULL),
    _f("gpu_steps", INT, None, "timed steps with GPU figures"),
    _f("boundary", STR, None, "which boundary did the device work: compiled or python", **_NULL),
    _f("data_wait_ms_median", FLOAT, "ms", "median of the steps' data_wait_ms", **_NULL),
    _f("input_wait_fraction", FLOAT, "ratio", "the share of the loop's time spent before steps", **_NULL),
    _f("energy_j_per_step", FLOAT, "J", "mean energy_j of the measured steps", **_NULL),
    _f("power_w_mean", FLOAT, "W", "their energy_j over their energy_span_ms", **_NULL),
    _f("samples_per_j", FLOAT, "samples/J", "their batch_size over their energy_j", **_NULL),
    _f("unavailable", REASONS, None, "summary field -> why it is null"),
    _f("compile_steps", INT, None, "measured steps that compiled (left out of the figures)", **_OPT),
    _f("timed_steps", INT, None, "the measured steps the figures are taken over: all but those FLOP-counted, "
       "explained or compiled", **_OPT),
)

# -- flops, peak, ranks -----------------------------------------------------------------------

_FLOPS = (
    *_HEAD,
    _f("source", STR, None, "auto (counted) or given (flops_per_step)"),
    _f("flops_per_step", FLOAT, "FLOPs", "the step's FLOPs", **_NULL),
    _f("flops_by_dtype", MapOf(FLOAT, "dtype", 64), "FLOPs", "FLOPs by the dtype they ran in", **_NULL),
    _f("ops", INT, None, "non-view ATen operations the step dispatched", **_NULL),
    _f("op_bytes", INT, "bytes", "the summed sizes of those operations' inputs and outputs", **_NULL),
    _f("step", INT, None, "the counted step", **_NULL),
    _f("notes", _NOTES, None, "what to know about the count"),
    _f("device", STR, None, "the backend's device"),
    _f("device_name", STR, None, "the GPU model whose calibration was looked up", **_NULL),
    _f("ideal_ms", FLOAT, "ms", "the time flops_by_dtype needs at the calibrated rates", **_NULL),
    _f("calibration", FREE, None, "the cached calibration used, as written in the cache", **_NULL),
    _f("datasheet_ms", FLOAT, "ms", "the time flops_by_dtype needs at the GPU's published dense peaks", **_NULL),
    _f("datasheet", Obj((
        _f("part", STR, None, "the GPU model, as its vendor names it"),
        _f("tflops", MapOf(FLOAT, "dtype", 64), "TFLOP/s", "its published dense peak by dtype"),
        _f("source", STR, None, "where the vendor publishes them"),
    )), None, "the datasheet peaks mfu_datasheet is against", **_NULL),
    _f("unavailable", REASONS, None, "field -> why it is null"),
)

_CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "other")
_BY_CATEGORY = Obj(tuple(_f(c, INT, "bytes", f"live bytes of {c.replace('_', ' ')}") for c in _CATEGORIES))
_MODULE = Obj((
    _f("module", STR, None, "the module's qualified name, (root) for the model"),
    _f("total_bytes", INT, "bytes", "live bytes at the peak that it made"),
    _f("bytes_by_category", _BY_CATEGORY, None, "those bytes by category"),
))

_PEAK = (
    *_HEAD,
    _f("step", INT, None, "the explained step's index", **_NULL),
    _f("device", STR, None, "cuda:N, or cpu"),
    _f("peak_allocated_bytes", INT, "bytes", "the allocator's high-water mark over the step", **_NULL),
    _f("live_bytes", INT, "bytes", "bytes live at the replayed high-water mark", **_NULL),
    _f("peak_at_ms", FLOAT, "ms", "when the peak happened, from the step's entry", **_NULL),
    _f("phase", STR, None, "the innermost phase open at the peak", **_NULL),
    _f("op", STR, None, "the innermost annotation or frame at the allocation that set the peak", **_NULL),
    _f("user_frame", STR, None, "that allocation's innermost frame outside torch and stepprof", **_NULL),
    _f("bytes_by_category", _BY_CATEGORY, None, "live bytes at the peak in each category", **_NULL),
    _f("modules", ListOf(_MODULE, 1024), None, "the modules with the most live bytes", **_NULL),
    _bytes("outside_modules_bytes", "live bytes made in the step outside every module"),
    _bytes("reserved_bytes", "what the allocator held from the driver at the peak"),
    _bytes("fragmentation_bytes", "reserved_bytes - live_bytes"),
    _bytes("largest_free_block_bytes", "the largest free range inside one segment at the peak"),
    _f("live_blocks", INT, None, "allocator blocks live at the peak", **_NULL),
    _f("trace_entries", INT, None, "the allocator history's entries in the step", **_NULL),
    _f("cost_ms", FLOAT, "ms", "host time explaining added", **_NULL),
    _f("timeline_ms", ListOf(FLOAT, 100_000), "ms", "times of the live-bytes timeline, from the step's entry",
       **_NULL),
    _f("timeline_bytes", ListOf(INT, 100_000), "bytes", "live bytes at each of those times", **_NULL),
    _f("activations_from", STR, None, "saved_tensors_hooks (exact) or stacks", **_NULL),
    _f("notes", _NOTES, None, "what may mislead here"),
    _f("unavailable", REASONS, None, "field -> why it is null"),
    _f("snapshot_path", STR, None, "the step's allocator snapshot, a pickle for pytorch.org/memory_viz "
       "(explain_peak(snapshot=))", **_OPT_NULL),
)

_STATS = Obj((
    _f("min", FLOAT, None, "the least rank's value"),
    _f("median", FLOAT, None, "the median over the ranks"),
    _f("max", FLOAT, None, "the largest rank's value"),
    _f("slowest_rank", INT, None, "the rank with the largest value"),
))
_RANKS = (
    *_HEAD,
    _f("step", INT, None, "rank 0's step at whose exit the exchange was enqueued", **_NULL),
    _f("world_size", INT, None, "ranks in the exchange's group"),
    _f("window_steps", _STATS, None, "the steps in each rank's window", **_NULL),
    _f("step_basis", STR, None, "gpu_ms or wall_ms: the figure of the step test", **_NULL),
    _f("figures", MapOf(_STATS, "figure", 64), None, "each figure over the ranks that have it"),
    _f("phases", MapOf(_STATS, "top-level phase name", 64), None, "the same for each top-level phase"),
    _f("per_rank", MapOf(ListOf(FLOAT, 2**20), "figure", 64), None, "each figure as a list indexed by rank"),
    _f("straggler_rank", INT, None, "the straggler", **_NULL),
    _f("straggler_basis", STR, None, "step, gap or the phase in which it was found", **_NULL),
    _f("straggler_excess_ms", FLOAT, "ms", "its excess over the median rank in that figure", **_NULL),
    _f("step_ratio", FLOAT, "ratio", "max / median of the step figure", **_NULL),
    _f("threshold", FLOAT, "ratio", "the straggler rule's ratio"),
    _f("unavailable", REASONS, None, "field -> why it is null"),
    _f("group_ranks", ListOf(INT, 2**20), None, "the global rank of each row of per_rank (a subgroup)", **_OPT),
)

# -- sweeps -----------------------------------------------------------------------------------

_SWEEP_POINT = (
    *_HEAD,
    _f("trial", INT, None, "1-based position of the trial in the sweep"),
    _f("phase", STR, None, "why the sweep tried this size: grow, refine, down or backfill"),
    _f("batch_size", INT, "samples", "the n passed to make_batch(n)"),
    _f("oom", BOOL, None, "the trial ran out of memory"),
    _f("samples_per_s", FLOAT, "samples/s", "batch_size / (step_ms / 1000)", **_NULL),
    _f("step_ms", FLOAT, "ms", "median of the timed steps' spans", **_NULL),
    _f("step_ms_p10", FLOAT, "ms", "10th percentile of the same spans", **_NULL),
    _f("step_ms_p90", FLOAT, "ms", "90th percentile of the same spans", **_NULL),
    _f("timed_steps", INT, None, "timed steps run"),
    _f("warmup_steps", INT, None, "untimed steps before the timed ones"),
    _bytes("peak_allocated_bytes", "high-water mark of allocated bytes over the trial"),
    _f("alloc_retries", INT, None, "increase of num_alloc_retries over the timed steps", **_NULL),
    _f("device_allocs", INT, None, "increase of num_device_alloc over the timed steps", **_NULL),
    _bytes("leaked_bytes", "bytes still allocated after an out-of-memory trial's clean-up", signed=True),
    _f("error", STR, None, "an out-of-memory trial's exception", **_NULL),
    _f("wall_s", FLOAT, "s", "host wall time of the whole trial"),
    _f("unavailable", REASONS, None, "field -> why it is null"),
)


def _batch(name: str, meaning: str) -> Field:
    return _f(name, INT, "samples", meaning, nullable=True)


_SWEEP_RESULT = (
    *_HEAD,
    _batch("knee", "the smallest batch within knee_within of the best samples/s"),
    _batch("max_fit", "the largest batch that ran"),
    _batch("first_oom", "the smallest batch that ran out of memory"),
    _batch("predicted_max", "the largest batch the memory fit predicts"),
    _f("thrash_zone", ListOf(INT, 2), "samples", "the first and last batch of the thrash zone", **_NULL),
    _batch("recommended", "the knee rule applied outside the thrash zone"),
    _f("reason", STR, None, "one plain sentence on the recommendation"),
    _f("stopped", STR, None, "how the search ended"),
    _f("device", STR, None, "cuda:N or cpu"),
    _f("trials", INT, None, "trials run"),
    _f("wall_s", FLOAT, "s", "host wall time of the sweep"),
    _bytes("capacity_bytes", "what torch's allocator could hold at the start"),
    _f("fit_base_bytes", FLOAT, "bytes", "the memory fit's base", nullable=True, signed=True),
    _f("fit_bytes_per_sample", FLOAT, "bytes", "the memory fit's bytes per sample", nullable=True, signed=True),
    _f("knee_within", FLOAT, "ratio", "the knee rule's fraction"),
    _f("notes", _NOTES, None, "warnings about the search"),
    _f("unavailable", REASONS, None, "field -> why it is null"),
)



def _record(kind: str, meaning: str, own: tuple[Field, ...]) -> Record:
    """A kind's record: its own fields, then the writer's it does not declare itself."""
    names = {f.name for f in own}
    return Record(kind, meaning, (*own, *(f for f in WRITER_FIELDS if f.name not in names)))


#: Every record kind stepprof writes, by kind (the keys are ``stepprof._schema.RECORD_KINDS``).
RECORDS: Final = {r.kind: r for r in (
    _record("step", "one finished step", _STEP),
    _record("memory", "a reconciliation of the process's GPU memory with nvidia-smi", _MEMORY),
    _record("summary", "a run's figures, written when its Profiler closes", _SUMMARY),
    _record("flops", "the FLOPs of one step and the calibration used", _FLOPS),
    _record("peak", "where the explained step's peak memory comes from", _PEAK),
    _record("ranks", "one cross-rank exchange: the ranks' figures and the straggler", _RANKS),
    _record("sweep_point", "one trial of stepprof.sweep()", _SWEEP_POINT),
    _record("sweep_result", "the result of stepprof.sweep()", _SWEEP_RESULT),
)}
#: A record of a kind this version does not write: only the head and the writer's fields are known.
FOREIGN: Final = _record("", "a record of a kind this version does not write", _HEAD)
