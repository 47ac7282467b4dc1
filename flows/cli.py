"""The installed ``spotlight`` command: library commands, plus those that orchestrate (Prefect)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from spotlight.cli import RUNS, ConfigOpt, RunUrlOpt, SetOpt, app, main, print_summary
from spotlight.console import console
from spotlight.config import load_config
from spotlight.mounts import check_mounted_inputs
from spotlight.report import Summary
from spotlight.run import check_inputs, compute_device
from spotlight.store import RunStore, preflight

BUDGET_CAPPED_EXIT = 3  # `spotlight run` stopped at placement.max_dollars (2: bad input, 1: an error)


@app.command(rich_help_panel=RUNS)
def run(config: Path = ConfigOpt, overrides: list[str] = SetOpt, run_url: Optional[str] = RunUrlOpt) -> None:
    """Run (or resume) post-training as a Prefect flow: pretrain, then explore -> filter -> update."""
    cfg = load_config(config, overrides, run_url)  # bad input fails here, before Prefect or any compute
    for url in dict.fromkeys((cfg.run_url, cfg.cache_url)):
        preflight(url)  # so does a store that cannot be reached or written (one line, exit 2)
    if os.environ.get("SPOTLIGHT_LAUNCHER", "local") == "local":
        compute_device(cfg.run.device)  # so does a device this machine does not have (its workers use it)
        check_inputs(cfg)  # and missing prompt files or reward weights
    else:
        from spotlight.memory_plan import fit_placement

        fit_placement(cfg)  # and a placement whose accelerators cannot hold a worker (the flow drops the others)
        check_mounted_inputs(cfg)  # cloud workers read their inputs from the buckets placement.mounts maps
    from flows.post_train import BUDGET_CAPPED, post_train

    state = post_train(config_path=str(config), run_url=run_url, overrides=overrides, return_state=True)
    if state.name == BUDGET_CAPPED:  # a clean stop: everything done is committed, the message says how to go on
        print_summary(Summary(**RunStore(cfg.run_url).get_json("report/summary.json")))  # the report it wrote
        console.print(f"[bold yellow]budget cap:[/] {state.message}", soft_wrap=True, highlight=False)
        raise SystemExit(BUDGET_CAPPED_EXIT)
    print_summary(Summary(**state.result()))


@app.command(rich_help_panel=RUNS)
def plan(run_url: Optional[str] = typer.Option(
        None, "--run", help="take busy hours per iteration from this run's cost ledger"),
         config: Optional[Path] = typer.Option(None, "--config", "-c", help="plan this config: the GPU memory each "
                                               "worker kind needs, then its placement's prices (default: prices of "
                                               "the resources in sky/trainer.yaml, sky/explorer.yaml)"),
         overrides: list[str] = SetOpt,
         prices: bool = typer.Option(True, "--prices/--no-prices", help="also price the placement with SkyPilot's "
                                     "optimizer")) -> None:
    """Before renting: GPU memory per worker kind, and the cheapest spot vs on-demand offer per kind.

    Memory with its parts (weights, training state, activations; no weights needed), the accelerators that
    cannot hold a worker dropped, then SkyPilot's prices per kind and $ per iteration."""
    from tasks.placement import format_plan, plan as make_plan

    cfg = load_config(config, overrides) if config is not None or overrides else None
    if cfg is not None:
        from spotlight.memory_plan import fit_placement, format_plan as format_memory, plan_memory

        memory = plan_memory(cfg)
        typer.echo(format_memory(memory))
        cfg, dropped = fit_placement(cfg, memory)  # no accelerator left for a worker: exit 2, naming it
        for line in dropped:
            typer.echo(line)
    if prices:
        typer.echo(format_plan(make_plan(run_url, config=cfg)))


HELP_ORDER = ["run", "plan", "simulate", "report", "export", "worker", "stage", "tiny-model"]  # a user's order
app.registered_commands.sort(key=lambda command: HELP_ORDER.index(command.name or command.callback.__name__))

__all__ = ["app", "main", "typer"]
