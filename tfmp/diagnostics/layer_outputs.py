"""Seeing every leaf layer's output: shared by the precision doctor and the memory estimate."""

from __future__ import annotations

import contextlib

import keras
import tensorflow as tf

from tfmp import keras_internals


def leaf_layers(model: keras.Model) -> list[keras.layers.Layer]:
    """The layers that compute (no sub-layers, not inputs), through nested models."""
    return [layer for layer in keras_internals.leaf_layers(model) if not isinstance(layer, keras.layers.InputLayer)]


def display_names(layers: list[keras.layers.Layer]) -> dict[keras.layers.Layer, str]:
    """Each layer's name, or its path where the name repeats: the sub-layers of every `MultiHeadAttention` are
    called `query`, `key`, ... and are told apart as `block0_attention/query`."""
    counts: dict[str, int] = {}
    for layer in layers:
        counts[layer.name] = counts.get(layer.name, 0) + 1
    return {layer: (getattr(layer, "path", None) or layer.name) if counts[layer.name] > 1 else layer.name for layer in layers}


@contextlib.contextmanager
def captured_outputs(model: keras.Model):
    """Within the block, every floating-point output of a leaf layer is appended to the
    yielded list as `(name, tensor)` (`display_names`). Each layer's `call` is wrapped for the
    duration and restored afterwards, so nested models are seen layer by layer."""
    captured: list[tuple[str, tf.Tensor]] = []
    originals = {}
    layers = leaf_layers(model)
    names = display_names(layers)
    for layer in layers:
        originals[layer] = layer.call

        def recording_call(*args, _call=layer.call, _name=names[layer], **kwargs):
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
