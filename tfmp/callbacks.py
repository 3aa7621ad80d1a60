"""Keras callbacks tfmp adds to `fit()`: NaN guard, checkpoints with resume, loss-scale telemetry.

`default_callbacks(workdir)` is the one-liner for library users; the CLI uses the same list.
"""

from __future__ import annotations

import csv
import logging
import math
import os
import signal
import threading
import time

import keras
import numpy as np
import tensorflow as tf

from tfmp import distribute, keras_internals, precision

logger = logging.getLogger(__name__)


class Checkpointing(keras.callbacks.Callback):
    """Saves model, optimizer and progress; resumes from the newest checkpoint at train begin.

    Saves at every epoch end and, with `every_steps`, every that many optimizer steps.
    Built on `tf.train.CheckpointManager` rather than Keras' `BackupAndRestore`: the
    manager keeps several checkpoints, writes each checkpoint's data before updating
    its index (so a crash mid-write leaves the previous one as the newest), and is what
    TF's preemption and multi-worker tooling builds on. Like `BackupAndRestore`, it
    tells `fit()` where to start by setting the model's initial epoch; a checkpoint
    taken mid-epoch resumes at the start of that epoch, with the optimizer's step
    count (and so the learning-rate schedule) where it was. A state whose loss or
    weights are not finite is never saved, so the newest checkpoint is always the
    last good one.

    Checkpoints are numbered by optimizer step: `ckpt-<step>`.

    Args:
        directory: where checkpoints go (`WORKDIR/checkpoints`) and are resumed from.
        max_to_keep: how many checkpoints to keep.
        every_steps: also save every this many optimizer steps (0: epoch ends only).
        save_directory: write here instead (non-chief workers: every worker must take
            part in saving, but only the chief's copy is kept).
    """

    def __init__(self, directory: str, max_to_keep: int = 3, every_steps: int = 0, save_directory: str | None = None):
        super().__init__()
        self.directory = directory
        self.save_directory = save_directory or directory
        self.max_to_keep = max_to_keep
        self.every_steps = every_steps
        self.restored_epoch = 0
        self.restored_step = 0
        self.nonfinite_state_step: int | None = None
        self._manager = None
        self._epoch = None
        self._current_epoch = 0

    def _ensure_manager(self) -> tf.train.CheckpointManager:
        if self._manager is None:
            model = self.model
            if model.optimizer is not None and not model.optimizer.built:
                with model.distribute_strategy.scope():
                    model.optimizer.build(model.trainable_variables)
            # Epochs completed when the checkpoint was taken.
            self._epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
            checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer, epoch=self._epoch)
            self._manager = tf.train.CheckpointManager(checkpoint, self.directory, max_to_keep=self.max_to_keep)
            self._save_manager = self._manager if self.save_directory == self.directory else \
                tf.train.CheckpointManager(checkpoint, self.save_directory, max_to_keep=1)
        return self._manager

    @staticmethod
    def readable(path: str) -> bool:
        """Whether every tensor of the checkpoint at `path` can be read (a crash or a full disk
        can leave a truncated data file behind an intact index)."""
        try:
            reader = tf.train.load_checkpoint(path)
            for name in reader.get_variable_to_shape_map():
                reader.get_tensor(name)
        except Exception:  # noqa: BLE001 — a damaged file fails in many ways (OpError, IndexError, ...)
            return False
        return True

    @property
    def usable(self) -> str | None:
        """The newest checkpoint that reads completely, or None."""
        for path in reversed(self._ensure_manager().checkpoints):
            if self.readable(path):
                return path
            logger.warning("checkpoint %s is corrupted or truncated; trying the one before it", path)
        return None

    def restore(self) -> int:
        """Restores the newest complete checkpoint, if any; returns the number of epochs it had completed.

        A checkpoint that does not read completely is skipped before any variable is
        touched; if none is usable, training starts over, with a warning.
        """
        manager = self._ensure_manager()
        if not manager.checkpoints:
            return 0
        path = self.usable
        if path is None:
            logger.warning("no usable checkpoint in %s: starting over", self.directory)
            return 0
        manager.checkpoint.restore(path).assert_existing_objects_matched()
        self.restored_epoch = int(self._epoch.numpy())
        self.restored_step = int(self.model.optimizer.iterations.numpy())
        logger.info("restored %s (epoch %d, step %d)", path, self.restored_epoch, self.restored_step)
        return self.restored_epoch

    def _save(self, completed_epochs: int, logs) -> None:
        # A step's loss is computed before its update: the weights can be non-finite
        # while the logged loss is not, so both are checked.
        state = [*self.model.weights, *self.model.optimizer.variables]  # BN statistics and momenta diverge too
        finite_weights = all(np.isfinite(variable.numpy()).all() for variable in state if "float" in str(variable.dtype))
        if not finite_weights or (logs and not math.isfinite(float(logs.get("loss", 0.0)))):
            logger.warning("non-finite %s: checkpoint not saved (the last good one stays the newest)",
                           "weights" if not finite_weights else f"loss {logs['loss']}")
            if not finite_weights:
                self.nonfinite_state_step = int(self.model.optimizer.iterations.numpy())
            return
        self._epoch.assign(completed_epochs)
        self._save_manager.save(checkpoint_number=int(self.model.optimizer.iterations.numpy()))

    def take_nonfinite_state_step(self) -> int | None:
        """The step at which a save was refused for non-finite weights since the last call, if any.

        With BatchNorm, a diverged model can keep a finite (huge) loss while its weights
        or statistics are already inf/NaN; `NaNGuard` treats this as divergence too."""
        step, self.nonfinite_state_step = self.nonfinite_state_step, None
        return step

    def save_now(self, logs=None) -> bool:
        """Saves the current step (mid-epoch); returns whether it was saved (finite state)."""
        before = self._save_manager.latest_checkpoint
        self._save(self._current_epoch, logs)
        return self._save_manager.latest_checkpoint != before

    def on_train_begin(self, logs=None):
        epoch = self.restore()
        if epoch:
            keras_internals.set_initial_epoch(self.model, epoch)

    def on_epoch_begin(self, epoch, logs=None):
        self._current_epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.every_steps and int(self.model.optimizer.iterations.numpy()) % self.every_steps == 0:
            self._save(self._current_epoch, logs)

    def on_epoch_end(self, epoch, logs=None):
        self._save(epoch + 1, logs)


