"""`run(config, workdir)`: one training run, from a config to `WORKDIR/metrics.json`.

The order of work is chosen so that bad input costs nothing: every check that can
fail on user input (names, the workdir's previous config, hardware, data) runs
before the workdir is created or written. A rerun of a finished run returns its
metrics without writing; a rerun of an unfinished one resumes from its newest
checkpoint; a rerun with another config is refused.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import keras
import tensorflow as tf

import tfmp
from tfmp import callbacks as tfmp_callbacks
from tfmp import data as tfmp_data
from tfmp import distribute, models, report, tasks
from tfmp.config import CHANGEABLE_AFTER_FAILURE, Config, UsageError, load_json, parse_memory_size
from tfmp.run_directory import RunDirectory, check_before_run
from tfmp.runtime import Runtime, prepare
from tfmp.tasks import TrainingFailed  # noqa: F401 — TrainingFailed is part of this module's API
from tfmp.tasks.stage import apply_float32_layers, build_encoder, check_method_settings
from tfmp.workdir_lock import WorkdirLock

logger = logging.getLogger(__name__)


def _memory_estimate(config: Config, data: tfmp_data.ImageData, runtime: Runtime, remat: str | None = None):
    """The memory estimate per replica of `config`'s model (with `remat` instead of `--remat` when given)."""
    from tfmp.diagnostics import memory

    config = config if remat is None else config.replace(remat=remat)
    per_replica = distribute.per_replica_batch_size(config.global_batch_size, runtime.num_replicas)
    with runtime.strategy.scope():
        # The same BatchNorm settings and checkpointing as training: both change what is kept.
        model = models.build_classifier(build_encoder(config, runtime, data.image_shape), data.num_classes)
        apply_float32_layers(model, config)
    shards = runtime.num_replicas if config.sharding != "none" else 1
    views = tasks.get(config.task).views(config, data.image_shape)
    return memory.estimate_memory(model, data.image_shape, per_replica, config.optimizer, views=views,
                                  optimizer_shards=shards, accumulation_steps=config.gradient_accumulation_steps,
                                  gradient_shards=runtime.num_replicas if config.sharding in ("zero2", "zero3") else 1,
                                  weight_shards=runtime.num_replicas if config.sharding == "zero3" else 1)


def memory_plan(config: Config, data: tfmp_data.ImageData, runtime: Runtime):
    """`tfmp.diagnostics.planner.Plan` for one device of `--device_memory` (or the GPU's own memory); None when
    neither is known. Builds the model once per remat mode the plan needs, then seeds again, so the run initialises
    as without it."""
    from tfmp.diagnostics import planner

    device_bytes = parse_memory_size(config.device_memory) if config.device_memory else (
        planner.gpu_memory_bytes() if tf.config.list_physical_devices("GPU") else None)
    if device_bytes is None:
        return None
    per_replica = distribute.per_replica_batch_size(config.global_batch_size, runtime.num_replicas)
    replicas = runtime.num_replicas if config.sharding == "none" else 1  # already sharded: nothing more to offer
    result = planner.plan(lambda mode: _memory_estimate(config, data, runtime, mode), device_bytes, config.remat, per_replica,
                          replicas, accumulation_steps=config.gradient_accumulation_steps)
    distribute.set_seed(config.seed)
    return result


def dry_run(config: Config, data: tfmp_data.ImageData, runtime: Runtime, workdir: RunDirectory) -> dict:
    """`--dry_run`: builds the model and input pipeline, writes and prints the memory estimate
    per replica (`WORKDIR/memory_estimate.json`) and, given a device's memory, the plan; trains nothing."""
    next(iter(tfmp_data.classification_pipeline(data.train, config.global_batch_size, training=False).take(1)))  # the pipeline builds
    estimate = _memory_estimate(config, data, runtime)
    values = {"task": config.task, "model": config.model, "num_replicas": runtime.num_replicas, **estimate.to_dict()}
    print(estimate.summary())
    plan = memory_plan(config, data, runtime)
    if plan is not None:
        values["plan"] = {"device_bytes": plan.device_bytes, "usable_bytes": plan.usable_bytes, "fits": plan.fits,
                          "total_bytes_by_remat": plan.totals, "cheapest_fitting_remat": plan.cheapest_fitting,
                          "largest_per_replica_batch": plan.largest_batch,
                          "smallest_fitting_gradient_accumulation_steps": plan.smallest_fitting_accumulation,
                          "summary": plan.summary()}
        print(plan.summary())
    workdir.write_memory_estimate(values)
    return values


