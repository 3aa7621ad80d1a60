"""`run(config, workdir)`: one training run, from a config to `WORKDIR/metrics.json`.

The order of work is chosen so that bad input costs nothing: every check that can
fail on user input (names, the workdir's previous config, hardware, data) runs
before the workdir is created or written. A rerun of a finished run returns its
metrics without writing; a rerun of an unfinished one resumes from its newest
checkpoint; a rerun with another config is refused.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time

import keras
import tensorflow as tf

import tfmp
from tfmp import callbacks as tfmp_callbacks
from tfmp import data as tfmp_data
from tfmp import compilation, distribute, models, optimizers, precision
from tfmp.config import Config, UsageError, validate
from tfmp.run_directory import RunDirectory, as_run_directory

logger = logging.getLogger(__name__)


class TrainingFailed(RuntimeError):
    """Training ran but did not succeed (e.g. the loss became non-finite); CLI exit code 1."""


def verbosity() -> int:
    # A progress bar on a terminal; one line per epoch in logs and CI.
    return 1 if sys.stdout.isatty() else 2


def loss_scale_metrics(optimizer) -> dict:
    """`loss_scale` and `skipped_steps` where the optimizer scales the loss (fp16), else nothing."""
    scale = precision.current_loss_scale(optimizer)
    if scale is None:
        return {}
    return {"loss_scale": scale, "skipped_steps": precision.skipped_steps(optimizer)}


def fit_classifier(config: Config, data: tfmp_data.ImageData, strategy: tf.distribute.Strategy, directory: RunDirectory, *,
                   indices=None, encoder: keras.Model | None = None, extra_callbacks=(), validate_every: int = 1) -> dict:
    """Trains encoder + linear classifier on the train split (or its `indices`); evaluates on test.

    Args:
        config: the stage's config (optimizer, learning rate, epochs, batch, ...).
        data: the data set.
        strategy: the distribution strategy.
        directory: this stage's `checkpoints/` and `tensorboard/` go here; a rerun resumes.
        indices: train on this subset only (e.g. the labeled fraction). A global batch
            larger than the subset is reduced to fit it.
        encoder: start from this encoder (fine-tuning) instead of a new one.
        extra_callbacks: Keras callbacks added after tfmp's own.
        validate_every: evaluate on the test split every this many epochs (the
            supervised baseline's one-step epochs would otherwise spend most of their
            time validating).

    Returns:
        `train_loss`, `eval_accuracy`, `eval_loss`, `steps`, `resumed_from_epoch`,
        `examples_per_second` (and the loss-scale figures under fp16).
    """
    replicas = strategy.num_replicas_in_sync
    count = len(data.train) if indices is None else len(indices)
    batch = config.global_batch_size
    if indices is not None and batch > count:
        batch = max(replicas, count - count % replicas)
        logger.info("batch reduced to %d to fit the %d labeled examples", batch, count)
    check_batch_fits(batch, count, f"training examples of {data.name}")
    steps_per_epoch = count // batch
    config = config.replace(global_batch_size=batch)
    with strategy.scope():
        # Synchronized BatchNorm on several replicas: Keras keeps a plain BatchNorm's moving
        # statistics per replica, so the replicas' copies drift apart (tests/test_guards.py).
        norm = models.NormSettings(momentum=config.bn_momentum, synchronized=strategy.num_replicas_in_sync > 1)
        encoder = encoder or models.build_encoder(config.model, data.image_shape, norm, remat=config.remat)
        model = models.build_classifier(encoder, data.num_classes)
        apply_float32_layers(model, config)
        model.compile(
            optimizer=optimizers.make_optimizer(config, steps_per_epoch),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
            jit_compile=compilation.for_keras(jit_compile(config, strategy), strategy),
        )
    train = tfmp_data.classification_pipeline(data.train, batch, training=True, seed=config.seed, indices=indices)
    test = tfmp_data.classification_pipeline(data.test, batch, training=False)

    callbacks = run_callbacks(config, directory)
    throughput = tfmp_callbacks.Throughput(batch)
    history = model.fit(train, epochs=config.epochs, validation_data=test, validation_freq=validate_every,
                        callbacks=[throughput, *callbacks, *extra_callbacks], shuffle=False, verbose=verbosity())
    losses = history.history.get("loss", [])
    raise_if_failed(callbacks, losses)
    checkpointing = find(callbacks, tfmp_callbacks.Checkpointing)
    evaluation = model.evaluate(test, return_dict=True, verbose=0)
    train_loss = losses[-1] if losses else model.evaluate(train, return_dict=True, verbose=0)["loss"]  # resumed when finished
    return {
        "train_loss": float(train_loss),
        "eval_accuracy": float(evaluation["accuracy"]),
        "eval_loss": float(evaluation["loss"]),
        "steps": int(model.optimizer.iterations.numpy()),
        "resumed_from_epoch": checkpointing.restored_epoch,
        "resumed_from_step": checkpointing.restored_step,
        "examples_per_second": throughput.examples_per_second,
        **loss_scale_metrics(model.optimizer),
    }


def apply_float32_layers(model: keras.Model, config: Config) -> None:
    """Applies `--float32_layers` (a no-op without it); a pattern matching nothing is a usage error."""
    if not config.float32_layers:
        return
    try:
        names = precision.keep_float32(model, config.float32_layers)
    except ValueError as error:
        raise UsageError(str(error)) from None
    logger.info("float32 layers: %s", ", ".join(names))


def jit_compile(config: Config, strategy: tf.distribute.Strategy) -> bool:
    """Whether this run's steps compile with XLA (`--jit_compile`, resolved for the strategy's devices)."""
    return compilation.resolve(config.jit_compile, strategy.num_replicas_in_sync)[0]


CALLBACK_SETTINGS = ("keep_checkpoints", "checkpoint_every_steps", "nan_retries", "max_skipped_steps", "loss_explosion_factor",
                     "replica_check_every_steps")


def run_callbacks(config: Config, directory: RunDirectory, monitors=()):
    """tfmp's callbacks for one training stage in `directory` (its settings are `Config`'s fields by name)."""
    return tfmp_callbacks.default_callbacks(directory, monitors=monitors, **{name: getattr(config, name) for name in CALLBACK_SETTINGS})


def find(callbacks, kind):
    return next(callback for callback in callbacks if isinstance(callback, kind))


def raise_if_failed(callbacks, losses: list[float]) -> None:
    """Raises TrainingFailed with the NaN guard's diagnosis when training diverged."""
    guard = find(callbacks, tfmp_callbacks.NaNGuard)
    if guard.diagnosis:
        raise TrainingFailed(guard.diagnosis)
    if losses and not math.isfinite(losses[-1]):  # e.g. the guard disabled with --nan_retries=0 and a finite restore
        raise TrainingFailed(f"training loss ended at {losses[-1]}; {guard.diagnose()}")


