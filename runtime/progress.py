"""The progress line rank 0 shows while training: step, loss, step time, throughput.

On a terminal it is one live line (rich); otherwise (a log file, a CI job) it prints a plain
line every ``--log-every`` steps and at the last step, so logs stay readable.
"""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


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
            self._progress = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(bar_width=20),
                                      TextColumn("{task.description}"), TimeRemainingColumn(),
                                      console=self.console, transient=False)
            self._task = self._progress.add_task("", total=total_steps, completed=first_step)
            self._progress.start()

    def describe(self, loss: float, step_s: float) -> str:
        rate = self.samples / step_s if step_s > 0 else float("inf")
        text = f"loss {loss:.4f}  {step_s * 1e3:.1f} ms/step  {rate:,.1f} samples/s"
        if self.tokens:
            text += f"  {rate * self.tokens:,.0f} tokens/s"
        return text

    def update(self, step: int, loss: float, step_s: float) -> None:
        """After step ``step`` (0-based) completed."""
        if not self.enabled:
            return
        text = self.describe(loss, step_s)
        if self._progress is not None:
            self._progress.update(self._task, completed=step + 1, description=text)
        elif (step + 1) % self.log_every == 0 or step + 1 == self.total:
            self.console.print(f"step {step + 1}/{self.total}  {text}", highlight=False)

    def note(self, text: str) -> None:
        if self.enabled:
            self.console.print(text, highlight=False)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
