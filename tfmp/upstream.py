"""Narrow workarounds for upstream bugs, each named with its issue and the versions it was checked on.

The private Keras names used here are fenced in `tfmp/keras_internals.py`.

A. Loss scaling under tf.distribute (Keras 3.15 / TF 2.21; report text and reproducer:
   experiments/upstream/loss_scale_overflow_on_one_replica.py). `LossScaleOptimizer._tf_apply`
   checks `isfinite` on each replica's *local* gradients and, inside `merge_call`, takes
   replica 0's answer, assuming the gradients were already all-reduced (true in tf.keras 2,
   not in Keras 3, whose inner optimizer all-reduces later). With an fp16 overflow on replica
   1 only, the step is applied and every weight becomes NaN. `apply_loss_scaled_step` decides
   once for all replicas — an all-reduce of the non-finite flags — before either path Keras
   takes (merge_call, or no merge_call under XLA on all-GPU mirrored strategies), so every
   replica skips or applies the same step. tfmp's `LossScaleOptimizer.apply_scaled_step` calls it;
   tests/test_loss_scale_replicas.py fails if a replica's overflow is missed again (in `fit()`,
   in a `strategy.run` loop, and on two workers).

B. Keras 3 `Model.fit` under `tf.distribute.MultiWorkerMirroredStrategy` (TF 2.21 / Keras 3.15)
fails on two workers, at two places inside Keras' TensorFlow trainer:

1. `TensorFlowTrainer._maybe_symbolic_build` builds the model from the first distributed
   batch by MEAN-reducing it across workers with `strategy.reduce(..., axis=None)`; the
   collective runtime rejects that eager all-reduce of a PerReplica batch
   (keras-team/keras#20585). Only the batch's shapes and dtypes matter for building, so
   the workaround builds from this worker's first local replica value instead.
2. `reduce_per_replica(..., reduction="auto")` maps "auto" to "mean" and, for a
   multi-worker strategy, calls `strategy.reduce("MEAN", v, axis=0)` on every value,
   including the scalar loss and metrics, which have no axis 0
   (tensorflow/tensorflow#72388). The workaround reduces scalars with `axis=None` (the
   mean over replicas) and leaves everything else to Keras.

`apply_multi_worker_fixes()` installs B's two fixes, once, and only affects multi-worker strategies:
every other strategy goes through Keras' original code. tfmp calls it when it creates a
`MultiWorkerMirroredStrategy`; tests/test_launch.py runs a real 2-worker job over loopback
gRPC and fails if either workaround stops being enough.
"""

from __future__ import annotations

import tensorflow as tf
from keras import ops, tree

from tfmp import keras_internals


def finite_on_every_replica(locally_finite: tf.Tensor) -> tf.Tensor:
    """True only where every replica's gradients are finite (call in replica context)."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return locally_finite
    non_finite_replicas = context.all_reduce(tf.distribute.ReduceOp.SUM, tf.cast(tf.logical_not(locally_finite), tf.float32))
    return tf.equal(non_finite_replicas, 0.0)


def apply_loss_scaled_step(optimizer: keras_internals.LossScaleOptimizerHooks, grads, trainable_variables=None) -> None:
    """Keras' loss-scaled step with the finite/non-finite decision taken over all replicas (A above)."""
    if tf.distribute.in_cross_replica_context():
        raise ValueError("apply() must be called in a replica context.")
    finite = finite_on_every_replica(optimizer.check_finite(grads))
    if keras_internals.strategy_supports_no_merge_call():
        ops.cond(finite, lambda: optimizer.on_finite_gradients(grads, trainable_variables), optimizer.on_non_finite_gradients)
        return

    def cross_replica(distribution, finite, grads, trainable_variables):
        # Every replica holds the same answer now; the update itself must run in cross-replica
        # context, since the inner optimizer's apply calls merge_call (as in Keras).
        everywhere_finite = distribution.experimental_local_results(finite)[0]

        def apply_everywhere():
            distribution.extended.call_for_each_replica(optimizer.on_finite_gradients, args=(grads, trainable_variables))

        ops.cond(everywhere_finite, apply_everywhere, optimizer.on_non_finite_gradients)

    tf.distribute.get_replica_context().merge_call(cross_replica, args=(finite, grads, trainable_variables))


def _first_local_value(value):
    if isinstance(value, tf.distribute.DistributedValues):
        return value.values[0]
    return value


def _build_from_local_batch(model, original, iterator, data_batch):
    """B.1: build from this worker's first local batch, under a multi-worker strategy."""
    strategy = model.distribute_strategy
    if not keras_internals.is_multi_worker(strategy) or iterator is None:
        return original(model, iterator=iterator, data_batch=data_batch)
    for _, _, batches in iterator:  # as Keras does: the first batch, for its shapes only
        data_batch = tree.map_structure(_first_local_value, next(batches))
        break
    with strategy.scope():
        keras_internals.build_from_batch(model, data_batch)


def _reduce_per_replica(values, strategy, reduction, original):
    """B.2: scalars reduced over replicas with axis=None, under a multi-worker strategy."""
    if reduction not in ("auto", "mean") or not keras_internals.is_multi_worker(strategy):
        return original(values, strategy, reduction)

    def reduce(value):
        rank = _first_local_value(value).shape.rank
        return strategy.reduce("MEAN", value, axis=0 if rank else None)

    return tree.map_structure(reduce, values)


def apply_multi_worker_fixes() -> None:
    """Installs the two workarounds of B (idempotent)."""
    keras_internals.patch_multi_worker_trainer(_build_from_local_batch, _reduce_per_replica)
