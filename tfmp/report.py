"""What a person sees of a run: its phases as they start, and a summary at the end.

* `Phases` announces each phase with its place in the whole, the time so far and, once it can
  be measured, the time left: `[3/7] baseline, label draw 1/5 · 2:41 elapsed · ETA 1:30`.
  The ETA of a phase kind (e.g. the baseline's draws) comes from the draws of that kind already
  finished; before one has, the ETA says so instead of guessing.
* `summary_table` turns `metrics.json` into the few figures that matter for the task, per label
  draw and as mean ± spread; `summary_png` draws them (probe vs baseline per draw, the kNN
  monitor over epochs) to `WORKDIR/summary.png`.

`python -m tfmp.report WORKDIR` prints a finished run's summary again and redraws its summary.png.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import statistics
import sys
import time

logger = logging.getLogger(__name__)


def clock(seconds: float) -> str:
    """`m:ss` (or `h:mm:ss`)."""
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


@dataclasses.dataclass
class Phase:
    title: str
    kind: str  # phases of one kind take about as long as each other (the baseline's draws)


class Phases:
    """The run's phases in order; `start(i)` prints the header of phase i and closes the one before.

    Args:
        phases: the run's phases.
        stream: where the headers go (stdout: they are the run's narrative, like Keras' epochs).
    """

    def __init__(self, phases: list[Phase], stream=None):
        self.phases = phases
        self.stream = stream or sys.stdout
        self.started = time.perf_counter()
        self.durations: dict[str, list[float]] = {}
        self._current: tuple[int, float] | None = None

    def _close_current(self) -> None:
        if self._current is not None:
            index, began = self._current
            self.durations.setdefault(self.phases[index].kind, []).append(time.perf_counter() - began)
            self._current = None

    def eta(self, next_index: int) -> str:
        """Time left for phases `next_index...`, from finished phases of the same kinds."""
        remaining = 0.0
        for phase in self.phases[next_index:]:
            measured = self.durations.get(phase.kind)
            if not measured:
                return f"ETA after the first {phase.kind}"
            remaining += statistics.median(measured)
        return f"ETA {clock(remaining)}"

    def start(self, index: int) -> None:
        self._close_current()
        elapsed = clock(time.perf_counter() - self.started)
        print(f"[{index + 1}/{len(self.phases)}] {self.phases[index].title} · {elapsed} elapsed · {self.eta(index)}",
              file=self.stream, flush=True)
        self._current = (index, time.perf_counter())

    def finish(self) -> float:
        """Closes the last phase; returns the run's seconds."""
        self._close_current()
        return time.perf_counter() - self.started


# ------------------------------------------------------------------------------------ summary

# Per-draw figures shown in the summary, in this order, with their column titles.
DRAW_COLUMNS = (("linear_probe_accuracy", "linear probe"), ("knn_accuracy", "kNN"), ("finetune_accuracy", "fine-tuned"),
                ("supervised_baseline_accuracy", "supervised baseline"))
GAIN_COLUMNS = (("linear_probe_accuracy", "probe − baseline"), ("finetune_accuracy", "fine-tuned − baseline"))
SINGLE_FIGURES = (("eval_accuracy", "test accuracy"), ("train_loss", "final train loss"),
                  ("examples_per_second", "examples/s"), ("mfu", "MFU"), ("steps", "steps"), ("wall_seconds", "wall seconds"))


def _spread(values: list[float]) -> str:
    mean = statistics.fmean(values)
    return f"{mean:.3f} ± {statistics.stdev(values):.3f}" if len(values) > 1 else f"{mean:.3f}"