def train_supervised(config: Config, data: tfmp_data.ImageData, strategy: tf.distribute.Strategy, workdir: RunDirectory,
                     extra_callbacks=()) -> dict:
    """`--task=supervised`: encoder + linear classifier on all train labels."""
    return fit_classifier(config, data, strategy, workdir, extra_callbacks=extra_callbacks)


def dry_run(config: Config, data: tfmp_data.ImageData, strategy: tf.distribute.Strategy, workdir: RunDirectory) -> dict:
    """`--dry_run`: builds the model and input pipeline, writes and prints the memory estimate
    per replica (`WORKDIR/memory_estimate.json`), and trains nothing."""
    from tfmp.diagnostics import memory

    per_replica = distribute.per_replica_batch_size(config.global_batch_size, strategy.num_replicas_in_sync)
    next(iter(tfmp_data.classification_pipeline(data.train, config.global_batch_size, training=False).take(1)))  # the pipeline builds
    with strategy.scope():
        # The same BatchNorm settings and checkpointing as training: both change what is kept.
        norm = models.NormSettings(momentum=config.bn_momentum, synchronized=strategy.num_replicas_in_sync > 1 or config.task == "simclr")
        encoder = models.build_encoder(config.model, data.image_shape, norm, remat=config.remat)
        model = models.build_classifier(encoder, data.num_classes)
        apply_float32_layers(model, config)
    views = 2 if config.task == "simclr" else 1
    estimate = memory.estimate_memory(model, data.image_shape, per_replica, config.optimizer, views=views)
    values = {"task": config.task, "model": config.model, "num_replicas": strategy.num_replicas_in_sync, **estimate.to_dict()}
    workdir.write_memory_estimate(values)
    print(estimate.summary())
    return values


def check_batch_fits(batch: int, count: int, what: str) -> None:
    """UsageError unless one global batch fits in `count` examples (`what` names them)."""
    if count // batch < 1:
        raise UsageError(f"global_batch_size {batch} exceeds the {count} {what}; lower --global_batch_size")


def check_model_fits(config: Config, data: tfmp_data.ImageData) -> None:
    """UsageError unless `--model` takes the data's images (e.g. resnet50 needs at least 32x32)."""
    try:
        models.check_image_size(config.model, data.image_shape)
    except ValueError as error:
        raise UsageError(f"{error} ({data.name} has {'x'.join(map(str, data.image_shape))} images)") from None


