"""What a run reports besides its losses: throughput, the loss scale of the optimizers that step,
and the per-epoch history tfmp appends to `history.csv`."""

from __future__ import annotations

import csv
import logging
import os
import time

import keras

from tfmp import precision
from tfmp.callbacks.model_state import optimizer_steps, owned_optimizers
from tfmp.run_directory import DamagedHistory, read_history, set_aside

logger = logging.getLogger(__name__)


class Throughput(keras.callbacks.Callback):
    """Times the training batches of each epoch (validation excluded).

    `examples_per_second` leaves out the first epoch of a `fit()` when there are others, since
    it includes tracing and oneDNN's first-call setup.
    """

    def __init__(self, global_batch_size: int):
        super().__init__()
        self.global_batch_size = global_batch_size
        self.epoch_seconds: list[float] = []
        self.epoch_steps: list[int] = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()
        self._steps = 0
        self._end = self._start

    def on_train_batch_end(self, batch, logs=None):
        self._steps = batch + 1  # the epoch's last finished step, also with steps_per_execution > 1
        self._end = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_seconds.append(self._end - self._start)
        self.epoch_steps.append(self._steps)

    @property
    def examples_per_second(self) -> float | None:
        first = 1 if len(self.epoch_seconds) > 1 else 0
        seconds = sum(self.epoch_seconds[first:])
        return self.global_batch_size * sum(self.epoch_steps[first:]) / seconds if seconds > 0 else None


class HistoryCSV(keras.callbacks.Callback):
    """Appends one row per epoch to `history.csv`: the columns the task really logs.

    Keras' `CSVLogger` adds a `val_` twin of every column even to a fit without validation data
    (four always-NA columns in a pretraining run's history). Here the columns are the first
    epoch's keys, plus their `val_` twins only when the fit validates (`validation=True`; the
    baseline validates at its last epoch only). Appending to an existing file keeps its header,
    so a resumed run's rows line up with the first run's.

    At the end of training, the `History` that `fit()` returns gets the epochs earlier runs logged
    in front of this one's: a resumed run (or a rerun with nothing left to train, which would
    return an empty `History`) hands back the whole run's history, as code reading it expects.
    """

    def __init__(self, path: str, validation: bool = False, tensorboard_directory: str | None = None):
        super().__init__()
        self.path, self.validation, self.tensorboard_directory = path, validation, tensorboard_directory
        self._earlier: list[dict] = []

    def on_train_begin(self, logs=None):
        try:
            self._earlier = read_history(self.path)
        except DamagedHistory as damage:
            # Derived from the run, not its truth (the checkpoints are): set aside, and rebuilt from the epochs
            # TensorBoard logged, so a resumed run's History and metrics still see the earlier epochs.
            aside = set_aside(self.path)
            self._earlier = history_from_tensorboard(self.tensorboard_directory) if self.tensorboard_directory else []
            if self._earlier:
                _write_rows(self.path, self._earlier)
            logger.warning("%s is damaged (%s): moved to %s and %s", self.path, damage, os.path.basename(aside),
                           f"rebuilt from TensorBoard's logs ({len(self._earlier)} epochs)" if self._earlier
                           else "started afresh (no TensorBoard logs to rebuild it from)")

    def on_train_end(self, logs=None):
        history = getattr(self.model, "history", None)
        if not self._earlier or not isinstance(history, keras.callbacks.History):
            return
        earlier = [row for row in self._earlier if int(row.get("epoch", -1)) not in set(getattr(history, "epoch", []))]
        current = history.history
        keys = list(dict.fromkeys([*current, *(key for row in earlier for key in row if key != "epoch")]))
        history.history = {key: [row.get(key) for row in earlier] + list(current.get(key, [None] * len(history.epoch)))
                           for key in keys}
        history.epoch = [int(row["epoch"]) for row in earlier] + list(getattr(history, "epoch", []))

    def on_epoch_end(self, epoch, logs=None):
        logs = dict(logs or {})
        exists = os.path.exists(self.path) and os.path.getsize(self.path) > 0
        if exists:
            with open(self.path, encoding="utf-8", newline="") as file:
                columns = next(csv.reader(file), [])[1:]
        else:
            columns = sorted(logs)
            if self.validation:
                columns += [f"val_{key}" for key in columns if not key.startswith("val_") and f"val_{key}" not in columns]
        with open(self.path, "a", encoding="utf-8", newline="") as file:
            writer = csv.writer(file)
            if not exists:
                writer.writerow(["epoch", *columns])
            writer.writerow([epoch, *(_csv_value(logs.get(key)) for key in columns)])


