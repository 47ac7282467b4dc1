"""Progress bars for long stages (rich), as a plain callback the library can call without knowing rich."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

console = Console(stderr=True)


class ProgressBars:
    """``bars(description, done, total)``: one bar per description, started on first use."""

    def __init__(self) -> None:
        self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TimeElapsedColumn(), console=console, transient=False)
        self._bars: dict[str, int] = {}

    def __call__(self, description: str, done: int, total: int) -> None:
        if not self._bars:
            self._progress.start()
        if description not in self._bars:
            self._bars[description] = self._progress.add_task(description, total=total)
        self._progress.update(self._bars[description], completed=done, total=total)
        if done >= total:
            self._progress.stop_task(self._bars[description])

    def close(self) -> None:
        if self._bars:
            self._progress.stop()
