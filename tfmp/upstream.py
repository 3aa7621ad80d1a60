"""Narrow workarounds for upstream bugs, each named with its issue and the versions it was checked on.

Keras 3 `Model.fit` under `tf.distribute.MultiWorkerMirroredStrategy` (TF 2.21 / Keras 3.15)
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

`apply_multi_worker_fixes()` installs both, once, and only affects multi-worker strategies:
every other strategy goes through Keras' original code. tfmp calls it when it creates a
`MultiWorkerMirroredStrategy`; tests/test_launch.py runs a real 2-worker job over loopback
gRPC and fails if either workaround stops being enough.
"""

from __future__ import annotations

import tensorflow as tf
from keras.src.backend.tensorflow import trainer as keras_tf_trainer
from keras import tree

_applied = False


def _is_multi_worker(strategy) -> bool:
    # Keras' own test for the branch that fails (a multi-worker collective strategy).
    return keras_tf_trainer._collective_all_reduce_multi_worker(strategy)


def _first_local_value(value):
    if isinstance(value, tf.distribute.DistributedValues):
        return value.values[0]
    return value


def apply_multi_worker_fixes() -> None:
    """Installs the two workarounds above (idempotent)."""
    global _applied
    if _applied:
        return
    original_symbolic_build = keras_tf_trainer.TensorFlowTrainer._maybe_symbolic_build
    original_reduce = keras_tf_trainer.reduce_per_replica

    def maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = self._distribute_strategy
        if strategy is None or not _is_multi_worker(strategy) or iterator is None:
            return original_symbolic_build(self, iterator=iterator, data_batch=data_batch)
        for _, _, batches in iterator:  # as Keras does: the first batch, for its shapes only
            data_batch = tree.map_structure(_first_local_value, next(batches))
            break
        with strategy.scope():
            self._symbolic_build(data_batch=data_batch)

    def reduce_per_replica(values, strategy, reduction):
        if reduction not in ("auto", "mean") or not _is_multi_worker(strategy):
            return original_reduce(values, strategy, reduction)

        def reduce(value):
            rank = _first_local_value(value).shape.rank
            return strategy.reduce("MEAN", value, axis=0 if rank else None)

        return tree.map_structure(reduce, values)

    keras_tf_trainer.TensorFlowTrainer._maybe_symbolic_build = maybe_symbolic_build
    keras_tf_trainer.reduce_per_replica = reduce_per_replica
    _applied = True
