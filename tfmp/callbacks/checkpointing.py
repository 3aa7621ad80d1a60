"""`Checkpointing`: when to save, what a checkpoint holds, and the restore at the start of `fit()`.

Built on `tf.train.Checkpoint` / `CheckpointManager` rather than Keras' `BackupAndRestore`: the
manager keeps several checkpoints, writes each checkpoint's data before its index (a crash
mid-write leaves the previous one as the newest), and is what TF's preemption and multi-worker
tooling builds on. Which files exist and read completely is `checkpoint_files`' job; whether a
state may be saved at all is asked of the run's save gate (the NaN guard), through one method.
"""

from __future__ import annotations

import logging
import os
import time
import keras
import tensorflow as tf

from tfmp import keras_internals
from tfmp.callbacks import checkpoint_files
from tfmp.callbacks.model_state import owned_optimizers
from tfmp.callbacks.interfaces import SaveGate, StepCount
from tfmp.callbacks.step_counter import CountingCallback
from tfmp.config import UsageError
from tfmp.sharding import weights

logger = logging.getLogger(__name__)

# Checkpoint directory -> epochs completed by the last fit() that trained there in this process.
_TRAINED_IN_THIS_PROCESS: dict[str, int] = {}


class RepeatedFit(UsageError):
    """A second `fit()` in one process on a workdir its first one already trained to `epochs`: it would train nothing."""


