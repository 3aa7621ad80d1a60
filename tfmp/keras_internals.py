"""Every private Keras / TensorFlow hook tfmp touches, in one place, with the versions it was checked on.

tfmp builds on Keras' public API wherever one exists. Where it does not, the private
name is used here and nowhere else, so an upgrade has one file to re-check:

| hook | used by | why there is no public way |
|---|---|---|
| `Model._initial_epoch` | `Checkpointing` (resume) | the hook Keras' own `BackupAndRestore` sets |
| `Layer._flatten_layers` | `--float32_layers`, the precision doctor, FLOP counting | nested layers of any depth, Functional or subclassed |
| `LossScaleOptimizer._tf_apply`, `_stateful_handle_finite_grads`, `_stateful_handle_non_finite_grads`, `_overwrite_variable_with_gradient` | `tfmp.precision.LossScaleOptimizer` | floor, hysteresis, skip count, and the all-replica overflow decision (`tfmp/upstream.py`) are overrides of these |
| `keras.src.backend.tensorflow.trainer` (`TensorFlowTrainer._maybe_symbolic_build`, `reduce_per_replica`, `_collective_all_reduce_multi_worker`) | `tfmp/upstream.py` | the two multi-worker `fit()` fixes patch them |
| `tf.__internal__.distribute.strategy_supports_no_merge_call` | `tfmp/upstream.py` | which cross-replica path an optimizer step takes |
| `tf.__internal__.distribute.interim.maybe_merge_call` | `tfmp/ssl/momentum.py` (EMA target update) | the cross-replica update path Keras' optimizers take, with and without merge calls |

`CHECKED_KERAS_VERSIONS` names the Keras releases these were read and tested against
(tests/test_keras_internals.py fails if a hook disappears). Outside them, the first use
warns once; tfmp keeps working as long as the hooks exist.
"""

from __future__ import annotations

import functools
import logging

import keras

logger = logging.getLogger(__name__)

CHECKED_KERAS_VERSIONS = ("3.15",)  # major.minor releases read and tested
LOSS_SCALE_HOOKS = ("_tf_apply", "_stateful_handle_finite_grads", "_stateful_handle_non_finite_grads",
                    "_overwrite_variable_with_gradient", "check_finite")


@functools.lru_cache(maxsize=None)
def warn_if_unchecked() -> bool:
    """Warns once when the installed Keras is not a release these hooks were checked on; returns whether it is."""
    major_minor = ".".join(keras.__version__.split(".")[:2])
    if major_minor in CHECKED_KERAS_VERSIONS:
        return True
    logger.warning("tfmp: Keras %s is not a release tfmp's Keras hooks were checked on (%s); see tfmp/keras_internals.py",
                   keras.__version__, ", ".join(CHECKED_KERAS_VERSIONS))
    return False


def missing_hooks() -> list[str]:
    """Private names tfmp relies on that the installed Keras / TensorFlow lacks (empty when all are there)."""
    import tensorflow as tf

    missing = [f"LossScaleOptimizer.{name}" for name in LOSS_SCALE_HOOKS if not hasattr(keras.optimizers.LossScaleOptimizer, name)]
    trainer = tensorflow_trainer()
    missing += [f"trainer.{name}" for name in ("reduce_per_replica", "_collective_all_reduce_multi_worker") if not hasattr(trainer, name)]
    if not hasattr(trainer.TensorFlowTrainer, "_maybe_symbolic_build"):
        missing.append("TensorFlowTrainer._maybe_symbolic_build")
    if not hasattr(keras.layers.Layer, "_flatten_layers"):
        missing.append("Layer._flatten_layers")
    if not hasattr(tf.__internal__.distribute, "strategy_supports_no_merge_call"):
        missing.append("tf.__internal__.distribute.strategy_supports_no_merge_call")
    if not hasattr(tf.__internal__.distribute.interim, "maybe_merge_call"):
        missing.append("tf.__internal__.distribute.interim.maybe_merge_call")
    return missing


def set_initial_epoch(model: keras.Model, epoch: int) -> None:
    """Makes the running `fit()` start at `epoch` (what Keras' `BackupAndRestore` does on resume)."""
    warn_if_unchecked()
    model._initial_epoch = epoch


def nested_layers(layer: keras.layers.Layer) -> list[keras.layers.Layer]:
    """Every layer inside `layer`, at any depth (not `layer` itself)."""
    return list(layer._flatten_layers(include_self=False, recursive=True))


def leaf_layers(model: keras.layers.Layer) -> list[keras.layers.Layer]:
    """The layers inside `model` that hold no other layers."""
    return [layer for layer in nested_layers(model) if not list(layer._flatten_layers(include_self=False))]


def tensorflow_trainer():
    """Keras' TensorFlow trainer module (patched by `tfmp.upstream` for multi-worker `fit()`)."""
    from keras.src.backend.tensorflow import trainer

    warn_if_unchecked()
    return trainer


def strategy_supports_no_merge_call() -> bool:
    """Whether the current strategy runs optimizer updates without `merge_call` (XLA on all-GPU mirrored strategies)."""
    import tensorflow as tf

    return tf.__internal__.distribute.strategy_supports_no_merge_call()


def maybe_merge_call(fn, strategy, *args):
    """Runs `fn(distribution, *args)` in cross-replica context (or directly where the strategy needs no merge
    call), as Keras' TensorFlow optimizer applies its updates."""
    import tensorflow as tf

    return tf.__internal__.distribute.interim.maybe_merge_call(fn, strategy, *args)


def is_multi_worker(strategy) -> bool:
    """Keras' own test for a multi-worker collective strategy (the branch `tfmp.upstream` fixes)."""
    return tensorflow_trainer()._collective_all_reduce_multi_worker(strategy)
