"""Seeing every leaf layer's output: shared by the precision doctor and the memory estimate."""

from __future__ import annotations

import contextlib

import keras
import tensorflow as tf

from tfmp import keras_internals


def leaf_layers(model: keras.Model) -> list[keras.layers.Layer]:
    """The layers that compute (no sub-layers, not inputs), through nested models."""
    return [layer for layer in keras_internals.leaf_layers(model) if not isinstance(layer, keras.layers.InputLayer)]


@contextlib.contextmanager
def captured_outputs(model: keras.Model):
    """Within the block, every floating-point output of a leaf layer is appended to the
    yielded list as `(layer_name, tensor)`. Each layer's `call` is wrapped for the
    duration and restored afterwards, so nested models are seen layer by layer."""
    captured: list[tuple[str, tf.Tensor]] = []
    originals = {}
    for layer in leaf_layers(model):
        originals[layer] = layer.call

        def recording_call(*args, _call=layer.call, _name=layer.name, **kwargs):
            output = _call(*args, **kwargs)
            if isinstance(output, tf.Tensor) and output.dtype.is_floating:
                captured.append((_name, output))
            return output

        layer.call = recording_call
    try:
        yield captured
    finally:
        for layer, call in originals.items():
            layer.call = call
