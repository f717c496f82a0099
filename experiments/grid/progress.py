"""Progress of the main job a person can follow: one live bar per preset on a terminal, one plain line per
finished cell elsewhere (CI, ``| tee``, Slurm logs), and the closing summary (where the tables and figures
are, which cells failed and why)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from experiments.grid.jobs import CellJob, CellOutcome, GridReport

__all__ = ["Bars", "Display", "Lines", "Tracker", "progress_bars", "summarise"]


class Display(Protocol):
    """Where progress goes: live bars on a terminal, plain lines elsewhere."""

    def start(self, report: GridReport, todo: int) -> None: ...

    def finish(self, report: GridReport, job: CellJob, outcome: CellOutcome, done: int) -> None: ...


@dataclass
class Lines:
    """One plain line per finished cell (CI, ``| tee``, Slurm logs): preset, cell, seconds, done/total."""

    console: Console

    def start(self, report: GridReport, todo: int) -> None:
        self.console.print(
            f"{report.preset}: {report.total} cells, {report.reused} reused, {todo} to compute",
            highlight=False,
        )

    def finish(self, report: GridReport, job: CellJob, outcome: CellOutcome, done: int) -> None:
        state = "done" if outcome.error is None else f"FAILED ({outcome.error.splitlines()[0]})"
        if outcome.error is None and outcome.copied_from is not None:
            state = f"copied from {outcome.copied_from} (the same cell)"
        elif outcome.error is None and outcome.read_back:
            state = "read back (another run of this store finished it meanwhile)"
        self.console.print(
            f"{report.preset} [{done}/{report.total}] {job.label}: {outcome.seconds:.1f} s {state}",
            highlight=False,
            markup=False,
            soft_wrap=True,  # NOTE: one line per cell, however long, so that logs can be grepped
        )


@dataclass
class Bars:
    """One live bar per preset: cells done (reused included), reused, failed, elapsed and time left."""

    progress: Progress
    tasks: dict[str, TaskID] = field(default_factory=dict)

    def start(self, report: GridReport, todo: int) -> None:
        self.tasks[report.preset] = self.progress.add_task(
            report.preset, total=report.total, completed=report.reused, reused=report.reused, failed=0
        )

    def finish(self, report: GridReport, job: CellJob, outcome: CellOutcome, done: int) -> None:
        self.progress.update(
            self.tasks[report.preset], completed=done, reused=report.reused, failed=len(report.failed)
        )


@dataclass
class Tracker:
    """Counts finished cells into their preset's report and shows them."""

    display: Display
    reports: dict[str, GridReport] = field(default_factory=dict)
    computed: int = 0
    """Cells computed (not copied) in this run."""
    traces_built: int = 0
    """Of those, the cells that built their counts (the others found them in their worker's cache)."""
    workloads_built: int = 0

    def add(self, report: GridReport, todo: int) -> None:
        self.reports[report.preset] = report
        self.display.start(report, todo)

    def done(self, job: CellJob, outcome: CellOutcome) -> None:
        report = self.reports[job.preset]
        if outcome.copied_from is None and not outcome.read_back:
            self.computed += 1
            self.traces_built += outcome.trace_generated
            self.workloads_built += outcome.workload_built
        if outcome.error is not None:
            report.failed.append((job.cell, outcome.error))
        elif outcome.copied_from is not None:
            report.copied += 1
        elif outcome.read_back:
            report.reused += 1
        else:
            report.ran += 1
        done = report.reused + report.ran + report.copied + len(report.failed)
        self.display.finish(report, job, outcome, done)

    def line(self) -> str:
        """Cells computed and copied, and how often a worker built counts and workloads."""
        copied = sum(report.copied for report in self.reports.values())
        return (
            f"{self.computed} cells computed, {copied} copied from the same cell of another preset; "
            f"counts built {self.traces_built} times, workloads {self.workloads_built} "
            "(the other cells found them in their worker's cache)"
        )


def progress_bars(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description:<18}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("cells, {task.fields[reused]} reused, {task.fields[failed]} failed"),
        TimeElapsedColumn(),
        TextColumn("left"),
        TimeRemainingColumn(),
        console=console,
    )


def summarise(console: Console, reports: list[GridReport], recompute_stale: bool, current: str) -> None:
    """Per preset: cells run, reused and failed (with why), and cells finished by other code than
    ``current`` (this code's ``code_version``)."""
    for rep in reports:
        if rep.skipped:
            console.print(f"[yellow]{escape(f'{rep.preset}: skipped ({rep.skipped})')}")
            continue
        copied = f", {rep.copied} copied from the same cell of another preset" if rep.copied else ""
        console.print(
            f"{rep.preset}: {rep.ran} cells run, {rep.reused} reused, {len(rep.failed)} failed{copied}"
        )
        if rep.stale:
            versions = ", ".join(f"{n} by {v}" for v, n in sorted(rep.stale.items()))
            what = "recomputed" if recompute_stale else "reused; --recompute-stale recomputes them"
            console.print(
                f"  [yellow]{sum(rep.stale.values())} finished cells came from other code than "
                f"{escape(current)} ({escape(versions)}): {what}"
            )
        if rep.left_out:
            console.print(
                f"  [yellow]{rep.left_out} finished cells of the grid recorded before are not in this "
                "one[/yellow] (a changed setting, or overrides that narrow the sweep): the analysis leaves "
                "them out; they stay on disk. To add this run's cells to the grid instead (e.g. more trace "
                "seeds), rerun with --extend-grid",
                soft_wrap=True,
            )
        if rep.grid_replaced:
            console.print(
                f"  [yellow]grid.json was damaged[/yellow] ({escape(rep.grid_replaced)}): replaced by this "
                "run's grid (which cells the earlier grid held cannot be told)",
                soft_wrap=True,
            )
        if rep.rekeyed:
            console.print(
                f"  [yellow]{rep.rekeyed} finished cells were keyed by an earlier rule[/yellow] (their trace "
                "file's path, or a peer trace's folder): they are computed again under the current keys, "
                "once; the old files stay on disk and the analysis leaves them out",
                soft_wrap=True,
            )
        for unreadable in rep.corrupt:
            console.print(
                f"  [yellow]unreadable or incomplete cell[/yellow] {escape(unreadable)}: "
                "treated as missing and computed again"
            )
        for cell, why in rep.failed:
            console.print(f"  [red]failed[/red] {escape(' '.join(cell))}: {escape(why)}", soft_wrap=True)
