"""Models anyone can load: tfmp's layers swapped for Keras' own, weights and statistics carried over.

tfmp trains with three layers of its own (`tfmp>BatchNormalization`, the fused kernel;
`tfmp>Conv2D`, a tap-matmul weight gradient where measured faster; `tfmp>CheckpointedBlock`, activation
checkpointing). A `.keras` file holding them loads only where tfmp is imported.
`portable(model)` returns the same network built from Keras layers only — Keras'
`BatchNormalization` with the same settings, gamma, beta and moving statistics; Keras' `Conv2D`
with the same config and kernel; each checkpointed block inlined as the plain sub-model it
wraps — so `keras.saving.load_model` loads it in safe mode without tfmp and computes what the
trained model computes (tfmp's BatchNorm differs from Keras' only in round-off:
tests/test_export.py).

Each layer keeps its dtype policy: an encoder trained under `mixed_bfloat16` is exported
with bf16 compute and float32 weights (say `keras.models.clone_model` with another policy
to change it). `adopt(model)` is the way back, for fine-tuning with tfmp's fused BatchNorm and Conv2D.
"""

from __future__ import annotations

import keras

from tfmp.models.conv import Conv2D
from tfmp.models.layers import BatchNormalization
from tfmp.models.remat import CheckpointedBlock


def _clone(model: keras.Model, replace) -> keras.Model:
    clone = keras.models.clone_model(model, clone_function=replace)
    clone.set_weights(model.get_weights())
    return clone


def portable(model: keras.Model) -> keras.Model:
    """`model` (functional) rebuilt from Keras' own layers, with the same weights and statistics."""

    def replace(layer):
        if isinstance(layer, BatchNormalization):
            config = layer.get_config()
            config.pop("fused")
            return keras.layers.BatchNormalization.from_config(config)
        if isinstance(layer, Conv2D):  # the same config; only the gradient differs
            config = layer.get_config()
            config.pop("conv_weight_gradient")
            return keras.layers.Conv2D.from_config(config)
        if isinstance(layer, CheckpointedBlock):
            return portable(layer.block)
        if isinstance(layer, keras.Model):
            return portable(layer)
        return layer.__class__.from_config(layer.get_config())

    return _clone(model, replace)


def adopt(model: keras.Model, conv_weight_gradient: str = "auto") -> keras.Model:
    """The inverse of `portable`: Keras' BatchNormalization and Conv2D layers become tfmp's (same
    settings, weights and statistics; convolutions in mode `conv_weight_gradient`), for training under tfmp."""

    def replace(layer):
        if type(layer) is keras.layers.BatchNormalization:
            return BatchNormalization.from_config(layer.get_config())
        if type(layer) is keras.layers.Conv2D:
            return Conv2D.from_config({**layer.get_config(), "conv_weight_gradient": conv_weight_gradient})
        if isinstance(layer, keras.Model):
            return adopt(layer, conv_weight_gradient)
        return layer.__class__.from_config(layer.get_config())

    return _clone(model, replace)


def uses_only_keras_layers(model: keras.Model) -> bool:
    """Whether every layer of `model` (nested ones included) is one Keras itself provides."""
    from tfmp import keras_internals

    return all(type(layer).__module__.startswith("keras.") for layer in keras_internals.nested_layers(model))
