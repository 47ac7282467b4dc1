"""What a person wants to see after a run: a reward curve, before/after samples, and a summary."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

from spotlight.cost import by_iteration, by_stage, cost_until, entry_cost, ledger  # noqa: E402
from spotlight.run import Run  # noqa: E402
from spotlight.store import RunStore, png_bytes  # noqa: E402


FIGURE_DPI = 100


@dataclass
class Summary:
    run_url: str
    iterations_done: int
    train_reward: list[tuple[int, float]]
    eval_reward: list[tuple[int, float]]
    within_group_std: list[tuple[int, float]]
    reward_curve: str
    samples: str
    ranking_spearman: list[tuple[int, float, float]]  # iteration, stale vs fresh, stale vs fresh training rollouts
    cost_usd: float
    cost_entries: int
    cost_by_stage: dict[str, dict[str, float]] | None = None  # stage -> attempts, not_ok, seconds, cost_usd
    cost_by_iteration: list[tuple[int | None, float]] | None = None  # None: work of no iteration (boots, idle tails)
    target: float | None = None
    target_reached: dict | None = None  # iteration, eval_reward, cost_usd, seconds (None: not reached)
    # what the reward does not see (spotlight.quality), per evaluation: within-prompt diversity relative to
    # theta_0's, and the digits' realism (mean distance to the nearest real digits; None: skipped)
    diversity_vs_base: list[tuple[int, float]] = field(default_factory=list)
    realism_digits: list[tuple[int, float | None]] = field(default_factory=list)
    realism_digits_real: float | None = None
    # the held-out reward per prompt metadata tag (GenEval's tasks), per evaluation; empty without tags
    eval_reward_by_tag: list[tuple[int, dict[str, float]]] = field(default_factory=list)

    @property
    def eval_first_last(self) -> tuple[float, float] | None:
        return (self.eval_reward[0][1], self.eval_reward[-1][1]) if len(self.eval_reward) >= 2 else None

    def as_dict(self) -> dict:
        return {
            "run_url": self.run_url, "iterations_done": self.iterations_done,
            "train_reward": self.train_reward, "eval_reward": self.eval_reward,
            "within_group_std": self.within_group_std,
            "reward_curve": self.reward_curve, "samples": self.samples,
            "ranking_spearman": self.ranking_spearman, "cost_usd": self.cost_usd, "cost_entries": self.cost_entries,
            "cost_by_stage": self.cost_by_stage, "cost_by_iteration": self.cost_by_iteration,
            "target": self.target, "target_reached": self.target_reached,
            "diversity_vs_base": self.diversity_vs_base, "realism_digits": self.realism_digits,
            "realism_digits_real": self.realism_digits_real, "eval_reward_by_tag": self.eval_reward_by_tag,
        }


def committed_metrics(store: RunStore, prefix: str, stage: str | None = None) -> list[dict]:
    out = []
    for name in store.list(prefix):
        key = f"{prefix}/{name}/{stage}" if stage else f"{prefix}/{name}"
        if store.is_committed(key):
            out.append(store.load(key).json("metrics.json"))
    return sorted(out, key=lambda m: m["iteration"])


def _grid_image(grid: np.ndarray) -> Image.Image:
    """[rows, cols, C, H, W] uint8 (C = 1 or 3) -> one image with 1-pixel white gutters; small tiles
    (the 16 px digits) are enlarged so they can be seen."""
    rows, cols, channels, h, w = grid.shape
    canvas = np.full((rows * (h + 1) + 1, cols * (w + 1) + 1, channels), 255, dtype=np.uint8)
    for r in range(rows):
        for c in range(cols):
            canvas[1 + r * (h + 1): 1 + r * (h + 1) + h, 1 + c * (w + 1): 1 + c * (w + 1) + w] = \
                grid[r, c].transpose(1, 2, 0)
    image = Image.fromarray(canvas[..., 0] if channels == 1 else canvas)
    scale = max(1, 64 // h)
    return image.resize((image.width * scale, image.height * scale), Image.NEAREST)


def before_after_figure(first: np.ndarray, last: np.ndarray, prompts: list[str], titles: tuple[str, str]) -> Figure:
    """Two sample grids ([rows, seeds, C, H, W] uint8, same seeds) side by side, each under its title
    (theta_0 and theta_N with their held-out rewards) and each row beside its prompt (wrapped), so the
    picture reads without the config. Sized in pixels so that tiles keep theirs (:func:`figure_image`)."""
    left, right = _grid_image(first), _grid_image(last)
    rows, h = first.shape[0], first.shape[3]
    pitch = (h + 1) * max(1, 64 // h)  # a row's height in _grid_image's output
    label, header, gap = 240, 34, 14
    width, height = label + 2 * left.width + gap, header + left.height
    fig = plt.figure(figsize=(width / FIGURE_DPI, height / FIGURE_DPI), dpi=FIGURE_DPI, facecolor="white")
    gray = "gray" if left.mode == "L" else None
    for x, grid, title in ((label, left, titles[0]), (label + left.width + gap, right, titles[1])):
        ax = fig.add_axes((x / width, 0, grid.width / width, grid.height / height))
        ax.imshow(np.asarray(grid), cmap=gray, vmin=0, vmax=255, interpolation="nearest")
        ax.set_axis_off()
        fig.text((x + grid.width / 2) / width, 1 - header / 2 / height, title, ha="center", va="center", fontsize=10)
    for r, prompt in enumerate(prompts[:rows]):
        lines = textwrap.wrap(prompt, 34, max_lines=4, placeholder=" ...") or ['""']
        y = left.height - (1 + r * pitch + pitch / 2)
        fig.text((label - 8) / width, y / height, "\n".join(lines), ha="right", va="center", fontsize=7.5)
    return fig


def figure_image(fig: Figure) -> Image.Image:
    """A figure rendered at its own size and dpi (``png_bytes`` of a figure re-renders at 120 dpi)."""
    fig.canvas.draw()
    image = Image.fromarray(np.asarray(fig.canvas.buffer_rgba())[..., :3].copy())
    plt.close(fig)
    return image


def to_target(store: RunStore, evals: list[dict], entries: list[dict], target: float) -> dict | None:
    """Cost and time until the first evaluated policy with held-out reward >= target: every ledger entry
    recorded by the time that evaluation was committed (attempts, failed ones included, and the workers'
    idle time), and the seconds from the run's first entry to that commit. None: not reached."""
    hit = next((m for m in evals if m["iteration"] >= 1 and m["eval_reward"] >= target), None)
    if hit is None:
        return None
    key = f"evaluations/{hit['iteration']:04d}"
    at = next((e["recorded_at"] for e in entries if e["stage"] == "evaluate" and e["iteration"] == hit["iteration"]
               and e.get("outcome", "ok") == "ok"), None)
    if at is None:  # an older run (no worker entries): the commit's own time
        at = store.fs.modified(store.path(f"{key}/COMMIT.json")).timestamp()
    first = min((e["recorded_at"] - e["seconds"] - e.get("idle_seconds", 0.0) for e in entries), default=at)
    return {"iteration": hit["iteration"], "eval_reward": hit["eval_reward"], "cost_usd": cost_until(entries, at),
            "seconds": max(0.0, at - first)}


