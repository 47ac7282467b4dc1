"""What the Prefect UI shows of a run: a per-iteration metrics table and a run report with the reward curve.

Keys are stable (``<run-name>-iterations``, ``<run-name>-report``), so each publication is a new
version of the same artifact and the Artifacts page shows the latest. Images are embedded as
``data:`` URIs: both Prefect UIs (v1 and v2) render them in markdown artifacts, while the run store's
own URLs (``file://`` or ``s3://``) are not reachable from a browser.
"""

from __future__ import annotations

import base64
import re
from collections import defaultdict
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.runtime import flow_run

from spotlight.store import RunStore
from tasks.stages import open_run

from spotlight import cost as _cost

NA = "n/a"
EXPLORATION = ("explor", "selected_std", "replaced", "low_variance", "planner", "worker_util", "ranking",
               "timing_critical")
# rows published so far, per (flow run, run name): each iteration republishes the whole table
_rows: dict[tuple[str | None, str], list[dict[str, Any]]] = defaultdict(list)


def artifact_key(config: dict[str, Any], suffix: str) -> str:
    """A Prefect artifact key (lowercase letters, digits, dashes) from the run name."""
    name = re.sub(r"[^a-z0-9-]+", "-", str(config["run"]["name"]).lower()).strip("-") or "run"
    return f"{name}-{suffix}"


def _fmt(value: Any) -> Any:
    return round(value, 4) if isinstance(value, float) else value


def cost_so_far(store: RunStore) -> str:
    """The run's spend from its cost ledger (``spotlight.cost``), or "n/a" when the run has none."""
    if not store.list(_cost.PREFIX):
        return NA
    try:
        total = _cost.total(store)
    except Exception as e:  # an artifact must never fail training; say why the cost is missing
        get_run_logger().warning("cost ledger of %s unreadable (%s: %s); cost shown as n/a", store.url,
                                 type(e).__name__, e)
        return NA
    return f"${total:.4f}"


def cost_of_iteration(store: RunStore, iteration: int) -> str:
    """Dollars the ledger holds for one iteration (its stage attempts, failed ones included, and the
    workers' idle time before them), or "n/a" when the run has no ledger."""
    if not store.list(_cost.PREFIX):
        return NA
    try:
        return f"${_cost.by_iteration(_cost.ledger(store)).get(iteration, 0.0):.4f}"
    except Exception as e:  # an artifact must never fail training
        get_run_logger().warning("cost ledger of %s unreadable (%s: %s)", store.url, type(e).__name__, e)
        return NA


def iteration_row(iteration: int, update_metrics: dict[str, Any], eval_metrics: dict[str, Any] | None,
                  cost: str, iteration_cost: str = NA) -> dict[str, Any]:
    """One table row: rewards, the group statistics GRPO learns from, exploration stats, cost so far."""
    row: dict[str, Any] = {
        "iteration": iteration,
        "train reward": _fmt(update_metrics["train_reward_mean"]),
        "held-out reward after": _fmt(eval_metrics["eval_reward"]) if eval_metrics else "",
        "within-group std": _fmt(update_metrics["within_group_std"]),
        "zero-variance fraction": _fmt(update_metrics["zero_variance_groups"]),
    }
    row.update({k.replace("_", " "): _fmt(v) for k, v in sorted(update_metrics.items()) if k.startswith(EXPLORATION)})
    row["update seconds"] = _fmt(update_metrics.get("seconds"))
    row["cost of iteration"] = iteration_cost
    row["cost so far"] = cost
    return row


