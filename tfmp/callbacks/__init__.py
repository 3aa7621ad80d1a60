"""Keras callbacks tfmp adds to `fit()`, for any Keras model (built lazily or not, functional,
Sequential, subclassed, with its own `train_step` and optimizers), one room per job:

    run_lock.py          `RunLock`: one run per workdir (`tfmp.workdir_lock`) for the length of `fit()`
    interfaces.py        what one callback may ask of another, and the order they run in
    step_counter.py      `StepCounter`: steps taken across resumptions
    checkpoint_files.py  which checkpoint files exist and read completely (no Keras)
    checkpointing.py     `Checkpointing`: save cadence, what a checkpoint holds, restore
    preemption.py        `PreemptionCheckpoint`, `Preempted`: SIGTERM and Ctrl-C
    guards.py            `NaNGuard` (divergence; the checkpoints' save gate), `ReplicaConsistencyCheck`
    telemetry.py         `Throughput`, `LossScaleMonitor`, `HistoryCSV` (writer and reader of history.csv)
    model_state.py       what a model owns: its optimizers and the losses it logs

`default_callbacks(workdir)` is the one-liner for library users; the CLI uses the same set. Its
settings are named as `tfmp.config.Config`'s fields (and so as the CLI's flags).
"""

from __future__ import annotations

import os
import keras

from tfmp import keras_internals
from tfmp.callbacks.checkpoint_files import find_checkpoints
from tfmp.callbacks.checkpointing import Checkpointing, RepeatedFit
from tfmp.callbacks.guards import NaNGuard, ReplicaConsistencyCheck, ReplicaDivergenceError
from tfmp.callbacks.interfaces import CallbackOrderError, check_order
from tfmp.callbacks.model_state import logged_losses, owned_optimizers
from tfmp.callbacks.preemption import Preempted, PreemptionCheckpoint
from tfmp.callbacks.run_lock import RunLock
from tfmp.callbacks.step_counter import StepCounter
from tfmp.callbacks.telemetry import HistoryCSV, LossScaleMonitor, Throughput
from tfmp.run_directory import RunDirectory, as_run_directory, logged_history


class RunCallbacks(list):
    """tfmp's callbacks for one `fit()`, flat and in the order they must run: a list (`+`, `extend`,
    iteration, `len`; `fit(callbacks=...)` takes it as it is) whose parts are also named by job
    (`.checkpointing`, `.guard`, ...). Built in an order their classes' declared constraints accept
    (`tfmp.callbacks.interfaces.check_order`)."""

    def __init__(self, *, lock: RunLock, step_counter: StepCounter, guard: NaNGuard, replica_check: ReplicaConsistencyCheck,
                 checkpointing: Checkpointing, preemption: PreemptionCheckpoint, loss_scale: LossScaleMonitor, monitors=(),
                 history: HistoryCSV, tensorboard: keras.callbacks.TensorBoard):
        self.lock, self.step_counter, self.guard, self.replica_check = lock, step_counter, guard, replica_check
        self.checkpointing, self.preemption, self.loss_scale = checkpointing, preemption, loss_scale
        self.monitors = tuple(monitors)  # callbacks whose values go into the logs, before the loggers write them
        self.history, self.tensorboard = history, tensorboard
        super().__init__([lock, step_counter, guard, replica_check, checkpointing, preemption, loss_scale, *self.monitors, history,
                          tensorboard])
        check_order(self)

    def as_list(self) -> list[keras.callbacks.Callback]:
        """The callbacks as a plain list (kept from when `RunCallbacks` was a tuple of parts)."""
        return list(self)


keras_internals.register_tree_node(RunCallbacks, flatten=list, unflatten=list)


def default_callbacks(workdir: str | RunDirectory, *, keep_checkpoints: int = 3, checkpoint_every_steps: int = 0,
                      checkpoint_every_seconds: float = 10.0, nan_retries: int = 2, max_skipped_steps: int = 20,
                      loss_explosion_factor: float = 1000.0, replica_check_every_steps: int = 100, monitors=(),
                      validation: bool = False, refuse_repeated_fit: bool = True) -> RunCallbacks:
    """The workdir's lock, step counter, guards, checkpoints with resume, preemption, telemetry, then the loggers.

    Args:
        workdir: the run directory (a path, or a `RunDirectory`, which on a non-chief worker
            resumes from the chief's checkpoints but writes to scratch).
        keep_checkpoints, checkpoint_every_steps, checkpoint_every_seconds, nan_retries, max_skipped_steps,
        loss_explosion_factor, replica_check_every_steps: as `tfmp.config.Config`'s fields.
        monitors: callbacks whose values go into the logs (e.g. `tfmp.ssl.probes.KNNMonitor`).
        validation: the fit validates, so history.csv gets `val_` columns.
        refuse_repeated_fit: a second `fit()` in this process that would train nothing raises `RepeatedFit` (tfmp's
            own stages pass False: a rerun of `tfmp.training.run` in one process resumes them).
    """
    run = as_run_directory(workdir)
    os.makedirs(run.write_path, exist_ok=True)
    counter = StepCounter()
    checkpointing = Checkpointing(run.checkpoints, keep_checkpoints=keep_checkpoints, checkpoint_every_steps=checkpoint_every_steps,
                                  checkpoint_every_seconds=checkpoint_every_seconds, save_directory=run.checkpoints_to_write,
                                  counter=counter, refuse_repeated_fit=refuse_repeated_fit)
    return RunCallbacks(
        lock=RunLock(None if run.is_scratch else run.path),
        step_counter=counter,
        guard=NaNGuard(checkpointing, nan_retries=nan_retries, max_skipped_steps=max_skipped_steps,
                       loss_explosion_factor=loss_explosion_factor, counter=counter),
        replica_check=ReplicaConsistencyCheck(replica_check_every_steps=replica_check_every_steps, counter=counter),
        checkpointing=checkpointing,
        preemption=PreemptionCheckpoint(checkpointing, counter=counter),
        loss_scale=LossScaleMonitor(),
        monitors=tuple(monitors),
        history=HistoryCSV(run.history_to_write, validation=validation, tensorboard_directory=run.tensorboard),
        tensorboard=keras.callbacks.TensorBoard(run.tensorboard, write_graph=False),
    )


__all__ = ["CallbackOrderError", "Checkpointing", "HistoryCSV", "LossScaleMonitor", "NaNGuard", "Preempted",
           "PreemptionCheckpoint", "RepeatedFit", "ReplicaConsistencyCheck", "ReplicaDivergenceError", "RunCallbacks",
           "RunLock", "StepCounter", "Throughput", "check_order", "default_callbacks", "find_checkpoints", "logged_history",
           "logged_losses", "owned_optimizers"]