class NaNGuard(keras.callbacks.Callback):
    """Catches divergence: restores the last good checkpoint and retries, then stops with a diagnosis.

    Triggers on a non-finite loss, on a finite one `explosion_factor` times the best
    finished epoch's (divergence that has not reached inf yet; Keras' per-batch `loss` is
    the epoch's running mean, so one noisy batch does not trigger it), on non-finite
    weights or statistics found when a checkpoint is due (a BatchNorm model can diverge
    with a huge but finite loss), or on more than `max_consecutive_skips` steps in a row
    skipped by fp16 loss scaling (the scale cannot find a working value). Each
    trigger restores the newest checkpoint (which `Checkpointing` guarantees is
    finite) and goes on, up to `max_retries` times, as Model Garden's recovery does;
    then training stops and `diagnosis` names the likely cause. The CLI turns a
    diagnosis into exit code 1.

    Args:
        checkpointing: the run's `Checkpointing` callback.
        max_retries: restores before giving up.
        max_consecutive_skips: fp16 steps skipped in a row that count as a failure.
        explosion_factor: loss / best epoch loss that counts as divergence (0: off).
    """

    def __init__(self, checkpointing: Checkpointing, max_retries: int = 2, max_consecutive_skips: int = 20,
                 explosion_factor: float = 1000.0):
        super().__init__()
        self.checkpointing = checkpointing
        self.max_retries = max_retries
        self.max_consecutive_skips = max_consecutive_skips
        self.explosion_factor = explosion_factor
        self._best_epoch_loss: float | None = None  # of this process's epochs; a resumed run starts afresh
        self.retries = 0
        self.events: list[str] = []
        self.diagnosis: str | None = None
        self._skip_streak = 0
        self._skipped = 0

    def on_train_begin(self, logs=None):
        self._skipped = precision.skipped_steps(self.model.optimizer) or 0

    def on_train_batch_end(self, batch, logs=None):
        loss = float((logs or {}).get("loss", 0.0))
        skipped = precision.skipped_steps(self.model.optimizer)
        if skipped is not None:
            self._skip_streak = self._skip_streak + 1 if skipped > self._skipped else 0
            self._skipped = skipped
        nonfinite_state_step = self.checkpointing.take_nonfinite_state_step()
        if not math.isfinite(loss):
            self._recover(f"step {self._step()}: loss {loss}")
        elif nonfinite_state_step is not None:
            self._recover(f"step {nonfinite_state_step}: non-finite weights (loss {loss:.3g})")
        elif self._exploded(loss):
            self._recover(f"step {self._step()}: loss {loss:.3g}, {loss / self._best_epoch_loss:.3g}x the best epoch's "
                          f"{self._best_epoch_loss:.3g}")
        elif self._skip_streak > self.max_consecutive_skips:
            self._recover(f"step {self._step()}: {self._skip_streak} fp16 steps skipped in a row")

    def _exploded(self, loss: float) -> bool:
        return bool(self.explosion_factor and self._best_epoch_loss and loss > self.explosion_factor * self._best_epoch_loss)

    def _step(self) -> int:
        # Read from the device only when there is something to report, not every step.
        return int(self.model.optimizer.iterations.numpy())

    # The guard runs before Checkpointing (default_callbacks), so a save refused for
    # non-finite weights is seen at the next batch end, epoch end or, after the last
    # epoch's save, at the end of training, where no retry is left: the run fails.
    def on_epoch_end(self, epoch, logs=None):
        nonfinite_state_step = self.checkpointing.take_nonfinite_state_step()
        if nonfinite_state_step is not None and not self.model.stop_training:
            self._recover(f"step {nonfinite_state_step}: non-finite weights in epoch {epoch + 1}")
        loss = float((logs or {}).get("loss", math.nan))
        if math.isfinite(loss) and loss > 0 and not self.model.stop_training and not self._exploded(loss):
            self._best_epoch_loss = min(loss, self._best_epoch_loss or math.inf)

    def on_train_end(self, logs=None):
        nonfinite_state_step = self.checkpointing.take_nonfinite_state_step()
        if nonfinite_state_step is not None and self.diagnosis is None:
            self._fail(f"step {nonfinite_state_step}: non-finite weights at the end of training")

    def _recover(self, event: str) -> None:
        """Restores the last good checkpoint, or stops with a diagnosis when retries are used up."""
        if self.retries < self.max_retries and self.checkpointing.usable:
            self.events.append(event)
            self.retries += 1
            self.checkpointing.restore()
            self.model.reset_metrics()
            self._skip_streak = 0
            logger.warning("%s; restored the last good checkpoint (retry %d of %d)", event, self.retries, self.max_retries)
            return
        self._fail(event)

    def _fail(self, event: str) -> None:
        self.events.append(event)
        self.diagnosis = self.diagnose()
        logger.error("%s", self.diagnosis)
        self.model.stop_training = True

    def diagnose(self) -> str:
        """One paragraph: what happened, the likely cause, what to change."""
        policy = precision.global_policy_name()
        optimizer = self.model.optimizer
        learning_rate = float(keras.ops.convert_to_numpy(optimizer.learning_rate))
        scale = precision.current_loss_scale(optimizer)
        what = f"training diverged ({'; '.join(self.events)}) after {self.retries} restore(s) of the last good checkpoint"
        if policy == precision.MIXED_FLOAT16:
            cause = (f"likely fp16 overflow (loss scale now {scale:g}, {precision.skipped_steps(optimizer)} steps skipped): use "
                     "--precision=mixed_bfloat16 (float32's range) where the hardware has it, keep overflowing layers in "
                     "float32 (see `python -m tfmp.doctor`), or lower --learning_rate")
        else:
            cause = (f"under {policy} this is not a precision problem but divergence: lower --learning_rate "
                     f"(now {learning_rate:.3g}) or lengthen --warmup_epochs")
        latest = self.checkpointing.usable
        where = f"the last good checkpoint is {latest}" if latest else "no good checkpoint was written before it"
        return f"{what}; {cause}; {where}"


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


