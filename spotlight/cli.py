"""Library commands of the ``spotlight`` CLI (no Prefect, no SkyPilot): run one stage, write the report.

``flows/cli.py`` adds the orchestration commands (``run``, ``plan``) and is the installed entry point.
"""

from __future__ import annotations

import os
import signal
import sys
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

USAGE = ("Flow-GRPO post-training of diffusion transformers, made cheaper by seed exploration on spot GPUs.\n\n"
         "Start with `spotlight run` (the tiny default on CPU) or, before renting a GPU for a real model, "
         "`spotlight plan --config C`.")
RUNS, INSIDE = "Runs", "Inside a run (workers, one stage, test models)"
app = typer.Typer(add_completion=False, no_args_is_help=True, help=USAGE)

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
    diversity, realism = dict(summary.diversity_vs_base), dict(summary.realism_digits)
    for it, value in summary.eval_reward:
        extra = f"  diversity {diversity[it]:.2f}x base" if it in diversity else ""
        extra += f", realism {realism[it]:.3f}" if realism.get(it) is not None else ""
        table.add_row(f"held-out reward, theta_{it}", f"{value:.3f}{extra}")
    for it, by_tag in summary.eval_reward_by_tag[:1] + summary.eval_reward_by_tag[1:][-1:]:  # first and last
        table.add_row(f"held-out reward by tag, theta_{it}", ", ".join(f"{tag} {r:.3f}" for tag, r in by_tag.items())
                      + f" (mean of the tags {sum(by_tag.values()) / len(by_tag):.3f})")
    if summary.realism_digits_real is not None:
        table.add_row("realism (distance to the 5 nearest real digits)",
                      f"lower is better; real digits: {summary.realism_digits_real:.3f}")
    for it, rho, rho_training in summary.ranking_spearman:
        table.add_row(f"seed ranking, stale vs fresh (iteration {it})",
                      f"Spearman rho {rho:.3f} ({rho_training:.3f} vs full-step training rollouts)")
    table.add_row("cost ledger", f"${summary.cost_usd:.4f} over {summary.cost_entries} entries")
    if summary.target is not None:
        hit = summary.target_reached
        table.add_row(f"to held-out reward {summary.target:g}",
                      f"theta_{hit['iteration']} ({hit['eval_reward']:.3f}): ${hit['cost_usd']:.4f}, "
                      f"{hit['seconds']:.0f} s" if hit else "not reached")
    if summary.eval_first_last:
        a, b = summary.eval_first_last
        table.add_row("held-out reward change", f"{b - a:+.3f}")
    out = Console()
    out.print(table)
    if summary.cost_by_stage:
        costs = Table(title="cost ledger per stage (idle: workers held but waiting, boots included)")
        for col in ("stage", "attempts", "failed or preempted", "seconds", "$"):
            costs.add_column(col, justify="left" if col == "stage" else "right")
        for stage, row in sorted(summary.cost_by_stage.items()):
            costs.add_row(stage, str(int(row["attempts"])), str(int(row["not_ok"])), f"{row['seconds']:.1f}",
                          f"{row['cost_usd']:.4f}")
        out.print(costs)
    out.print(f"reward curve:             {summary.reward_curve}", soft_wrap=True)
    out.print(f"samples (before | after): {summary.samples}", soft_wrap=True)


@app.command(rich_help_panel=INSIDE)
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


@app.command(rich_help_panel=RUNS)
def report(config: Path = ConfigOpt, overrides: list[str] = SetOpt, run_url: Optional[str] = RunUrlOpt,
           target: Optional[float] = typer.Option(
               None, "--target", help="held-out reward to price (cost and time to it); default evaluation.target")) -> None:
    """Write the reward curve and sample grid of a run from what it committed, and print its summary."""
    print_summary(write_report(open_run(load_config(config, overrides, run_url)), target))


@app.command(rich_help_panel=RUNS)
def export(run_url: str = typer.Option(..., "--run", help="the run's store URL (file://... or s3://...)"),
           iteration: int = typer.Option(..., "--iteration", "-t", help="export theta_N (after N updates)"),
           out: Path = typer.Option(..., "--out", help="folder to write (created)")) -> None:
    """Write theta_N as diffusers loads it: a LoRA (pipe.load_lora_weights(OUT)) or a transformer folder, plus a model card."""
    from spotlight.export import export_policy
    from spotlight.run import open_run_from_url

    for path in export_policy(open_run_from_url(run_url), iteration, out):
        console.print(f"wrote {path}", soft_wrap=True, highlight=False)


