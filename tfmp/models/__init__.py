"""Models: encoders by name, and classifiers on top of them.

Encoders map images to a feature vector and are built under the active Keras dtype
policy (low-precision compute under `mixed_*`). Classifier logits come from a Dense
layer with a float32 policy, so logits and losses stay float32 whatever the policy.
"""

from __future__ import annotations

import keras

from tfmp.config import MODELS
from tfmp.models.cnn import small_cnn
from tfmp.models.layers import NormSettings
from tfmp.models.remat import check_mode
from tfmp.models.resnet import resnet18_cifar, resnet50

ENCODERS = {"small_cnn": small_cnn, "resnet18_cifar": resnet18_cifar, "resnet50": resnet50}
MINIMUM_IMAGE_SIZE = {"small_cnn": 8, "resnet18_cifar": 8, "resnet50": 32}
assert tuple(ENCODERS) == MODELS, "tfmp.config.MODELS must list exactly the encoders built here"


def check_image_size(name: str, input_shape: tuple[int, ...]) -> None:
    """Raises ValueError unless encoder `name` exists and takes images of `input_shape` (its
    downsampling needs a minimum size)."""
    if name not in ENCODERS:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(ENCODERS)}")
    if min(input_shape[:2]) < MINIMUM_IMAGE_SIZE[name]:
        raise ValueError(f"model {name} needs images of at least {MINIMUM_IMAGE_SIZE[name]}px, got {input_shape[0]}; set --image_size")


def build_encoder(name: str, input_shape: tuple[int, int, int], norm: NormSettings = NormSettings(),
                  remat: str = "none") -> keras.Model:
    """Builds the encoder called `name` for images of `input_shape`.

    `remat` is the activation checkpointing mode (`tfmp.models.remat`): none, blocks, full.

    Raises:
        ValueError: unknown name, or images too small for it.
    """
    check_image_size(name, input_shape)
    check_mode(remat)
    return ENCODERS[name](input_shape, norm=norm, remat=remat)


def build_classifier(encoder: keras.Model, num_classes: int, name: str = "classifier") -> keras.Model:
    """The encoder followed by a linear layer whose logits are float32."""
    inputs = keras.Input(encoder.input_shape[1:], name="images")
    logits = keras.layers.Dense(num_classes, dtype="float32", name="logits")(encoder(inputs))
    return keras.Model(inputs, logits, name=name)


from tfmp.models import export  # noqa: E402 — `tfmp.models.export.portable(model)`, after what it builds on

__all__ = ["ENCODERS", "NormSettings", "build_encoder", "build_classifier", "export"]