def check_supervised_inputs(config: Config, data: tfmp_data.ImageData) -> None:
    check_batch_fits(config.global_batch_size, len(data.train), f"training examples of {data.name}")
    check_model_fits(config, data)


def _tasks() -> dict:
    """Each task: (runs it, checks its inputs before anything is written)."""
    from tfmp.ssl import tasks as ssl_tasks  # the SSL tasks build on this module

    return {"supervised": (train_supervised, check_supervised_inputs),
            "simclr": (ssl_tasks.pretrain_simclr, ssl_tasks.check_simclr_inputs),
            "linear_eval": (ssl_tasks.linear_eval, ssl_tasks.check_encoder_inputs),
            "finetune": (ssl_tasks.finetune, ssl_tasks.check_encoder_inputs)}


def prepare(config: Config) -> tuple[Config, str, tf.distribute.Strategy]:
    """Sets the seed and precision policy and creates the strategy; user errors become UsageError.

    Args:
        config: a config that passed `validate`.

    Returns:
        `(config, policy_name, strategy)`.
    """
    try:
        # The strategy first: MultiWorkerMirroredStrategy must configure TF before anything else runs.
        hosts = config.worker_hosts.split(",") if config.worker_hosts else None
        strategy = distribute.get_strategy(config.strategy, num_cpu_devices=config.num_cpu_devices or None, tpu=config.tpu or None,
                                           worker_hosts=hosts, task_index=config.task_index)
        policy = precision.set_policy(config.precision)
        distribute.per_replica_batch_size(config.global_batch_size, strategy.num_replicas_in_sync)
        xla, reason = compilation.resolve(config.jit_compile, strategy.num_replicas_in_sync)
    except (ValueError, RuntimeError) as error:
        raise UsageError(str(error)) from None
    logger.info("jit_compile: %s (%s); XLA compiles: %s", xla, reason, compilation.scope(xla, strategy))
    distribute.set_seed(config.seed)
    return config, policy, strategy


def run(config: Config, workdir: str | RunDirectory, *, extra_callbacks=()) -> dict:
    """Runs (or resumes, or recognises as finished) the training run `config` in `workdir`.

    Args:
        config: the run's config.
        workdir: the run directory (see `tfmp.run_directory`).
        extra_callbacks: Keras callbacks added after tfmp's own.

    Returns:
        The run's metrics (also written to `WORKDIR/metrics.json`).

    Raises:
        UsageError: bad config, data, files or hardware for it; nothing was written.
        TrainingFailed: the run did not train successfully.
    """
    started = time.perf_counter()
    config = validate(config)
    directory = as_run_directory(workdir)
    finished = None if config.dry_run else directory.finished_metrics(config)
    if finished is not None:
        print(f"already finished: {directory.metrics_file} (nothing to do)")
        return finished
    directory.check_writable()

    config, policy, strategy = prepare(config)
    try:
        data = tfmp_data.load(config.dataset, data_dir=config.data_dir or None, image_size=config.image_size, seed=config.seed,
                              unlabeled_split=config.unlabeled_split, skip_unreadable_images=config.skip_unreadable_images)
    except ValueError as error:
        raise UsageError(str(error)) from None
    if config.dry_run:
        return dry_run(config, data, strategy, directory)

    run_task, check_inputs = _tasks()[config.task]
    check_inputs(config, data)  # everything that can fail on user input fails here, before config.json is written
    chief = distribute.is_chief(strategy)
    directory = directory.for_worker(chief)
    if chief:
        directory.write_config(config)
    try:
        task_metrics = run_task(config, data, strategy, directory, extra_callbacks)
    except tfmp_callbacks.ReplicaDivergenceError as error:
        raise TrainingFailed(str(error)) from None
    finally:
        if not chief:
            directory.remove_scratch()

    metrics = {
        "task": config.task,
        "dataset": data.name,
        "model": config.model,
        "precision": policy,
        "strategy": distribute.strategy_name(strategy),
        "num_replicas": strategy.num_replicas_in_sync,
        "jit_compile": jit_compile(config, strategy),
        "xla_scope": compilation.scope(jit_compile(config, strategy), strategy),
        "global_batch_size": config.global_batch_size,
        "per_replica_batch_size": config.global_batch_size // strategy.num_replicas_in_sync,
        "epochs": config.epochs,
        "wall_seconds": round(time.perf_counter() - started, 3),
        "tfmp_version": tfmp.__version__,
        "tensorflow_version": tf.__version__,
        "keras_version": keras.__version__,
        **task_metrics,
    }
    if chief:
        directory.write_metrics(metrics)
    return metrics