@app.command("tiny-model", rich_help_panel=INSIDE)
def tiny_model(kind: str = typer.Argument(..., help="sd3 | flux | flux-schnell | qwen-image | clip | aesthetic-head"),
               out: Path = typer.Argument(..., help="folder (or .pth file for aesthetic-head) to write")) -> None:
    """Build a tiny random-weight model offline (to try the real-model path on a CPU, as the tests do)."""
    from spotlight.models.tiny_clip import build_tiny_aesthetic_head, build_tiny_clip
    from spotlight.models.tiny_pipelines import build_tiny_pipeline

    builders = {"sd3": lambda: build_tiny_pipeline("sd3", out), "flux": lambda: build_tiny_pipeline("flux", out),
                "flux-schnell": lambda: build_tiny_pipeline("flux", out, guidance_embeds=False),
                "qwen-image": lambda: build_tiny_pipeline("qwen-image", out),
                "clip": lambda: build_tiny_clip(out), "aesthetic-head": lambda: build_tiny_aesthetic_head(out, 16)}
    if kind not in builders:
        raise typer.BadParameter(f"unknown kind {kind!r}; kinds: {', '.join(builders)}")
    console.print(f"wrote {builders[kind]()}", soft_wrap=True, highlight=False)


@app.command(rich_help_panel=INSIDE)
def worker(run_url: str = typer.Option(..., "--run", help="the run's store URL (file://... or s3://...)"),
           kind: str = typer.Option("explorer", "--kind", envvar="SPOTLIGHT_WORKER_KIND",
                                    help="explorer (exploration items) or trainer (pretrain, update, evaluate, "
                                         "ranking; joins explorations the flow waits for)"),
           worker_id: Optional[str] = typer.Option(None, "--id", envvar="SPOTLIGHT_WORKER_ID",
                                                   help="worker name; default host-pid"),
           lease_seconds: Optional[float] = typer.Option(
               None, "--lease-seconds", help="lease length, renewed every third; default: the run's placement.lease_seconds"),
           idle_exit: float = typer.Option(0.0, "--idle-exit", help="exit after this long with no claimable work"),
           poll_seconds: Optional[float] = typer.Option(
               None, "--poll-seconds", help="how often to look for new work; default 0.02 s on a local store, "
                                            "0.5 s on S3 (or SPOTLIGHT_POLL_SECONDS)")) -> None:
    """Work on a run as a long-lived worker: pull its work items until the run is done (SIGTERM-safe).

    Exits 0 when the run's flow is over (or it idled out), 143 when SIGTERM (a preemption) stopped it first."""
    # SIGTERM while booting (imports, loading the model): nothing is held yet; leave as a preempted worker,
    # never killed by the signal (SkyPilot would read -15, which recover_on_exit_codes does not list)
    signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(128 + signum))
    from spotlight.queue_worker import exit_code
    from spotlight.worker import work_on_run

    if kind not in ("explorer", "trainer"):
        raise typer.BadParameter(f"--kind {kind!r}: expected explorer or trainer")
    stats = work_on_run(run_url, worker_id=worker_id, lease_seconds=lease_seconds, idle_exit_seconds=idle_exit,
                        poll_seconds=poll_seconds, kind=kind)
    table = Table(title=f"{kind} worker {stats['worker']} on {run_url}")
    table.add_column("what")
    table.add_column("value")
    for key in ("items_claimed", "units_done", "items_completed", "items_released", "leases_lost"):
        value = stats[key]
        table.add_row(key.replace("_", " "), str(len(value) if isinstance(value, list) else value))
    table.add_row("busy / idle seconds", f"{stats['busy_seconds']:.1f} / {stats['idle_seconds']:.1f}")
    table.add_row("utilisation", f"{stats['utilisation']:.0%}")
    table.add_row("stopped by SIGTERM", str(stats["stopped"]))
    Console().print(table)
    # Everything is committed: leave now. The interpreter's own teardown (torch and friends) takes
    # seconds, which a preempted worker has not got before its kill -9. Stopped by SIGTERM: not done, so
    # not 0 (SkyPilot would record the job SUCCEEDED and never recover it).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code(run_url, stats["stopped"]))


