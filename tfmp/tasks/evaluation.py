"""Measuring an encoder on few labels: the label draws, linear probe and kNN over them, and the
`linear_eval` and `finetune` tasks for any method's saved `encoder.keras`.

With 2% of digits' labels (30 images), which 30 matters by several points, so every figure is
the mean over `--label_draws` seeded, class-balanced subsets; the probes and the supervised
baseline of a draw see the same labeled examples.
"""

from __future__ import annotations

import keras
import numpy as np

from tfmp import compilation, tasks
from tfmp import data as tfmp_data
from tfmp.config import Config, UsageError
from tfmp.models import export, vit
from tfmp.report import Phase, Phases
from tfmp.run_directory import RunDirectory
from tfmp.runtime import Runtime
from tfmp.ssl import probes
from tfmp.tasks.stage import check_batch_fits
from tfmp.tasks.supervised import fit_classifier

EVAL_BATCH = 256


def labeled_indices(config: Config, data: tfmp_data.ImageData, draw: int = 0):
    """The labeled subset of draw `draw` (draw 0 is also what the online probe and kNN monitor see)."""
    return tfmp_data.balanced_subset(data.train.labels, config.label_fraction, config.seed + draw)


def check_label_draws(config: Config, data: tfmp_data.ImageData) -> None:
    """UsageError unless every label draw of `--label_fraction` exists (e.g. at least one label a class)."""
    for draw in range(config.label_draws):
        try:
            labeled_indices(config, data, draw)
        except ValueError as error:
            raise UsageError(f"--label_fraction={config.label_fraction} on {data.name}: {error}") from None


def mean_over_draws(per_draw: list[dict]) -> dict:
    """Means of each figure over the label draws, plus `<key>_per_draw` lists when there are several."""
    summary = {key: sum(row[key] for row in per_draw) / len(per_draw) for key in per_draw[0]}
    if len(per_draw) > 1:
        summary.update({f"{key}_per_draw": [row[key] for row in per_draw] for key in per_draw[0]})
    return summary


def evaluate_over_draws(config: Config, data: tfmp_data.ImageData, encoder: keras.Model, jit_compile: bool = False) -> dict:
    """Linear probe and kNN on each of `--label_draws` label subsets, averaged.

    Features are computed once: the test split's, and the train split's at the union of every
    draw's labeled examples (the encoder is frozen and in inference mode, so a draw's features are
    rows of these), instead of once per draw."""
    draws = [labeled_indices(config, data, draw) for draw in range(config.label_draws)]
    union = np.unique(np.concatenate(draws))  # sorted: the pipeline yields them in this order
    train_features, train_labels = probes.extract_features(
        encoder, tfmp_data.classification_pipeline(data.train, EVAL_BATCH, training=False, indices=union), jit_compile)
    test_features, test_labels = probes.extract_features(
        encoder, tfmp_data.classification_pipeline(data.test, EVAL_BATCH, training=False), jit_compile)
    per_draw = []
    compiled = compilation.CompiledOnce()  # one traced probe step for all the draws
    for labeled in draws:
        rows = np.searchsorted(union, labeled)
        features, labels = train_features[rows], train_labels[rows]
        per_draw.append({
            "linear_probe_accuracy": probes.linear_probe(features, labels, test_features, test_labels, data.num_classes,
                                                         epochs=config.probe_epochs, learning_rate=config.probe_learning_rate,
                                                         seed=config.seed, jit_compile=jit_compile, compiled=compiled),
            "knn_accuracy": probes.knn_accuracy(features, labels, test_features, test_labels, data.num_classes),
        })
    return {"labeled_examples": int(len(draws[0])), **mean_over_draws(per_draw)}


def load_encoder(path: str) -> keras.Model:
    """A saved `encoder.keras`, loaded in safe mode (only registered Keras objects, no lambdas)."""
    try:
        return keras.saving.load_model(path)
    except (ValueError, OSError, TypeError) as error:
        raise UsageError(f"encoder {path}: cannot load ({str(error).splitlines()[0] if str(error) else type(error).__name__})") from None


def check_encoder_inputs(config: Config, data: tfmp_data.ImageData) -> None:
    """`--encoder=PATH` loads (safe mode) and takes the data's images, checked before anything is written."""
    encoder = load_encoder(config.encoder)
    embedding = vit.patch_embedding_of(encoder)
    if not export.takes_images_of(encoder, data.image_shape):
        channels = encoder.input_shape[-1]
        takes = (f"images with sides a multiple of {embedding.patch} and {channels} channel{'s' if channels > 1 else ''}"
                 if embedding is not None else f"images of shape {tuple(encoder.input_shape[1:])}")
        raise UsageError(f"encoder {config.encoder} takes {takes}, {data.name} gives {tuple(data.image_shape)}; "
                         f"set --image_size to match")
    check_label_draws(config, data)
    if config.layer_decay != 1.0 and embedding is None:
        raise UsageError(f"--layer_decay is for ViT encoders; {config.encoder} has no patch embedding")
    if config.task == "finetune":
        labeled = labeled_indices(config, data)
        check_batch_fits(min(config.global_batch_size, len(labeled)), len(labeled), "labeled examples")


def evaluation_phase(config: Config) -> Phase:
    draws = f"{config.label_draws} label draw{'s' if config.label_draws > 1 else ''}"
    return Phase(f"linear probe + kNN, {draws} of {config.label_fraction:.0%} of the labels", "evaluation")


def phases(config: Config) -> list[Phase]:
    """linear_eval's one phase, or finetune's."""
    if config.task == "finetune":
        return [Phase(f"fine-tune on {config.label_fraction:.0%} of the labels, {config.epochs} epochs", "training")]
    return [evaluation_phase(config)]


def linear_eval(config: Config, data: tfmp_data.ImageData, runtime: Runtime, directory: RunDirectory,
                extra_callbacks=(), progress: Phases | None = None) -> dict:
    """`--task=linear_eval --encoder=PATH`: linear probe and kNN of a saved encoder."""
    (progress or Phases(phases(config))).start(0)
    encoder = load_encoder(config.encoder)  # checked by check_encoder_inputs before the run started
    if tuple(encoder.input_shape[1:]) != tuple(data.image_shape):  # a ViT at another resolution than it learned
        encoder = export.adopt(encoder, conv_weight_gradient=runtime.conv_weight_gradient)
    return {"encoder": config.encoder, **evaluate_over_draws(config, data, encoder, runtime.jit_compile)}


def finetune(config: Config, data: tfmp_data.ImageData, runtime: Runtime, directory: RunDirectory,
             extra_callbacks=(), progress: Phases | None = None) -> dict:
    """`--task=finetune --encoder=PATH`: train the saved encoder + a linear head on the labeled fraction."""
    (progress or Phases(phases(config))).start(0)
    with runtime.strategy.scope():
        # back to tfmp's fused BatchNorm and Conv2D for training
        encoder = export.adopt(load_encoder(config.encoder), conv_weight_gradient=runtime.conv_weight_gradient)
    labeled = labeled_indices(config, data)
    metrics = fit_classifier(config, data, runtime, directory, indices=labeled, encoder=encoder, extra_callbacks=extra_callbacks)
    return {"encoder": config.encoder, "labeled_examples": int(len(labeled)), **metrics}


LINEAR_EVAL = tasks.Task(linear_eval, check_encoder_inputs, phases)
FINETUNE = tasks.Task(finetune, check_encoder_inputs, phases)
