"""preflight, render and schema: the commands that read the playbooks and touch no host
(``preflight --live`` adds one facts call per host).

Only light modules are imported up front: an offline pre-flight whose inputs are unchanged is
answered from its result cache (preflight/runcache.py) without loading the config models, the
planner or the renderer, which are imported when a command needs them."""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from dflashops.commands.table import DEFAULT_FORKS
from dflashops.output import escape, inert, some
from dflashops.preflight.report import Report, write_outputs

if TYPE_CHECKING:
    from dflashops.engines.render import Rendered


def preflight(
    out: Console,
    *,
    inventory: str | None = None,
    hosts: list[str] | str | None = None,
    playbooks: list[str] | None = None,
    json_path: str | None = None,
    junit_path: str | None = None,
    live: bool = False,
    forks: int = DEFAULT_FORKS,
) -> int:
    def full() -> Report:
        from dflashops.preflight.offline import run_preflight
        from dflashops.project import find_inventory, select, split_names

        selection = select(find_inventory(inventory), playbooks or [], split_names(hosts))
        return run_preflight(selection, keep_rendered=False)

    with _few_collections():
        if live:  # what the hosts say is never kept: always asked
            from dflashops.preflight.live import run_live

            report = full()
            if report.plan is not None:
                run_live(report.plan, report, forks)
        else:
            from dflashops.preflight import runcache

            selection_key = runcache.RunKey(inventory, list(playbooks or []), hosts)
            report = runcache.run(selection_key, full)
        write_outputs(report, json_path, junit_path)
        print_report(out, report)
    return 0 if report.ok else 1


@contextmanager
def _few_collections() -> Iterator[None]:
    """Loading, planning and rendering a fleet makes about a million objects that live to the
    end of the run, and few reference cycles: the default collection every 700 allocations
    scans them over and over (0.1-0.2 s of a 1,000-host run). Rarely, for the run's length."""
    old = gc.get_threshold()
    gc.set_threshold(100_000, 20, 100)
    try:
        yield
    finally:
        gc.set_threshold(*old)


def print_report(out: Console, report: Report) -> None:
    for c in report.errors:
        out.print(f"[red]FAIL[/] {c.check}: {escape(inert(c.message))}")
    for c in report.warnings:
        out.print(f"[yellow]WARN[/] {c.check}: {escape(inert(c.message))}")
    live = sorted({c.subject for c in report.checks if c.check == "live-reachable"})
    if live:
        reached = sum(1 for c in report.checks if c.check == "live-reachable" and c.ok)
        out.print(f"live: {reached} of {len(live)} host(s) reached ({some(live)})")
    passed = sum(1 for c in report.checks if c.ok)
    verdict = "[green]preflight passed[/]" if report.ok else "[red]preflight failed[/]"
    hosts = report.hosts
    out.print(
        f"{verdict}: {report.units} units on {len(hosts)} host(s) ({some(hosts) or 'none'}); "
        f"{passed} checks passed, {len(report.errors)} failed, {len(report.warnings)} warnings"
    )


def render(
    out: Console,
    *,
    inventory: str | None = None,
    hosts: list[str] | str | None = None,
    playbooks: list[str] | None = None,
    units: list[str] | None = None,
    out_dir: str | None = None,
) -> int:
    """Print the launch scripts, or write them to OUT_DIR/<host>/<unit>.sh for review; with
    ``units`` (--unit) those units' alone (a service: all its units)."""
    from dflashops.engines.render import render_plan, template_dirs
    from dflashops.plan import build_plan, topo_order
    from dflashops.plan.expand import reportable
    from dflashops.plan.names import of_units, resolve
    from dflashops.project import find_inventory, select, split_names

    selection = select(find_inventory(inventory), playbooks or [], split_names(hosts))
    plan = build_plan(selection.inventory, selection.playbooks, selection.hosts)
    rendered, render_problems = render_plan(
        plan, template_dirs(b.path for b in selection.playbooks)
    )
    problems = reportable([*selection.problems, *plan.problems, *render_problems])
    if problems:
        for p in problems:
            out.print(f"[red]error:[/] {escape(str(p))}")
        out.print(
            "[red]nothing rendered[/]: fix the problems above (`dflashops preflight` checks everything)"
        )
        return 1
    if split_names(units):
        where = f"in the playbooks for {some(list(plan.hosts)) or 'the selected hosts'}"
        chosen = set(resolve(split_names(units), of_units(plan.units), where))
        rendered = [r for r in rendered if r.unit.name in chosen]
    order = {u.name: i for i, u in enumerate(topo_order(plan.units))}
    rendered.sort(key=lambda r: (r.unit.host.name, order[r.unit.name]))
    if out_dir:
        for path in write_rendered(rendered, Path(out_dir)):
            out.print(f"wrote {path}")
        return 0
    for r in rendered:
        out.print(f"[bold]# ---- {r.unit.host.name}/{r.unit.name} (fingerprint {r.short}) ----[/]")
        out.print(escape(r.script), end="")
    return 0


def write_rendered(rendered: list[Rendered], out_dir: Path) -> list[Path]:
    written = []
    for r in rendered:
        host_dir = out_dir / r.unit.host.name
        host_dir.mkdir(parents=True, exist_ok=True)
        path = host_dir / f"{r.unit.name}.sh"
        path.write_text(r.script, encoding="utf-8")
        path.chmod(0o755)
        written.append(path)
    return written


def schema(out: Console, *, which: str = "all") -> int:
    """JSON Schema of the inventory and playbook files, for editors (yaml-language-server)."""
    from dflashops.config.inventory import InventoryFile
    from dflashops.config.playbook import PlaybookFile

    schemas = {
        "inventory": InventoryFile.model_json_schema(),
        "playbook": PlaybookFile.model_json_schema(),
    }
    body = schemas if which == "all" else schemas[which]
    out.print_json(json.dumps(body)) if out.is_terminal else out.out(
        json.dumps(body, indent=2), highlight=False
    )
    return 0
