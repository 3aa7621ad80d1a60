"""What every task's training stages share: one helper that fits a stage and collects its results.

A *stage* is one `fit()` with its own run directory (pretraining, a fine-tune, the supervised
baseline of one label draw). `fit_stage` adds tfmp's callbacks (checkpoints with resume,
guards, telemetry, loggers), trains, raises `TrainingFailed` with the NaN guard's diagnosis
when the stage diverged, and returns the figures every stage reports. The input checks
(`check_batch_fits`, `check_model_fits`) and the one rule for synchronized BatchNorm
(`norm_settings`) live here too, so that all tasks apply them alike.
"""

from __future__ import annotations

import logging
import math
import sys
from typing import Callable

import keras
import tensorflow as tf

from tfmp import callbacks as tfmp_callbacks
from tfmp import compilation, models, precision, registry
from tfmp.config import Config, UsageError
from tfmp.diagnostics import flops
from tfmp.run_directory import RunDirectory
from tfmp.runtime import Runtime

logger = logging.getLogger(__name__)

# tfmp's callback settings are `Config`'s fields of the same names (tfmp.callbacks.default_callbacks).
CALLBACK_SETTINGS = ("keep_checkpoints", "checkpoint_every_steps", "checkpoint_every_seconds", "nan_retries", "max_skipped_steps",
                     "loss_explosion_factor", "replica_check_every_steps")


class TrainingFailed(RuntimeError):
    """Training ran but did not succeed (e.g. the loss became non-finite); CLI exit code 1."""


def verbosity() -> int:
    # A progress bar on a terminal; one line per epoch in logs and CI.
    return 1 if sys.stdout.isatty() else 2


def norm_settings(config: Config, runtime: Runtime) -> models.NormSettings:
    """The one rule for BatchNorm in every task: synchronized across replicas whenever there are several.

    Keras keeps a plain BatchNorm's moving statistics per replica, so the replicas' copies drift
    apart (tests/test_guards.py); and in SSL a replica could tell its own images apart by their
    local batch statistics. On one replica synchronizing changes nothing and costs a code path.
    """
    return models.NormSettings(bn_momentum=config.bn_momentum, synchronized=runtime.num_replicas > 1)


def build_encoder(config: Config, runtime: Runtime, image_shape: tuple[int, int, int]) -> keras.Model:
    """`--model` for images of `image_shape`, as every task builds it (call inside the strategy's scope)."""
    return models.build_encoder(config.model, image_shape, norm_settings(config, runtime), remat=config.remat,
                                conv_weight_gradient=runtime.conv_weight_gradient, drop_path_rate=config.drop_path_rate)


MAX_AUTO_STEPS_PER_EXECUTION = 64


def largest_divisor_at_most(count: int, limit: int) -> int:
    """The largest divisor of `count` not above `limit`."""
    return max(divisor for divisor in range(1, min(count, limit) + 1) if count % divisor == 0)


def steps_per_execution(config: Config, steps_per_epoch: int, runtime: Runtime) -> int:
    """Steps per compiled call for an epoch of `steps_per_epoch` steps (`--steps_per_execution`).

    A divisor of the epoch, so that every execution is full and the batch indices callbacks see
    are the true step counts (Keras reports an execution's planned last step even when the epoch
    ends inside it). Left to auto, it is also at most `--checkpoint_every_steps`, so checkpoints
    (and the NaN guard's restore point) keep the cadence asked for.

    One step a call under MultiWorkerMirroredStrategy: Keras 3.15's multi-step loop fails there
    (InvalidArgumentError at a placeholder of its `has_next` condition, two workers on 127.0.0.1)."""
    if isinstance(runtime.strategy, tf.distribute.MultiWorkerMirroredStrategy):
        if config.steps_per_execution > 1:
            logger.warning("--steps_per_execution=%d: one step a call under multi_worker_mirrored (Keras' multi-step loop "
                           "fails there)", config.steps_per_execution)
        return 1
    auto_limit = min(MAX_AUTO_STEPS_PER_EXECUTION, config.checkpoint_every_steps or MAX_AUTO_STEPS_PER_EXECUTION)
    return largest_divisor_at_most(steps_per_epoch, config.steps_per_execution or auto_limit)