class LossScaleMonitor(keras.callbacks.Callback):
    """Adds `loss_scale` and `skipped_steps` to the epoch logs (TensorBoard and history.csv show them).

    Reports the loss-scaling optimizers the model actually stepped this epoch — not the one
    `compile()` made when a custom `train_step` uses optimizers of its own. With one such
    optimizer the keys are `loss_scale` / `skipped_steps`; with several, `<name>_loss_scale` /
    `<name>_skipped_steps` each. Under mixed_float16 with no loss-scaling optimizer at all it
    says so once at train begin: fp16 gradients then underflow silently.
    """

    runs_before = (HistoryCSV, keras.callbacks.TensorBoard)  # they write the logs it adds to

    def on_train_begin(self, logs=None):
        self._optimizers = owned_optimizers(self.model)
        self._activity = {name: _activity(optimizer) for name, optimizer in self._optimizers.items()}
        scaling = [name for name, optimizer in self._optimizers.items() if precision.current_loss_scale(optimizer) is not None]
        if precision.global_policy_name() == precision.MIXED_FLOAT16 and not scaling:
            logger.warning("LossScaleMonitor: mixed_float16, but none of %s's optimizers (%s) scales the loss; wrap them with "
                           "tfmp.precision.wrap_optimizer or fp16 gradients may underflow to zero", self.model.name,
                           ", ".join(self._optimizers) or "none")

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        stepped = {}
        for name, optimizer in self._optimizers.items():
            activity = _activity(optimizer)
            if activity != self._activity[name] and precision.current_loss_scale(optimizer) is not None:
                stepped[name] = optimizer
            self._activity[name] = activity
        for name, optimizer in stepped.items():
            prefix = "" if len(stepped) == 1 else f"{name}_"
            logs[f"{prefix}loss_scale"] = precision.current_loss_scale(optimizer)
            logs[f"{prefix}skipped_steps"] = precision.skipped_steps(optimizer)


def _activity(optimizer) -> tuple[int, int]:
    """(updates applied, steps skipped): a loss-scaling optimizer that skipped every step still stepped."""
    return optimizer_steps(optimizer), precision.skipped_steps(optimizer) or 0


def _write_rows(path: str, rows: list[dict]) -> None:
    columns = list(dict.fromkeys(key for row in rows for key in row if key != "epoch"))
    with open(path, "w", encoding="utf-8", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["epoch", *columns])
        for row in rows:
            writer.writerow([int(row["epoch"]), *(_csv_value(row.get(key)) for key in columns)])


# What Keras' TensorBoard callback writes beside the logs it is given.
TENSORBOARD_ONLY_TAGS = ("learning_rate",)


def history_from_tensorboard(directory: str) -> list[dict]:
    """The per-epoch logs Keras' TensorBoard callback wrote under `directory` (`train/`, `validation/`: `epoch_<name>`
    scalars by epoch), as history.csv rows; the last value written for an epoch wins (a resumed run writes it again)."""
    import tensorflow as tf

    rows: dict[int, dict] = {}
    for run, prefix in (("train", ""), ("validation", "val_")):
        for path in sorted(tf.io.gfile.glob(os.path.join(directory, run, "events.out.tfevents.*"))):
            try:
                for record in tf.data.TFRecordDataset(path):
                    event = tf.compat.v1.Event.FromString(record.numpy())
                    for value in event.summary.value:
                        name = value.tag.removeprefix("epoch_")
                        if not value.tag.startswith("epoch_") or name in TENSORBOARD_ONLY_TAGS:
                            continue
                        number = float(tf.make_ndarray(value.tensor)) if value.HasField("tensor") else value.simple_value
                        rows.setdefault(int(event.step), {"epoch": float(event.step)})[prefix + name] = number
            except tf.errors.OpError:
                continue  # a cut event file: what it held before the cut was read
    return [rows[epoch] for epoch in sorted(rows)]


def _csv_value(value) -> str:
    if value is None:
        return "NA"
    try:
        return repr(float(value))
    except (TypeError, ValueError):
        return str(value)
