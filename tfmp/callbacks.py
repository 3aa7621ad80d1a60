"""Keras callbacks tfmp adds to `fit()`: checkpoints with resume, loss-scale telemetry.

`default_callbacks(workdir)` is the one-liner for library users; the CLI uses the same list.
"""

from __future__ import annotations

import csv
import logging
import math
import os
import time

import keras
import tensorflow as tf

from tfmp import precision

logger = logging.getLogger(__name__)


class Checkpointing(keras.callbacks.Callback):
    """Saves model, optimizer and epoch at every epoch end; resumes from the newest at train begin.

    Built on `tf.train.CheckpointManager` rather than Keras' `BackupAndRestore`: the
    manager keeps several checkpoints, writes each checkpoint's data before updating
    its index (so a crash mid-write leaves the previous one as the newest), and is what
    TF's preemption and multi-worker tooling builds on. Like `BackupAndRestore`, it
    tells `fit()` where to start by setting the model's initial epoch.

    Args:
        directory: where checkpoints go (`WORKDIR/checkpoints`).
        max_to_keep: how many checkpoints to keep.
    """

    def __init__(self, directory: str, max_to_keep: int = 3):
        super().__init__()
        self.directory = directory
        self.max_to_keep = max_to_keep
        self.restored_epoch = 0
        self._manager = None
        self._epoch = None

    def _ensure_manager(self) -> tf.train.CheckpointManager:
        if self._manager is None:
            model = self.model
            if model.optimizer is not None and not model.optimizer.built:
                with model.distribute_strategy.scope():
                    model.optimizer.build(model.trainable_variables)
            self._epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
            checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer, epoch=self._epoch)
            self._manager = tf.train.CheckpointManager(checkpoint, self.directory, max_to_keep=self.max_to_keep)
        return self._manager

    def restore(self) -> int:
        """Restores the newest checkpoint, if any; returns the number of epochs it had done."""
        manager = self._ensure_manager()
        if manager.latest_checkpoint is None:
            return 0
        manager.checkpoint.restore(manager.latest_checkpoint).assert_existing_objects_matched()
        self.restored_epoch = int(self._epoch.numpy())
        logger.info("resumed from %s (epoch %d)", manager.latest_checkpoint, self.restored_epoch)
        return self.restored_epoch

    def on_train_begin(self, logs=None):
        epoch = self.restore()
        if epoch:
            self.model._initial_epoch = epoch  # the hook Keras' own BackupAndRestore uses

    def on_epoch_end(self, epoch, logs=None):
        # Never let a diverged state replace the last good checkpoint.
        if logs and not math.isfinite(float(logs.get("loss", 0.0))):
            logger.warning("epoch %d ended with loss %s: checkpoint not saved", epoch + 1, logs["loss"])
            return
        self._epoch.assign(epoch + 1)
        self._manager.save(checkpoint_number=epoch + 1)


class Throughput(keras.callbacks.Callback):
    """Times the training batches of each epoch (validation excluded).

    `examples_per_second` leaves out the first epoch of a `fit()` when there are
    others, since it includes tracing and oneDNN's first-call setup.
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
        self._steps += 1
        self._end = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_seconds.append(self._end - self._start)
        self.epoch_steps.append(self._steps)

    @property
    def examples_per_second(self) -> float | None:
        first = 1 if len(self.epoch_seconds) > 1 else 0
        seconds = sum(self.epoch_seconds[first:])
        return self.global_batch_size * sum(self.epoch_steps[first:]) / seconds if seconds > 0 else None


class LossScaleMonitor(keras.callbacks.Callback):
    """Adds `loss_scale` and `skipped_steps` to the epoch logs (TensorBoard shows them)."""

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        scale = precision.current_loss_scale(self.model.optimizer)
        if scale is not None:
            logs["loss_scale"] = scale
        skipped = precision.skipped_steps(self.model.optimizer)
        if skipped is not None:
            logs["skipped_steps"] = skipped


HISTORY_FILE = "history.csv"


def logged_history(workdir: str) -> list[dict]:
    """The per-epoch logs `default_callbacks` appended to WORKDIR/history.csv, across resumptions."""
    path = os.path.join(workdir, HISTORY_FILE)
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8", newline="") as file:
        return [{key: float(value) for key, value in row.items() if value not in ("", "NA", None)} for row in csv.DictReader(file)]


def default_callbacks(workdir: str, *, max_to_keep: int = 3, monitors=()) -> list[keras.callbacks.Callback]:
    """Checkpoints with resume, stop on NaN, telemetry, then the loggers (history.csv, TensorBoard).

    Telemetry (loss scale, and `monitors` such as a kNN monitor) comes before the
    loggers so its values are in the logs they write.
    """
    os.makedirs(workdir, exist_ok=True)
    return [
        Checkpointing(os.path.join(workdir, "checkpoints"), max_to_keep=max_to_keep),
        keras.callbacks.TerminateOnNaN(),
        LossScaleMonitor(),
        *monitors,
        keras.callbacks.CSVLogger(os.path.join(workdir, HISTORY_FILE), append=True),
        keras.callbacks.TensorBoard(os.path.join(workdir, "tensorboard"), write_graph=False),
    ]
