"""Training sessions: several trainer runs in one set of gloo ranks (session_worker.py).

A multi-process run spends most of its seconds starting: importing torch, the rendezvous,
building the first model. Tests that compare many layouts of one world size against a
reference run them as cases of one session instead of one launch each.

A session past its timeout (a hang guard, scaled to the host's load by `run_ranks`) is
stopped; the cases it finished keep their results (the worker writes them after each case),
and the first test that needs a case it did not finish fails with one line naming the session,
the case it was in and its last output; any later one is skipped with a short reference to
that line, instead of every test of a module erroring with the same traceback. A session that
finished every case and then hung until the guard fails its first test the same way.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from filelock import FileLock

from tests.helpers.distributed import run_ranks, timeout_scale, with_overrides
from tests.helpers.hf_models import with_hf_folders

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
    names: list[str] = field(default_factory=list)  # every case the session was given, in order
    timed_out: str | None = None  # the one line that says so, when the session was stopped
    reported: bool = False  # that line has failed a test already

    def __getitem__(self, name: str) -> dict:
        """The case's {"history", "ranks"}; a case that failed fails the caller with its error."""
        case = self.cases.get(name)
        hung_after_all = len(self.cases) == len(self.names)  # it finished every case, then did not exit
        if self.timed_out is not None and not self.reported and (case is None or hung_after_all):
            self.reported = True
            pytest.fail(self.timed_out, pytrace=False)
        if case is None and self.timed_out is not None:
            pytest.skip(f"{self.timed_out.split(':')[0]}: reported once, by the first test that needed it")
        assert case is not None, f"case {name} did not run:\n{self.stdout[-2000:]}\n{self.stderr[-4000:]}"
        assert case["error"] is None, f"case {name} failed: {case['error']}\n{self.stderr[-3000:]}"
        return case


@dataclass
class SessionCases:
    """The cases of several sessions by name (a module fixture's result): a lookup gives the
    case's result, or fails or skips the test as its session's `SessionResult` does."""

    sessions: dict[str, SessionResult] = field(default_factory=dict)

    def add(self, session: SessionResult) -> None:
        self.sessions.update({name: session for name in session.names})

    def __getitem__(self, name: str) -> dict:
        return self.sessions[name][name]


def run_session(nproc: int, cases: list[Case], folder: Path, timeout: float) -> SessionResult:
    """Run `cases` in order on `nproc` ranks; every case's dump folder is `folder/<name>`
    unless its argv names one. An argument "hf:<model_type>" stands for that tiny transformers
    model's folder (tests/helpers/hf_models.py), and "chat:<file>" for a chat data file
    (tests/helpers/chat_data.py), written under `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    spec = [
        {
            "name": c.name,
            "argv": with_hf_folders(with_overrides(["--job.dump_folder", str(folder / c.name)], c.argv), folder),
            "copy_checkpoint": list(c.copy_checkpoint) if c.copy_checkpoint else None,
            "call": c.call,
        }
        for c in cases
    ]
    (folder / "cases.json").write_text(json.dumps(spec))
    out = folder / "results.json"
    names = [c.name for c in cases]
    try:
        result = run_ranks(nproc, [str(WORKER), str(out), str(folder / "cases.json")], [], timeout)
    except subprocess.TimeoutExpired as expired:
        finished = json.loads(out.read_text()) if out.exists() else {}
        line = timed_out_line(folder.name, nproc, names, finished, expired)
        return SessionResult(finished, expired.output or "", expired.stderr or "", names, line)
    cases_run = json.loads(out.read_text()) if out.exists() else {}
    return SessionResult(cases_run, result.stdout, result.stderr, names)


def shared_session(
    tmp_path_factory: pytest.TempPathFactory,
    label: str,
    nproc: int,
    make_cases: Callable[[Path], list[Case]],
    timeout: float,
) -> SessionResult:
    """`run_session` once per pytest run, whichever module asks first: the references that
    several modules compare against (the equivalence layouts of each world size live in files
    of their own, so that the xdist workers run them side by side). Under xdist the
    workers share their basetemp's parent; a lock makes a second asker wait for the first's
    result, which it then reads from disk. `make_cases(folder)` gives the cases (and writes any
    file they read into the session's folder) where the session runs. Ask for it after the
    module's own sessions: by then another module has often finished it."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    folder = shared / f"shared-{label}"
    with FileLock(str(shared / f"shared-{label}.lock")):
        saved = folder / "session.json"
        if saved.exists():
            return SessionResult(**json.loads(saved.read_text()))
        result = run_session(nproc, make_cases(folder), folder, timeout)
        saved.write_text(json.dumps(dataclasses.asdict(result)))
    return result


def timed_out_line(label: str, nproc: int, names: list[str], finished: dict, expired) -> str:
    """`session world4 (4 ranks) timed out after 600 s (...): in case X, N of M cases
    finished; last output: ...`: what a user needs to find the hang, on one line."""
    stuck = next((name for name in names if name not in finished), "?")
    output = (expired.output or "") + (expired.stderr or "")
    last = [line for line in output.splitlines() if line.strip() and not line.startswith("@@")]
    tail = re.sub(r"\s+", " ", last[-1])[-300:] if last else "(none)"
    return (
        f"session {label} ({nproc} ranks) timed out after {expired.timeout:.0f} s (hang guard x "
        f"{timeout_scale():.1f} for this host's load): in case {stuck}, {len(finished)} of {len(names)} "
        f"cases finished; last output: {tail}"
    )
