"""Keras callbacks tfmp adds to `fit()`, for any Keras model (built lazily or not, functional,
Sequential, subclassed, with its own `train_step` and optimizers), one room per concern:

    checkpointing.py  `Checkpointing` (resume, damaged-file tolerant discovery), `StepCounter`,
                      `PreemptionCheckpoint` (SIGTERM, Ctrl-C)
    guards.py         `NaNGuard` (divergence: restore and retry, then a diagnosis),
                      `ReplicaConsistencyCheck`
    telemetry.py      `Throughput`, `LossScaleMonitor`, `HistoryCSV` (writer and reader of history.csv)
    model_state.py    what a model owns: its optimizers and the losses it logs

`default_callbacks(workdir)` is the one-liner for library users; the CLI uses the same list.
Its settings are named as `tfmp.config.Config`'s fields (and so as the CLI's flags).
"""

from __future__ import annotations

import os

import keras

from tfmp.callbacks.checkpointing import Checkpointing, Preempted, PreemptionCheckpoint, StepCounter, find_checkpoints
from tfmp.callbacks.guards import NaNGuard, ReplicaConsistencyCheck, ReplicaDivergenceError
from tfmp.callbacks.model_state import logged_losses, owned_optimizers
from tfmp.callbacks.telemetry import HistoryCSV, LossScaleMonitor, Throughput, logged_history
from tfmp.run_directory import RunDirectory, as_run_directory


def default_callbacks(workdir: str | RunDirectory, *, keep_checkpoints: int = 3, checkpoint_every_steps: int = 0,
                      checkpoint_every_seconds: float = 10.0,
                      nan_retries: int = 2, max_skipped_steps: int = 20, loss_explosion_factor: float = 1000.0,
                      replica_check_every_steps: int = 100, monitors=(), validation: bool = False) -> list[keras.callbacks.Callback]:
    """Step counter, guards (NaN, replica consistency), checkpoints with resume, telemetry, then the loggers.

    The guards run before the checkpoint so that a state they reject is not saved; telemetry
    (loss scale, and `monitors` such as a kNN monitor) comes before the loggers (history.csv,
    TensorBoard) so its values are in the logs they write.

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
                                  checkpoint_every_seconds=checkpoint_every_seconds,
                                  save_directory=run.checkpoints_to_write, counter=counter)
    return [
        counter,
        NaNGuard(checkpointing, nan_retries=nan_retries, max_skipped_steps=max_skipped_steps,
                 loss_explosion_factor=loss_explosion_factor),
        ReplicaConsistencyCheck(replica_check_every_steps=replica_check_every_steps, counter=counter),
        checkpointing,
        PreemptionCheckpoint(checkpointing),
        LossScaleMonitor(),
        *monitors,
        HistoryCSV(run.history_to_write, validation=validation),
        keras.callbacks.TensorBoard(run.tensorboard, write_graph=False),
    ]


__all__ = ["Checkpointing", "HistoryCSV", "LossScaleMonitor", "NaNGuard", "Preempted", "PreemptionCheckpoint", "ReplicaConsistencyCheck",
           "ReplicaDivergenceError", "StepCounter", "Throughput", "default_callbacks", "find_checkpoints", "logged_history",
           "logged_losses", "owned_optimizers"]
