"""`--task=<an SSL method>`: self-supervised pretraining and its measurement.

One task for every method of `tfmp.registry.SSL_METHODS`: pretrain on the train split's images (labels
hidden, but for the labeled fraction the online probe may see), save `WORKDIR/encoder.keras`,
measure the frozen encoder with a linear probe and kNN on `--label_fraction` of the train labels
(`--label_draws` draws); with `--compare_finetune`, fine-tune a copy of it with a linear head on each draw's
labels (as MAE is evaluated); with `--compare_supervised`, train the same architecture from
scratch on the same labeled examples — the number SSL has to beat. The small-data guard reads
the plan before training and the results after (`tfmp.ssl.guard`).
"""

from __future__ import annotations

import logging
import time

import keras
import numpy as np

from tfmp import data as tfmp_data
from tfmp import averaging, compilation, distribute, optimizers, registry, tasks
from tfmp.config import Config
from tfmp.data.augment import AugmentConfig
from tfmp.diagnostics import flops
from tfmp.models import export
from tfmp.report import Phase, Phases
from tfmp.run_directory import RunDirectory
from tfmp.runtime import Runtime
from tfmp.ssl import guard, probes
from tfmp.tasks.evaluation import (EVAL_BATCH, check_label_draws, evaluate_over_draws, evaluation_phase, labeled_indices,
                                   mean_over_draws)
from tfmp.tasks.stage import (apply_float32_layers, build_encoder, check_batch_fits, check_model_fits, fit_stage, norm_settings,
                              steps_per_execution)
from tfmp.tasks.supervised import baseline_config, finetune_config, fit_classifier

logger = logging.getLogger(__name__)


def augment_config(config: Config) -> AugmentConfig:
    return AugmentConfig(crop_scale=(config.crop_min_scale, 1.0), flip=config.flip, color_jitter=config.color_jitter,
                         blur_probability=config.blur_probability, noise_stddev=config.noise_stddev)


def pretraining_images(config: Config, data: tfmp_data.ImageData) -> tuple[tfmp_data.Split, np.ndarray | None]:
    """The images pretraining sees: the extra unlabeled split if there is one, else the train split;
    with `--pretrain_examples=N`, a seeded sample of N of them (the small-data guard's sweep).

    Returns:
        `(split, indices)`: indices sorted, or None for the whole split.
    """
    images = data.unlabeled or data.train
    if not config.pretrain_examples or config.pretrain_examples >= len(images):
        return images, None
    return images, np.sort(np.random.default_rng(config.seed).choice(len(images), config.pretrain_examples, replace=False))


def check_inputs(config: Config, data: tfmp_data.ImageData) -> None:
    """What a pretraining task needs from the user's input, checked before anything is written."""
    images, indices = pretraining_images(config, data)
    count = len(images) if indices is None else len(indices)
    check_batch_fits(config.global_batch_size, count, f"images of {data.name} to pretrain on")
    check_label_draws(config, data)
    check_model_fits(config, data)
    registry.SSL_METHODS.load(config.task).check_inputs(config, data.image_shape)


def build_method(config: Config, data: tfmp_data.ImageData, runtime: Runtime, total_steps: int):
    """The method `--task` names around a new encoder, built and compiled in the strategy's scope."""
    norm = norm_settings(config, runtime)
    with runtime.strategy.scope():
        encoder = build_encoder(config, runtime, data.image_shape)
        model = registry.SSL_METHODS.load(config.task).from_run_config(
            encoder, config, num_classes=data.num_classes, norm=norm, augment_config=augment_config(config), seed=config.seed,
            total_steps=total_steps, gradient_accumulation_steps=config.gradient_accumulation_steps)
        model.build((None, *data.image_shape))
        apply_float32_layers(model, config)
        steps_per_epoch = total_steps // config.epochs
        model.compile(optimizer=optimizers.make_optimizer(config, steps_per_epoch), jit_compile=runtime.jit_compile,
                      steps_per_execution=steps_per_execution(config, steps_per_epoch, runtime))
    return model


def phases(config: Config) -> list[Phase]:
    """Pretraining, evaluation, then the baseline of each label draw."""
    plan = [Phase(f"pretrain {config.task} ({config.model}), {config.epochs} epochs", "pretraining"), evaluation_phase(config)]
    if config.compare_finetune:
        plan += [Phase(f"fine-tune the encoder, label draw {draw + 1}/{config.label_draws}", "finetune draw")
                 for draw in range(config.label_draws)]
    if config.compare_supervised:
        plan += [Phase(f"supervised baseline, label draw {draw + 1}/{config.label_draws}", "baseline draw")
                 for draw in range(config.label_draws)]
    return plan


def export_portable(encoder: keras.Model, path: str, chief: bool) -> None:
    """Saves `encoder` built from Keras' own layers only, so the file loads without tfmp (`tfmp.models.export`). The
    copy is built on every worker — under zero3 on several workers reading a weight is a collective every worker
    joins — and written by the chief."""
    exported = export.portable(encoder)
    if chief:
        exported.save(path)


