"""What a forecast shows: the tables (rich), the assumptions under them, and a plot (matplotlib).

Ratios are the baseline's mean over the schedule's mean (x faster, x cheaper), pooled over seeds, zones
and trace offsets. A seed whose curve never reached the target counts with the whole horizon, so its
cost is a lower bound: a ratio over a baseline with such seeds is printed "> x" (a true lower bound),
over a schedule with such seeds "< x", and "?" when both have them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from rich.table import Table

from spotlight.forecast.estimate import Forecast, Outcome, ScheduleForecast
from spotlight.forecast.schedules import ON_DEMAND_SYNC, SYNC_EXPLORATION
from spotlight.forecast.widths import WidthOption, cheapest


def _spread(values: list[float]) -> tuple[float, float, float, float]:
    """Mean, p10, p50, p90."""
    p10, p50, p90 = np.percentile(values, [10, 50, 90])
    return float(np.mean(values)), float(p10), float(p50), float(p90)


def ratio(baseline: list[Outcome], mine: list[Outcome], what: str) -> str:
    """Baseline mean / this mean, with the bound the unreached seeds allow."""
    if not baseline or not mine:
        return "n/a"
    value = float(np.mean([getattr(o, what) for o in baseline]) / np.mean([getattr(o, what) for o in mine]))
    low, high = not all(o.reached for o in baseline), not all(o.reached for o in mine)
    return "?" if low and high else f"{'> ' if low else '< ' if high else ''}{value:.2f}x"


def over_offsets(base: ScheduleForecast, mine: ScheduleForecast, what: str) -> str:
    """p10-p90 over trace offsets of the ratio baseline / this: per zone and start offset, the seeds' mean
    against the baseline's seeds' mean in that zone (the spread the traces make, seeds averaged), with the
    bounds the unreached seeds allow."""
    values = []
    for zone, outs in mine.outcomes.items():
        theirs = list(base.outcomes.get(zone, ()))
        for offset in sorted({o.offset for o in outs}):
            at = [o for o in outs if o.offset == offset]
            values.append(np.mean([getattr(o, what) for o in theirs]) / np.mean([getattr(o, what) for o in at]))
    if not values:
        return "n/a"
    low, high = not all(t.reached for t in base.targets), not all(t.reached for t in mine.targets)
    if low and high:
        return "?"
    p10, p90 = np.percentile(values, [10, 90])
    return f"{'> ' if low else '< ' if high else ''}{p10:.2f}-{p90:.2f}"


def _reached(s: ScheduleForecast) -> str:
    return f"{sum(t.reached for t in s.targets)}/{len(s.targets)}"


def _iterations(s: ScheduleForecast) -> str:
    its = [t.iterations for t in s.targets]
    return f"{np.mean(its):.0f} ({min(its)}-{max(its)})"


def _against(base: ScheduleForecast, mine: ScheduleForecast, what: str) -> str:
    """The mean ratio and, in brackets, its p10-p90 over trace offsets."""
    if base is mine or not base.all:
        return ""
    spread = over_offsets(base, mine, what).removeprefix("> ").removeprefix("< ")
    return f"{ratio(base.all, mine.all, what)} ({spread})"


def summary_table(fc: Forecast) -> Table:
    """Time and dollars to the target per schedule, pooled over seeds, zones and trace offsets, against the
    two baselines."""
    sc = fc.scenario
    table = Table(title=f"forecast to held-out reward >= {sc.target}, {fc.config_name} at {sc.horizon.real_iterations} "
                        f"iterations ({len(fc.traces)} zones x {sc.offsets} trace offsets x seeds; on-demand-only "
                        "schedules: one run per zone and seed)",
                  caption="x faster, x cheaper: the baseline's mean / this mean, and in brackets its p10-p90 over "
                          "trace offsets (per offset the seeds' mean)")
    base, synced = fc.schedule(ON_DEMAND_SYNC.name), fc.schedule(SYNC_EXPLORATION.name)
    for col in ("schedule", "curve", "seeds reached", "iterations mean (range)", "hours mean (p10-p90)",
                "$ mean (p10-p90)", "vs on-demand sync: x faster", "x cheaper", "vs sync exploration: x faster",
                "x cheaper ", "$ trainer / explorers / controller / S3", "preemptions/run"):
        table.add_column(col, justify="left" if col in ("schedule", "curve") else "right")
    for s in fc.schedules:
        outs = s.all
        if not outs:
            table.add_row(s.schedule.name, s.schedule.curve, "no curve", *["-"] * 9)
            continue
        m, p10, _, p90 = _spread([o.seconds / 3600 for o in outs])
        d, d10, _, d90 = _spread([o.dollars for o in outs])
        parts = " / ".join(f"{np.mean([dict(o.usd)[k] for o in outs]):.2f}"
                           for k in ("trainer", "explorers", "controller", "s3"))
        table.add_row(s.schedule.name, s.schedule.curve, _reached(s), _iterations(s), f"{m:.1f} ({p10:.1f}-{p90:.1f})",
                      f"{d:.2f} ({d10:.2f}-{d90:.2f})", _against(base, s, "seconds"), _against(base, s, "dollars"),
                      _against(synced, s, "seconds"), _against(synced, s, "dollars"), parts,
                      f"{np.mean([o.preemptions for o in outs]):.2f}")
    return table


def seed_table(fc: Forecast) -> Table:
    """Per seed (the bench pairs seeds across modes): each schedule's mean over zones and offsets."""
    seeds = sorted({t.seed for s in fc.schedules for t in s.targets})
    table = Table(title="per seed: iterations, then x faster / x cheaper than on-demand sync (mean over zones and offsets)")
    table.add_column("schedule")
    for seed in seeds:
        table.add_column(f"seed {seed}", justify="right")
    base = fc.schedule(ON_DEMAND_SYNC.name)
    for s in fc.schedules:
        cells = []
        for seed in seeds:
            mine = [o for o in s.all if o.seed == seed]
            theirs = [o for o in base.all if o.seed == seed]
            if not mine:
                cells.append("-")
                continue
            its = mine[0].iterations if mine[0].reached else f">{mine[0].iterations}"
            cells.append(f"{its}: {ratio(theirs, mine, 'seconds')} / {ratio(theirs, mine, 'dollars')}")
        table.add_row(s.schedule.name, *cells)
    return table


