"""Library commands of the ``spotlight`` CLI (no Prefect, no SkyPilot): run one stage, write the report.

``flows/cli.py`` adds the orchestration commands (``run``, ``plan``) and is the installed entry point.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from spotlight.config import ConfigError, load_config
from spotlight.console import ProgressBars, console
from spotlight.report import Summary, write_report
from spotlight.stages import STAGES, open_run, pretrain
from spotlight.store import StoreError

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)

ConfigOpt = typer.Option(Path("configs/tiny.yaml"), "--config", "-c", help="run config (YAML)")
SetOpt = typer.Option([], "--set", "-s", help="override a setting: section.key=value (repeatable)")
RunUrlOpt = typer.Option(None, "--run", help="run store URL (file://... or s3://...); default from the config")


def config_with(config: Path, overrides: list[str], run_url: str | None):
    return load_config(config, [*overrides, *([f"run.url={run_url}"] if run_url else [])])


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
    if summary.eval_first_last:
        a, b = summary.eval_first_last
        table.add_row("held-out reward change", f"{b - a:+.3f}")
    table.add_row("reward curve", summary.reward_curve)
    table.add_row("samples (before | after)", summary.samples)
    console.print(table)


@app.command()
def stage(name: str = typer.Argument(..., help=f"pretrain, {', '.join(STAGES)}"),
          iteration: int = typer.Option(0, "--iteration", "-t"),
          config: Path = ConfigOpt, overrides: list[str] = SetOpt, run_url: Optional[str] = RunUrlOpt) -> None:
    """Run one stage in this process (idempotent: a committed stage returns at once)."""
    if name != "pretrain" and name not in STAGES:
        raise typer.BadParameter(f"unknown stage {name!r}; stages: pretrain, {', '.join(STAGES)}")
    bars = ProgressBars()
    run = open_run(config_with(config, overrides, run_url), bars)
    commit = pretrain(run) if name == "pretrain" else STAGES[name](run, iteration)
    bars.close()
    console.print(f"committed {run.store.url}/{commit.name}")


@app.command()
def report(config: Path = ConfigOpt, overrides: list[str] = SetOpt, run_url: Optional[str] = RunUrlOpt) -> None:
    """Write the reward curve and sample grid of a run from what it committed, and print its summary."""
    print_summary(write_report(open_run(config_with(config, overrides, run_url))))


def main() -> None:
    """Entry point that turns known errors into one clear line and exit code 2."""
    try:
        app()
    except (ConfigError, StoreError) as e:
        console.print(f"[bold red]error:[/] {e}")
        raise SystemExit(2) from None
