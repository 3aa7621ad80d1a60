"""Gradient clipping by the global norm of the true gradient (or each variable's by its own norm, `per_tensor`): after
the cross-replica sum, unscaled, alike on every replica.

Keras' `global_clipnorm` clips inside `Optimizer.apply`, which under tf.distribute runs on each replica before the
replicas' gradients are summed (Keras 3.15, `base_optimizer.py`: `_clip_gradients` comes before
`_backend_update_step`, whose `_all_reduce_sum_gradients` sums them): each replica clips its own partial gradient
by its own norm, so with N replicas the threshold acts on a different vector than on one device, and the replicas
scale by different factors. tfmp clips the summed gradient instead:

* an unsharded optimizer: `clip_after_reduction(optimizer, global_clipnorm)` moves the clipping into the sum
  (`keras_internals.transform_after_reduction`), so it costs no extra collective;
* `ShardedOptimizer`: the sharded step clips each replica's chunks by the global norm summed across replicas, or
  (`clipnorm`) each variable's chunks by that variable's norm summed across replicas (`tfmp.sharding.optimizer`).

The clipping lives in the optimizer object, not in Keras' config of it: an optimizer saved into a `.keras` file says
`global_clipnorm: None`, so call `clip_after_reduction` again on one loaded from a file. tfmp's own runs build their
optimizer from `--global_clipnorm` at every start, so a resumed run clips as before.

Under fp16 the loss-scale optimizer checks the gradients (an overflow on any replica skips the step on all) and
unscales them before the inner optimizer runs, so clipping sees the true gradient of a finite step only. The clipping
itself is `tf.clip_by_global_norm`, on the gradients of float32 variables (which every mixed policy keeps).
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tfmp import keras_internals


def clip_after_reduction(optimizer: keras.optimizers.Optimizer, global_clipnorm: float | None = None, *,
                         per_tensor: bool = False):
    """Makes `optimizer` clip by the global norm of the replicas' summed gradient; returns it.

    Args:
        optimizer: a Keras optimizer (AdamW, SGD, tfmp's LARS, ...), not yet wrapped for loss scaling.
        global_clipnorm: the threshold; None takes the optimizer's own `global_clipnorm` (Keras' name), which is
            then cleared so that Keras does not also clip each replica's gradient.
        per_tensor: clip each variable's summed gradient to the threshold by its own norm instead (Keras' `clipnorm`;
            DINO's `clip_grad`), still after the replicas' sum.
    """
    clipnorm = optimizer.global_clipnorm if global_clipnorm is None else global_clipnorm
    if not clipnorm or clipnorm <= 0:
        raise ValueError(f"global_clipnorm must be above 0, got {clipnorm}")
    if getattr(optimizer, "clipnorm", None) or getattr(optimizer, "clipvalue", None):
        raise ValueError(f"{type(optimizer).__name__} also clips per tensor (clipnorm / clipvalue); use one clipping")
    optimizer.global_clipnorm = None
    optimizer.clipped_after_reduction = float(clipnorm)
    keras_internals.transform_after_reduction(optimizer, lambda gradients: clipped(gradients, clipnorm, per_tensor))
    return optimizer


def clipped(gradients: list, clipnorm: float, per_tensor: bool = False) -> list:
    """`gradients` (whole ones: summed already) clipped to `clipnorm` by their global norm, or each by its own
    (`per_tensor`); a None gradient stays None."""
    if per_tensor:
        return [None if gradient is None else tf.clip_by_norm(gradient, clipnorm) for gradient in gradients]
    return tf.clip_by_global_norm(list(gradients), clipnorm)[0]
