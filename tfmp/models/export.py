"""Models anyone can load: tfmp's layers swapped for Keras' own, weights and statistics carried over.

tfmp trains with layers of its own (`tfmp>BatchNormalization`, the fused kernel;
`tfmp>Conv2D`, a tap-matmul weight gradient where measured faster; `tfmp>CheckpointedBlock`,
activation checkpointing; `tfmp>PatchEmbedding`, a ViT's patches and position embedding at any
resolution; `tfmp>Dense` and `tfmp>LayerNormalization`, a ViT's GELU and LayerNorm as XLA programs). A `.keras` file
holding them loads only where tfmp is imported.
`portable(model)` returns the same network built from Keras layers only — Keras'
`BatchNormalization` with the same settings, gamma, beta and moving statistics; Keras' `Conv2D`,
`Dense` and `LayerNormalization` with the same config and weights; each checkpointed block inlined as the plain
sub-model it wraps; a ViT's patch embedding as Keras' Reshape / Permute / Reshape / EinsumDense at the resolution its position
embedding was learned at — so `keras.saving.load_model` loads it in safe mode without tfmp and computes what the
trained model computes (tfmp's BatchNorm differs from Keras' only in round-off:
tests/test_export.py).

Each layer keeps its dtype policy: an encoder trained under `mixed_bfloat16` is exported
with bf16 compute and float32 weights (say `keras.models.clone_model` with another policy
to change it). `adopt(model)` is the way back, for fine-tuning with tfmp's fused BatchNorm, Conv2D, GELU and LayerNorm.
"""

from __future__ import annotations

import keras

from tfmp.models import fused, vit
from tfmp.models.conv import Conv2D
from tfmp.models.layers import BatchNormalization
from tfmp.models.remat import CheckpointedBlock


KERAS_OF_FUSED = {fused.Dense: keras.layers.Dense, fused.LayerNormalization: keras.layers.LayerNormalization}
FUSED_OF_KERAS = {keras_class: fused_class for fused_class, keras_class in KERAS_OF_FUSED.items()}


def _clone(model: keras.Model, replace, call=None, input_tensors=None) -> keras.Model:
    clone = keras.models.clone_model(model, clone_function=replace, call_function=call, input_tensors=input_tensors)
    # A ViT's position embedding changes shape, (rows, columns, width) <-> (tokens, width): the same values.
    for weight, value in zip(clone.weights, model.get_weights()):
        weight.assign(value.reshape(weight.shape))
    return clone


def portable(model: keras.Model) -> keras.Model:
    """`model` (functional) rebuilt from Keras' own layers, with the same weights and statistics. A ViT is exported
    at the resolution its position embedding was learned at (`tfmp.models.vit.keras_patch_layers`)."""

    def replace(layer):
        if isinstance(layer, BatchNormalization):
            config = layer.get_config()
            config.pop("fused")
            return keras.layers.BatchNormalization.from_config(config)
        if isinstance(layer, Conv2D):  # the same config; only the gradient differs
            config = layer.get_config()
            config.pop("conv_weight_gradient")
            return keras.layers.Conv2D.from_config(config)
        if type(layer) in KERAS_OF_FUSED:  # the same config; only the computation differs
            return KERAS_OF_FUSED[type(layer)].from_config(layer.get_config())
        if isinstance(layer, CheckpointedBlock):
            return portable(layer.block)
        if isinstance(layer, keras.Model):
            return portable(layer)
        return layer.__class__.from_config(layer.get_config())

    def call(layer, *args, **kwargs):
        if isinstance(layer, vit.PatchEmbedding):
            return vit.keras_patch_layers(args[0], layer)
        return layer(*args, **kwargs)

    embeddings = [layer for layer in model.layers if isinstance(layer, vit.PatchEmbedding)]
    input_tensors = None
    if embeddings:
        (rows, columns), patch = embeddings[0].grid, embeddings[0].patch
        input_tensors = keras.Input((rows * patch, columns * patch, model.input_shape[-1]), name=model.inputs[0].name)
    return _clone(model, replace, call, input_tensors)


def adopt(model: keras.Model, conv_weight_gradient: str = "auto") -> keras.Model:
    """The inverse of `portable`: Keras' BatchNormalization and Conv2D layers become tfmp's (same
    settings, weights and statistics; convolutions in mode `conv_weight_gradient`), for training under tfmp; a
    ViT's patch layers become `PatchEmbedding` again, taking images of any size."""
    embedding = vit.patch_embedding_of(model)

    def replace(layer):
        if type(layer) is keras.layers.BatchNormalization:
            return BatchNormalization.from_config(layer.get_config())
        if type(layer) is keras.layers.Conv2D:
            return Conv2D.from_config({**layer.get_config(), "conv_weight_gradient": conv_weight_gradient})
        if type(layer) is keras.layers.LayerNormalization or (type(layer) is keras.layers.Dense
                                                              and layer.get_config()["activation"] == "gelu"):
            return FUSED_OF_KERAS[type(layer)].from_config(layer.get_config())
        if isinstance(layer, keras.Model):
            return adopt(layer, conv_weight_gradient)
        return layer.__class__.from_config(layer.get_config())

    def call(layer, *args, **kwargs):
        if embedding is not None and layer.name == "patch_grid":
            return embedding(args[0])
        if embedding is not None and layer.name in vit.KERAS_PATCH_LAYERS:
            return args[0]  # computed by the embedding above
        return layer(*args, **kwargs)

    input_tensors = None
    if embedding is not None:
        input_tensors = keras.Input((None, None, model.input_shape[-1]), name=model.inputs[0].name)
    return _clone(model, replace, call, input_tensors)


def takes_images_of(model: keras.Model, image_shape) -> bool:
    """Whether `model` (as saved, or after `adopt`) takes images of `image_shape`: its input's shape, or any size
    whose sides are multiples of the patch for a ViT."""
    embedding = vit.patch_embedding_of(model) or next(
        (layer for layer in model.layers if isinstance(layer, vit.PatchEmbedding)), None)
    expected = tuple(model.input_shape[1:])
    if embedding is None:
        return expected == tuple(image_shape)
    return (expected[-1] == image_shape[-1] and image_shape[0] % embedding.patch == 0
            and image_shape[1] % embedding.patch == 0)


def uses_only_keras_layers(model: keras.Model) -> bool:
    """Whether every layer of `model` (nested ones included) is one Keras itself provides."""
    from tfmp import keras_internals

    return all(type(layer).__module__.startswith("keras.") for layer in keras_internals.nested_layers(model))