def run(config: Config, data: tfmp_data.ImageData, runtime: Runtime, directory: RunDirectory,
        extra_callbacks=(), progress: Phases | None = None) -> dict:
    """Pretrain with `--task`'s method, save the encoder, probe it, and (optionally) fine-tune it and train the
    baseline on each label draw."""
    progress = progress or Phases(phases(config))
    progress.start(0)
    images, indices = pretraining_images(config, data)
    count = len(images) if indices is None else len(indices)
    total_steps = config.epochs * (count // config.global_batch_size)
    labeled = labeled_indices(config, data)
    model = build_method(config, data, runtime, total_steps)
    encoder = model.encoder

    warnings = guard.check(count, config.epochs, config.global_batch_size, encoder.count_params())
    for warning in warnings:
        logger.warning("small-data guard: %s", warning)

    visible = None
    if images is data.train:  # the labeled fraction's labels stay visible (online probe), as positions in `indices`
        visible = labeled if indices is None else np.flatnonzero(np.isin(indices, labeled))
    def pretrain():
        return tfmp_data.classification_pipeline(images, config.global_batch_size, training=True, seed=config.seed,
                                                 indices=indices, visible_labels=visible)

    knn = probes.KNNMonitor(encoder, tfmp_data.classification_pipeline(data.train, EVAL_BATCH, training=False, indices=labeled),
                            tfmp_data.classification_pipeline(data.test, EVAL_BATCH, training=False), data.num_classes,
                            every_epochs=config.knn_every_epochs, jit_compile=runtime.jit_compile)
    plateau = guard.PlateauWatch(stop=config.stop_on_plateau)
    started = time.perf_counter()
    results = fit_stage(model, pretrain, config, directory, global_batch_size=config.global_batch_size,
                        monitors=[knn, plateau], extra_callbacks=extra_callbacks,
                        # the method's full-size views through the encoder (two; DINO's crops and MAE's visible
                        # tokens by their share), forward + backward (the heads are not counted)
                        flops_per_example=views(config, data.image_shape) * 3
                        * flops.forward_flops_per_example(encoder, data.image_shape))
    export_portable(encoder, directory.encoder_file, runtime.chief)

    pretrained = time.perf_counter()
    progress.start(1)
    metrics = {
        "method": config.task,
        **results,
        "unlabeled_examples": count,
        "small_data_warnings": warnings,
        "knn_curve": plateau.curve,  # (epoch, kNN accuracy) of every measurement in this process
        "encoder_dtype_policy": encoder.dtype_policy.name,
        **evaluate_over_draws(config, data, encoder, runtime.jit_compile),
    }
    if averaging.has_average(model.optimizer):  # the moving average, measured and exported the same way
        with averaging.averaged(model):
            export_portable(encoder, directory.encoder_average_file, runtime.chief)
            metrics.update({f"ema_{name}": value for name, value in
                            evaluate_over_draws(config, data, encoder, runtime.jit_compile).items() if name != "labeled_examples"})
    # Seconds per phase, so a comparison of methods can leave out the (shared) baseline.
    metrics.update(pretrain_seconds=round(pretrained - started, 2), evaluation_seconds=round(time.perf_counter() - pretrained, 2))
    next_phase = 2
    if config.compare_finetune:
        def pretrained_copy():  # a fresh copy of the pretrained encoder per draw, with tfmp's layers
            with runtime.strategy.scope():
                return export.adopt(export.portable(encoder), conv_weight_gradient=runtime.conv_weight_gradient)

        metrics.update(train_per_draw(finetune_config(config), data, runtime, directory, progress, next_phase, "finetune",
                                      encoder=pretrained_copy))
        next_phase += config.label_draws
    if config.compare_supervised:
        metrics.update(train_per_draw(baseline_config(config), data, runtime, directory, progress, next_phase, "baseline"))
    verdict = guard.verdict(metrics, plateau)
    for warning in verdict:
        logger.warning("small-data guard: %s", warning)
    metrics["small_data_warnings"] = warnings + verdict
    return metrics


# What each per-draw stage reports, by its stage directory's name.
DRAW_STAGES = {"finetune": ("finetune_accuracy", "finetune_seconds"),
               "baseline": ("supervised_baseline_accuracy", "baseline_seconds")}


def train_per_draw(recipe: Config, data: tfmp_data.ImageData, runtime: Runtime, directory: RunDirectory, progress: Phases,
                   first_phase: int, stage: str, encoder=None) -> dict:
    """A classifier trained on each label draw's labels with `recipe` — from scratch (the supervised baseline) or from
    `encoder()`'s copy of the pretrained encoder (`--compare_finetune`) — in one compiled model traced once; the test
    accuracy's mean over the draws (`DRAW_STAGES`) and the stage's seconds.

    Each draw is seeded alone: a classifier's initialisation must not depend on how much randomness the method (or a
    resumption) used before it, so every method's run compares with the same baseline."""
    started = time.perf_counter()
    accuracy, seconds = DRAW_STAGES[stage]
    compiled = compilation.CompiledOnce()
    per_draw = []
    for draw in range(recipe.label_draws):
        progress.start(first_phase + draw)
        distribute.set_seed(recipe.seed + draw)
        trained = fit_classifier(recipe, data, runtime, directory.stage(stage, f"draw{draw}"),
                                 indices=labeled_indices(recipe, data, draw), encoder=encoder() if encoder else None,
                                 validate_every=recipe.epochs, quiet=True, compiled=compiled)
        per_draw.append({accuracy: trained["eval_accuracy"]})
    return {**mean_over_draws(per_draw), seconds: round(time.perf_counter() - started, 2)}


def views(config: Config, image_shape: tuple[int, int, int]) -> float:
    return registry.SSL_METHODS.load(config.task).views_per_example(config, image_shape)


TASK = tasks.Task(run, check_inputs, phases, views)