def zone_table(fc: Forecast) -> Table:
    """The spread over trace offsets, per zone: p10 / p50 / p90, for the schedules the traces touch."""
    table = Table(title=f"per zone, over {fc.scenario.offsets} trace offsets x seeds (p10 / p50 / p90)")
    for col in ("schedule", "zone", "hours", "$", "x faster", "x cheaper", "preemptions/run"):
        table.add_column(col, justify="left" if col in ("schedule", "zone") else "right")
    base = fc.schedule(ON_DEMAND_SYNC.name).outcomes
    for s in fc.schedules:
        for zone, outs in s.outcomes.items():
            if len(outs) == len(s.targets):  # one run per seed: no trace touched it
                continue
            _, p10, p50, p90 = _spread([o.seconds / 3600 for o in outs])
            _, d10, d50, d90 = _spread([o.dollars for o in outs])
            table.add_row(s.schedule.name, zone, f"{p10:.1f} / {p50:.1f} / {p90:.1f}",
                          f"{d10:.2f} / {d50:.2f} / {d90:.2f}", ratio(list(base.get(zone, ())), list(outs), "seconds"),
                          ratio(list(base.get(zone, ())), list(outs), "dollars"),
                          f"{np.mean([o.preemptions for o in outs]):.2f}")
    return table


def width_table(options: list[WidthOption], fc: Forecast | None = None) -> Table:
    """Every width x explorer count, and the one with the lowest mean $ to the target."""
    best = cheapest(options)
    table = Table(title="exploration width and explorers: $ to the target (Spotlight at the config's placement; "
                        f"mean over {len(options[0].outcomes)} runs per cell: seeds x zones x trace offsets)")
    for col in ("bench variant", "K/G", "candidates per prompt", "explorers", "seeds reached", "iterations mean",
                "hours mean (p10-p90)", "$ mean (p10-p90)", "x cheaper than on-demand sync", ""):
        table.add_column(col, justify="left" if col in ("bench variant", "") else "right")
    base = fc.schedule(ON_DEMAND_SYNC.name).all if fc else []
    for o in options:
        m, p10, _, p90 = _spread([x.seconds / 3600 for x in o.outcomes])
        d, d10, _, d90 = _spread([x.dollars for x in o.outcomes])
        table.add_row(o.label, f"{o.bench_width / o.bench_group:.1f}", str(o.width), str(o.explorers),
                      f"{sum(t.reached for t in o.targets)}/{len(o.targets)}",
                      f"{np.mean([t.iterations for t in o.targets]):.0f}", f"{m:.1f} ({p10:.1f}-{p90:.1f})",
                      f"{d:.2f} ({d10:.2f}-{d90:.2f})", ratio(base, list(o.outcomes), "dollars") if base else "n/a",
                      "<- chosen" if o is best else "")
    return table


