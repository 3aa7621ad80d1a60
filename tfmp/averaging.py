"""An exponential moving average of the weights (`--ema_momentum`, Keras' name), kept beside the trained weights.

The average is Keras' own: the optimizer's `use_ema` option keeps a float32 copy of every trainable variable and
updates it after each applied step (`average <- m * average + (1 - m) * weight`, the first step copying the
weight), as optimizer state — so it is checkpointed with the optimizer, resumes exactly, runs under every
tf.distribute strategy, and under fp16 loss scaling skips the steps the `LossScaleOptimizer` skips (the inner
optimizer is not called on them).

What tfmp changes: Keras' `fit()` ends by overwriting the model's weights with the average
(`finalize_variable_values`), which loses the trained weights — a second `fit()` would continue from the average and
the two can no longer be compared. `average_weights` keeps the trained weights in the model; `averaged(model)` is
the context in which the model holds the average (to evaluate or export it), putting the trained weights back
after.

Under `--sharding=zero1|zero2` the average is one more slot of the sharded state: each replica keeps and updates its
chunks of it (`tfmp.sharding.ShardedOptimizer`), and `averaged` gathers it whole once.
"""

from __future__ import annotations

import contextlib

import keras

from tfmp import keras_internals
from tfmp.sharding import ShardedOptimizer


def innermost(optimizer: keras.optimizers.Optimizer) -> keras.optimizers.Optimizer:
    """The optimizer that updates the weights, inside any loss-scaling wrapper."""
    while isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    return optimizer


def _keep_trained_weights(var_list) -> None:
    """`finalize_variable_values` that leaves the model's weights as trained (Keras' would copy the average in)."""


def average_weights(optimizer: keras.optimizers.Optimizer, momentum: float) -> keras.optimizers.Optimizer:
    """Keeps an exponential moving average of the weights `optimizer` trains, with `momentum` (e.g. 0.999); returns
    `optimizer`. Call before the optimizer is built (before the first step)."""
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"ema_momentum must be in [0, 1), got {momentum}")
    inner = innermost(optimizer)
    if _is_sharded(inner):
        raise ValueError("call average_weights on the optimizer before wrapping it in ShardedOptimizer (its slots are "
                         "fixed when it is made)")
    if inner.built:
        raise ValueError("average_weights needs an optimizer that has not been built yet (call it before training)")
    inner.use_ema, inner.ema_momentum, inner.ema_overwrite_frequency = True, momentum, None
    inner.finalize_variable_values = _keep_trained_weights
    return optimizer


def has_average(optimizer) -> bool:
    if optimizer is None:
        return False
    inner = innermost(optimizer)
    if _is_sharded(inner):
        inner = inner.inner  # the optimizer zero1 wraps keeps the setting
    return bool(getattr(inner, "use_ema", False))


def _is_sharded(optimizer) -> bool:
    return isinstance(optimizer, ShardedOptimizer)


def _averages(optimizer) -> tuple[list, list]:
    """(the trained variables, their averages as arrays, in the same order)."""
    if _is_sharded(optimizer):
        if optimizer.replicas > 1:  # gathered from the replicas' chunks
            return optimizer.variables_in_order, optimizer.whole_averages()
        optimizer = optimizer.inner  # zero1 on one replica runs its inner optimizer unchanged
    return (keras_internals.optimizer_trainable_variables(optimizer),
            [average.numpy() for average in keras_internals.weight_averages(optimizer)])


@contextlib.contextmanager
def averaged(model: keras.Model, optimizer: keras.optimizers.Optimizer | None = None):
    """Inside, `model`'s trainable weights are the average `optimizer` (default: the model's) keeps; after, the
    trained weights again. Works on a model built under a strategy (every replica's copy is swapped)."""
    optimizer = innermost(optimizer or model.optimizer)
    variables, averages = _averages(optimizer)
    trained = [variable.numpy() for variable in variables]
    try:
        with model.distribute_strategy.scope():  # mirrored variables are assigned in their strategy's scope
            for variable, average in zip(variables, averages):
                variable.assign(average)
        yield model
    finally:
        with model.distribute_strategy.scope():
            for variable, value in zip(variables, trained):
                variable.assign(value)