class Preempted(RuntimeError):
    """SIGTERM arrived during training; the current step was checkpointed."""


class PreemptionCheckpoint(keras.callbacks.Callback):
    """On SIGTERM (the preemption notice of TPU VMs, spot GPUs, Kubernetes), saves a
    checkpoint of the current step at the next step end and stops with `Preempted`.

    The handler only sets a flag, so the step in flight finishes cleanly; rerunning the
    same command resumes from that checkpoint. Installed for the duration of `fit()`
    (when `fit()` runs in the main thread), the previous handler restored afterwards.
    Single-process runs only: multi-worker runs need every worker to save at the same
    step, which is what TF's `PreemptionCheckpointHandler` coordinates (not wired in yet).
    """

    def __init__(self, checkpointing: Checkpointing):
        super().__init__()
        self.checkpointing = checkpointing
        self.requested = False
        self._previous = None

    def _request(self, signum, frame):
        self.requested = True

    def _uninstall(self):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def on_train_begin(self, logs=None):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._request)

    def on_train_batch_end(self, batch, logs=None):
        if not self.requested:
            return
        self._uninstall()
        saved = self.checkpointing.save_now(logs)
        step = int(self.model.optimizer.iterations.numpy())
        raise Preempted(f"SIGTERM at step {step}: " + ("checkpoint saved" if saved else "state not finite, last good checkpoint kept")
                        + "; rerun the same command to resume")

    def on_train_end(self, logs=None):
        self._uninstall()


