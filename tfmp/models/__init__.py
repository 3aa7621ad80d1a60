"""Models: encoders by name, and classifiers on top of them.

Encoders map images to a feature vector and are built under the active Keras dtype
policy (low-precision compute under `mixed_*`). Classifier logits come from a Dense
layer with a float32 policy, so logits and losses stay float32 whatever the policy.
"""

from __future__ import annotations

import re

import keras

from tfmp import registry
from tfmp.models.layers import NormSettings
from tfmp.models.remat import check_mode


def check_image_size(name: str, input_shape: tuple[int, ...]) -> None:
    """Raises ValueError unless encoder `name` is registered and takes images of `input_shape` (its
    downsampling needs the builder's `minimum_image_size`; a ViT's sides must be multiples of its `patch_size`)."""
    builder = registry.ENCODERS.load(name)
    minimum = getattr(builder, "minimum_image_size", 1)
    if min(input_shape[:2]) < minimum:
        raise ValueError(f"model {name} needs images of at least {minimum}px, got {input_shape[0]}; set --image_size")
    patch = getattr(builder, "patch_size", 1)
    if input_shape[0] % patch or input_shape[1] % patch:
        raise ValueError(f"model {name} cuts {patch}x{patch} patches: the image size must be a multiple of {patch}, "
                         f"got {input_shape[0]}x{input_shape[1]}; set --image_size")


def takes_drop_path(name: str) -> bool:
    """Whether encoder `name` has stochastic depth (`--drop_path_rate`): the ViTs."""
    return getattr(registry.ENCODERS.load(name), "takes_drop_path", False)


def build_encoder(name: str, input_shape: tuple[int, int, int], norm: NormSettings = NormSettings(), *,
                  remat: str = "none", conv_weight_gradient: str = "auto", drop_path_rate: float = 0.0) -> keras.Model:
    """Builds the encoder registered as `name` (`tfmp.registry.ENCODERS`) for images of `input_shape`.

    Args:
        name: the encoder (`--model`).
        input_shape: one image's shape.
        norm: BatchNorm settings.
        remat: activation checkpointing (`tfmp.models.remat`): none, blocks, full.
        conv_weight_gradient: the weight-gradient mode of its convolutions (`tfmp.models.conv`).
        drop_path_rate: stochastic depth of the last block (ViTs only; the rate rises linearly to it).

    Raises:
        ValueError: unknown name, images too small for it, or stochastic depth asked of an encoder without it.
    """
    check_image_size(name, input_shape)
    check_mode(remat)
    options = {}
    if drop_path_rate:
        if not takes_drop_path(name):
            raise ValueError(f"model {name} has no stochastic depth: --drop_path_rate is for the ViT encoders")
        options["drop_path_rate"] = drop_path_rate
    return registry.ENCODERS.load(name)(input_shape, norm=norm, remat=remat, conv_weight_gradient=conv_weight_gradient,
                                        **options)


def build_classifier(encoder: keras.Model, num_classes: int, name: str = "classifier") -> keras.Model:
    """The encoder followed by a linear layer whose logits are float32."""
    inputs = keras.Input(encoder.input_shape[1:], name="images")
    logits = keras.layers.Dense(num_classes, dtype="float32", name="logits")(encoder(inputs))
    return keras.Model(inputs, logits, name=name)


# A block's layers are named after it (`tfmp.models.remat.checkpointed`): `block3_attention` (ViTs),
# `stage2_block1_a_conv` (ResNets), `decoder_block0_mlp_hidden` (MAE's decoder); a variable's path starts with them.
_BLOCK_LAYER = re.compile(r"((?:[A-Za-z0-9]+_)*?block\d+)(?:_|$)")


def block_of(variable) -> str | None:
    """The transformer or residual block of a tfmp model a weight belongs to, from its path (`block3` for
    `block3_attention/query/kernel`, `stage2_block1` for `stage2_block1_a_conv/kernel`, with the path segments before
    it), or None (a stem, a head, a final norm). zero3's FSDP units in tfmp's CLI
    (`tfmp.sharding.ShardedOptimizer(units=...)`): a block's weights are gathered together, with or without `--remat`
    (under it the block's variables keep these paths)."""
    segments = variable.path.split("/")
    for depth, segment in enumerate(segments[:-1]):
        match = _BLOCK_LAYER.match(segment)
        if match:
            return "/".join([*segments[:depth], match.group(1)])
    return None


from tfmp.models import export  # noqa: E402 — `tfmp.models.export.portable(model)`, after what it builds on

__all__ = ["NormSettings", "block_of", "build_encoder", "build_classifier", "check_image_size", "takes_drop_path", "export"]
