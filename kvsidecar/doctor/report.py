"""What `doctor` answers: a `DoctorReport` of named checks, each OK / WARN / FAIL / SKIP with a one-line
fix, and its verdict, `result`: READY, DEGRADED (works, but something costs speed or safety) or NOT READY
(a check failed); with `--deep`, the §61 compatibility verdict (supported / experimental / broken) and its
evidence."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Status = Literal["OK", "WARN", "FAIL", "SKIP"]


@dataclass(kw_only=True)
class Check:
    name: str
    status: Status
    detail: str
    fix: str = ""


@dataclass(kw_only=True)
class DoctorReport:
    server: str
    endpoint: str
    checks: list[Check] = field(default_factory=list)
    # the §61 check's verdict (`doctor.restore_check`), its memory class and evidence; None without --deep
    compatibility: dict[str, Any] | None = None

    @property
    def result(self) -> str:
        statuses = {c.status for c in self.checks}
        return "NOT READY" if "FAIL" in statuses else "DEGRADED" if "WARN" in statuses else "READY"

    def add(self, name: str, status: Status, detail: str, fix: str = "") -> None:
        self.checks.append(Check(name=name, status=status, detail=detail, fix=fix))

    def to_dict(self) -> dict[str, Any]:
        return {
            "server": self.server,
            "endpoint": self.endpoint,
            "result": self.result,
            "checks": [asdict(c) for c in self.checks],
            "compatibility": self.compatibility,
        }
