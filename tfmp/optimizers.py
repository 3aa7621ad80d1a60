"""Optimizers and learning-rate schedules, from Keras' own pieces.

`make_optimizer` builds the configured optimizer with linear warmup and cosine decay
(Keras' `CosineDecay` with `warmup_steps`), keeps biases and BatchNorm parameters out
of weight decay, and wraps it for loss scaling under `mixed_float16`.
"""

from __future__ import annotations

import keras

from tfmp import precision

# Variables whose names contain these are excluded from weight decay.
NO_DECAY_NAMES = ("bias", "gamma", "beta")


def warmup_cosine(peak_learning_rate: float, total_steps: int, warmup_steps: int) -> keras.optimizers.schedules.LearningRateSchedule:
    """Linear warmup from 0 to `peak_learning_rate`, then cosine decay to 0 at `total_steps`."""
    warmup_steps = min(warmup_steps, total_steps - 1)
    if warmup_steps <= 0:
        return keras.optimizers.schedules.CosineDecay(peak_learning_rate, decay_steps=max(total_steps, 1))
    return keras.optimizers.schedules.CosineDecay(
        initial_learning_rate=0.0,
        decay_steps=total_steps - warmup_steps,
        warmup_target=peak_learning_rate,
        warmup_steps=warmup_steps,
    )


def make_optimizer(config, steps_per_epoch: int) -> keras.optimizers.Optimizer:
    """The optimizer a `tfmp.config.Config` asks for, loss-scaled where the policy needs it.

    Call inside the strategy scope, after `precision.set_policy`.
    """
    total_steps = steps_per_epoch * config.epochs
    schedule = warmup_cosine(config.learning_rate, total_steps, round(config.warmup_epochs * steps_per_epoch))
    if config.optimizer == "sgd":
        optimizer = keras.optimizers.SGD(schedule, momentum=0.9, nesterov=True, weight_decay=config.weight_decay or None)
    else:
        optimizer = keras.optimizers.AdamW(schedule, weight_decay=config.weight_decay)
    if config.weight_decay:
        optimizer.exclude_from_weight_decay(var_names=list(NO_DECAY_NAMES))
    return precision.wrap_optimizer(
        optimizer,
        loss_scale=config.loss_scale,
        initial_scale=config.initial_loss_scale,
        growth_steps=config.loss_scale_growth_steps,
    )
