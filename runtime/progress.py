"""The progress line rank 0 shows while training: step, loss, step time, throughput.

On a terminal it is one live line (rich); otherwise (a log file, a CI job) it prints a plain
line every ``--log-every`` steps and at the last step, so logs stay readable.

The live line must fit the terminal: rich cuts a line that does not fit with an ellipsis
(``step 19… … 0:04…`` at 80 columns), which hides the very figures it exists to show. So
the line is laid out for the console's width: the figures go in order of importance (step,
loss, step time, samples/s, tokens/s) while they fit, and the bar shrinks, then goes.
"""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, TextColumn, TimeRemainingColumn

# The time remaining, compact: "0:04", "-:--" before the first estimate, "1:02:03" past an hour.
ETA_WIDTH = 7
SEPARATOR = "  "


def bar_width_for(width: int) -> int:
    """The bar's width on a console ``width`` columns wide: 20, 10 from 70 columns, none below.

    Below 70 columns the figures need the room more than the bar does (the step count says
    how far along the run is).
    """
    return 20 if width >= 100 else 10 if width >= 70 else 0


def fit_fields(fields: list[str], width: int) -> str:
    """The first fields, joined, that fit in ``width`` columns (the first always, cut if it must be).

    ``fields`` come in order of importance; one that does not fit ends the line, so that a
    less important field never shows while a more important one is missing.
    """
    line = fields[0][:max(1, width)]
    for field in fields[1:]:
        longer = line + SEPARATOR + field
        if len(longer) > width:
            break
        line = longer
    return line


class TrainingProgress:
    def __init__(self, total_steps: int, first_step: int, samples_per_step: int, tokens_per_sample: int | None,
                 log_every: int, enabled: bool, console: Console | None = None) -> None:
        self.console = console or Console()
        self.total = total_steps
        self.samples = samples_per_step
        self.tokens = tokens_per_sample
        self.log_every = log_every
        self.enabled = enabled
        self.live = enabled and self.console.is_terminal
        self._progress: Progress | None = None
        if self.live:
            self._bar = bar_width_for(self.console.width)
            columns: list[ProgressColumn] = [TextColumn("{task.description}")]
            if self._bar:
                columns.append(BarColumn(bar_width=self._bar))
            columns.append(TimeRemainingColumn(compact=True, elapsed_when_finished=True))
            self._progress = Progress(*columns, console=self.console, transient=False)
            self._task = self._progress.add_task(self.fit(first_step, None, None), total=total_steps,
                                                 completed=first_step)
            self._progress.start()

    def fields(self, done: int, loss: float | None, step_s: float | None) -> list[str]:
        """The line's figures, most important first."""
        out = [f"step {done}/{self.total}"]
        if loss is None or step_s is None:
            return out
        rate = self.samples / step_s if step_s > 0 else float("inf")
        out += [f"loss {loss:.4f}", f"{step_s * 1e3:.1f} ms/step", f"{rate:,.1f} samples/s"]
        if self.tokens:
            out.append(f"{rate * self.tokens:,.0f} tokens/s")
        return out

    def fit(self, done: int, loss: float | None, step_s: float | None) -> str:
        """The figures that fit beside the bar and the time remaining on this console."""
        room = self.console.width - self._bar - ETA_WIDTH - 2 - 1   # a space between columns; one spare
        return fit_fields(self.fields(done, loss, step_s), room)

    def describe(self, loss: float, step_s: float) -> str:
        """Every figure but the step count, for the plain lines of a log."""
        return SEPARATOR.join(self.fields(0, loss, step_s)[1:])

    def update(self, step: int, loss: float, step_s: float) -> None:
        """After step ``step`` (0-based) completed."""
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.update(self._task, completed=step + 1, description=self.fit(step + 1, loss, step_s))
        elif (step + 1) % self.log_every == 0 or step + 1 == self.total:
            self.console.print(f"step {step + 1}/{self.total}  {self.describe(loss, step_s)}", highlight=False)

    def note(self, text: str) -> None:
        if self.enabled:
            self.console.print(text, highlight=False)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
