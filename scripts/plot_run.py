"""Plot runs side by side: loss (train and validation), throughput and memory, one PNG.

    python scripts/plot_run.py outputs/runs/20261123-101500 outputs/runs/20261123-111500 -o compare.png
    python scripts/plot_run.py outputs            # the newest run under outputs/runs

Each RUN_DIR is a run folder (metrics.jsonl and config.toml, see titanlite/observe/run_dir.py) or a
folder holding run folders, from which the newest is taken. Each run is labelled by its
folder name plus the config values in which the runs differ (`lr=0.0003`,
`tensor_parallel_degree=2`), so two learning rates or two layouts read apart at a glance.
Needs matplotlib: `pip install -e .[plot]`.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the parser titanlite.config uses there
    import tomli as tomllib

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titanlite.errors import USER_ERROR_EXIT_CODE, TitanliteError  # noqa: E402
from titanlite.observe.run_dir import CONFIG_FILE, METRICS_FILE, read_metrics  # noqa: E402

# Panel title -> (y-axis label, [(metrics.jsonl key, kind of line), ...]).
PANELS: dict[str, tuple[str, list[tuple[str, str]]]] = {
    "loss": ("cross-entropy", [("loss", "train"), ("validation_loss", "validation")]),
    "throughput": ("tokens/s per device", [("tps", "train")]),
    "memory": ("peak memory (GiB)", [("memory_gib", "train")]),
}
IGNORED_DIFFERENCES = {"job.dump_folder"}  # differs between any two runs; says nothing about them
MAX_LABEL_DIFFERENCES = 3


@dataclass(frozen=True)
class Line:
    """One plotted line: whose (the run's label), what kind, and its points."""

    run: str
    kind: str  # "train" or "validation"
    steps: list[int]
    values: list[float]


Series = dict[str, list[Line]]
"""Panel title -> its lines: everything the figure shows."""


@dataclass(frozen=True)
class Run:
    folder: Path
    config: dict[str, Any]  # "section.key" -> value, from config.toml ({} when absent)
    records: list[dict[str, Any]]


def find_run(path: Path) -> Path:
    """`path` itself when it holds metrics.jsonl, else the newest run folder below it that
    logged a step (names are start times, so the largest name is the newest; a start that
    trained nothing, such as a resume with no step left, is passed over)."""
    if (path / METRICS_FILE).is_file():
        return path
    found = sorted(
        {p.parent for p in [*path.glob(f"*/{METRICS_FILE}"), *path.glob(f"*/*/{METRICS_FILE}")]},
        key=lambda p: p.name,
        reverse=True,
    )
    if not found:
        raise TitanliteError(f"{path}: no {METRICS_FILE} here or in the run folders below it")
    return next((folder for folder in found if read_metrics(folder)), found[0])


def load_run(path: Path) -> Run:
    folder = find_run(path)
    config: dict[str, Any] = {}
    if (folder / CONFIG_FILE).is_file():
        with open(folder / CONFIG_FILE, "rb") as f:
            config = {f"{s}.{k}": v for s, table in tomllib.load(f).items() for k, v in table.items()}
    records = read_metrics(folder)
    if not records:
        raise TitanliteError(f"{folder / METRICS_FILE}: no records yet")
    return Run(folder, config, records)


def labels(runs: list[Run]) -> list[str]:
    """Folder name (the path when names repeat) plus the config values that differ."""
    names = [run.folder.name for run in runs]
    if len(set(names)) < len(names):
        names = [str(run.folder) for run in runs]
    keys = sorted({k for run in runs for k in run.config} - IGNORED_DIFFERENCES)
    differing = [k for k in keys if len({repr(run.config.get(k)) for run in runs}) > 1]
    result = []
    for name, run in zip(names, runs):
        shown = [f"{k.split('.')[-1]}={run.config.get(k)}" for k in differing[:MAX_LABEL_DIFFERENCES]]
        more = ", ..." if len(differing) > MAX_LABEL_DIFFERENCES else ""
        result.append(f"{name} ({', '.join(shown)}{more})" if shown else name)
    return result


def series(runs: list[Run]) -> Series:
    """The lines of every panel; a key a run never logged (no validation) gives no line."""
    panels: Series = {title: [] for title in PANELS}
    for label, run in zip(labels(runs), runs):
        for title, (_, keys) in PANELS.items():
            for key, kind in keys:
                points = [(r["step"], r[key]) for r in run.records if r.get(key) is not None]
                if points:
                    steps, values = zip(*points)
                    panels[title].append(Line(label, kind, list(steps), list(values)))
    return panels


def _matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise TitanliteError("plotting needs matplotlib (the optional extra 'plot'): pip install -e .[plot]") from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    return plt, MaxNLocator


def render(panels: Series, out: Path) -> None:
    """One row of panels; one colour per run, named once in a legend under the figure;
    validation lines dashed with markers."""
    plt, MaxNLocator = _matplotlib()
    runs = list(dict.fromkeys(line.run for lines in panels.values() for line in lines))
    colour = {run: f"C{i % 10}" for i, run in enumerate(runs)}
    figure, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for axis, (title, lines) in zip(axes[0], panels.items()):
        for line in lines:
            style = {"linestyle": "--", "marker": "o"} if line.kind == "validation" else {}
            axis.plot(line.steps, line.values, color=colour[line.run], label=line.kind, **style)
        axis.set(title=title, xlabel="step", ylabel=PANELS[title][0])
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.grid(alpha=0.3)
        if any(line.kind == "validation" for line in lines):  # say which style is which
            handles = [
                plt.Line2D([], [], color="grey", label="train"),
                plt.Line2D([], [], color="grey", linestyle="--", marker="o", label="validation"),
            ]
            axis.legend(handles=handles, fontsize="small")
    handles = [plt.Line2D([], [], color=colour[run], linewidth=3) for run in runs]
    figure.legend(handles, runs, loc="upper center", bbox_to_anchor=(0.5, 0), ncol=min(len(runs), 2))
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100, bbox_inches="tight")
    plt.close(figure)


def main(argv: list[str] | None = None) -> Series:
    """Plot the runs named on the command line; returns the plotted series (for tests)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="a run folder, or a folder of them")
    parser.add_argument("-o", "--out", type=Path, default=Path("run.png"), help="PNG to write (default run.png)")
    args = parser.parse_args(argv)
    panels = series([load_run(path) for path in args.run_dirs])
    render(panels, args.out)
    print(f"wrote {args.out}")
    return panels


if __name__ == "__main__":
    try:
        main()
    except TitanliteError as error:
        print(f"titanlite: error: {error}", file=sys.stderr)
        sys.exit(USER_ERROR_EXIT_CODE)
