"""The run directory: every path and file name of a run, and what a rerun finds there.

    WORKDIR/config.json            the resolved config (written once every input check has passed)
    WORKDIR/metrics.json           final figures, flat JSON (written last, atomically)
    WORKDIR/failure.json           the diagnosis of an attempt that failed; while it is there, a rerun may change
                                   the numerics in `tfmp.config.CHANGEABLE_AFTER_FAILURE`
    WORKDIR/run.lock               the process running here (`tfmp.workdir_lock`)
    WORKDIR/memory_estimate.json   what --dry_run estimated (nothing else is written then)
    WORKDIR/checkpoints/           tf.train checkpoints (`tfmp.callbacks.Checkpointing`)
    WORKDIR/tensorboard/           TensorBoard scalars of every stage (a stage's below, e.g. baseline/draw0/)
    WORKDIR/history.csv            one row per epoch, appended across resumptions
    WORKDIR/encoder.keras          the pretrained encoder (--task=<an SSL method>), loadable without tfmp
    WORKDIR/encoder_ema.keras      its moving average of the weights (--ema_momentum), the same way
    WORKDIR/summary.png            the run's figures drawn (probe vs baseline per draw, kNN over epochs)
    WORKDIR/baseline/draw<N>/      a stage's own run directory (the supervised baseline of label draw N):
                                   its checkpoints and history.csv

A non-chief worker of a multi-worker run resumes from the chief's directory but writes to
a scratch folder of its own (`for_worker`), removed when the run ends: every worker must
take part in saving, only the chief's copy is kept.

Imports no TensorFlow, so the CLI can answer "already finished", refuse a conflicting
rerun or an unwritable workdir before TensorFlow starts.
"""

from __future__ import annotations

import csv
import dataclasses
import errno
import json
import logging
import os
import shutil
import tempfile

from tfmp import logs
from tfmp.config import (CHANGEABLE_AFTER_FAILURE, Config, UsageError, load_json, renamed_settings_given, save_json,
                         validate)

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.json"
FAILURE_FILE = "failure.json"  # why the last attempt failed (training diverged); gone once the run finishes
MEMORY_ESTIMATE_FILE = "memory_estimate.json"
HISTORY_FILE = "history.csv"
SUMMARY_PNG_FILE = "summary.png"
ENCODER_FILE = "encoder.keras"
ENCODER_AVERAGE_FILE = "encoder_ema.keras"
CHECKPOINTS = "checkpoints"
TENSORBOARD = "tensorboard"


def _scratch_root() -> str:
    return os.path.join(tempfile.gettempdir(), f"tfmp-worker-{os.getpid()}")


