"""The installed ``spotlight`` command: library commands, plus those that orchestrate (Prefect)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from spotlight.cli import ConfigOpt, RunUrlOpt, SetOpt, app, main, print_summary
from spotlight.config import load_config
from spotlight.mounts import check_mounted_inputs
from spotlight.report import Summary
from spotlight.run import check_inputs, compute_device
from spotlight.store import preflight


@app.command()
def run(config: Path = ConfigOpt, overrides: list[str] = SetOpt, run_url: Optional[str] = RunUrlOpt) -> None:
    """Run (or resume) post-training as a Prefect flow: pretrain, then explore -> filter -> update."""
    cfg = load_config(config, overrides, run_url)  # bad input fails here, before Prefect or any compute
    for url in dict.fromkeys((cfg.run_url, cfg.cache_url)):
        preflight(url)  # so does a store that cannot be reached or written (one line, exit 2)
    if os.environ.get("SPOTLIGHT_LAUNCHER", "local") == "local":
        compute_device(cfg.run.device)  # so does a device this machine does not have (its workers use it)
        check_inputs(cfg)  # and missing prompt files or reward weights
    else:
        check_mounted_inputs(cfg)  # cloud workers read them from the buckets placement.mounts maps
    from flows.post_train import post_train

    summary = post_train(config_path=str(config), run_url=run_url, overrides=overrides)
    print_summary(Summary(**summary))


@app.command()
def plan(run_url: Optional[str] = typer.Option(
        None, "--run", help="take busy hours per iteration from this run's cost ledger"),
         config: Optional[Path] = typer.Option(None, "--config", "-c", help="price this config's placement "
                                               "(default: the resources in sky/trainer.yaml, sky/explorer.yaml)"),
         overrides: list[str] = SetOpt) -> None:
    """Cheapest spot vs on-demand offer per worker kind (SkyPilot's optimizer, shipped catalog) and $ per iteration."""
    from tasks.placement import format_plan, plan as make_plan

    cfg = load_config(config, overrides) if config is not None or overrides else None
    typer.echo(format_plan(make_plan(run_url, config=cfg)))


__all__ = ["app", "main", "typer"]
