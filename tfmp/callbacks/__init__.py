"""Keras callbacks tfmp adds to `fit()`, for any Keras model (built lazily or not, functional,
Sequential, subclassed, with its own `train_step` and optimizers), one room per job:

    run_lock.py          `RunLock`: one run per workdir (`tfmp.workdir_lock`) for the length of `fit()`
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
from typing import NamedTuple

import keras

from tfmp.callbacks.checkpoint_files import find_checkpoints
from tfmp.callbacks.checkpointing import Checkpointing
from tfmp.callbacks.guards import NaNGuard, ReplicaConsistencyCheck, ReplicaDivergenceError
from tfmp.callbacks.model_state import logged_losses, owned_optimizers
from tfmp.callbacks.preemption import Preempted, PreemptionCheckpoint
from tfmp.callbacks.run_lock import RunLock
from tfmp.callbacks.step_counter import StepCounter
from tfmp.callbacks.telemetry import HistoryCSV, LossScaleMonitor, Throughput
from tfmp.run_directory import RunDirectory, as_run_directory, logged_history


class RunCallbacks(NamedTuple):
    """tfmp's callbacks for one `fit()`, by job. Pass it to `fit(callbacks=...)` as it is, or inside a
    list (Keras flattens tuples); `as_list()` gives them flat, in the order they run."""

    lock: RunLock
    step_counter: StepCounter
    guard: NaNGuard
    replica_check: ReplicaConsistencyCheck
    checkpointing: Checkpointing
    preemption: PreemptionCheckpoint
    loss_scale: LossScaleMonitor
    monitors: tuple  # callbacks whose values go into the logs, before the loggers write them
    history: HistoryCSV
    tensorboard: keras.callbacks.TensorBoard

    def as_list(self) -> list[keras.callbacks.Callback]:
        return [*self[:7], *self.monitors, self.history, self.tensorboard]


def default_callbacks(workdir: str | RunDirectory, *, keep_checkpoints: int = 3, checkpoint_every_steps: int = 0,
                      checkpoint_every_seconds: float = 10.0, nan_retries: int = 2, max_skipped_steps: int = 20,
                      loss_explosion_factor: float = 1000.0, replica_check_every_steps: int = 100, monitors=(),
                      validation: bool = False) -> RunCallbacks:
    """The workdir's lock, step counter, guards, checkpoints with resume, preemption, telemetry, then the loggers.

    Args:
        workdir: the run directory (a path, or a `RunDirectory`, which on a non-chief worker
            resumes from the chief's checkpoints but writes to scratch).
        keep_checkpoints, checkpoint_every_steps, checkpoint_every_seconds, nan_retries, max_skipped_steps,
        loss_explosion_factor, replica_check_every_steps: as `tfmp.config.Config`'s fields.
        monitors: callbacks whose values go into the logs (e.g. `tfmp.ssl.probes.KNNMonitor`).
        validation: the fit validates, so history.csv gets `val_` columns.
    """
    run = as_run_directory(workdir)
    os.makedirs(run.write_path, exist_ok=True)
    counter = StepCounter()
    checkpointing = Checkpointing(run.checkpoints, keep_checkpoints=keep_checkpoints, checkpoint_every_steps=checkpoint_every_steps,
                                  checkpoint_every_seconds=checkpoint_every_seconds, save_directory=run.checkpoints_to_write,
                                  counter=counter)
    return RunCallbacks(
        lock=RunLock(None if run.is_scratch else run.path),
        step_counter=counter,
        guard=NaNGuard(checkpointing, nan_retries=nan_retries, max_skipped_steps=max_skipped_steps,
                       loss_explosion_factor=loss_explosion_factor),
        replica_check=ReplicaConsistencyCheck(replica_check_every_steps=replica_check_every_steps, counter=counter),
        checkpointing=checkpointing,
        preemption=PreemptionCheckpoint(checkpointing),
        loss_scale=LossScaleMonitor(),
        monitors=tuple(monitors),
        history=HistoryCSV(run.history_to_write, validation=validation),
        tensorboard=keras.callbacks.TensorBoard(run.tensorboard, write_graph=False),
    )


__all__ = ["Checkpointing", "HistoryCSV", "LossScaleMonitor", "NaNGuard", "Preempted", "PreemptionCheckpoint", "ReplicaConsistencyCheck",
           "ReplicaDivergenceError", "RunCallbacks", "RunLock", "StepCounter", "Throughput", "default_callbacks", "find_checkpoints",
           "logged_history", "logged_losses", "owned_optimizers"]
