"""What one recipe changes against another, seed by seed: the difference of two variants at theta_N, paired.

Each seed is one pretrained base, so two recipes run on the same seeds differ by less than their spreads
over seeds: the paired difference (held-out reward, diversity relative to the base, realism) with its 95%
t-interval says whether a step along a knob (a KL of 0.18 against 0.21) moved a quantity at all. Inputs as
`quality_goal.py`'s: ``summary.json`` files or ``--out`` folders of either bench, merged, a name with aliases.

    .venv/bin/python bench/paired_difference.py /tmp/q20kl18/summary.json /tmp/q20/summary.json \
        --a mix16g8kl18 --b mix16g8kl21
"""

from __future__ import annotations

from pathlib import Path

import typer
from quality_goal import paired
from rich.console import Console
from rich.table import Table
from targets import t_interval

QUANTITIES = {"held-out reward": "eval_reward", "diversity vs base": "diversity_vs_base", "realism": "realism_digits"}


def main(inputs: list[Path] = typer.Argument(..., help="summary.json files or --out folders of runs"),
         a: str = typer.Option(..., help="the variant's names in the inputs, comma-separated (one config)"),
         b: str = typer.Option(..., help="the variant it is compared with, likewise"), iterations: int = 20,
         seeds: str = typer.Option("", help="comma-separated; default: every seed both variants have")) -> None:
    runs, a, b, chosen = paired(inputs, iterations, a, b, seeds)
    table = Table(title=f"{a} minus {b} at theta_{iterations}, paired by seed: {','.join(map(str, chosen))} "
                        f"({len(chosen)}; mean [95% t-interval])")
    for col in (f"quantity, theta_{iterations}", a, b, "difference [95% interval]", "seeds where it is > 0"):
        table.add_column(col)
    for what, key in QUANTITIES.items():
        ours, theirs = ([runs[(v, s)][key][-1] for s in chosen] for v in (a, b))
        diff = t_interval([x - y for x, y in zip(ours, theirs)])
        table.add_row(what, f"{t_interval(ours).mean:.4f}", f"{t_interval(theirs).mean:.4f}",
                      f"{diff.mean:+.4f} [{diff.low:+.4f}, {diff.high:+.4f}]",
                      f"{sum(x > y for x, y in zip(ours, theirs))}/{len(chosen)}")
    Console(width=200).print(table)


if __name__ == "__main__":
    typer.run(main)
