"""Where each stage runs and what it costs: project checks of the SkyPilot YAMLs, and
SkyPilot's own optimizer over a price catalog (``spotlight plan``).

Why a subprocess for the optimizer: SkyPilot fixes its catalog directory and state database when
it is first imported (``~/.sky``, or ``$SKY_RUNTIME_DIR``). ``cheapest_offers`` therefore runs
``python -m tasks.placement`` with a private HOME/SKY_RUNTIME_DIR seeded with the shipped catalog
snapshot (``sky/catalog/v8``), so planning is offline, deterministic and never touches the user's
``~/.sky``. The clouds the optimizer may use are the catalog's (AWS, GCP, Azure, Lambda); they are
marked enabled the way ``sky check`` records them (``allowed_clouds`` in the private
``~/.sky/config.yaml`` plus the enabled-clouds cache in SkyPilot's state database), because no
credentials exist there for ``sky check`` to verify.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from spotlight import catalog
from tasks.sky_task import REQUIRED_ENVS, REQUIRED_SECRETS, SKY_DIR, WORKER_YAMLS, worker_task_config

REPO = Path(__file__).resolve().parent.parent
CATALOG_DIR = SKY_DIR / "catalog"  # holds v8/<cloud>/vms.csv, v8/common/accelerators.csv
CATALOG_CLOUDS = ("AWS", "GCP", "Azure", "Lambda")
CATALOG_VERSION = "v8"

# The busy hours per iteration `plan` assumes without a ledger: a GPU-sized run (SD3.5-M class
# policy, 8 prompts x 8 rollouts) spends about half an hour per update on the trainer and a quarter
# hour of explorer time per exploration.
DEFAULT_KIND_HOURS = {"explorer": 0.25, "trainer": 0.5}


class TaskYamlError(ValueError):
    """A SkyPilot task YAML that SkyPilot or this project rejects; names the file and the problem."""


def recovery_strategies() -> set[str]:
    """Recovery strategies SkyPilot registers (its client does not check the name; the controller would)."""
    from sky.jobs import recovery_strategy  # noqa: F401 - registers the strategies
    from sky.utils import registry

    return {name.upper() for name in registry.JOBS_RECOVERY_STRATEGY_REGISTRY.keys()}


def check_task_yaml(path: str | os.PathLike, catalog_dir: Path = CATALOG_DIR) -> Any:
    """Parse a task YAML with SkyPilot and apply the project's rules; returns the ``sky.Task``.

    Rules: accelerators must be in the catalog; spot tasks need ``job_recovery`` with a known
    strategy, ``max_restarts_on_errors`` and the preempted worker's exit code in ``recover_on_exit_codes``,
    several accelerators and no pinned cloud; the task's required envs are declared; AWS keys are
    declared as secrets and never given inline.
    """
    import sky

    from spotlight.queue_worker import PREEMPTED_EXIT_CODE

    path = Path(path)
    where = f"task YAML {path}"
    try:
        raw = yaml.safe_load(path.read_text())
        task = sky.Task.from_yaml(str(path))
    except Exception as e:  # SkyPilot raises ValueError / jsonschema errors; name the file either way
        raise TaskYamlError(f"{where}: SkyPilot rejects it: {e}") from e
    problems: list[str] = []
    known = catalog.accelerator_names(Path(catalog_dir) / CATALOG_VERSION)
    for res in task.resources:
        for name in (res.accelerators or {}):
            if name.lower() not in known:
                close = sorted(a for a in known.values() if a.lower().startswith(name.lower()[:2]))
                problems.append(f"unknown accelerator {name!r} (not in SkyPilot's catalog"
                                + (f"; did you mean one of {', '.join(close)}?)" if close else ")"))
    spot = {bool(r.use_spot) for r in task.resources}
    if True in spot:
        if spot != {True}:
            problems.append("mixes spot and on-demand candidates; a stage is either spot or not")
        if any(r.cloud is not None for r in task.resources):
            problems.append("pins a cloud; leave it out so the optimizer can pick the cheapest one")
        if len(task.resources) < 2:
            problems.append("offers one accelerator; list several under resources.any_of")
        recovery = (raw.get("resources") or {}).get("job_recovery")
        if not isinstance(recovery, dict):
            problems.append("spot task without resources.job_recovery {strategy, max_restarts_on_errors}")
        else:
            strategies = recovery_strategies()
            strategy = str(recovery.get("strategy") or "")
            if strategy.upper() not in strategies:
                problems.append(f"invalid job_recovery strategy {strategy!r}; SkyPilot has "
                                f"{', '.join(sorted(strategies))}")
            if "max_restarts_on_errors" not in recovery:
                problems.append("job_recovery lacks max_restarts_on_errors (a crash would not be retried)")
            codes = recovery.get("recover_on_exit_codes")
            if PREEMPTED_EXIT_CODE not in (codes if isinstance(codes, list) else [codes]):
                problems.append(f"job_recovery.recover_on_exit_codes lacks {PREEMPTED_EXIT_CODE}, the exit code of a "
                                "worker a preemption stopped (SkyPilot would count it as a failure of the program)")
    envs = task.envs
    for env in REQUIRED_ENVS.get(task.name or "", ("RUN_URL",)):
        if env not in envs:
            problems.append(f"missing required env {env!r} (declare it under envs; the launcher sets it)")
    secrets = raw.get("secrets") or {}
    for key in REQUIRED_SECRETS:
        if key not in secrets:
            problems.append(f"missing secret {key!r} (declare it under secrets with no value)")
        elif secrets[key]:
            problems.append(f"secret {key!r} has an inline value; credentials never go in a YAML")
    if problems:
        raise TaskYamlError(f"{where}:\n" + "\n".join(f"  - {p}" for p in problems))
    return task


# -- the optimizer -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Offer:
    """The optimizer's pick for a task: where, what, and dollars per hour for all its nodes."""

    cloud: str
    region: str
    instance_type: str
    accelerators: str
    use_spot: bool
    price_per_hour: float

    def describe(self) -> str:
        return f"{self.cloud} {self.region} {self.instance_type} ({self.accelerators})"