@dataclasses.dataclass(frozen=True)
class RunDirectory:
    """Paths of one run (or one stage of it).

    Attributes:
        path: the directory runs are resumed from and, on the chief, written to.
        write_path: where this process writes (a scratch folder on a non-chief worker).
    """

    path: str
    write_path: str = ""
    tensorboard_path: str = ""

    def __post_init__(self):
        if not self.path:
            raise UsageError("--workdir is required")
        if not self.write_path:
            object.__setattr__(self, "write_path", self.path)
        if not self.tensorboard_path:
            object.__setattr__(self, "tensorboard_path", os.path.join(self.write_path, TENSORBOARD))

    @property
    def is_scratch(self) -> bool:
        return self.write_path != self.path

    def for_worker(self, chief: bool) -> RunDirectory:
        """This directory as a worker sees it: the chief writes here, the others to scratch."""
        if chief:
            return RunDirectory(self.path)
        return RunDirectory(self.path, os.path.join(_scratch_root(), os.path.abspath(self.path).lstrip(os.sep)))

    def stage(self, *parts: str) -> RunDirectory:
        """A stage's own run directory below this one (e.g. `stage("baseline", "draw0")`); its
        TensorBoard logs go below the run's, so one `tensorboard --logdir WORKDIR/tensorboard` shows
        every stage (runs `train`, `validation`, `baseline/draw0/train`, ...)."""
        return RunDirectory(os.path.join(self.path, *parts), os.path.join(self.write_path, *parts),
                            os.path.join(self.tensorboard_path, *parts))

    @staticmethod
    def remove_scratch() -> None:
        """Removes this process's scratch folder (a non-chief worker's writes)."""
        shutil.rmtree(_scratch_root(), ignore_errors=True)

    # Files read from the run directory itself.
    @property
    def config_file(self) -> str:
        return os.path.join(self.path, CONFIG_FILE)

    @property
    def failure_file(self) -> str:
        return os.path.join(self.path, FAILURE_FILE)

    @property
    def metrics_file(self) -> str:
        return os.path.join(self.path, METRICS_FILE)

    @property
    def memory_estimate_file(self) -> str:
        return os.path.join(self.path, MEMORY_ESTIMATE_FILE)

    @property
    def checkpoints(self) -> str:
        """Where checkpoints are resumed from (the chief's)."""
        return os.path.join(self.path, CHECKPOINTS)

    @property
    def encoder_file(self) -> str:
        return os.path.join(self.path, ENCODER_FILE)

    @property
    def encoder_average_file(self) -> str:
        return os.path.join(self.path, ENCODER_AVERAGE_FILE)

    @property
    def summary_png_file(self) -> str:
        return os.path.join(self.path, SUMMARY_PNG_FILE)

    @property
    def history_file(self) -> str:
        return os.path.join(self.path, HISTORY_FILE)

    # Where this process writes.
    @property
    def checkpoints_to_write(self) -> str:
        return os.path.join(self.write_path, CHECKPOINTS)

    @property
    def tensorboard(self) -> str:
        return self.tensorboard_path

    @property
    def history_to_write(self) -> str:
        return os.path.join(self.write_path, HISTORY_FILE)

    def check_writable(self) -> None:
        """Raises UsageError (one line) unless the run directory is, or can be made, a writable directory.

        Writes and removes a probe file in the run directory, or, while it does not exist yet, in
        the nearest folder above it that does: creating (and removing again) the run directory
        here would race with the other workers of a multi-worker run, which check the same
        directory at the same moment (one worker's removal broke the other's probe). Nothing is
        left behind, so a refused run writes nothing."""
        try:
            os.stat(self.path)
        except OSError as error:
            if error.errno in (errno.ENAMETOOLONG, errno.EINVAL, errno.EILSEQ):  # a name the filesystem rejects
                raise UsageError(f"workdir {self.path!r} cannot be a directory here ({error.strerror}); "
                                 "choose another --workdir") from None
        except ValueError as error:  # a NUL byte
            raise UsageError(f"workdir {self.path!r} cannot be a directory here ({getattr(error, 'strerror', None) or error}); "
                             "choose another --workdir") from None
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise UsageError(f"workdir {self.path} is a file, not a directory; choose another --workdir")
        for inside in (self.checkpoints, self.tensorboard):
            if os.path.isdir(inside) and not os.access(inside, os.W_OK | os.X_OK):
                raise UsageError(f"workdir {self.path}: {os.path.basename(inside)}/ is not writable; fix its permissions "
                                 "or choose another --workdir")
        folder = os.path.abspath(self.path)
        while not os.path.exists(folder):
            folder = os.path.dirname(folder)
        try:
            with tempfile.NamedTemporaryFile(dir=folder, prefix=".tfmp-write-check-"):
                pass
        except OSError as error:
            raise UsageError(f"workdir {self.path} is not writable ({error.strerror or error}); "
                             "choose another --workdir") from None

    def finished_metrics(self, config: Config) -> dict | None:
        """What an earlier run here left: its metrics when the same config already finished,
        None when the directory is new or holds the same config unfinished (to be resumed).

        Raises:
            UsageError: the directory holds a run with a different config.
        """
        if not os.path.exists(self.config_file):
            return None
        try:
            earlier = load_json(self.config_file)
        except (OSError, ValueError, TypeError) as error:
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise UsageError(f"workdir {self.path}: {CONFIG_FILE} does not read ({reason}); move it aside to rerun the run "
                             "here (its checkpoints are resumed), or choose another --workdir") from None
        failed = os.path.exists(self.failure_file)
        differences = config.differences(earlier, after_failure=failed)
        if differences:
            may_change = (f"; after its failure, {', '.join(CHANGEABLE_AFTER_FAILURE)} may change here" if failed else "")
            raise UsageError(f"workdir {self.path} holds a run with another config ({'; '.join(differences)}){may_change}; "
                             "use a new --workdir")
        if not os.path.exists(self.metrics_file):
            return None
        try:
            with open(self.metrics_file, encoding="utf-8") as file:
                return dict(json.load(file))
        except (OSError, ValueError, TypeError):
            return None  # damaged: the run is resumed from its checkpoints and writes it again

    def remove_if_only_config(self) -> None:
        """Removes the run directory when it holds nothing but its config.json (and empty folders): what a run
        refused after writing its config leaves, so that nothing of it stays behind."""
        if not os.path.isdir(self.path):
            return
        for folder, _, files in os.walk(self.path):
            if any(os.path.join(folder, name) != self.config_file for name in files):
                return
        shutil.rmtree(self.path)

    def write_config(self, config: Config) -> None:
        os.makedirs(self.path, exist_ok=True)
        save_json(config, self.config_file)

    def write_json(self, values: dict, file_name: str) -> str:
        """Writes `file_name` here via a temporary file and a rename, so it is never half-written; returns its path."""
        os.makedirs(self.path, exist_ok=True)
        path = os.path.join(self.path, file_name)
        temporary = f"{path}.tmp"
        with open(temporary, "w", encoding="utf-8") as file:
            json.dump(values, file, indent=2, sort_keys=True)
            file.write("\n")
        os.replace(temporary, path)
        return path

    def write_memory_estimate(self, values: dict) -> str:
        return self.write_json(values, MEMORY_ESTIMATE_FILE)

    def write_failure(self, diagnosis: str) -> str:
        return self.write_json({"diagnosis": diagnosis}, FAILURE_FILE)

    def write_metrics(self, metrics: dict) -> str:
        written = self.write_json(metrics, METRICS_FILE)
        if os.path.exists(self.failure_file):
            os.remove(self.failure_file)  # the rerun with changed numerics finished
        return written


