"""``gpipe-plan calibrate``: read a report and a profile, write the calibrated profile, print."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from ..artifacts import write_json_atomic
from .calibrate import calibrate


def calibrate_command(report: str, profile: str, out: str | None, speed_correction: bool = False) -> None:
    doc = calibrate(profile, report, use_speed_probe=speed_correction)
    target = out or str(Path(profile).with_suffix("")) + ".calibrated.json"
    write_json_atomic(target, doc)
    last = doc["calibration"][-1]
    table = Table(title="calibration: measured / predicted, per stage", title_justify="left")
    for col in ("stage", "layers", "forward", "backward", "optimizer"):
        table.add_column(col, justify="left" if col == "layers" else "right")
    for st in last["stages"]:
        names = st["layers"][0] if len(st["layers"]) == 1 else f"{st['layers'][0]} .. {st['layers'][-1]}"
        table.add_row(str(st["stage"]), names,
                      *(f"{st[k + '_scale']:.2f}x" if k + "_scale" in st else "-" for k in ("forward", "backward",
                                                                                             "optimizer")))
    console = Console()
    console.print(table)
    drift = last["speed_ratio_divided_out"]
    if drift != 1.0:
        console.print(f"the machine ran at {drift:.2f}x the profile's time during that run (speed probe): divided out",
                      highlight=False)
    console.print(f"wrote {target}: solve with it to plan with the measured costs", highlight=False)