def summary_table(metrics: dict) -> str:
    """The figures of `metrics.json` that matter for the task, as a small text table."""
    lines = [f"{metrics.get('task', '?')} · {metrics.get('model', '?')} · {metrics.get('precision', '?')} · "
             f"{metrics.get('strategy', '?')} x{metrics.get('num_replicas', 1)}"]
    columns = [(key, title) for key, title in DRAW_COLUMNS if key in metrics]
    if columns:
        per_draw = {key: metrics.get(f"{key}_per_draw", [metrics[key]]) for key, _ in columns}
        draws = len(next(iter(per_draw.values())))
        baseline = per_draw.get("supervised_baseline_accuracy")
        # The pretrained encoder's gain over the baseline, per way of evaluating it (probe; fine-tuning when run).
        gains = [(key, title) for key, title in GAIN_COLUMNS if key in per_draw] if baseline else []
        header = ["label draw", *(title for _, title in columns), *(title for _, title in gains)]
        rows = []
        for draw in range(draws):
            row = [str(draw + 1), *(f"{per_draw[key][draw]:.3f}" for key, _ in columns)]
            rows.append(row + [f"{per_draw[key][draw] - baseline[draw]:+.3f}" for key, _ in gains])
        mean_row = ["mean", *(_spread(per_draw[key]) for key, _ in columns)]
        mean_row += [f"{statistics.fmean(a - b for a, b in zip(per_draw[key], baseline)):+.3f}" for key, _ in gains]
        rows.append(mean_row)
        widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
        for row in [header, *rows]:
            lines.append("  ".join(cell.rjust(width) for cell, width in zip(row, widths)))
        if "labeled_examples" in metrics:
            lines.append(f"{metrics['labeled_examples']} labeled examples per draw"
                         + (f", {metrics['unlabeled_examples']} unlabeled" if "unlabeled_examples" in metrics else ""))
    for key, title in SINGLE_FIGURES:
        value = metrics.get(key)
        if isinstance(value, (int, float)) and not (columns and key == "train_loss"):
            lines.append(f"{title}: {value:.4g}" if isinstance(value, float) else f"{title}: {value}")
    if metrics.get("small_data_warnings"):  # each was logged as a warning when found; not repeated here
        lines.append(f"small-data guard: {len(metrics['small_data_warnings'])} warning(s), in metrics.json")
    return "\n".join(lines)


def summary_png(metrics: dict, history: list[dict], path: str) -> str | None:
    """Draws the summary (probe vs baseline per draw; the kNN monitor and loss over epochs) to `path`.

    Returns the path, or None where there is nothing to draw or matplotlib is missing (said once, at INFO).
    """
    knn = [(index + 1, row["knn_accuracy"]) for index, row in enumerate(history) if "knn_accuracy" in row]
    has_draws = "linear_probe_accuracy" in metrics
    if not has_draws and not knn:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot
    except ImportError:
        logger.warning("summary.png skipped: matplotlib is not installed (pip install matplotlib)")
        return None
    panels = int(has_draws) + int(bool(knn))
    figure, axes = pyplot.subplots(1, panels, figsize=(5.5 * panels, 3.6), squeeze=False)
    axes = list(axes[0])
    if has_draws:
        axis = axes.pop(0)
        series = [(key, title) for key, title in DRAW_COLUMNS if key in metrics]
        draws = len(metrics.get("linear_probe_accuracy_per_draw", [0]))
        width = 0.8 / len(series)
        for offset, (key, title) in enumerate(series):
            values = metrics.get(f"{key}_per_draw", [metrics[key]])
            axis.bar([draw + offset * width for draw in range(draws)], values, width, label=title)
        axis.set_xticks([draw + 0.4 - width / 2 for draw in range(draws)], [str(draw + 1) for draw in range(draws)])
        axis.set_xlabel("label draw")
        axis.set_ylabel("test accuracy")
        low = min(min(metrics.get(f"{key}_per_draw", [metrics[key]])) for key, _ in series)
        axis.set_ylim(max(0.0, low - 0.1), 1.12)  # headroom for the legend above the bars
        axis.set_title(f"{metrics.get('labeled_examples', '?')} labels per draw")
        axis.legend(loc="upper center", ncol=len(series), fontsize=7, frameon=False)
    if knn:
        axis = axes.pop(0)
        axis.plot([epoch for epoch, _ in knn], [value for _, value in knn], marker="o", label="kNN accuracy")
        axis.set_xlabel("pretraining epoch")
        axis.set_ylabel("kNN accuracy")
        axis.set_title("kNN monitor")
    figure.suptitle(f"{metrics.get('task', '')} · {metrics.get('model', '')} · {metrics.get('precision', '')}", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot.close(figure)
    return path


def main(argv: list[str]) -> int:
    """`python -m tfmp.report WORKDIR`: the summary of a finished run, and its summary.png drawn again."""
    from tfmp.run_directory import RunDirectory, logged_history

    if len(argv) != 2 or argv[1].startswith("-"):
        print("usage: python -m tfmp.report WORKDIR", file=sys.stderr)
        return 2
    directory = RunDirectory(argv[1])
    try:
        with open(directory.metrics_file, encoding="utf-8") as file:
            metrics = json.load(file)
    except (OSError, ValueError) as error:
        print(f"tfmp.report: error: {directory.metrics_file}: no finished run's metrics there "
              f"({getattr(error, 'strerror', None) or error})", file=sys.stderr)
        return 2
    print(summary_table(metrics))
    drawn = summary_png(metrics, logged_history(directory.history_file), directory.summary_png_file)
    print(f"drawn: {drawn}" if drawn else "nothing to draw for this task (no label draws, no kNN monitor)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