def assumptions(fc: Forecast) -> list[str]:
    """The inputs behind the numbers, one line each, printed under the tables."""
    sc, w = fc.scenario, fc.work
    per_forward = sc.update_seconds / w.update_forwards
    lines = [sc.horizon.describe(),
             f"an update: {sc.update_seconds:.0f} s on the trainer (stated) = {w.update_forwards} forward-pass "
             f"equivalents ({per_forward:.3f} s each); an exploration: {sum(w.candidates)} candidates x "
             f"{w.explore_steps} steps = {w.explore_forwards} forwards ({w.width:.0f} per prompt, "
             f"{len(w.candidates)} items of {w.seeds_per_batch}-seed units); "
             + (f"an evaluation every {w.evaluate_every}: {w.evaluate_forwards} forwards" if w.evaluate_forwards
                else "evaluations not modelled (evaluation.prompts is null)"),
             sc.boot.describe(),
             f"S3 requests: {sc.polling.name}; PUT/LIST $0.005 and GET $0.0004 per 1,000 (S3 Standard)",
             "the trainer joins an exploration the moment its update commits (the flow's rule); workers are held "
             "from the start until the target (idle time paid); the controller's own boot and a lost item's lease "
             "expiry (a kill without notice) are not modelled"]
    for label, runs in fc.curves.items():
        kg = [c.selection for c in runs if c.selection]
        explored = (f", explored {np.mean([c.explored for c in runs if c.explored]):.0f} candidates per prompt "
                    f"(K/G {np.mean(kg):.1f}; priced here: K/G {w.width / w.group_size:.1f})" if kg else "")
        lines.append(f"curve {label}: {len(runs)} seed(s) ({', '.join(str(c.seed) for c in runs)}), {runs[0].length} "
                     f"iterations each{explored} ({runs[0].url.rsplit('/', 1)[0] if runs[0].url else 'in memory'})")
    seen = set()
    for s in fc.schedules:
        for zone, st in s.setups.items():
            offers = [st.trainer, *([st.explorers] if st.explorers else []), st.controller]
            for offer in offers:
                line = offer.describe() + (f" x {st.explorer_count}" if offer is st.explorers else "")
                if line not in seen:
                    seen.add(line)
                    lines.append(line)
            if st.trainer_factor != 1.0 and ("factor", st.trainer_factor) not in seen:
                seen.add(("factor", st.trainer_factor))
                lines.append(f"the trainer explores at {st.trainer_factor:.2f} s per explorer-second "
                             "(dense bf16 TFLOPS ratio, datasheets)")
    for trace in fc.traces:
        lines.append(f"zone {trace.zone}: {trace.source} ({len(trace.values)} ticks of {trace.gap_seconds} s, "
                     f"{trace.preemptions} preemptions in the file); every spot worker of a zone replays it "
                     "(preempted together), wrapping at its end")
    return lines


def write_plot(fc: Forecast, path: Path) -> Path:
    """Reward curves (every seed) with the target, and hours and dollars to it per schedule and zone."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    ax = axes[0]
    for i, (label, runs) in enumerate(fc.curves.items()):
        for j, c in enumerate(runs):
            ax.plot(*zip(*c.rewards), color=f"C{i}", alpha=0.7, label=f"{label} ({len(runs)} seeds)" if j == 0 else None)
    ax.axhline(fc.scenario.target, color="k", ls="--", lw=1, label=f"target {fc.scenario.target}")
    ax.set(xlabel="bench iteration", ylabel="held-out reward", title="reward curves (every seed)")
    ax.legend(fontsize=8)
    zones = [t.zone for t in fc.traces]
    width = 0.8 / len(zones)
    names = [s.schedule.name for s in fc.schedules]
    for ax, what, unit in ((axes[1], "seconds", "hours to target"), (axes[2], "dollars", "$ to target")):
        for i, s in enumerate(fc.schedules):
            for k, zone in enumerate(zones):
                values = [getattr(o, what) / (3600 if what == "seconds" else 1) for o in s.outcomes.get(zone, ())]
                if values:
                    box = ax.boxplot(values, positions=[i - 0.4 + width * (k + 0.5)], widths=width * 0.9,
                                     patch_artist=True)
                    box["boxes"][0].set_facecolor(f"C{k}")
        ax.set_xticks(range(len(names)), [n.replace(", ", ",\n") for n in names], fontsize=7)
        ax.set(ylabel=unit, title=f"{unit} (boxes: seeds x trace offsets)")
    axes[1].set_yscale("log")  # capacity waits stretch hours over orders of magnitude
    axes[2].legend(handles=[plt.Rectangle((0, 0), 1, 1, color=f"C{k}") for k in range(len(zones))], labels=zones,
                   fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
