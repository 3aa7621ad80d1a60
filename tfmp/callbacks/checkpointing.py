"""Checkpoints with resume that survives damaged files, and the checkpoint taken on SIGTERM.

Built on `tf.train.Checkpoint` / `CheckpointManager` rather than Keras' `BackupAndRestore`: the
manager keeps several checkpoints, writes each checkpoint's data before its index (a crash
mid-write leaves the previous one as the newest), and is what TF's preemption and multi-worker
tooling builds on.

Checkpoints are found from their index files (`ckpt-<step>.index`), not from the `checkpoint`
state file, which a crash or a bad disk can leave unreadable; each is read completely before
anything is restored, so a damaged one is skipped whole and never restored in part.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
import time

import keras
import tensorflow as tf

from tfmp import keras_internals
from tfmp.callbacks.model_state import first_non_finite, logged_losses, owned_optimizers
from tfmp.config import UsageError

logger = logging.getLogger(__name__)

PREFIX = "ckpt"
STATE_FILE = "checkpoint"  # tf.train's name for the file listing a directory's checkpoints
_INDEX = re.compile(rf"^{PREFIX}-(\d+)\.index$")


class StepCounter(keras.callbacks.Callback):
    """Training steps this run has taken, across resumptions (the number checkpoints carry).

    Counted from the batch indices `fit()` passes to callbacks, which also counts right with
    `steps_per_execution > 1`, rather than read from `model.optimizer.iterations`: a model whose
    `train_step` steps its own optimizers leaves that one at 0.
    """

    def __init__(self):
        super().__init__()
        self.step = 0
        self.previous_step = 0  # the count before the last batch end: steps_per_execution steps ago
        self._epoch_start = 0
        self._batch = -1

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_start = self.step
        self._batch = -1

    def on_train_batch_end(self, batch, logs=None):
        self._batch = batch
        self.previous_step, self.step = self.step, self._epoch_start + batch + 1

    def crossed(self, every: int) -> bool:
        """Whether the last batch end passed a multiple of `every` steps (0: never). With
        `steps_per_execution > 1` callbacks see one batch end per execution, so "step % every == 0"
        would miss most multiples."""
        return bool(every) and self.step // every > self.previous_step // every

    def rewind(self, step: int) -> None:
        """Sets the count to `step` (a restored checkpoint's) at the current batch: the next batch is step + 1."""
        self.step = self.previous_step = step
        self._epoch_start = step - self._batch - 1


def find_checkpoints(directory: str) -> list[tuple[int, str]]:
    """(step, path prefix) of every checkpoint whose index file is in `directory`, oldest first."""
    if not os.path.isdir(directory):
        return []
    found = [(int(match.group(1)), os.path.join(directory, f"{PREFIX}-{match.group(1)}"))
             for match in map(_INDEX.match, os.listdir(directory)) if match]
    return sorted(found)


def unreadable_reason(path: str) -> str | None:
    """Why the checkpoint at `path` cannot be read completely, or None when every tensor reads.

    A crash, a full disk or a bad copy can leave a truncated data file behind an intact index,
    a garbage index, an empty file or a missing shard; each fails in its own way."""
    try:
        reader = tf.train.load_checkpoint(path)
        for name in reader.get_variable_to_shape_map():
            reader.get_tensor(name)
    except Exception as error:  # noqa: BLE001 — OpError, IndexError, DataLossError, ...
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return f"{type(error).__name__}: {first_line}"[:160]
    return None


def _state_file_readable(directory: str) -> bool:
    try:
        tf.train.get_checkpoint_state(directory)
    except Exception:  # noqa: BLE001 — garbage bytes raise UnicodeDecodeError or a text-proto ParseError
        return False
    return True


class Checkpointing(keras.callbacks.Callback):
    """Saves the model, every optimizer it owns, the step and the epoch; resumes at train begin.

    Saves at epoch ends and, with `checkpoint_every_steps`, every that many steps, as
    `ckpt-<step>`. With `checkpoint_every_seconds`, an epoch end saves only once that many
    seconds have passed since the last save; the first epoch end of a `fit()` always saves (the
    NaN guard's restore point), and so does the last (or, at the end of training, the epoch after
    which another callback stopped it). On a small data set an epoch takes well under a second
    and a save tens of milliseconds: the digits SimCLR preset spent ~4 s of its 50 s pretraining
    saving 100 epochs. Under MultiWorkerMirroredStrategy every epoch end saves: the workers save
    together, and their clocks would not agree on when.

    Like `BackupAndRestore`, it tells `fit()` where to start by setting the model's initial epoch; a checkpoint taken mid-epoch resumes at the start of that epoch,
    with the optimizers' step counts (and so the learning-rate schedules) where they were.
    A state whose losses, weights or optimizer slots are not finite is never saved, so the
    newest checkpoint is always the last good one.

    Works for models built lazily (a `Sequential` without `keras.Input`, a subclassed model):
    nothing is built here; such a model is restored at the end of its first step, once Keras
    has created its variables, and that step's update is overwritten (see `on_train_begin`).

    At resume, damaged checkpoints are skipped with one warning naming them; when checkpoint
    files exist but none reads completely, it raises `UsageError` (the CLI's exit 2) rather
    than silently start over and lose the run's state.

    Args:
        directory: where checkpoints are resumed from (`WORKDIR/checkpoints`).
        keep_checkpoints: how many checkpoints to keep.
        checkpoint_every_steps: also save every this many steps (0: epoch ends only).
        checkpoint_every_seconds: at epoch ends, save once this many seconds have passed since the
            last save (0: at every epoch end).
        save_directory: write here instead (non-chief workers: every worker must take part in
            saving, but only the chief's copy is kept).
        counter: the run's `StepCounter` (one is made and driven here when not given).
    """

    def __init__(self, directory: str, keep_checkpoints: int = 3, checkpoint_every_steps: int = 0,
                 checkpoint_every_seconds: float = 0.0, save_directory: str | None = None, counter: StepCounter | None = None):
        super().__init__()
        self.directory = directory
        self.save_directory = save_directory or directory
        self.keep_checkpoints = keep_checkpoints
        self.checkpoint_every_steps = checkpoint_every_steps
        self.checkpoint_every_seconds = checkpoint_every_seconds
        self._last_save = time.monotonic()
        self._finite_check = None  # (the variables it reads, a traced all-finite reduction over them)
        self._unsaved_epochs: int | None = None  # epochs completed at the newest epoch end not saved
        self._every_epoch_end = not checkpoint_every_seconds
        self._saved_epoch_end = False  # in this fit()
        self._owns_counter = counter is None
        self.counter = counter or StepCounter()
        self.restored_epoch = 0
        self.restored_step = 0
        self.restored_path: str | None = None
        self.nonfinite_state_step: int | None = None
        self._checkpoint = None
        self._manager = None
        self._optimizers: dict = {}
        self._current_epoch = 0

    @property
    def step(self) -> int:
        return self.counter.step

    @property
    def optimizers(self) -> dict:
        """The optimizers checkpointed: every one the model owns, by attribute name."""
        self._tracked()
        return self._optimizers

    def set_model(self, model):
        super().set_model(model)
        if self._owns_counter:
            self.counter.set_model(model)

    def _tracked(self) -> tf.train.Checkpoint:
        if self._checkpoint is None:
            self._optimizers = owned_optimizers(self.model)
            self._epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")  # epochs completed
            self._step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
            self._checkpoint = tf.train.Checkpoint(model=self.model, optimizers=dict(self._optimizers), epoch=self._epoch,
                                                   step=self._step)
        return self._checkpoint

    def _save_manager(self) -> tf.train.CheckpointManager:
        if self._manager is None:
            if self.save_directory == self.directory:
                self._set_aside_unreadable_state_file()
            self._manager = tf.train.CheckpointManager(self._tracked(), self.save_directory,
                                                       max_to_keep=self.keep_checkpoints if self.save_directory == self.directory else 1,
                                                       checkpoint_name=PREFIX)
        return self._manager

    def _set_aside_unreadable_state_file(self) -> None:
        """An unreadable `checkpoint` state file would stop `CheckpointManager`; it is moved to
        `checkpoint.unreadable` (kept for inspection) and rewritten from the index files found."""
        state = os.path.join(self.directory, STATE_FILE)
        if not os.path.exists(state) or _state_file_readable(self.directory):
            return
        os.replace(state, f"{state}.unreadable")
        found = [path for _, path in find_checkpoints(self.directory)]
        if found:
            tf.compat.v1.train.update_checkpoint_state(self.directory, found[-1], all_model_checkpoint_paths=found)
        logger.warning("checkpoint state file %s was unreadable: moved to %s.unreadable and rebuilt from %d index file(s)",
                       state, STATE_FILE, len(found))

    def newest_readable(self) -> tuple[str | None, list[str]]:
        """The newest checkpoint that reads completely (or None), and the newer ones skipped, with why."""
        skipped = []
        for _, path in reversed(find_checkpoints(self.directory)):
            reason = unreadable_reason(path)
            if reason is None:
                return path, skipped
            skipped.append(f"{os.path.basename(path)} ({reason})")
        return None, skipped

    @property
    def usable(self) -> str | None:
        """The newest checkpoint that reads completely, or None."""
        return self.newest_readable()[0]

    def _choose(self, at_start: bool) -> str | None:
        """The checkpoint to restore (newest complete one), warning about the damaged ones skipped."""
        self._tracked()
        path, skipped = self.newest_readable()
        if skipped:
            logger.warning("checkpoints in %s: skipped %s; %s", self.directory, "; ".join(skipped),
                           f"resuming from {os.path.basename(path)}" if path else "none is readable")
        if path is None and skipped and at_start:
            raise UsageError(f"checkpoints in {self.directory}: none restores completely ({'; '.join(skipped)}); "
                             f"to start over from step 0 move that folder aside, or put back a good copy, then rerun")
        return path

    def restore(self, at_start: bool = False) -> int:
        """Restores the newest complete checkpoint, if any; returns the number of epochs it had completed.

        Raises:
            UsageError: at the start of training, checkpoint files exist but none reads completely.
        """
        path = self._choose(at_start)
        return self._load(path) if path else 0

    def _load(self, path: str) -> int:
        # Objects that exist are filled now; optimizer variables not created yet are filled by
        # tf.train when Keras creates them (the model itself is built: see on_train_begin).
        self._checkpoint.restore(path).assert_existing_objects_matched()
        self.restored_path = path
        self.restored_epoch = int(self._epoch.numpy())
        self.restored_step = int(self._step.numpy())
        self.counter.rewind(self.restored_step)
        logger.info("restored %s (epoch %d, step %d)", path, self.restored_epoch, self.restored_step)
        return self.restored_epoch

    def _nonfinite_state(self, logs) -> str | None:
        # A step's loss is computed before its update: the weights can be non-finite while the
        # logged loss is not, so both are checked (BN statistics and optimizer slots diverge too).
        state = [*self.model.weights, *(variable for optimizer in self._optimizers.values() if optimizer.built
                                         for variable in optimizer.variables)]
        if not self._all_finite([variable for variable in state if "float" in str(variable.dtype)]):
            self.nonfinite_state_step = self.step
            return "weights"
        losses = logged_losses(logs)
        bad = first_non_finite(losses)
        return f"{bad} {losses[bad]}" if bad else None

    def _all_finite(self, variables) -> bool:
        # One traced reduction, not a host copy of every variable (~9 ms an epoch for the digits
        # SimCLR model); traced again only when the variables change (an optimizer built later).
        key = [id(variable) for variable in variables]
        if self._finite_check is None or self._finite_check[0] != key:
            check = tf.function(lambda: tf.reduce_all([tf.reduce_all(tf.math.is_finite(variable.value)) for variable in variables]))
            self._finite_check = (key, check)
        return bool(self._finite_check[1]())

    def _save(self, completed_epochs: int, logs) -> bool:
        manager = self._save_manager()
        problem = self._nonfinite_state(logs)
        if problem:
            logger.warning("non-finite %s at step %d: checkpoint not saved (the last good one stays the newest)", problem, self.step)
            return False
        self._epoch.assign(completed_epochs)
        self._step.assign(self.step)
        manager.save(checkpoint_number=self.step)
        self._last_save = time.monotonic()
        return True

    def take_nonfinite_state_step(self) -> int | None:
        """The step at which a save was refused for non-finite weights since the last call, if any.

        With BatchNorm, a diverged model can keep a finite (huge) loss while its weights or
        statistics are already inf/NaN; `NaNGuard` treats this as divergence too."""
        step, self.nonfinite_state_step = self.nonfinite_state_step, None
        return step

    def save_now(self, logs=None) -> bool:
        """Saves the current step (mid-epoch); returns whether it was saved (finite state)."""
        return self._save(self._current_epoch, logs)

    def on_train_begin(self, logs=None):
        self._tracked()
        self._last_save = time.monotonic()
        self._saved_epoch_end = False
        self._every_epoch_end = (not self.checkpoint_every_seconds
                                 or isinstance(self.model.distribute_strategy, tf.distribute.MultiWorkerMirroredStrategy))
        if not self._optimizers:
            logger.warning("Checkpointing: %s owns no optimizer; checkpoints hold its weights and step only", self.model.name)
        self._pending = None
        if self.model.built:
            epoch = self.restore(at_start=True)
        else:
            # A model built lazily gets its variables while Keras traces the first step. tf.train's
            # deferred restoration then gives a subclassed model's layers a second copy of their
            # kernels (measured on Keras 3.15 / TF 2.21), so the restore waits until the end of the
            # first step, whose update it overwrites; epoch and step are read from the file now.
            self._pending = self._choose(at_start=True)
            epoch = self._read_progress(self._pending) if self._pending else 0
        if epoch:
            keras_internals.set_initial_epoch(self.model, epoch)

    def _read_progress(self, path: str) -> int:
        reader = tf.train.load_checkpoint(path)
        self.counter.step = self.counter.previous_step = int(reader.get_tensor("step/.ATTRIBUTES/VARIABLE_VALUE"))
        return int(reader.get_tensor("epoch/.ATTRIBUTES/VARIABLE_VALUE"))

    def on_epoch_begin(self, epoch, logs=None):
        self._current_epoch = epoch
        if self._owns_counter:
            self.counter.on_epoch_begin(epoch, logs)

    def on_train_batch_end(self, batch, logs=None):
        if self._owns_counter:
            self.counter.on_train_batch_end(batch, logs)
        if self._pending:
            path, self._pending = self._pending, None
            self._load(path)
            self.model.reset_metrics()  # the overwritten step's loss is not this run's
            return
        if self.counter.crossed(self.checkpoint_every_steps):
            self._save(self._current_epoch, logs)

    def on_epoch_end(self, epoch, logs=None):
        due = (self._every_epoch_end or not self._saved_epoch_end or epoch + 1 >= self.params.get("epochs", 0)
               or time.monotonic() - self._last_save >= self.checkpoint_every_seconds)
        self._unsaved_epochs = None if due else epoch + 1
        if due:
            self._saved_epoch_end = self._save(epoch + 1, logs) or self._saved_epoch_end
        else:
            self._nonfinite_state(logs)  # no save due, but the NaN guard still learns of weights gone bad

    def discard_unsaved(self) -> None:
        """Training failed (the NaN guard): the newest epoch end must not be saved at the end of training."""
        self._unsaved_epochs = None

    def on_train_end(self, logs=None):
        # Another callback (--stop_on_plateau's watch) stopped training after an epoch end that had
        # no save due: that epoch is the stage's last, and a rerun must find it finished.
        if self._unsaved_epochs is not None:
            self._save(self._unsaved_epochs, logs)
            self._unsaved_epochs = None


class Preempted(RuntimeError):
    """SIGTERM or Ctrl-C (SIGINT) arrived during training; the current step was checkpointed.

    Attributes:
        signal_number: the signal that stopped training (the CLI exits with 128 + it: 143, 130).
    """

    def __init__(self, message: str, signal_number: int):
        super().__init__(message)
        self.signal_number = signal_number


class PreemptionCheckpoint(keras.callbacks.Callback):
    """On SIGTERM (the preemption notice of TPU VMs, spot GPUs, Kubernetes) or Ctrl-C, saves a
    checkpoint of the current step at the next step end and stops with `Preempted`.

    The handler only sets a flag, so the step in flight finishes cleanly; rerunning the same
    command resumes from that checkpoint. A second Ctrl-C before that step ends interrupts at
    once (Python's own KeyboardInterrupt), for a step that never ends. Ctrl-C is left alone
    where the process was told to ignore it (`nohup`, `SIG_IGN`). Installed for the duration
    of `fit()` when `fit()` runs in the main thread (Python delivers signals only there;
    elsewhere it says so once), the previous handlers restored afterwards. Single-process runs
    only: multi-worker runs need every worker to save at the same step, which is what TF's
    `PreemptionCheckpointHandler` coordinates (not wired in yet).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, checkpointing: Checkpointing):
        super().__init__()
        self.checkpointing = checkpointing
        self.requested: int | None = None  # the signal received, if any
        self._previous: dict = {}

    def _request(self, signum, frame):
        if signum == signal.SIGINT and self.requested == signal.SIGINT:
            self._uninstall()  # the second Ctrl-C: stop now
            raise KeyboardInterrupt
        self.requested = signum

    def _uninstall(self):
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}

    def on_train_begin(self, logs=None):
        self.requested = None
        if threading.current_thread() is not threading.main_thread():
            logger.warning("PreemptionCheckpoint: fit() runs outside the main thread, where Python cannot receive SIGTERM or "
                           "Ctrl-C; a preempted run resumes from its last regular checkpoint")
            return
        for number in self.SIGNALS:
            if signal.getsignal(number) is not signal.SIG_IGN:
                self._previous[number] = signal.signal(number, self._request)

    def on_train_batch_end(self, batch, logs=None):
        if self.requested is None:
            return
        self._uninstall()
        saved = self.checkpointing.save_now(logs)
        name = "SIGTERM" if self.requested == signal.SIGTERM else "Ctrl-C (SIGINT)"
        raise Preempted(f"{name} at step {self.checkpointing.step}: "
                        + ("checkpoint saved" if saved else "state not finite, last good checkpoint kept")
                        + "; rerun the same command to resume", self.requested)

    def on_train_end(self, logs=None):
        self._uninstall()
