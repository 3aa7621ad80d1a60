"""`--task=supervised`, and the classifier stages other tasks reuse (fine-tuning, the supervised baseline).

`fit_classifier` trains encoder + linear classifier on the train split (or a labeled subset of
it) and evaluates on the test split. The supervised baseline of an SSL run is the same stage
with `baseline_config`'s recipe, on the same labeled examples the probes see.
"""

from __future__ import annotations

import logging

import keras

from tfmp import data as tfmp_data
from tfmp import accumulation, averaging, compilation, models, optimizers, tasks
from tfmp.config import Config
from tfmp.diagnostics import flops
from tfmp.report import Phase, Phases
from tfmp.run_directory import RunDirectory
from tfmp.runtime import Runtime
from tfmp.tasks.stage import (apply_float32_layers, build_encoder, check_batch_fits, check_model_fits, fit_stage, largest_divisor_at_most,
                              steps_per_execution)

logger = logging.getLogger(__name__)

MAX_GROUPED_EPOCHS = 50  # one-step epochs per `fit()` epoch (see fit_classifier)


def fit_classifier(config: Config, data: tfmp_data.ImageData, runtime: Runtime, directory: RunDirectory, *,
                   indices=None, encoder: keras.Model | None = None, extra_callbacks=(), validate_every: int = 1,
                   quiet: bool = False, compiled: compilation.CompiledOnce | None = None) -> dict:
    """Trains encoder + linear classifier on the train split (or its `indices`); evaluates on test.

    Args:
        config: the stage's config (optimizer, learning rate, epochs, batch, ...).
        data: the data set.
        runtime: the run's decisions (strategy, XLA, conv weight gradient).
        directory: this stage's `checkpoints/` and `tensorboard/` go here; a rerun resumes.
        indices: train on this subset only (e.g. the labeled fraction). A global batch
            larger than the subset is reduced to fit it.
        encoder: start from this encoder (fine-tuning) instead of a new one.
        extra_callbacks: Keras callbacks added after tfmp's own.
        validate_every: evaluate on the test split every this many epochs (the
            supervised baseline's one-step epochs would otherwise spend most of their
            time validating).
        quiet: an inner stage (no epoch lines unless `--verbose`).
        compiled: train in this holder's compiled model, traced once (the first call given it
            compiles it); every call given the same holder must have the same config, data
            and subset size.

    Returns:
        `fit_stage`'s figures plus `eval_accuracy` and `eval_loss` on the test split.
    """
    replicas = runtime.num_replicas
    count = len(data.train) if indices is None else len(indices)
    batch = config.global_batch_size
    if indices is not None and batch > count:
        batch = max(replicas, count - count % replicas)
        (logger.debug if quiet else logger.info)("batch reduced to %d to fit the %d labeled examples", batch, count)
    check_batch_fits(batch, count, f"training examples of {data.name}")
    steps_per_epoch = count // batch
    config = config.replace(global_batch_size=batch)
    # One-step epochs (the baseline's 30 labeled images are one batch) are grouped into `fit()`
    # epochs of many steps over the repeated batch: the same optimisation (every step sees all
    # the examples, reshuffled, and the schedule counts the same steps), without paying Keras'
    # and tfmp's per-epoch work (iterator, callbacks, an epoch checkpoint) 200 times per stage.
    group = largest_divisor_at_most(config.epochs, MAX_GROUPED_EPOCHS) if steps_per_epoch == 1 else 1
    with runtime.strategy.scope():
        encoder = encoder or build_encoder(config, runtime, data.image_shape)
        model = models.build_classifier(encoder, data.num_classes)
        apply_float32_layers(model, config)

        def compile_model(model):
            model.compile(
                optimizer=optimizers.make_optimizer(config, steps_per_epoch),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
                jit_compile=runtime.keras_jit_compile,
                steps_per_execution=steps_per_execution(config, steps_per_epoch * group, runtime),
            )

        if compiled is None:
            compile_model(model)
        else:
            model = compiled.compile(model, compile_model)
        if config.layer_decay != 1.0:  # finetune of a ViT (checked before the run)
            optimizers.decay_learning_rate_by_layer(model.optimizer, model.trainable_variables, config.layer_decay)
        # A batch reduced to a small labeled subset takes the most micro-batches up to --gradient_accumulation_steps
        # that cut it evenly (it needs less memory than the batch the flag was chosen for).
        accumulation.accumulate_gradients(model, largest_divisor_at_most(batch // replicas, config.gradient_accumulation_steps))
    def train():
        return tfmp_data.classification_pipeline(data.train, batch, training=True, seed=config.seed, indices=indices)

    test = tfmp_data.classification_pipeline(data.test, batch, training=False)
    results = fit_stage(model, train, config.replace(epochs=config.epochs // group), directory, global_batch_size=batch,
                        steps_per_epoch=group if group > 1 else None, extra_callbacks=extra_callbacks,
                        validation_data=test, validate_every=max(1, validate_every // group), quiet=quiet,
                        flops_per_example=3 * flops.forward_flops_per_example(model, data.image_shape))
    evaluation = model.evaluate(test, return_dict=True, verbose=0)
    results.update(eval_accuracy=float(evaluation["accuracy"]), eval_loss=float(evaluation["loss"]))
    if averaging.has_average(model.optimizer):  # the moving average of the weights, evaluated beside them
        with averaging.averaged(model):
            evaluation = model.evaluate(test, return_dict=True, verbose=0)
        results.update(ema_eval_accuracy=float(evaluation["accuracy"]), ema_eval_loss=float(evaluation["loss"]))
    return results


def baseline_config(config: Config) -> Config:
    """The supervised-from-scratch recipe of an SSL run's baseline: AdamW at the baseline learning
    rate, no batch scaling, `--baseline_epochs`."""
    defaults = Config()
    return config.replace(optimizer="adamw", learning_rate=config.baseline_learning_rate, learning_rate_scaling="none",
                          epochs=config.baseline_epochs, weight_decay=defaults.weight_decay,
                          warmup_epochs=max(1.0, 0.05 * config.baseline_epochs), layer_decay=1.0)


def finetune_config(config: Config) -> Config:
    """The recipe `--compare_finetune` fine-tunes a pretrained encoder with: the baseline's, with `--layer_decay`."""
    return baseline_config(config).replace(layer_decay=config.layer_decay)


def check_inputs(config: Config, data: tfmp_data.ImageData) -> None:
    """What `--task=supervised` needs from the user's input, checked before anything is written."""
    check_batch_fits(config.global_batch_size, len(data.train), f"training examples of {data.name}")
    check_model_fits(config, data)


def phases(config: Config) -> list[Phase]:
    return [Phase(f"train {config.model}, {config.epochs} epochs", "training")]


def run(config: Config, data: tfmp_data.ImageData, runtime: Runtime, directory: RunDirectory,
        extra_callbacks=(), progress: Phases | None = None) -> dict:
    """`--task=supervised`: encoder + linear classifier on all train labels."""
    (progress or Phases(phases(config))).start(0)
    return fit_classifier(config, data, runtime, directory, extra_callbacks=extra_callbacks)


TASK = tasks.Task(run, check_inputs, phases)