class Checkpointing(CountingCallback):
    """Saves the model, every optimizer it owns, the step and the epoch; resumes at train begin.

    Saves at epoch ends and, with `checkpoint_every_steps`, every that many steps, as
    `ckpt-<step>`. With `checkpoint_every_seconds`, an epoch end saves only once that many
    seconds have passed since the last save; the first epoch end of a `fit()` always saves (the
    NaN guard's restore point), and so does the last (or the epoch after which another callback
    stopped training). Under MultiWorkerMirroredStrategy every epoch end saves: the workers
    save together, and their clocks would not agree on when. A state the save gate vetoes is
    never saved, so the newest checkpoint is always the last good one.

    Like `BackupAndRestore`, it tells `fit()` where to start by setting the model's initial
    epoch; a checkpoint taken mid-epoch resumes at the start of that epoch, with the optimizers'
    step counts (and so the learning-rate schedules) where they were. A model built lazily is
    restored at the end of its first step, once Keras has created its variables (that step's
    update is overwritten). At resume, damaged checkpoints are skipped with one warning; when
    checkpoint files exist but none reads completely, it raises `UsageError` rather than
    silently start over.

    Args:
        directory: where checkpoints are resumed from (`WORKDIR/checkpoints`).
        keep_checkpoints: how many checkpoints to keep.
        checkpoint_every_steps: also save every this many steps (0: epoch ends only).
        checkpoint_every_seconds: at epoch ends, save once this many seconds have passed since the
            last save (0: at every epoch end).
        save_directory: write here instead (non-chief workers: every worker must take part in
            saving, but only the chief's copy is kept).
        counter: the run's `StepCounter` (one is made and driven here when not given).
        refuse_repeated_fit: refuse a second `fit()` in this process that would train nothing (`RepeatedFit`);
            tfmp's own stages pass False: rerunning `tfmp.training.run` in one process resumes it, stage by stage.
    """

    def __init__(self, directory: str, keep_checkpoints: int = 3, checkpoint_every_steps: int = 0,
                 checkpoint_every_seconds: float = 0.0, save_directory: str | None = None, counter: StepCount | None = None,
                 refuse_repeated_fit: bool = True):
        super().__init__(counter)
        self.refuse_repeated_fit = refuse_repeated_fit
        self.directory = directory
        self.save_directory = save_directory or directory
        self.keep_checkpoints = keep_checkpoints
        self.checkpoint_every_steps = checkpoint_every_steps
        self.checkpoint_every_seconds = checkpoint_every_seconds
        self.save_gate: SaveGate | None = None
        self.restored_epoch = 0
        self.restored_step = 0
        self.restored_path: str | None = None
        self._last_save = time.monotonic()
        self._last_saved: tuple[int, int] | None = None  # (step, epochs completed) of this process's newest save
        self._step_at_begin = 0  # the step this fit() started from
        self._unsaved_epochs: int | None = None  # epochs completed at the newest epoch end not saved
        self._every_epoch_end = not checkpoint_every_seconds
        self._saved_epoch_end = False  # in this fit()
        self._pending_restore: str | None = None
        self._build_config_written = False
        self._continue_in_memory = False
        self._checkpoint_state_object = None
        self._manager = None
        self._current_epoch = 0

    def set_save_gate(self, gate: SaveGate) -> None:
        """Every save asks `gate.save_veto(logs)` first."""
        self.save_gate = gate

    @property
    def step(self) -> int:
        return self.counter.step

    def _checkpoint_state(self) -> tf.train.Checkpoint:
        if self._checkpoint_state_object is None:
            self._epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")  # epochs completed
            self._step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
            self._checkpoint_state_object = tf.train.Checkpoint(model=self.model, optimizers=owned_optimizers(self.model),
                                                                epoch=self._epoch, step=self._step)
        return self._checkpoint_state_object

    def _save_manager(self) -> tf.train.CheckpointManager:
        if self._manager is None:
            if self.save_directory == self.directory:
                checkpoint_files.set_aside_unreadable_state_file(self.directory)
            keep = self.keep_checkpoints if self.save_directory == self.directory else 1
            self._manager = tf.train.CheckpointManager(self._checkpoint_state(), self.save_directory, max_to_keep=keep,
                                                       checkpoint_name=checkpoint_files.PREFIX)
        return self._manager

    @property
    def last_good_checkpoint(self) -> str | None:
        """The newest checkpoint that reads completely, or None."""
        return checkpoint_files.newest_readable(self.directory)[0]

    def _choose(self, at_start: bool) -> str | None:
        """The checkpoint to restore (newest complete one), warning about the damaged ones skipped."""
        self._checkpoint_state()
        path, skipped = checkpoint_files.newest_readable(self.directory)
        if skipped:
            logger.warning("checkpoints in %s: skipped %s; %s", self.directory, "; ".join(skipped),
                           f"resuming from {os.path.basename(path)}" if path else "none is readable")
        if path is None and skipped and at_start:
            raise UsageError(f"checkpoints in {self.directory}: none restores completely ({'; '.join(skipped)}); "
                             f"to start over from step 0 move that folder aside, or put back a good copy, then rerun")
        return path

    def restore_last_good(self) -> bool:
        """Restores the newest complete checkpoint; False when there is none."""
        path = self._choose(at_start=False)
        if path:
            self._load(path)
        return path is not None

    def _load(self, path: str, build_compiled_optimizer: bool = False) -> int:
        # Objects that exist are filled now; optimizer variables not created yet are filled by
        # tf.train when Keras creates them (the model itself is built: see on_train_begin).
        with weights.reading_own_slices():  # zero3 on several workers: each worker reads its replicas' chunks only
            status = self._checkpoint_state_object.restore(path)
        optimizer = getattr(self.model, "optimizer", None)
        if build_compiled_optimizer and optimizer is not None and not optimizer.built and optimizer.iterations.numpy() > 0:
            # The compiled optimizer stepped before the save (its step count is restored now): built here, its
            # slots are filled at creation, rather than through a deferred restoration that a rerun with nothing
            # to train would leave unfilled. One that never stepped (keras-io's DCGAN and SimCLR compile() without
            # one and step their own) was saved unbuilt and stays so: its slots are in no checkpoint.
            optimizer.build(self.model.trainable_variables)
        status.assert_existing_objects_matched()
        self.restored_path = path
        self.restored_epoch = int(self._epoch.numpy())
        self.restored_step = int(self._step.numpy())
        self.counter.rewind(self.restored_step)
        logger.info("restored %s (epoch %d, step %d)", path, self.restored_epoch, self.restored_step)
        written_on, replicas = checkpoint_files.read_replicas(self.directory), self.model.distribute_strategy.num_replicas_in_sync
        if written_on and written_on != replicas:
            logger.warning("resuming on %d replica(s) from a checkpoint written on %d: the same global batches in the same "
                           "order, but not bit-identical to the run on %d (per-replica BatchNorm statistics, summation "
                           "order)", replicas, written_on, written_on)
        return self.restored_epoch

    def _save(self, completed_epochs: int, logs) -> bool:
        manager = self._save_manager()
        veto = self.save_gate.save_veto(logs) if self.save_gate is not None else None
        if veto:
            logger.warning("%s at step %d: checkpoint not saved (the last good one stays the newest)", veto, self.step)
            return False
        self._epoch.assign(completed_epochs)
        self._step.assign(self.step)
        manager.save(checkpoint_number=self.step)
        self._last_save = time.monotonic()
        self._last_saved = (self.step, completed_epochs)
        if not self._build_config_written and self.model.get_build_config():
            checkpoint_files.write_build_config(self.save_directory, self.model.get_build_config())
            checkpoint_files.write_replicas(self.save_directory, self.model.distribute_strategy.num_replicas_in_sync)
            self._build_config_written = True
        return True

    def _epochs_completed_now(self) -> int:
        # At a batch end that ends the epoch (with steps_per_execution, often the only one), the epoch is complete
        # although its on_epoch_end has not run yet: a resume must start at the next epoch, not redo this one.
        steps = self.params.get("steps") if self.params else None
        return self._current_epoch + (1 if steps and self.counter.steps_into_epoch >= steps else 0)

    def save_now(self, logs=None) -> bool:
        """Saves the current step (mid-epoch, or again after its epoch end); returns whether it is saved (not vetoed)."""
        completed = self._epochs_completed_now()
        if self._last_saved == (self.step, completed):
            return True  # saved already (the epoch end's own checkpoint), and nothing has trained since
        return self._save(completed, logs)

    def on_train_begin(self, logs=None):
        self._checkpoint_state()
        self._last_save = time.monotonic()
        self._saved_epoch_end = False
        self._every_epoch_end = (not self.checkpoint_every_seconds
                                 or isinstance(self.model.distribute_strategy, tf.distribute.MultiWorkerMirroredStrategy))
        if not owned_optimizers(self.model):
            logger.warning("Checkpointing: %s owns no optimizer; checkpoints hold its weights and step only", self.model.name)
        self._pending_restore = None
        self._build_config_written = False
        if self._continue_in_memory:
            # The same model goes on in the next fit() of one run: it holds what the newest checkpoint holds.
            self._continue_in_memory = False
            if self._epoch.numpy():
                keras_internals.set_initial_epoch(self.model, int(self._epoch.numpy()))
            return
        path = self._choose(at_start=True)
        saved_epochs, self._step_at_begin = checkpoint_files.progress(path) if path else (0, 0)
        self._refuse_a_repeated_fit(saved_epochs)
        if path and not self.model.built:
            # A model built lazily (a Sequential without Input, a subclassed model) has no variables yet:
            # built here from the input shape its earlier run kept (Keras' own build config).
            build_config = checkpoint_files.read_build_config(self.directory)
            if build_config:
                self.model.build_from_config(build_config)
        if path is None:
            epoch = 0
        elif self.model.built or self.model.weights:
            epoch = self._load(path, build_compiled_optimizer=True)
        else:
            # No build config (checkpoints of an older tfmp): the variables appear while Keras traces the
            # first step, and tf.train's deferred restoration then gives a subclassed model's layers a
            # second copy of their kernels (Keras 3.15 / TF 2.21); the restore waits until the end of the
            # first step, whose update it overwrites. Epoch and step are read from the file now.
            self._pending_restore = path
            epoch = self._read_progress(path)
        if epoch:
            keras_internals.set_initial_epoch(self.model, epoch)

    def _refuse_a_repeated_fit(self, saved_epochs: int) -> None:
        """Raises `RepeatedFit` when this process already trained this workdir to the `epochs` of the fit starting now.

        `epochs` is the run's total, as with Keras' `BackupAndRestore`: a rerun resumes and a finished run trains
        nothing. Within one process, a second `fit(epochs=1)` after a first one (keras-io's distributed-training
        guide does this) is meant to train one more epoch, as plain Keras would; tfmp says so instead of silently
        training nothing. A new process (the rerun of a stopped script) is never refused: it resumes."""
        epochs = (self.params or {}).get("epochs")
        trained_to = _TRAINED_IN_THIS_PROCESS.get(os.path.realpath(self.directory))
        if not self.refuse_repeated_fit or trained_to is None or not epochs or saved_epochs < epochs:
            return
        raise RepeatedFit(f"fit(epochs={epochs}) on {os.path.dirname(os.path.abspath(self.directory))} would train nothing: "
                          f"this process already trained it to epoch {trained_to}, and with tfmp's checkpoints `epochs` is "
                          f"the run's total (a rerun resumes); pass epochs={trained_to + epochs} to train {epochs} more, or "
                          "use another workdir")

    def _read_progress(self, path: str) -> int:
        epoch, step = checkpoint_files.progress(path)
        self.counter.start_at(step)
        return epoch

    def continue_in_memory(self) -> None:
        """The next `fit()` goes on from the model as it is (the state of the last save), without a restore."""
        self._continue_in_memory = True

    def saved_progress(self) -> tuple[int, int]:
        """(epochs completed, step) of the checkpoint a `fit()` starting now resumes from; (0, 0) without one."""
        path = checkpoint_files.newest_readable(self.directory)[0]
        return checkpoint_files.progress(path) if path else (0, 0)

    def on_epoch_begin(self, epoch, logs=None):
        self._current_epoch = epoch
        super().on_epoch_begin(epoch, logs)

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch, logs)
        if self._pending_restore:
            path, self._pending_restore = self._pending_restore, None
            self._load(path)
            self.model.reset_metrics()  # the overwritten step's loss is not this run's
            return
        if self.counter.crossed(self.checkpoint_every_steps):
            self._save(self._epochs_completed_now(), logs)

    def on_epoch_end(self, epoch, logs=None):
        due = (self._every_epoch_end or not self._saved_epoch_end or epoch + 1 >= self.params.get("epochs", 0)
               or time.monotonic() - self._last_save >= self.checkpoint_every_seconds)
        self._unsaved_epochs = None if due else epoch + 1
        if due:
            self._saved_epoch_end = self._save(epoch + 1, logs) or self._saved_epoch_end

    def on_train_end(self, logs=None):
        # Another callback (--stop_on_plateau's watch) stopped training after an epoch end that had
        # no save due: that epoch is the stage's last, and a rerun must find it finished.
        if self._unsaved_epochs is not None:
            self._save(self._unsaved_epochs, logs)
            self._unsaved_epochs = None
        if self._last_saved is not None and self._last_saved[0] > self._step_at_begin:
            _TRAINED_IN_THIS_PROCESS[os.path.realpath(self.directory)] = self._last_saved[1]