def as_run_directory(directory: str | RunDirectory) -> RunDirectory:
    """Accepts a path (library users) or a RunDirectory (tfmp's own code)."""
    return directory if isinstance(directory, RunDirectory) else RunDirectory(str(directory))


def check_before_run(config: Config, workdir: str | RunDirectory) -> tuple[Config, RunDirectory, dict | None]:
    """Every check of a run that needs no TensorFlow: the config, and what the workdir holds. The CLI
    runs it before TensorFlow loads and hands the result to `tfmp.training.run`, which runs it only
    when it was not given.

    Returns:
        `(the validated config, its run directory, the metrics of the finished run or None)`.

    Raises:
        UsageError: a bad config, or a workdir that cannot take this run.
    """
    for note in renamed_settings_given(config):
        logs.once(logger, logging.WARNING, note)
    config = validate(config)
    if config.sharding == "zero2" and config.gradient_accumulation_steps == 1:
        logs.once(logger, logging.WARNING, "--sharding=zero2 with --gradient_accumulation_steps=1: no gradient outlives a "
                  "step, so the step is zero1's (zero2 holds each replica's chunks of the accumulated gradients)")
    directory = as_run_directory(workdir)
    finished = None if config.dry_run else directory.finished_metrics(config)
    if finished is None:
        directory.check_writable()
    return config, directory, finished


class DamagedHistory(ValueError):
    """history.csv does not read as the file `tfmp.callbacks.HistoryCSV` writes; the message says why."""


def read_history(history_file: str) -> list[dict]:
    """The per-epoch logs `tfmp.callbacks.HistoryCSV` appended to `history_file` (history.csv), across resumptions.

    Raises:
        DamagedHistory: the file is not one HistoryCSV wrote (garbage, a cut row, no `epoch` column).
    """
    if not os.path.exists(history_file):
        return []
    try:
        with open(history_file, encoding="utf-8", newline="") as file:
            rows = list(csv.reader(file))
    except (OSError, UnicodeDecodeError, csv.Error) as error:
        raise DamagedHistory(f"does not read ({type(error).__name__})") from None
    if not rows:
        return []  # an empty file: what a crash before the first row leaves
    header, history = rows[0], []
    if not header or header[0] != "epoch" or len(set(header)) != len(header):
        raise DamagedHistory("its header is not epoch,<logged values>")
    for number, row in enumerate(rows[1:], start=2):
        if len(row) != len(header):
            raise DamagedHistory(f"line {number} has {len(row)} of {len(header)} columns")
        try:
            values = {key: float(value) for key, value in zip(header, row) if value not in ("", "NA")}
        except ValueError:
            raise DamagedHistory(f"line {number} holds a value that is not a number") from None
        if "epoch" not in values or values["epoch"] != int(values["epoch"]) or values["epoch"] < 0:
            raise DamagedHistory(f"line {number} has no epoch number")
        history.append(values)
    return history


def logged_history(history_file: str) -> list[dict]:
    """`read_history`, with a damaged file read as no history (it is derived; `HistoryCSV` sets it aside and rebuilds it)."""
    try:
        return read_history(history_file)
    except DamagedHistory:
        return []


def set_aside(path: str) -> str:
    """Moves a damaged derived file to `<path>.damaged` (or `.damaged-2`, ...), keeping it for inspection; returns where."""
    aside, number = f"{path}.damaged", 1
    while os.path.exists(aside):
        number += 1
        aside = f"{path}.damaged-{number}"
    os.replace(path, aside)
    return aside
