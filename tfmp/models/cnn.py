"""`small_cnn`: a compact BatchNorm CNN for 8x8 to 32x32 images (digits, MNIST-sized data)."""

from __future__ import annotations

import keras

from tfmp.models.layers import NormSettings, conv_bn_relu
from tfmp.models.remat import checkpointed


def small_cnn(input_shape: tuple[int, int, int], norm: NormSettings = NormSettings(), width: int = 32,
              remat: str = "none", conv_weight_gradient: str = "auto") -> keras.Model:
    """Three conv-BN-ReLU stages (width, 2x, 4x) and global average pooling.

    Downsamples (max-pool) only while the feature map stays at least 4x4, so the
    same encoder fits 8x8 digits and 28x28 or 32x32 images. With `remat="blocks"` each
    conv-BN-ReLU unit is one checkpointed segment (`tfmp.models.remat`).

    Returns:
        A functional model mapping images to `4 * width` features.
    """
    inputs = keras.Input(input_shape, name="images")
    x = inputs
    size = input_shape[0]
    for stage, filters in enumerate((width, 2 * width, 4 * width)):
        x = checkpointed(conv_bn_relu, x, name=f"stage{stage}", remat=remat, filters=filters, kernel_size=3, norm=norm,
                         conv_weight_gradient=conv_weight_gradient)
        if stage < 2 and size >= 16:
            x = keras.layers.MaxPooling2D(name=f"stage{stage}_pool")(x)
            size //= 2
    features = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    return keras.Model(inputs, features, name="small_cnn")


small_cnn.minimum_image_size = 8
