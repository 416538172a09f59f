"""The report as text: per log its runs (figures, tables, diagnoses) and sweeps, then the ranks.

Names, devices, sync sites, reasons and notes come from the log, which anyone can
write: :func:`render` builds a list of lines and passes each through
:func:`~stepprof._units.printable` as it joins them, so a control character in any
of them (a terminal escape, a newline) prints as a visible escape, on its own line.
"""

from __future__ import annotations

from .._log import LINE_MAX_BYTES
from .._records import Percentiles, boundary_name, python_boundary_line
from .._units import format_bytes, printable
from .peak import peak_lines
from .model import DistributedView, Report, RunReport

__all__ = ["render"]

#: A figure line's label -> its key in the run's ``unavailable`` (for the reason after "n/a").
_REASON_KEYS = {
    "wall ms": "wall_ms",
    "GPU ms": "gpu_ms",
    "samples/s": "samples_per_s",
    "data wait ms": "data_wait_ms_median",
    "input wait (of loop)": "input_wait_fraction",
    "GPU busy (median)": "gpu_busy_median",
    "syncs/step": "syncs_per_step",
    "TFLOP/s (median)": "tflops_per_s_median",
    "MFU (median)": "mfu_median",
    "MFU datasheet (median)": "mfu_datasheet_median",
    "stepprof µs/step (mean)": "overhead_us_mean",
    "energy J/step (mean)": "energy_j_per_step",
    "power W (mean)": "power_w_mean",
    "samples/J": "samples_per_j",
    "peak allocated": "peak_allocated_bytes",
}


#: Characters of a run's ``run_id`` shown in its heading (stepprof's ids have 12).
_ID_SHOWN = 24