def run(config: Config, workdir: str | RunDirectory, *, extra_callbacks=(), checked=None) -> dict:
    """Runs (or resumes, or recognises as finished) the training run `config` in `workdir`.

    Args:
        config: the run's config.
        workdir: the run directory (see `tfmp.run_directory`).
        extra_callbacks: Keras callbacks added after tfmp's own.
        checked: what `tfmp.run_directory.check_before_run(config, workdir)` returned, if the caller ran it.

    Returns:
        The run's metrics (also written to `WORKDIR/metrics.json`).

    Raises:
        UsageError: bad config, data, files or hardware for it; nothing was written.
        TrainingFailed: the run did not train successfully.
    """
    started = time.perf_counter()
    if checked is None:
        checked = check_before_run(config, workdir)
    config, directory, finished = checked
    if finished is not None:
        print(f"already finished: {directory.metrics_file} (nothing to do)")
        return finished

    check_method_settings(config)
    runtime = prepare(config)
    try:
        data = tfmp_data.load_for(config)
    except ValueError as error:
        raise UsageError(str(error)) from None
    if config.dry_run:
        return dry_run(config, data, runtime, directory)
    if not config.ignore_memory_estimate:
        plan = memory_plan(config, data, runtime)
        if plan is not None and not plan.fits:
            raise UsageError(f"{plan.summary()}; --ignore_memory_estimate runs it anyway")

    task = tasks.get(config.task)
    task.check_inputs(config, data)  # everything that can fail on user input fails here, before config.json is written
    directory = directory.for_worker(runtime.chief)
    new_workdir = not os.path.exists(directory.path)
    try:
        # One run per workdir, held by the chief from its first write to its last (tfmp.workdir_lock).
        with WorkdirLock(directory.path) if runtime.chief else contextlib.nullcontext():
            return _run_locked(config, data, task, runtime, directory, extra_callbacks, started)
    except UsageError:
        # Bad input found only once the task built its model (e.g. --float32_layers matching no layer): the
        # config.json just written goes again, so the corrected command runs in the same workdir.
        if runtime.chief and new_workdir:
            directory.remove_if_only_config()
        raise


def _run_locked(config: Config, data, task, runtime: Runtime, directory: RunDirectory, extra_callbacks, started: float) -> dict:
    """The run itself, once its checks passed and (on the chief) the workdir is locked: config, task, metrics."""
    if runtime.chief:
        finished = directory.finished_metrics(config)  # again: another process may have finished it meanwhile
        if finished is not None:
            print(f"already finished: {directory.metrics_file} (nothing to do)")
            return finished
        if os.path.exists(directory.failure_file) and os.path.exists(directory.config_file):
            changed = config.differences(load_json(directory.config_file))
            logger.info("rerunning a failed run%s; it resumes from its last good checkpoint",
                        f" with {'; '.join(changed)}" if changed else "")
        directory.write_config(config)
    progress = report.Phases(task.phases(config))
    try:
        task_metrics = task.run(config, data, runtime, directory, extra_callbacks, progress)
    except (TrainingFailed, tfmp_callbacks.ReplicaDivergenceError) as error:
        if runtime.chief:
            directory.write_failure(str(error))
        raise TrainingFailed(f"{error}; a rerun in this workdir may change {', '.join(CHANGEABLE_AFTER_FAILURE)} and "
                             "resumes from the last good checkpoint") from None
    finally:
        if not runtime.chief:
            directory.remove_scratch()

    metrics = {
        "task": config.task,
        "dataset": data.name,
        "model": config.model,
        "precision": runtime.precision,
        "strategy": distribute.strategy_name(runtime.strategy),
        "num_replicas": runtime.num_replicas,
        "jit_compile": runtime.jit_compile,
        "xla_scope": runtime.xla_scope,
        "global_batch_size": config.global_batch_size,
        "per_replica_batch_size": config.global_batch_size // runtime.num_replicas,
        "epochs": config.epochs,
        "wall_seconds": round(time.perf_counter() - started, 3),
        "tfmp_version": tfmp.__version__,
        "tensorflow_version": tf.__version__,
        "keras_version": keras.__version__,
        **task_metrics,
    }
    progress.finish()
    if runtime.chief:
        directory.write_metrics(metrics)
        report.summary_png(metrics, tfmp_callbacks.logged_history(directory.history_file), directory.summary_png_file)
    return metrics