def publish_iteration(config: dict[str, Any], iteration: int, update_metrics: dict[str, Any],
                      eval_metrics: dict[str, Any] | None) -> None:
    """Publish the iteration table (all iterations of this flow run so far) as a new artifact version."""
    rows = _rows[(flow_run.id, config["run"]["name"])]
    rows[:] = [r for r in rows if r["iteration"] != iteration]  # a retried iteration replaces its row
    store = open_run(config).store
    rows.append(iteration_row(iteration, update_metrics, eval_metrics, cost_so_far(store),
                              cost_of_iteration(store, iteration)))
    create_table_artifact(
        key=artifact_key(config, "iterations"), table=sorted(rows, key=lambda r: r["iteration"]),
        description=f"Per-iteration metrics of run `{config['run']['name']}` (held-out reward: of the policy "
                    f"after that iteration's update, where evaluated).")


def _image(store: RunStore, url: str, alt: str) -> str:
    data = store.read_bytes(url.removeprefix(f"{store.url}/"))
    return f"![{alt}](data:image/png;base64,{base64.b64encode(data).decode()})"


def run_markdown(config: dict[str, Any], summary: dict[str, Any], store: RunStore) -> str:
    """The run report: headline numbers, reward curve, before/after samples, and where the files are."""
    evals = summary["eval_reward"]
    lines = [f"# Spotlight run `{config['run']['name']}`", "",
             "| | |", "|---|---|",
             f"| run store | `{summary['run_url']}` |",
             f"| exploration mode | {config['exploration']['mode']} |",
             f"| iterations done | {summary['iterations_done']} of {config['grpo']['iterations']} |"]
    if len(evals) >= 2:
        lines.append(f"| held-out reward | {evals[0][1]:.4f} (iteration {evals[0][0]}) -> "
                     f"{evals[-1][1]:.4f} (iteration {evals[-1][0]}) |")
    lines.append(f"| cost | {cost_so_far(store)} |")
    if summary.get("target") is not None:
        hit = summary.get("target_reached")
        lines.append(f"| cost to held-out reward {summary['target']:g} | " + (
            f"${hit['cost_usd']:.4f} and {hit['seconds']:.0f} s (theta_{hit['iteration']}: {hit['eval_reward']:.4f}) |"
            if hit else "not reached |"))
    lines += [""] + cost_markdown(summary) + ["## Reward curve", "", _image(store, summary["reward_curve"], "reward curve"), ""]
    if evals:
        lines += [f"## Samples: iteration {evals[0][0]} (left) and {evals[-1][0]} (right), one row per digit", "",
                  _image(store, summary["samples"], "samples before and after"), ""]
    lines += ["## Files", "", f"- reward curve: `{summary['reward_curve']}`"]
    if evals:
        lines.append(f"- before/after sample grid: `{summary['samples']}`")
    lines += [f"- sample grid of iteration {t}: `samples.safetensors` of commit `{store.url}/evaluations/{t:04d}`"
              for t, _ in evals]
    return "\n".join(lines) + "\n"


def cost_markdown(summary: dict[str, Any]) -> list[str]:
    """Cost per stage and per iteration from the summary's ledger figures (none: no lines)."""
    stages, iterations = summary.get("cost_by_stage") or {}, summary.get("cost_by_iteration") or []
    if not stages:
        return []
    lines = ["## Cost per stage", "", "| stage | attempts | failed or preempted | seconds | $ |", "|---|---|---|---|---|"]
    lines += [f"| {stage} | {int(r['attempts'])} | {int(r['not_ok'])} | {r['seconds']:.1f} | {r['cost_usd']:.4f} |"
              for stage, r in sorted(stages.items())]
    lines += ["", "idle: workers held but waiting (boots included).", "", "## Cost per iteration", "",
              "| iteration | $ |", "|---|---|"]
    lines += [f"| {'none (boots, idle tails)' if it is None else it} | {usd:.4f} |" for it, usd in iterations]
    return lines + [""]


def publish_run(config: dict[str, Any], summary: dict[str, Any]) -> None:
    """Publish the run report (a markdown artifact) from the summary that ``report`` wrote."""
    store = open_run(config).store
    create_markdown_artifact(key=artifact_key(config, "report"), markdown=run_markdown(config, summary, store),
                             description=f"Reward curve and samples of run `{config['run']['name']}`")
