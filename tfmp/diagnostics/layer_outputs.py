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
def observed_calls(layers: list, observe):
    """Within the block, `observe(layer, args, output)` runs after each call of one of `layers`: each layer's `call` is
    wrapped for the duration and restored afterwards."""
    originals = {layer: layer.call for layer in layers}
    for layer in layers:
        def observed_call(*args, _layer=layer, _call=layer.call, **kwargs):
            output = _call(*args, **kwargs)
            observe(_layer, args, output)
            return output

        layer.call = observed_call
    try:
        yield
    finally:
        for layer, call in originals.items():
            layer.call = call


@contextlib.contextmanager
def captured_outputs(model: keras.Model):
    """Within the block, every floating-point output of a leaf layer is appended to the
    yielded list as `(name, tensor)` (`display_names`), so nested models are seen layer by layer."""
    captured: list[tuple[str, tf.Tensor]] = []
    layers = leaf_layers(model)
    names = display_names(layers)

    def capture(layer, args, output):
        if isinstance(output, tf.Tensor) and output.dtype.is_floating:
            captured.append((names[layer], output))

    with observed_calls(layers, capture):
        yield captured