class ReplicaDivergenceError(RuntimeError):
    """Per-replica copies of some variables differ; the message names them."""


class ReplicaConsistencyCheck(keras.callbacks.Callback):
    """Every `every_steps` steps (and at each epoch end), checks that all replicas hold the
    same variables (`tfmp.distribute.check_replica_consistency`) and stops training with
    `ReplicaDivergenceError` naming the ones that do not. Does nothing on one replica."""

    def __init__(self, every_steps: int = 100, atol: float = 0.0):
        super().__init__()
        self.every_steps = every_steps
        self.atol = atol
        self._active = False

    def on_train_begin(self, logs=None):
        self._active = self.model.distribute_strategy.num_replicas_in_sync > 1

    def _check(self):
        if self.model.distribute_strategy.num_replicas_in_sync < 2:
            return
        differing = distribute.check_replica_consistency(self.model, self.atol)
        if differing:
            step = int(self.model.optimizer.iterations.numpy())
            raise ReplicaDivergenceError(f"replicas disagree at step {step} on {len(differing)} variable(s): {', '.join(differing)}")

    def on_train_batch_end(self, batch, logs=None):
        # Checked first so one-replica runs never read the step counter back to the host.
        if self._active and self.every_steps and int(self.model.optimizer.iterations.numpy()) % self.every_steps == 0:
            self._check()

    def on_epoch_end(self, epoch, logs=None):
        self._check()


HISTORY_FILE = "history.csv"


def logged_history(workdir: str) -> list[dict]:
    """The per-epoch logs `default_callbacks` appended to WORKDIR/history.csv, across resumptions."""
    path = os.path.join(workdir, HISTORY_FILE)
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8", newline="") as file:
        return [{key: float(value) for key, value in row.items() if value not in ("", "NA", None)} for row in csv.DictReader(file)]


def default_callbacks(workdir: str, *, max_to_keep: int = 3, checkpoint_every_steps: int = 0, nan_retries: int = 2,
                      max_consecutive_skips: int = 20, loss_explosion_factor: float = 1000.0, replica_check_every_steps: int = 100,
                      monitors=(), write_dir: str | None = None) -> list[keras.callbacks.Callback]:
    """Guards (NaN, replica consistency), checkpoints with resume, telemetry, then the loggers.

    The guards run before the checkpoint so that a state they reject is not saved;
    telemetry (loss scale, and `monitors` such as a kNN monitor) comes before the
    loggers (history.csv, TensorBoard) so its values are in the logs they write.

    Args:
        workdir: where checkpoints are resumed from (and, by default, everything is written).
        write_dir: where checkpoints and logs are written instead: a non-chief worker of a
            multi-worker run resumes from the chief's checkpoints but writes to scratch.
    """
    write_dir = write_dir or workdir
    os.makedirs(write_dir, exist_ok=True)
    checkpointing = Checkpointing(os.path.join(workdir, "checkpoints"), max_to_keep=max_to_keep, every_steps=checkpoint_every_steps,
                                  save_directory=os.path.join(write_dir, "checkpoints"))
    return [
        NaNGuard(checkpointing, max_retries=nan_retries, max_consecutive_skips=max_consecutive_skips,
                 explosion_factor=loss_explosion_factor),
        ReplicaConsistencyCheck(every_steps=replica_check_every_steps),
        checkpointing,
        PreemptionCheckpoint(checkpointing),
        LossScaleMonitor(),
        *monitors,
        keras.callbacks.CSVLogger(os.path.join(write_dir, HISTORY_FILE), append=True),
        keras.callbacks.TensorBoard(os.path.join(write_dir, "tensorboard"), write_graph=False),
    ]