@app.command(rich_help_panel=RUNS)
def simulate(
        target: float = typer.Option(..., "--target", help="held-out reward to reach"),
        curves: Path = typer.Option(..., "--curves", help="a bench/time_to_target.py --out folder: run stores "
                                                          "none-s<seed>, sync-s<seed>, spotlight-s<seed> (every seed)"),
        config: Path = ConfigOpt, overrides: list[str] = SetOpt,
        update_seconds: Optional[float] = typer.Option(
            None, "--update-seconds", help="the trainer's seconds per update at the config's batch on its GPU; "
                                           "default: measured in the curves' none runs (timeline/)"),
        horizon: Optional[str] = typer.Option(
            None, "--horizon", help="CURVE:REAL, curve iteration k -> iteration k x REAL / CURVE; default: the "
                                    "curves' length : the config's grpo.iterations"),
        widths: Optional[Path] = typer.Option(
            None, "--widths", help="a bench/width_sweep.py --out folder: choose the width and explorer count (the "
                                   "curves' spotlight runs join the table, priced at their mean width)"),
        width_explorers: str = typer.Option("1,2,4", "--width-explorers", help="explorer counts the width table tries"),
        width_offsets: int = typer.Option(8, "--width-offsets", help="trace offsets per zone in the width table"),
        explorers: Optional[int] = typer.Option(None, "--explorers", help="default: placement.explorer.workers"),
        setup_seconds: float = typer.Option(240.0, "--setup-seconds", help="provisioning + setup per launch"),
        bandwidth: float = typer.Option(1.0, "--bandwidth-gb-s", help="weights read at boot, GB/s"),
        polling: str = typer.Option("current", "--polling", help="S3 polling while waiting: current | before "
                                     "(the code before issue 18's O(1) looks)"),
        cloud: str = typer.Option("aws", "--cloud", help="whose catalog prices (sky/catalog/v8/<cloud>/vms.csv)"),
        region: Optional[str] = typer.Option(None, "--region", help="price region; default: each trace zone's region"),
        traces: Optional[Path] = typer.Option(None, "--traces", help="spot trace folder; default: the shipped sky/traces"),
        zones: Optional[str] = typer.Option(None, "--zones", help="comma-separated zones of that folder; default: all"),
        offsets: int = typer.Option(32, "--offsets", help="evenly spaced trace start offsets per zone"),
        plot: Path = typer.Option(Path("out/simulate.png"), "--plot", help="where to write the PNG")) -> None:
    """Forecast hours and $ to a held-out reward target at a config's placement, on real spot traces.

    The schedules: on-demand sync, all-spot sync, sync exploration and Spotlight (and, with --widths, the cheapest width)."""
    from statistics import fmean

    from spotlight.forecast import boot, curves as fcurves, estimate, records, report, requests, traces as ftraces, widths as fw
    from spotlight.forecast.errors import ForecastError

    cfg = load_config(config, overrides)
    runs = records.runs_in(curves, ("none", "sync", "spotlight"))
    by_label = fcurves.by_label([r.curve for r in runs])
    if update_seconds is None:
        measured = [s for r in runs if r.mode == "none" for s in r.trainer_seconds]
        if not measured:
            raise ForecastError(f"{curves}: no timeline/ records in its none runs: give --update-seconds")
        update_seconds = fmean(measured)
    if horizon is None:
        horizon = f"{runs[0].curve.length}:{cfg.grpo.iterations}"
    try:
        curve_its, real_its = (int(x) for x in horizon.split(":"))
    except ValueError:
        raise ForecastError(f"--horizon {horizon!r}: expected CURVE:REAL, e.g. 20:1000") from None
    if polling not in requests.POLLING:
        raise ForecastError(f"--polling {polling!r}: expected one of {', '.join(requests.POLLING)}")
    scenario = estimate.Scenario(target, fcurves.Horizon(curve_its, real_its), update_seconds,
                                 boot.Boot(setup_seconds, bandwidth, boot.weight_bytes(cfg)), requests.POLLING[polling],
                                 offsets, cloud, region, explorers)
    zone_traces = ftraces.load_traces(traces or ftraces.TRACES_DIR, zones.split(",") if zones else None)
    fc = estimate.forecast(cfg, scenario, by_label, zone_traces)
    out = Console()
    for table in (report.summary_table(fc), report.seed_table(fc), report.zone_table(fc)):
        out.print(table)
    if widths is not None:
        from dataclasses import replace

        counts = tuple(int(x) for x in width_explorers.split(","))
        planned = [r for r in runs if r.label == "spotlight"]  # the planner's own allocation, beside fixed widths
        options = fw.width_options(cfg, replace(scenario, offsets=width_offsets), records.runs_in(widths) + planned,
                                   zone_traces, counts)
        out.print(report.width_table(options, fc))
    for s in fc.schedules:
        if not s.targets:
            out.print(f"[bold yellow]note:[/] {s.schedule.name}: no {s.schedule.curve!r} runs in {curves}; not forecast")
        elif not all(t.reached for t in s.targets):
            missed = [str(t.seed) for t in s.targets if not t.reached]
            out.print(f"[bold yellow]note:[/] {s.schedule.name}: the {s.schedule.curve!r} curve of seed(s) "
                      f"{', '.join(missed)} never reaches {target}: counted with the whole horizon (a lower bound)")
    for line in report.assumptions(fc):
        out.print(line, soft_wrap=True, highlight=False)
    out.print(f"plot: {report.write_plot(fc, plot)}", soft_wrap=True, highlight=False)


def main() -> None:
    """Entry point that turns known errors into one clear line and exit code 2."""
    try:
        app()
    except (ConfigError, StoreError) as e:
        console.print(f"[bold red]error:[/] {e}", soft_wrap=True, markup=True, highlight=False)
        raise SystemExit(2) from None
