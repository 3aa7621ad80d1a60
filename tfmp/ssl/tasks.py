"""The SSL tasks of `python -m tfmp.train`: `simclr`, `linear_eval`, `finetune`.

`simclr` pretrains on the train split's images (labels hidden, but for the labeled
fraction the online probe may see), saves `WORKDIR/encoder.keras`, measures the
frozen encoder with a linear probe and kNN on `--label_fraction` of the train labels,
and, with `--compare_supervised`, trains the same architecture from scratch on the
same labeled examples — the number SSL has to beat.
"""

from __future__ import annotations

import logging

import keras
import tensorflow as tf

from tfmp import callbacks as tfmp_callbacks
from tfmp import data as tfmp_data
from tfmp import distribute, models, optimizers
from tfmp.models import export
from tfmp.config import Config, UsageError
from tfmp.data.augment import AugmentConfig
from tfmp.ssl import guard, probes
from tfmp.ssl.simclr import SimCLR
from tfmp.run_directory import RunDirectory
from tfmp.training import (apply_float32_layers, check_batch_fits, check_model_fits, find, fit_classifier, jit_compile,
                            loss_scale_metrics, raise_if_failed, run_callbacks, verbosity)

logger = logging.getLogger(__name__)
EVAL_BATCH = 256


def augment_config(config: Config) -> AugmentConfig:
    return AugmentConfig(crop_scale=(config.crop_min_scale, 1.0), flip=config.flip, color_jitter=config.color_jitter,
                         blur_probability=config.blur_probability, noise_stddev=config.noise_stddev)


def labeled_indices(config: Config, data: tfmp_data.ImageData, draw: int = 0):
    """The labeled subset of draw `draw` (draw 0 is also what the online probe and kNN monitor see)."""
    return tfmp_data.balanced_subset(data.train.labels, config.label_fraction, config.seed + draw)


def mean_over_draws(per_draw: list[dict]) -> dict:
    """Means of each figure over the label draws, plus `<key>_per_draw` lists when there are several."""
    summary = {key: sum(row[key] for row in per_draw) / len(per_draw) for key in per_draw[0]}
    if len(per_draw) > 1:
        summary.update({f"{key}_per_draw": [row[key] for row in per_draw] for key in per_draw[0]})
    return summary


def evaluate_encoder(config: Config, data: tfmp_data.ImageData, encoder: keras.Model, labeled, xla: bool = False) -> dict:
    """Linear probe and kNN accuracy on the test split, from the labeled train examples only."""
    bank = tfmp_data.classification_pipeline(data.train, EVAL_BATCH, training=False, indices=labeled)
    test = tfmp_data.classification_pipeline(data.test, EVAL_BATCH, training=False)
    train_features, train_labels = probes.extract_features(encoder, bank, jit_compile=xla)
    test_features, test_labels = probes.extract_features(encoder, test, jit_compile=xla)
    return {
        "linear_probe_accuracy": probes.linear_probe(train_features, train_labels, test_features, test_labels, data.num_classes,
                                                     epochs=config.probe_epochs, learning_rate=config.probe_learning_rate,
                                                     seed=config.seed, jit_compile=xla),
        "knn_accuracy": probes.knn_accuracy(train_features, train_labels, test_features, test_labels, data.num_classes),
    }


def evaluate_over_draws(config: Config, data: tfmp_data.ImageData, encoder: keras.Model, xla: bool = False) -> dict:
    """`evaluate_encoder` on each of `--label_draws` label subsets, averaged."""
    per_draw = [evaluate_encoder(config, data, encoder, labeled_indices(config, data, draw), xla)
                for draw in range(config.label_draws)]
    return {"labeled_examples": int(len(labeled_indices(config, data))), **mean_over_draws(per_draw)}


def baseline_config(config: Config) -> Config:
    """The supervised-from-scratch recipe: AdamW at the baseline learning rate, no batch scaling."""
    defaults = Config()
    return config.replace(optimizer="adamw", learning_rate=config.baseline_learning_rate, learning_rate_scaling="none",
                          epochs=config.baseline_epochs, weight_decay=defaults.weight_decay,
                          warmup_epochs=max(1.0, 0.05 * config.baseline_epochs))


def check_simclr_inputs(config: Config, data: tfmp_data.ImageData) -> None:
    """What `--task=simclr` needs from the user's input, checked before anything is written."""
    unlabeled = data.unlabeled or data.train
    check_batch_fits(config.global_batch_size, len(unlabeled), f"images of {data.name} to pretrain on")
    for draw in range(config.label_draws):
        try:
            labeled_indices(config, data, draw)
        except ValueError as error:
            raise UsageError(f"--label_fraction={config.label_fraction} on {data.name}: {error}") from None
    check_model_fits(config, data)


