"""Vision Transformer encoders (ViT, Dosovitskiy et al. 2021) from Keras' own layers.

A ViT cuts the image into patches, projects each to a token, adds a learned position embedding, and runs pre-norm
transformer blocks (LayerNorm -> multi-head self-attention -> residual; LayerNorm -> GELU MLP -> residual). The
features are the mean of the final tokens after a last LayerNorm: global average pooling, as big_vision's plain ViT
baseline, instead of a CLS token (no extra token and no custom layer to carry it).

Only Keras' built-in layers are used, so a saved encoder loads without tfmp:

* patches: `Reshape` / `Permute` / `Reshape`, the same arithmetic as a stride-`patch` convolution;
* patch projection + position embedding: one `EinsumDense` whose bias spans (token, channel) — that bias is the
  learned position embedding (plus the projection's bias). It follows `--image_size`: the token count is fixed when
  the encoder is built;
* attention: `MultiHeadAttention` (in Keras 3.15 on TensorFlow it runs `ops.dot_product_attention`);
* stochastic depth: `Dropout` with `noise_shape=(None, 1, 1)`, which drops a sample's whole residual branch and
  scales the rest by 1 / (1 - rate) — DeiT's drop path — at rates rising linearly to `drop_path_rate` over the blocks.

Mixed precision (measured on Keras 3.15, tests/test_vit.py): the Dense, EinsumDense and attention matmuls run in the
policy's compute dtype; LayerNormalization computes its statistics and normalisation in float32 and returns the
compute dtype; attention casts its logits to float32 after the query-key product and takes the softmax in float32.

With `remat="blocks"` (or `"full"`: a ViT has no stages, so it is the same) each transformer block is one
checkpointed segment (`tfmp.models.remat`): the forward pass keeps one (tokens, width) tensor per block.
"""

from __future__ import annotations

import dataclasses

import keras

from tfmp.models.layers import NormSettings
from tfmp.models.remat import checkpointed


@dataclasses.dataclass(frozen=True)
class ViTSize:
    """One ViT configuration: patch side, token width, blocks, attention heads, MLP width."""

    patch: int
    width: int
    depth: int
    heads: int
    mlp_width: int


SIZES = {
    # For digits-sized images (8x8 to 16x16): 16 to 64 tokens.
    "vit_micro_p2": ViTSize(patch=2, width=64, depth=4, heads=4, mlp_width=128),
    # ViT-Ti/4 for 32x32 images (CIFAR): 64 tokens.
    "vit_tiny_p4": ViTSize(patch=4, width=192, depth=12, heads=3, mlp_width=768),
    # ViT-S/16 and ViT-B/16 for 224x224 (ImageNet): 196 tokens.
    "vit_small_p16": ViTSize(patch=16, width=384, depth=12, heads=6, mlp_width=1536),
    "vit_base_p16": ViTSize(patch=16, width=768, depth=12, heads=12, mlp_width=3072),
}


def patch_tokens(images, patch: int, width: int):
    """Images (batch, height, width, channels) -> tokens (batch, patches, width) with the position embedding added."""
    height, image_width, channels = images.shape[1:]
    rows, columns = height // patch, image_width // patch
    x = keras.layers.Reshape((rows, patch, columns, patch, channels), name="patch_grid")(images)
    x = keras.layers.Permute((1, 3, 2, 4, 5), name="patch_order")(x)
    x = keras.layers.Reshape((rows * columns, patch * patch * channels), name="patches")(x)
    # The bias over (token, channel) is the learned position embedding.
    return keras.layers.EinsumDense("btp,pc->btc", output_shape=(rows * columns, width), bias_axes="tc",
                                    kernel_initializer=keras.initializers.LecunNormal(),
                                    bias_initializer=keras.initializers.TruncatedNormal(stddev=0.02),
                                    name="patch_embedding")(x)


def encoder_block(x, name: str, *, heads: int, mlp_width: int, drop_path: float = 0.0):
    """One pre-norm transformer block."""
    width = x.shape[-1]

    def drop_path_layer(branch, part):
        if not drop_path:
            return branch
        return keras.layers.Dropout(drop_path, noise_shape=(None, 1, 1), name=f"{name}_{part}_drop_path")(branch)

    y = keras.layers.LayerNormalization(epsilon=1e-6, name=f"{name}_attention_norm")(x)
    y = keras.layers.MultiHeadAttention(heads, key_dim=width // heads, name=f"{name}_attention")(y, y)
    x = keras.layers.Add(name=f"{name}_attention_residual")([x, drop_path_layer(y, "attention")])
    y = keras.layers.LayerNormalization(epsilon=1e-6, name=f"{name}_mlp_norm")(x)
    y = keras.layers.Dense(mlp_width, activation="gelu", name=f"{name}_mlp_hidden")(y)
    y = keras.layers.Dense(width, name=f"{name}_mlp_output")(y)
    return keras.layers.Add(name=f"{name}_mlp_residual")([x, drop_path_layer(y, "mlp")])


def vision_transformer(input_shape: tuple[int, int, int], size: ViTSize, name: str, *, remat: str = "none",
                       drop_path_rate: float = 0.0) -> keras.Model:
    """A ViT encoder mapping images to `size.width` features (mean of the final tokens).

    Raises:
        ValueError: the image sides are not multiples of the patch side.
    """
    if input_shape[0] % size.patch or input_shape[1] % size.patch:
        raise ValueError(f"{name}: image sides {input_shape[:2]} are not multiples of the patch side {size.patch}")
    inputs = keras.Input(input_shape, name="images")
    x = patch_tokens(inputs, size.patch, size.width)
    for block in range(size.depth):
        rate = drop_path_rate * block / max(size.depth - 1, 1)
        x = checkpointed(encoder_block, x, name=f"block{block}", remat=remat, heads=size.heads, mlp_width=size.mlp_width,
                         drop_path=rate)
    x = keras.layers.LayerNormalization(epsilon=1e-6, name="final_norm")(x)
    features = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    return keras.Model(inputs, features, name=name)


def _builder(name: str):
    size = SIZES[name]

    def build(input_shape: tuple[int, int, int], norm: NormSettings = NormSettings(), remat: str = "none",
              conv_weight_gradient: str = "auto", drop_path_rate: float = 0.0) -> keras.Model:
        del norm, conv_weight_gradient  # no BatchNorm, no convolution
        return vision_transformer(input_shape, size, name, remat=remat, drop_path_rate=drop_path_rate)

    build.__name__ = build.__qualname__ = name
    build.__doc__ = f"{name}: {size}."
    build.minimum_image_size = size.patch
    build.patch_size = size.patch
    build.takes_drop_path = True
    return build


vit_micro_p2 = _builder("vit_micro_p2")
vit_tiny_p4 = _builder("vit_tiny_p4")
vit_small_p16 = _builder("vit_small_p16")
vit_base_p16 = _builder("vit_base_p16")