def _spread(p: Percentiles | None, fmt: str = "{:.2f}") -> str:
    """``median (p10 .., p90 ..)``, or ``n/a``."""
    if p is None:
        return "n/a"
    return f"{fmt.format(p.median)} (p10 {fmt.format(p.p10)}, p90 {fmt.format(p.p90)})"


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def _number(x: float | None, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def render(report: Report) -> str:
    """The report as plain text: figures, then diagnoses with evidence and remedies.

    Every line is printable: control characters from the log are escaped (``--json``
    keeps the values exact).
    """
    out: list[str] = []
    for log in report.logs:
        out.append(f"== {log.path}: {log.lines:,} lines")
        if log.not_stepprof is not None:
            out.append(f"   {log.not_stepprof}: pass a log that stepprof wrote")
        elif log.skipped_lines:
            out.append(f"   skipped {log.skipped_lines:,} line(s) that are not stepprof records "
                       f"(torn, corrupt, over {LINE_MAX_BYTES // 2**20} MiB, or without a usable kind or step index)")
        if 1 in log.schema_versions:
            out.append(
                "   written by stepprof 0.1.0 (schema 1): its summaries are not read here; read the log "
                "with stepprof 0.1.x (pip install 'stepprof<0.2')"
            )
        if log.newer_schema:
            out.append(
                f"   written by a newer stepprof (schema {log.newer_schema}): fields this version "
                f"does not know are ignored"
            )
        if log.runs_dropped:
            out.append(
                f"   {log.runs_dropped:,} earlier run(s) not shown: the report keeps a log's last "
                f"{log.runs_kept:,} runs"
            )
        if not log.runs and not log.sweeps and log.not_stepprof is None:
            out.append("   no step, memory or sweep records")
        for run in log.runs:
            _render_run(run, out, len({(r.run, r.run_id) for r in log.runs}) > 1)
        for i, sweep in enumerate(log.sweeps):
            out.append("")
            out.append(f"-- sweep {i + 1}" if len(log.sweeps) > 1 else "-- sweep")
            out.extend((sweep.table or "(no points)").split("\n"))  # its lines; str(SweepResult) escapes values
            if sweep.result is None:
                out.append("the sweep has no result record (it stopped before the end)")
        out.append("")
    if report.distributed is not None:
        _render_ranks(report.distributed, out)
    return "\n".join(map(printable, out)).rstrip() + "\n"


def _render_ranks(view: DistributedView, out: list[str]) -> None:
    rows = view.ranks
    out.append(f"== ranks: {len(rows)} log(s) of world size {rows[0].world_size}")
    out.append(f"   {'rank':>4} {'steps':>7} {'wall ms':>9} {'GPU ms':>9} {'peak':>11} {'syncs/step':>10}  log")
    for r in rows:
        out.append(
            f"   {r.rank:>4} {r.measured_steps:>7,} {_ms(r.wall_ms_median):>9} {_ms(r.gpu_ms_median):>9} "
            f"{format_bytes(r.peak_allocated_bytes_max):>11} {_number(r.syncs_per_step_median, 'g'):>10}  {r.log}"
        )
    for note in view.notes:
        out.append(f"   note: {note}")
    ex = view.exchanges
    if ex is None:
        out.append("   stepprof's exchanges: no ranks records (rank 0's log not given, or ranks_every=0)")
    else:
        named = ", ".join(f"rank {k} in {v:,}" for k, v in ex.straggler_counts.items()) or "no rank"
        out.append(f"   stepprof's exchanges: {ex.exchanges:,}; straggler named: {named}")
        rec = ex.latest_named
        if rec is not None:
            excess = rec.get("straggler_excess_ms")
            out.append(
                f"   latest named (step {rec.get('step')}): rank {rec.get('straggler_rank')}, "
                f"basis {rec.get('straggler_basis')}, "
                f"{_ms(excess if type(excess) in (int, float) else None)} ms over the median"
            )
        last = ex.latest
        if last is not None and last.get("straggler_rank") is None:
            why = (last.get("unavailable") or {}).get("straggler_rank")
            out.append(f"   latest exchange (step {last.get('step')}): no straggler" + (f" ({why})" if why else ""))
    check = view.from_medians
    if check.straggler_rank is not None:
        out.append(
            f"   from the per-rank medians: rank {check.straggler_rank} (basis {check.basis}, "
            f"{check.excess_ms:.2f} ms over the median; {check.step_figure})"
        )
    else:
        out.append(f"   from the per-rank medians: no straggler ({check.reason})")


def _render_run(run: RunReport, out: list[str], several: bool) -> None:
    """One run's block, appended to ``out``: its heading, figures, details and diagnoses."""
    out.append("")
    out.extend(_run_head(run, several))
    rows = _figure_rows(run)
    width = max(len(k) for k, _ in rows)
    previous = None
    for label, value in rows:
        key = _REASON_KEYS.get(label)
        why = run.unavailable[key] if value == "n/a" and key in run.unavailable else None
        # A reason the row above gave already (energy's three rows, FLOPs' two) is not repeated.
        reason = "" if why is None else "  (as above)" if why == previous else f"  ({why})"
        previous = why
        out.append(f"   {label:<{width}}  {value}{reason}")
    if run.boundary == "python":
        out.append("   " + python_boundary_line(run.unavailable.get("boundary"), run.device))
    out.extend(_detail_lines(run))
    out.append("")
    out.extend(_diagnosis_lines(run))


def _run_head(run: RunReport, several: bool) -> list[str]:
    """The run's heading line (id, device, step counts, names), then what limits its figures."""
    head = f"-- run {run.run + 1}" if several else "--"
    if run.run_id is not None:  # a log's id may be any str: a long one is cut
        head += f" [{run.run_id if len(run.run_id) <= _ID_SHOWN else run.run_id[:_ID_SHOWN] + '…'}]"
    if run.step_name is not None:  # one of a run's step names: its steps only
        named = f"steps named {run.step_name!r}"
    else:
        named = "names: " + (", ".join(run.names[:5]) or "none")
    out = [
        f"{head} {run.device or 'no device'}: {run.steps:,} steps ({run.warmup_steps:,} warm-up, "
        f"{run.error_steps:,} failed, {run.measured_steps:,} measured"
        + (f", {run.timed_steps:,} timed" if 0 < run.timed_steps < run.measured_steps else "")
        + f"); {named}"
        + _batch_sizes(run)
    ]
    if not run.summary_found and run.steps:
        out.append("   no summary record: the run did not close (crash or still running)")
    if run.approximate_quantiles:
        out.append("   quantiles are approximate (over 32,768 steps: rank error < 0.1%)")
    if run.malformed_steps:
        out.append(f"   {run.malformed_steps:,} step record(s) without a usable wall_ms were left out")
    return out


def _batch_sizes(run: RunReport) -> str:
    """The run's batch sizes for its heading: one, a few with their steps, or the range."""
    sizes = run.batch_size_steps
    if not sizes:
        return f"; batch {run.batch_size:,}" if run.batch_size else ""
    if len(sizes) == 1:
        return f"; batch {sizes[0][0]:,}"
    if len(sizes) <= 4:
        return "; batch " + ", ".join(f"{b:,} ({n:,} steps)" for b, n in sorted(sizes))
    return (f"; batch {min(b for b, _ in sizes):,} to {max(b for b, _ in sizes):,} "
            f"({len(sizes):,} sizes; most often {sizes[0][0]:,})")


def _figure_rows(run: RunReport) -> list[tuple[str, str]]:
    """The run's figures as (label, value) rows: times, throughput, energy, then memory."""
    f = run.figures
    rows = [
        ("wall ms", _spread(f.wall_ms)),
        ("GPU ms", _spread(f.gpu_ms)),
        ("samples/s", _spread(f.samples_per_s, "{:,.0f}")),
        *([("tokens/s (median)", _number(f.tokens_per_s_median, ",.0f"))] if f.tokens_per_s_median is not None else []),
        ("data wait ms", _spread(f.data_wait_ms)),
        ("input wait (of loop)", _number(f.input_wait_fraction, ".1%")),
        ("GPU busy (median)", _number(f.gpu_busy_median, ".2f")),
        ("syncs/step", _spread(f.syncs_per_step, "{:g}")),
        ("TFLOP/s (median)", _number(f.tflops_per_s_median, ".4g")),
        ("MFU (median)", _number(f.mfu_median, ".1%")),
        ("MFU datasheet (median)", _number(f.mfu_datasheet_median, ".1%")),
        ("stepprof µs/step (mean)", _number(f.overhead_us_mean, ".0f")
         + (f" ({boundary_name(run.boundary)} boundary)" if run.boundary else "")),
        ("energy J/step (mean)", _number(f.energy_j_per_step, ".4g")),
        ("power W (mean)", _number(f.power_w_mean, ".0f")),
        ("samples/J", _number(f.samples_per_j, ",.4g")),
    ]
    c = run.compile
    if c is not None:
        rows.append(("compiled steps", f"{c.steps:,} of the measured, left out of the figures ({c.compiles:,} "
                     f"compiles, {c.compile_ms:,.0f} ms, {c.graph_breaks:,} graph breaks over all steps)"))
    if 0 < run.gpu_steps < run.timed_steps:
        why = f" ({run.gpu_missing_reason})" if run.gpu_missing_reason else ""
        rows.append(("GPU figures on", f"{run.gpu_steps:,} of {run.timed_steps:,} timed steps{why}"))
    m = run.memory
    rows += [
        ("peak allocated", format_bytes(m.peak_allocated_bytes_max)),
        ("reserved (max)", format_bytes(m.reserved_bytes_max)),
        ("nvidia-smi (NVML)", format_bytes(m.nvml_process_bytes)),
        ("residual (context+other)", format_bytes(m.residual_bytes)),
    ]
    if m.host_rss_bytes_last is not None:
        rows.append(("host RSS (last)", format_bytes(m.host_rss_bytes_last)))
    a = run.allocator
    if a is not None:
        rows.append(
            ("allocator retries", f"{a.num_alloc_retries:,} (cudaMalloc in {a.steps_with_device_alloc:,} steps)")
        )
    return rows


def _detail_lines(run: RunReport) -> list[str]:
    """The top sync sites, the phase table, the FLOPs counted and the explained peak."""
    out = []
    if run.syncs is not None and run.syncs.sites:
        out.append("   top sync sites:")
        for s in run.syncs.sites[:5]:
            out.append(f"     {s.per_step:>6.2f}/step  {s.where}  {s.kind}  {s.code or ''}")
    if run.phases:
        # Which steps a phase ran in, and how often: gradient accumulation's phases show here
        # (forward 4 times a step, the optimizer in 5 of 17); its times are per step it ran in.
        out.append(f"   {'phase':<24} {'in steps':>10} {'runs/step':>9} {'wall ms':>9} {'GPU ms':>9} "
                   f"{'peak':>11} {'syncs/step':>10}")
        for ph in run.phases:
            ran = f"{ph.steps:,}/{run.timed_steps:,}" if run.timed_steps else f"{ph.steps:,}"
            out.append(
                f"   {ph.name[:24]:<24} {ran:>10} {_number(ph.runs_per_step, '.2g'):>9} "
                f"{_ms(ph.wall_ms_median):>9} {_ms(ph.gpu_ms_median):>9} "
                f"{format_bytes(ph.peak_allocated_bytes_max):>11} {_number(ph.syncs_per_step, '.2f'):>10}"
            )
    flops = run.flops
    if flops is not None and type(flops.get("flops_per_step")) in (int, float):
        out.append(
            f"   FLOPs/step {flops['flops_per_step']:.4g} ({flops.get('source')}"
            + (f", counted in step {flops['step']}" if type(flops.get("step")) is int else "")
            + ")"
        )
    if isinstance(run.peak, dict):
        out.extend("   " + line for line in peak_lines(run.peak))
    return out


def _diagnosis_lines(run: RunReport) -> list[str]:
    """The diagnoses with their evidence and remedies, then what could not be diagnosed."""
    out = []
    if run.diagnoses:
        out.append("   Diagnoses")
        for d in run.diagnoses:
            out.append(f"   * {d.title}")
            for e in d.evidence:
                out.append(f"       evidence: {e}")
            for r in d.remedy:
                out.append(f"       remedy:   {r}")
    else:
        out.append("   Diagnoses: nothing stands out")
    if run.not_diagnosed:
        out.append("   Not diagnosed")
        for k, v in run.not_diagnosed.items():
            out.append(f"   - {k}: {v}")
    return out