def write_report(run: Run, target: float | None = None) -> Summary:
    """Reward curve and before/after sample grid PNGs in the run store, from committed stages only, and
    the cost ledger per stage and iteration; ``target`` (default ``evaluation.target``): the held-out
    reward whose cost and time to reach the summary states."""
    store = run.store
    updates = committed_metrics(store, "iterations", "update")
    evals = committed_metrics(store, "evaluations")
    quality = [m for m in evals if m.get("diversity") is not None]
    fig, (ax, qax) = plt.subplots(2, 1, figsize=(7, 6.5), sharex=True, height_ratios=(3, 2))
    if updates:
        ax.plot([m["iteration"] for m in updates], [m["train_reward_mean"] for m in updates],
                label=f"train reward ({run.cfg.rewards.describe('train')}, SDE rollouts)", alpha=0.8)
    if evals:
        ax.plot([m["iteration"] for m in evals], [m["eval_reward"] for m in evals], "o-",
                label=f"held-out reward ({run.cfg.rewards.describe('eval')}, ODE, fixed seeds)")
    tagged = [(m["iteration"], m["eval_reward_by_tag"]) for m in evals if m.get("eval_reward_by_tag")]
    for tag in sorted({tag for _, by_tag in tagged for tag in by_tag}):
        its = [(t, by_tag[tag]) for t, by_tag in tagged if tag in by_tag]
        ax.plot([t for t, _ in its], [r for _, r in its], "--", lw=1, alpha=0.8, label=f"held-out, {tag}")
    ax.set_ylabel("reward")
    ax.set_title(f"{run.cfg.run.name}: exploration mode {run.cfg.exploration.mode}")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    # what the reward does not see, on the same evaluation samples, relative to theta_0 (1 = as the base)
    if quality:
        its = [m["iteration"] for m in quality]
        qax.plot(its, [m["diversity_vs_base"] for m in quality], "s-", label="within-prompt diversity (pixel RMS)")
        base_realism = quality[0].get("realism_digits") if quality[0]["iteration"] == 0 else None
        if base_realism:
            qax.plot(its, [m["realism_digits"] / base_realism for m in quality], "^-",
                     label="distance to the nearest real digits (lower: more realistic)")
            qax.axhline(quality[0]["realism_digits_real"] / base_realism, color="grey", ls=":",
                        label="real digits' own distance")
        qax.axhline(1.0, color="black", lw=0.5)
        qax.legend(loc="best", fontsize="small")
    qax.set_ylabel("relative to theta_0")
    qax.set_xlabel("iteration")
    qax.grid(alpha=0.3)
    fig.tight_layout()
    store.write_bytes("report/reward_curve.png", png_bytes(fig))
    plt.close(fig)
    if evals:
        first, last = evals[0], evals[-1]
        grids = [store.load(f"evaluations/{m['iteration']:04d}").tensors("samples.safetensors")["grid"].numpy()
                 for m in (first, last)]
        weights = " (EMA)" if last.get("weights") == "ema" else ""
        titles = (f"theta_{first['iteration']}: held-out {first['eval_reward']:.3f}",
                  f"theta_{last['iteration']}{weights}: held-out {last['eval_reward']:.3f}")
        figure = before_after_figure(*grids, last.get("prompts", []), titles)
        store.write_bytes("report/samples_before_after.png", png_bytes(figure_image(figure)))
    rankings = committed_metrics(store, "iterations", "ranking")
    entries = ledger(store)
    summary = Summary(
        run_url=store.url,
        iterations_done=len(updates),
        train_reward=[(m["iteration"], m["train_reward_mean"]) for m in updates],
        eval_reward=[(m["iteration"], m["eval_reward"]) for m in evals],
        within_group_std=[(m["iteration"], m["within_group_std"]) for m in updates],
        reward_curve=f"{store.url}/report/reward_curve.png",
        samples=f"{store.url}/report/samples_before_after.png",
        ranking_spearman=[(m["iteration"], m["spearman"], m["spearman_to_training"]) for m in rankings],
        cost_usd=sum(entry_cost(e) for e in entries),
        cost_entries=len(entries),
        cost_by_stage=by_stage(entries),
        cost_by_iteration=sorted(by_iteration(entries).items(), key=lambda kv: -1 if kv[0] is None else kv[0]),
        diversity_vs_base=[(m["iteration"], m["diversity_vs_base"]) for m in quality],
        realism_digits=[(m["iteration"], m["realism_digits"]) for m in quality],
        realism_digits_real=next((m.get("realism_digits_real") for m in quality), None),
        eval_reward_by_tag=tagged,
    )
    target = run.cfg.evaluation.target if target is None else target
    if target is not None:
        summary.target, summary.target_reached = target, to_target(store, evals, entries, target)
    store.put_json("report/summary.json", summary.as_dict())
    return summary