def apply_float32_layers(model: keras.Model, config: Config) -> None:
    """Applies `--float32_layers` (a no-op without it); a pattern matching nothing is a usage error."""
    if not config.float32_layers:
        return
    try:
        names = precision.keep_float32(model, config.float32_layers)
    except ValueError as error:
        raise UsageError(str(error)) from None
    logger.info("float32 layers: %s", ", ".join(names))


def loss_scale_metrics(optimizer) -> dict:
    """`loss_scale` and `skipped_steps` where the optimizer scales the loss (fp16), else nothing."""
    scale = precision.current_loss_scale(optimizer)
    if scale is None:
        return {}
    return {"loss_scale": scale, "skipped_steps": precision.skipped_steps(optimizer)}


def run_callbacks(config: Config, directory: RunDirectory, monitors=(), validation: bool = False) -> tfmp_callbacks.RunCallbacks:
    """tfmp's callbacks for one training stage in `directory` (its settings are `Config`'s fields by name)."""
    # A stage's `epochs` is its total and rerunning the run resumes it, in a new process or this one (a notebook
    # rerunning `training.run` after a stop): its fits are never refused as repeats.
    return tfmp_callbacks.default_callbacks(directory, monitors=monitors, validation=validation, refuse_repeated_fit=False,
                                            **{name: getattr(config, name) for name in CALLBACK_SETTINGS})


def raise_if_failed(guard: tfmp_callbacks.NaNGuard, losses: list[float]) -> None:
    """Raises TrainingFailed with the NaN guard's diagnosis when training diverged."""
    if guard.diagnosis:
        raise TrainingFailed(guard.diagnosis)
    if losses and not math.isfinite(losses[-1]):  # e.g. the guard disabled with --nan_retries=0 and a finite restore
        raise TrainingFailed(f"training loss ended at {losses[-1]}; {guard.diagnose()}")


def resume_plan(saved: tuple[int, int], epochs: int, steps_per_epoch: int) -> list[tuple[int, int, int]]:
    """The `fit()`s that train from a checkpoint's (epochs completed, step) to `epochs`: each as (epochs to reach,
    steps per epoch, the first step of the stream). A checkpoint inside an epoch first finishes that epoch with
    its remaining steps, so the run ends with the steps an uninterrupted run takes, epoch boundaries where they were."""
    completed, step = saved
    into_epoch = step - completed * steps_per_epoch
    plan = []
    if 0 < into_epoch < steps_per_epoch and completed < epochs:
        plan.append((completed + 1, steps_per_epoch - into_epoch, step))
        completed += 1
    if completed < epochs or not plan:  # a finished stage still gets its fit(): that is where it is restored
        plan.append((epochs, steps_per_epoch, completed * steps_per_epoch))
    return plan


