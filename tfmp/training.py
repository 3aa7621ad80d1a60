"""`run(config, workdir)`: one training run, from a config to `WORKDIR/metrics.json`.

The order of work is chosen so that bad input costs nothing: every check that can
fail on user input (names, the workdir's previous config, hardware, data) runs
before the workdir is created or written. A rerun of a finished run returns its
metrics without writing; a rerun of an unfinished one resumes from its newest
checkpoint; a rerun with another config is refused.
"""

from __future__ import annotations

import logging
import time

import keras
import tensorflow as tf

import tfmp
from tfmp import callbacks as tfmp_callbacks
from tfmp import data as tfmp_data
from tfmp import compilation, distribute, models, precision, report
from tfmp.models import conv
from tfmp.config import Config, UsageError, validate
from tfmp.run_directory import RunDirectory, as_run_directory
from tfmp.tasks import TASKS, TrainingFailed  # noqa: F401 — TrainingFailed is part of this module's API
from tfmp.tasks.stage import apply_float32_layers, jit_compile, norm_settings

logger = logging.getLogger(__name__)


def dry_run(config: Config, data: tfmp_data.ImageData, strategy: tf.distribute.Strategy, workdir: RunDirectory) -> dict:
    """`--dry_run`: builds the model and input pipeline, writes and prints the memory estimate
    per replica (`WORKDIR/memory_estimate.json`), and trains nothing."""
    from tfmp.diagnostics import memory

    per_replica = distribute.per_replica_batch_size(config.global_batch_size, strategy.num_replicas_in_sync)
    next(iter(tfmp_data.classification_pipeline(data.train, config.global_batch_size, training=False).take(1)))  # the pipeline builds
    with strategy.scope():
        # The same BatchNorm settings and checkpointing as training: both change what is kept.
        encoder = models.build_encoder(config.model, data.image_shape, norm_settings(config, strategy), remat=config.remat)
        model = models.build_classifier(encoder, data.num_classes)
        apply_float32_layers(model, config)
    estimate = memory.estimate_memory(model, data.image_shape, per_replica, config.optimizer, views=TASKS[config.task].views)
    values = {"task": config.task, "model": config.model, "num_replicas": strategy.num_replicas_in_sync, **estimate.to_dict()}
    workdir.write_memory_estimate(values)
    print(estimate.summary())
    return values


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
    conv.weight_gradient = config.conv_weight_gradient  # read when the steps are traced
    if policy == "mixed_bfloat16":
        logger.info("conv weight gradient: %s", conv.describe_weight_gradient())
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

    task = TASKS[config.task]
    task.check_inputs(config, data)  # everything that can fail on user input fails here, before config.json is written
    chief = distribute.is_chief(strategy)
    directory = directory.for_worker(chief)
    if chief:
        directory.write_config(config)
    progress = report.Phases(task.phases(config))
    try:
        task_metrics = task.run(config, data, strategy, directory, extra_callbacks, progress)
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
    progress.finish()
    if chief:
        directory.write_metrics(metrics)
        report.summary_png(metrics, tfmp_callbacks.logged_history(directory.history_file), directory.summary_png_file)
    return metrics