def cheapest_offers(yaml_paths: list[Path], catalog_dir: Path = CATALOG_DIR,
                    timeout: float = 300) -> dict[str, dict[str, Offer]]:
    """``{yaml: {"spot": Offer, "on_demand": Offer}}`` from SkyPilot's optimizer over the catalog."""
    with tempfile.TemporaryDirectory(prefix="spotlight-sky-") as home:
        shutil.copytree(Path(catalog_dir) / CATALOG_VERSION, Path(home) / ".sky" / "catalogs" / CATALOG_VERSION)
        (Path(home) / ".sky" / "config.yaml").write_text(
            yaml.safe_dump({"allowed_clouds": list(CATALOG_CLOUDS)}))
        out = Path(home) / "offers.json"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "GOOGLE_", "AZURE_"))}
        env.update(HOME=home, SKY_RUNTIME_DIR=home, SKYPILOT_DISABLE_USAGE_COLLECTION="1",
                   PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
        proc = subprocess.run([sys.executable, "-m", "tasks.placement", str(out), *map(str, yaml_paths)],
                              env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"SkyPilot's optimizer failed on {[str(p) for p in yaml_paths]}:\n"
                               f"{(proc.stdout + proc.stderr)[-3000:]}")
        raw = json.loads(out.read_text())
    return {y: {kind: Offer(**o) for kind, o in offers.items()} for y, offers in raw.items()}


def _optimize(out: str, yaml_paths: list[str]) -> None:
    """Inside the private SkyPilot home: optimize each task for spot and for on-demand."""
    import sky
    from sky import global_user_state, skypilot_config
    from sky.clouds import cloud as cloud_lib

    workspace = skypilot_config.get_active_workspace()
    global_user_state.set_allowed_clouds(list(CATALOG_CLOUDS), workspace)
    global_user_state.set_enabled_clouds(list(CATALOG_CLOUDS), cloud_lib.CloudCapability.COMPUTE, workspace)
    result: dict[str, dict[str, dict[str, Any]]] = {}
    for path in yaml_paths:
        result[path] = {}
        for kind, use_spot in (("spot", True), ("on_demand", False)):
            task = sky.Task.from_yaml(path)
            task.set_resources({r.copy(use_spot=use_spot, job_recovery=None) for r in task.resources})
            dag = sky.Dag()
            dag.add(task)
            sky.Optimizer.optimize(dag, minimize=sky.OptimizeTarget.COST, quiet=True)
            best = task.best_resources
            accs = ", ".join(f"{k}:{v:g}" for k, v in (best.accelerators or {}).items())
            result[path][kind] = asdict(Offer(
                cloud=str(best.cloud), region=f"{best.region}/{best.zone}" if best.zone else str(best.region),
                instance_type=str(best.instance_type),
                accelerators=accs, use_spot=use_spot, price_per_hour=best.get_cost(3600) * task.num_nodes))
    Path(out).write_text(json.dumps(result))


# -- the plan ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class StagePlan:
    """One worker kind's offers and dollars per iteration (``stage`` is the kind: trainer, explorer)."""

    stage: str
    yaml: str
    hours_per_iteration: float
    hours_source: str
    spot: Offer
    on_demand: Offer

    @property
    def ratio(self) -> float:
        return self.spot.price_per_hour / self.on_demand.price_per_hour

    @property
    def spot_per_iteration(self) -> float:
        return self.hours_per_iteration * self.spot.price_per_hour

    @property
    def on_demand_per_iteration(self) -> float:
        return self.hours_per_iteration * self.on_demand.price_per_hour


def plan(run_url: str | None = None, catalog_dir: Path = CATALOG_DIR, sky_dir: Path = SKY_DIR,
         config: Any = None) -> list[StagePlan]:
    """Cheapest spot and on-demand offers per worker kind, and dollars per iteration.

    Busy hours per iteration come from the run's cost ledger when ``run_url`` is given (mean over its
    iterations, all attempts included, by the kind that did the work), else from ``DEFAULT_KIND_HOURS``.
    ``config``: a run config whose placement replaces the YAMLs' resources, as the launcher does.
    """
    hours, source = dict(DEFAULT_KIND_HOURS), {s: "default" for s in DEFAULT_KIND_HOURS}
    if run_url:
        from spotlight.cost import kind_hours_per_iteration, ledger
        from spotlight.store import RunStore

        measured = kind_hours_per_iteration(ledger(RunStore(run_url)))
        for kind in WORKER_YAMLS:
            if kind in measured:
                hours[kind], source[kind] = measured[kind], f"ledger of {run_url}"
    paths = {kind: Path(sky_dir) / name for kind, name in WORKER_YAMLS.items()}
    for p in paths.values():
        check_task_yaml(p, catalog_dir)
    with tempfile.TemporaryDirectory(prefix="spotlight-plan-") as tmp:
        if config is not None:  # the placement's resources, in a copy of each YAML
            for kind in paths:
                paths[kind] = Path(tmp) / WORKER_YAMLS[kind]
                paths[kind].write_text(yaml.safe_dump(worker_task_config(kind, config, sky_dir), sort_keys=False))
        offers = cheapest_offers(list(paths.values()), catalog_dir)
    return [StagePlan(kind, str(Path(sky_dir) / WORKER_YAMLS[kind]), hours[kind], source[kind],
                      offers[str(p)]["spot"], offers[str(p)]["on_demand"])
            for kind, p in paths.items()]


def format_plan(plans: list[StagePlan]) -> str:
    """Plain text (greppable, no table truncation): one block per stage, then the iteration total."""
    lines = []
    for p in plans:
        lines += [
            f"{p.stage} ({p.yaml}): {p.hours_per_iteration:.3f} h per iteration ({p.hours_source})",
            f"  spot       {p.spot.describe():<52} ${p.spot.price_per_hour:>8.4f}/h  "
            f"${p.spot_per_iteration:>8.4f}/iteration",
            f"  on-demand  {p.on_demand.describe():<52} ${p.on_demand.price_per_hour:>8.4f}/h  "
            f"${p.on_demand_per_iteration:>8.4f}/iteration",
            f"  spot/on-demand price ratio {p.ratio:.3f} ({(1 - p.ratio) * 100:.0f}% cheaper on spot)",
        ]
    spot, od = sum(p.spot_per_iteration for p in plans), sum(p.on_demand_per_iteration for p in plans)
    lines.append(f"per iteration: spot ${spot:.4f}, on-demand ${od:.4f}, ratio {spot / od:.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    _optimize(sys.argv[1], sys.argv[2:])
