"""Per-part verdicts, the whole report, and how they are shown (table) and saved (JSON)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

PASS, FAIL, WEAK, ERROR, SKIP = "PASS", "FAIL", "NO POWER", "ERROR", "SKIP"
# NO POWER: nothing failed, but the negative control was not detected either, so a pass would be
# unearned (the draft is statistically indistinguishable from the target at this budget).


@dataclass
class PartResult:
    part: int
    name: str
    status: str
    summary: str  # one line with the key numbers
    details: dict = field(default_factory=dict)  # the full evidence (JSON-serialisable)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.status in (PASS, SKIP)

    def to_dict(self) -> dict:
        return {
            "part": self.part,
            "name": self.name,
            "status": self.status,
            "summary": self.summary,
            "seconds": round(self.seconds, 3),
            "details": self.details,
        }


@dataclass
class CheckReport:
    parts: list[PartResult]
    config: dict
    meta: dict = field(default_factory=dict)  # models, dtype, versions

    @property
    def passed(self) -> bool:
        return all(p.passed for p in self.parts) and any(p.status == PASS for p in self.parts)

    def part(self, number: int) -> PartResult:
        return next(p for p in self.parts if p.part == number)

    def to_dict(self) -> dict:
        return {
            "passed": self.passed,
            "meta": self.meta,
            "config": self.config,
            "parts": [p.to_dict() for p in self.parts],
        }

    def write_json(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2, default=_jsonable)
            f.write("\n")

    def render(self, console=None) -> None:
        from rich.console import Console
        from rich.table import Table

        console = console or Console()
        table = Table(title="specdecode check", show_lines=True)
        table.add_column("#", justify="right")
        table.add_column("part")
        table.add_column("result")
        table.add_column("evidence", overflow="fold")
        table.add_column("time", justify="right")
        colour = {PASS: "green", FAIL: "red", ERROR: "red", WEAK: "yellow", SKIP: "dim"}
        for p in self.parts:
            table.add_row(str(p.part), p.name, f"[{colour[p.status]}]{p.status}[/]", p.summary, f"{p.seconds:.0f}s")
        console.print(table)
        verdict = "[green]PASS[/]: speculation did not change what the target says" if self.passed else "[red]FAIL[/]"
        console.print(f"overall: {verdict}")


def _jsonable(obj):
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    return str(obj)