def pretrain_simclr(config: Config, data: tfmp_data.ImageData, strategy: tf.distribute.Strategy, workdir: RunDirectory,
                    extra_callbacks=()) -> dict:
    """`--task=simclr`: pretrain, save the encoder, probe it, and (optionally) train the baseline."""
    unlabeled = data.unlabeled or data.train
    steps_per_epoch = len(unlabeled) // config.global_batch_size
    labeled = labeled_indices(config, data)
    norm = models.NormSettings(momentum=config.bn_momentum, synchronized=True)
    with strategy.scope():
        encoder = models.build_encoder(config.model, data.image_shape, norm, remat=config.remat)
        model = SimCLR(encoder, num_classes=data.num_classes, projection_dim=config.projection_dim, temperature=config.temperature,
                       augment_config=augment_config(config), seed=config.seed, norm=norm)
        model.build((None, *data.image_shape))
        apply_float32_layers(model, config)
        model.compile(optimizer=optimizers.make_optimizer(config, steps_per_epoch), jit_compile=jit_compile(config, strategy))

    warnings = guard.check(len(unlabeled), config.epochs, config.global_batch_size, encoder.count_params())
    for warning in warnings:
        logger.warning("small-data guard: %s", warning)

    visible = labeled if unlabeled is data.train else None
    pretrain = tfmp_data.classification_pipeline(unlabeled, config.global_batch_size, training=True, seed=config.seed,
                                                 visible_labels=visible)
    knn = probes.KNNMonitor(encoder, tfmp_data.classification_pipeline(data.train, EVAL_BATCH, training=False, indices=labeled),
                            tfmp_data.classification_pipeline(data.test, EVAL_BATCH, training=False), data.num_classes,
                            every_epochs=config.knn_every_epochs, jit_compile=jit_compile(config, strategy))
    callbacks = run_callbacks(config, workdir, monitors=[knn])
    checkpointing = find(callbacks, tfmp_callbacks.Checkpointing)
    throughput = tfmp_callbacks.Throughput(config.global_batch_size)
    history = model.fit(pretrain, epochs=config.epochs, callbacks=[throughput, *callbacks, *extra_callbacks], shuffle=False,
                        verbose=verbosity())
    losses = history.history.get("loss") or [row["loss"] for row in tfmp_callbacks.logged_history(workdir.history_file)[-1:]]
    raise_if_failed(callbacks, losses)
    if distribute.is_chief(strategy):
        # Keras' own layers only, so the file loads without tfmp (tfmp.models.export).
        export.portable(encoder).save(workdir.encoder_file)

    metrics = {
        "train_loss": float(losses[-1]),
        "steps": int(model.optimizer.iterations.numpy()),
        "resumed_from_epoch": checkpointing.restored_epoch,
        "resumed_from_step": checkpointing.restored_step,
        "examples_per_second": throughput.examples_per_second,
        "unlabeled_examples": len(unlabeled),
        "small_data_warnings": warnings,
        "encoder_dtype_policy": encoder.dtype_policy.name,
        **loss_scale_metrics(model.optimizer),
        **evaluate_over_draws(config, data, encoder, jit_compile(config, strategy)),
    }
    if config.compare_supervised:
        per_draw = []
        for draw in range(config.label_draws):
            baseline = fit_classifier(baseline_config(config), data, strategy, workdir.stage("baseline", f"draw{draw}"),
                                      indices=labeled_indices(config, data, draw), validate_every=config.baseline_epochs)
            per_draw.append({"supervised_baseline_accuracy": baseline["eval_accuracy"]})
        metrics.update(mean_over_draws(per_draw))
    return metrics


def _load_encoder(path: str) -> keras.Model:
    try:
        return keras.saving.load_model(path)  # safe mode: only registered Keras objects, no lambdas
    except (ValueError, OSError, TypeError) as error:
        raise UsageError(f"encoder {path}: cannot load ({str(error).splitlines()[0] if str(error) else type(error).__name__})") from None


def _check_encoder_input(encoder: keras.Model, data: tfmp_data.ImageData, path: str) -> None:
    expected = tuple(encoder.input_shape[1:])
    if expected != tuple(data.image_shape):
        raise UsageError(f"encoder {path} takes images of shape {expected}, {data.name} gives {tuple(data.image_shape)}; "
                         "set --image_size to match")


def check_encoder_inputs(config: Config, data: tfmp_data.ImageData) -> None:
    """`--encoder=PATH` loads (safe mode) and takes the data's images, checked before anything is written."""
    _check_encoder_input(_load_encoder(config.encoder), data, config.encoder)
    if config.task == "finetune":
        labeled = labeled_indices(config, data)
        check_batch_fits(min(config.global_batch_size, len(labeled)), len(labeled), "labeled examples")


def linear_eval(config: Config, data: tfmp_data.ImageData, strategy: tf.distribute.Strategy, workdir: RunDirectory,
                extra_callbacks=()) -> dict:
    """`--task=linear_eval --encoder=PATH`: linear probe and kNN of a saved encoder."""
    encoder = _load_encoder(config.encoder)  # checked by check_encoder_inputs before the run started
    return {"encoder": config.encoder, **evaluate_over_draws(config, data, encoder, jit_compile(config, strategy))}


def finetune(config: Config, data: tfmp_data.ImageData, strategy: tf.distribute.Strategy, workdir: RunDirectory,
             extra_callbacks=()) -> dict:
    """`--task=finetune --encoder=PATH`: train the saved encoder + a linear head on the labeled fraction."""
    with strategy.scope():
        encoder = export.adopt(_load_encoder(config.encoder))  # back to tfmp's fused BatchNorm for training
    labeled = labeled_indices(config, data)
    metrics = fit_classifier(config, data, strategy, workdir, indices=labeled, encoder=encoder, extra_callbacks=extra_callbacks)
    return {"encoder": config.encoder, "labeled_examples": int(len(labeled)), **metrics}


__all__ = ["pretrain_simclr", "linear_eval", "finetune"]