def fit_stage(model: keras.Model, dataset: Callable[[], tf.data.Dataset], config: Config, directory: RunDirectory, *,
              global_batch_size: int,
              steps_per_epoch: int | None = None, monitors=(), extra_callbacks=(), validation_data=None, validate_every: int = 1,
              quiet: bool = False, flops_per_example: float | None = None) -> dict:
    """Trains `model` on `dataset` for `config.epochs` with tfmp's callbacks in `directory` (a rerun resumes).

    Args:
        model: a compiled Keras model.
        dataset: makes the batched training data, one pass (each `fit()` gets a new one: a dataset's shuffle
            draws its next order from how often that dataset object was iterated before, in this process).
        config: the stage's config (epochs and the callbacks' settings).
        directory: the stage's run directory.
        global_batch_size: examples per step (for the throughput figure).
        steps_per_epoch: steps per `fit()` epoch; None: one pass over the dataset.
        monitors: callbacks whose values go into the logs (e.g. a kNN monitor).
        extra_callbacks: the caller's Keras callbacks, after tfmp's own.
        validation_data, validate_every: as `fit()`'s `validation_data` and `validation_freq`.
        quiet: an inner stage (the baseline's draws): no epoch lines unless `--verbose`.
        flops_per_example: training FLOPs per example; with it the results have `mfu` and how
            its peak was derived (`tfmp.diagnostics.flops`).

    Returns:
        `train_loss` (the last epoch's, also when the stage had already finished), `steps`,
        `resumed_from_epoch`, `resumed_from_step`, `examples_per_second`, and the loss-scale
        figures under fp16.

    Raises:
        TrainingFailed: the stage diverged; the message is the NaN guard's diagnosis.
    """
    callbacks = run_callbacks(config, directory, monitors, validation=validation_data is not None)
    throughput = tfmp_callbacks.Throughput(global_batch_size)
    checkpointing = callbacks.checkpointing
    fit_callbacks = [throughput, *callbacks, *extra_callbacks]
    tfmp_callbacks.check_order(fit_callbacks)
    if model.built:  # a lazily built model's weights are not all there to build the optimizer for
        compilation.build_optimizer_before_tracing(model)
    resumed = None
    for epochs, steps, first_step in resume_plan(checkpointing.saved_progress(), config.epochs,
                                                 steps_per_epoch or int(dataset().cardinality())):
        # One stream of batches, pass after pass (the shuffle reshuffles each pass, from the run's seed): a
        # resumed fit starts where the checkpoint stopped in it, so it sees the batches the stopped run would have.
        stream = dataset().repeat().skip(first_step)
        history = model.fit(stream, epochs=epochs, steps_per_epoch=steps, validation_data=validation_data,
                            validation_freq=validate_every, callbacks=fit_callbacks,
                            shuffle=False, verbose=0 if quiet and not config.verbose else verbosity())
        resumed = resumed or (checkpointing.restored_epoch, checkpointing.restored_step)
        if model.stop_training:
            break
        checkpointing.continue_in_memory()
    # A stage that had already finished trains no epoch: its last loss is in its history.csv.
    logged = tfmp_callbacks.logged_history(directory.history_file)[-1:]
    losses = history.history.get("loss") or [row["loss"] for row in logged if "loss" in row]
    raise_if_failed(callbacks.guard, losses)
    utilisation = {} if flops_per_example is None else flops.utilisation(flops_per_example, throughput.examples_per_second,
                                                                          precision.global_policy_name())
    return {
        "train_loss": float(losses[-1]) if losses else math.nan,
        "steps": int(model.optimizer.iterations.numpy()),
        "resumed_from_epoch": resumed[0],
        "resumed_from_step": resumed[1],
        "examples_per_second": throughput.examples_per_second,
        **utilisation,
        **loss_scale_metrics(model.optimizer),
    }


def check_batch_fits(batch: int, count: int, what: str) -> None:
    """UsageError unless one global batch fits in `count` examples (`what` names them)."""
    if count // batch < 1:
        raise UsageError(f"global_batch_size {batch} exceeds the {count} {what}; lower --global_batch_size")


def check_method_settings(config: Config) -> None:
    """UsageError when a setting some SSL method reads (its class's `settings`) differs from its default but the
    task does not read it: `--task=byol --temperature=0.1` was accepted and silently ignored. Every registered
    method is asked, a user's own included."""
    readers: dict[str, list[str]] = {}
    for name in registry.SSL_METHODS.names():
        for setting in registry.SSL_METHODS.entry(name).load().settings:
            readers.setdefault(setting, []).append(name)
    taken = registry.SSL_METHODS.entry(config.task).load().settings if config.task in registry.SSL_METHODS.names() else ()
    defaults = Config()
    for setting, methods in readers.items():
        if setting not in taken and getattr(config, setting) != getattr(defaults, setting):
            raise UsageError(f"--{setting} applies to --task={'|'.join(methods)} only, not --task={config.task}; remove it")


def check_model_fits(config: Config, data) -> None:
    """UsageError unless `--model` takes the data's images (e.g. resnet50 needs at least 32x32)."""
    try:
        models.check_image_size(config.model, data.image_shape)
    except ValueError as error:
        shape = "x".join(map(str, data.image_shape))
        where = (f"--image_size={config.image_size} resizes {data.name}'s images to {shape}" if config.image_size
                 else f"{data.name} has {shape} images")
        raise UsageError(f"{error} ({where})") from None
