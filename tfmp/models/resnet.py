"""ResNets: `resnet18_cifar` (3x3 stem, no max-pool, for 32x32) and `resnet50` (ImageNet-style).

Written here rather than taken from `keras.applications` because tfmp needs control
that the applications do not give: synchronized BatchNorm (SimCLR across replicas),
BatchNorm momentum for small data sets, and block boundaries for activation
checkpointing (`remat="blocks"` makes each residual block one checkpointed segment,
`"full"` also each stage). `resnet18_cifar` is the same network as the PyTorch peer that
`experiments/benchmarks/run_benchmarks.py` times it against (the peer lives beside the repository,
in the project's shared benchmark folder, not in it), so the two can be timed side by side.
"""

from __future__ import annotations

import keras

from tfmp.models.layers import NormSettings, batch_norm, conv, conv_bn_relu
from tfmp.models.remat import checkpointed


def basic_block(x, filters: int, strides: int, norm: NormSettings, name: str, conv_weight_gradient: str = "auto"):
    """Two 3x3 convolutions with an identity (or 1x1 projection) shortcut."""
    shortcut = x
    if strides != 1 or x.shape[-1] != filters:
        shortcut = conv(filters, 1, strides, name=f"{name}_proj_conv", conv_weight_gradient=conv_weight_gradient)(x)
        shortcut = batch_norm(norm, name=f"{name}_proj_bn")(shortcut)
    x = conv_bn_relu(x, filters, 3, norm, strides, name=f"{name}_a", conv_weight_gradient=conv_weight_gradient)
    x = conv(filters, 3, name=f"{name}_b_conv", conv_weight_gradient=conv_weight_gradient)(x)
    x = batch_norm(norm, name=f"{name}_b_bn")(x)
    x = keras.layers.Add(name=f"{name}_add")([x, shortcut])
    return keras.layers.ReLU(name=f"{name}_out")(x)


def bottleneck_block(x, filters: int, strides: int, norm: NormSettings, name: str, conv_weight_gradient: str = "auto"):
    """1x1 reduce, 3x3 (strided), 1x1 expand to 4x filters; last BN starts at zero."""
    shortcut = x
    if strides != 1 or x.shape[-1] != 4 * filters:
        shortcut = conv(4 * filters, 1, strides, name=f"{name}_proj_conv", conv_weight_gradient=conv_weight_gradient)(x)
        shortcut = batch_norm(norm, name=f"{name}_proj_bn")(shortcut)
    x = conv_bn_relu(x, filters, 1, norm, name=f"{name}_a", conv_weight_gradient=conv_weight_gradient)
    x = conv_bn_relu(x, filters, 3, norm, strides, name=f"{name}_b", conv_weight_gradient=conv_weight_gradient)
    x = conv(4 * filters, 1, name=f"{name}_c_conv", conv_weight_gradient=conv_weight_gradient)(x)
    x = batch_norm(norm, name=f"{name}_c_bn", zero_init=True)(x)
    x = keras.layers.Add(name=f"{name}_add")([x, shortcut])
    return keras.layers.ReLU(name=f"{name}_out")(x)


def _stage(x, block, filters: int, num_blocks: int, first_strides: int, norm: NormSettings, name: str, block_remat: str,
           conv_weight_gradient: str):
    for index in range(num_blocks):
        strides = first_strides if index == 0 else 1
        x = checkpointed(block, x, name=f"{name}_block{index}", remat=block_remat, filters=filters, strides=strides, norm=norm,
                         conv_weight_gradient=conv_weight_gradient)
    return x


def _resnet(inputs, x, block, blocks_per_stage, norm: NormSettings, name: str, remat: str, conv_weight_gradient: str) -> keras.Model:
    for stage, (filters, num_blocks) in enumerate(zip((64, 128, 256, 512), blocks_per_stage)):
        # remat="full": each stage is a checkpointed segment around its checkpointed blocks.
        stage_remat = "blocks" if remat == "full" else "none"
        x = checkpointed(_stage, x, name=f"stage{stage}", remat=stage_remat, block=block, filters=filters, num_blocks=num_blocks,
                         first_strides=2 if stage > 0 else 1, norm=norm, block_remat="none" if remat == "none" else "blocks",
                         conv_weight_gradient=conv_weight_gradient)
    features = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    return keras.Model(inputs, features, name=name)


def resnet18_cifar(input_shape: tuple[int, int, int], norm: NormSettings = NormSettings(), remat: str = "none",
                   conv_weight_gradient: str = "auto") -> keras.Model:
    """ResNet-18 for small images: 3x3 stride-1 stem, no max-pool, 512 features."""
    inputs = keras.Input(input_shape, name="images")
    x = conv_bn_relu(inputs, 64, 3, norm, name="stem", conv_weight_gradient=conv_weight_gradient)
    return _resnet(inputs, x, basic_block, (2, 2, 2, 2), norm, "resnet18_cifar", remat, conv_weight_gradient)


resnet18_cifar.minimum_image_size = 8


def resnet50(input_shape: tuple[int, int, int], norm: NormSettings = NormSettings(), remat: str = "none",
             conv_weight_gradient: str = "auto") -> keras.Model:
    """ResNet-50 (v1.5: stride in the 3x3 conv): 7x7 stride-2 stem, max-pool, 2048 features."""
    inputs = keras.Input(input_shape, name="images")
    x = conv_bn_relu(inputs, 64, 7, norm, strides=2, name="stem", conv_weight_gradient=conv_weight_gradient)
    x = keras.layers.MaxPooling2D(3, strides=2, padding="same", name="stem_pool")(x)
    return _resnet(inputs, x, bottleneck_block, (3, 4, 6, 3), norm, "resnet50", remat, conv_weight_gradient)


resnet50.minimum_image_size = 32
