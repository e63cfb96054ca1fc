"""Training sessions: several trainer runs in one set of gloo ranks (session_worker.py).

A multi-process run spends most of its seconds starting: importing torch, the rendezvous,
building the first model. Tests that compare many layouts of one world size against a
reference run them as cases of one session instead of one launch each.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers.distributed import run_ranks, with_overrides

WORKER = Path(__file__).with_name("session_worker.py")


@dataclass
class Case:
    """One trainer run of a session: its overrides (a later value replacing an earlier one)
    and, to resume, the checkpoint to start from (a dump folder and a step). A case with
    `call` ("module:function") runs that function on every rank instead, in the session's
    process group, and records what it returns."""

    name: str
    argv: list[str]
    copy_checkpoint: tuple[str, int] | None = None
    call: str | None = None


@dataclass
class SessionResult:
    cases: dict[str, dict] = field(default_factory=dict)
    stdout: str = ""
    stderr: str = ""

    def __getitem__(self, name: str) -> dict:
        """The case's {"history", "ranks"}; a case that failed fails the caller with its error."""
        case = self.cases.get(name)
        assert case is not None, f"case {name} did not run:\n{self.stdout[-2000:]}\n{self.stderr[-4000:]}"
        assert case["error"] is None, f"case {name} failed: {case['error']}\n{self.stderr[-3000:]}"
        return case


def run_session(nproc: int, cases: list[Case], folder: Path, timeout: float) -> SessionResult:
    """Run `cases` in order on `nproc` ranks; every case's dump folder is `folder/<name>`
    unless its argv names one."""
    folder.mkdir(parents=True, exist_ok=True)
    spec = [
        {
            "name": c.name,
            "argv": with_overrides(["--job.dump_folder", str(folder / c.name)], c.argv),
            "copy_checkpoint": list(c.copy_checkpoint) if c.copy_checkpoint else None,
            "call": c.call,
        }
        for c in cases
    ]
    (folder / "cases.json").write_text(json.dumps(spec))
    out = folder / "results.json"
    result = run_ranks(nproc, [str(WORKER), str(out), str(folder / "cases.json")], [], timeout)
    cases_run = json.loads(out.read_text()) if out.exists() else {}
    return SessionResult(cases_run, result.stdout, result.stderr)
