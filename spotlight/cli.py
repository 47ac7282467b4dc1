"""Library commands of the ``spotlight`` CLI (no Prefect, no SkyPilot): run one stage, write the report.

``flows/cli.py`` adds the orchestration commands (``run``, ``plan``) and is the installed entry point.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from spotlight.config import ConfigError, load_config
from spotlight.console import ProgressBars, console
from spotlight.report import Summary, write_report
from spotlight.run import open_run
from spotlight.stages import STAGES, pretrain
from spotlight.store import StoreError

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)

ConfigOpt = typer.Option(Path("configs/tiny.yaml"), "--config", "-c", help="run config (YAML)")
SetOpt = typer.Option([], "--set", "-s", help="override a setting: section.key=value (repeatable)")
RunUrlOpt = typer.Option(None, "--run", help="run store URL (file://... or s3://...); default from the config")


def print_summary(summary: Summary) -> None:
    table = Table(title=f"Spotlight run {summary.run_url}")
    table.add_column("what")
    table.add_column("value")
    table.add_row("iterations committed", str(summary.iterations_done))
    if summary.train_reward:
        table.add_row("train reward (first -> last iteration)",
                      f"{summary.train_reward[0][1]:.3f} -> {summary.train_reward[-1][1]:.3f}")
    for it, value in summary.eval_reward:
        table.add_row(f"held-out reward, theta_{it}", f"{value:.3f}")
    for it, rho, rho_training in summary.ranking_spearman:
        table.add_row(f"seed ranking, stale vs fresh (iteration {it})",
                      f"Spearman rho {rho:.3f} ({rho_training:.3f} vs full-step training rollouts)")
    table.add_row("cost ledger", f"${summary.cost_usd:.4f} over {summary.cost_entries} stage attempts")
    if summary.eval_first_last:
        a, b = summary.eval_first_last
        table.add_row("held-out reward change", f"{b - a:+.3f}")
    out = Console()
    out.print(table)
    out.print(f"reward curve:             {summary.reward_curve}", soft_wrap=True)
    out.print(f"samples (before | after): {summary.samples}", soft_wrap=True)


@app.command()
def stage(name: str = typer.Argument(..., help=f"pretrain, {', '.join(STAGES)}"),
          iteration: int = typer.Option(0, "--iteration", "-t"),
          config: Path = ConfigOpt, overrides: list[str] = SetOpt, run_url: Optional[str] = RunUrlOpt) -> None:
    """Run one stage in this process (idempotent: a committed stage returns at once)."""
    if name != "pretrain" and name not in STAGES:
        raise typer.BadParameter(f"unknown stage {name!r}; stages: pretrain, {', '.join(STAGES)}")
    bars = ProgressBars()
    run = open_run(load_config(config, overrides, run_url), bars)
    commit = pretrain(run) if name == "pretrain" else STAGES[name](run, iteration)
    bars.close()
    where = f"{commit.store.url}/{commit.name}" if commit is not None else "nothing to pretrain (a pipeline)"
    console.print(f"committed {where}", soft_wrap=True, highlight=False)


@app.command()
def report(config: Path = ConfigOpt, overrides: list[str] = SetOpt, run_url: Optional[str] = RunUrlOpt) -> None:
    """Write the reward curve and sample grid of a run from what it committed, and print its summary."""
    print_summary(write_report(open_run(load_config(config, overrides, run_url))))


@app.command()
def worker(run_url: str = typer.Option(..., "--run", help="the run's store URL (file://... or s3://...)"),
           worker_id: Optional[str] = typer.Option(None, "--id", envvar="SPOTLIGHT_WORKER_ID",
                                                   help="worker name; default host-pid"),
           lease_seconds: Optional[float] = typer.Option(
               None, "--lease-seconds", help="lease length, renewed every third; default: the run's exploration.lease_seconds"),
           idle_exit: float = typer.Option(0.0, "--idle-exit", help="exit after this long with no claimable work"),
           poll_seconds: float = typer.Option(0.5, "--poll-seconds", help="how often to look for new work")) -> None:
    """Explore seeds for a run: pull items from its exploration queues until none is left (SIGTERM-safe)."""
    from spotlight.worker import work_on_run

    stats = work_on_run(run_url, worker_id=worker_id, lease_seconds=lease_seconds, idle_exit_seconds=idle_exit,
                        poll_seconds=poll_seconds)
    table = Table(title=f"worker {stats['worker']} on {run_url}")
    table.add_column("what")
    table.add_column("value")
    for key in ("items_claimed", "units_done", "items_completed", "items_released", "leases_lost"):
        value = stats[key]
        table.add_row(key.replace("_", " "), str(len(value) if isinstance(value, list) else value))
    table.add_row("busy / idle seconds", f"{stats['busy_seconds']:.1f} / {stats['idle_seconds']:.1f}")
    table.add_row("utilisation", f"{stats['utilisation']:.0%}")
    table.add_row("stopped by SIGTERM", str(stats["stopped"]))
    Console().print(table)


def main() -> None:
    """Entry point that turns known errors into one clear line and exit code 2."""
    try:
        app()
    except (ConfigError, StoreError) as e:
        console.print(f"[bold red]error:[/] {e}", soft_wrap=True, markup=True, highlight=False)
        raise SystemExit(2) from None
