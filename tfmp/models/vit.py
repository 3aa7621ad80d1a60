"""Vision Transformer encoders (ViT, Dosovitskiy et al. 2021) from Keras' own layers.

A ViT cuts the image into patches, projects each to a token, adds a learned position embedding, and runs pre-norm
transformer blocks (LayerNorm -> multi-head self-attention -> residual; LayerNorm -> GELU MLP -> residual). The
features are the mean of the final tokens after a last LayerNorm: global average pooling, as big_vision's plain ViT
baseline, instead of a CLS token (no extra token and no custom layer to carry it).

Keras' built-in layers, one of tfmp's own and two of Keras' with a faster computation inside:

* patches, their projection and the position embedding: `PatchEmbedding`, tfmp's one layer here. The position
  embedding is its own (rows, columns, width) weight, learned at the grid of `--image_size`; an image of another size
  gets it resized bicubically to its token grid (in float32, inside the step, as DINO does), so one encoder takes
  global and local crops of different sizes and a fine-tune at another resolution. The encoder's input is
  (None, None, channels); the sides must be multiples of the patch;
* attention: `MultiHeadAttention` (in Keras 3.15 on TensorFlow it runs `ops.dot_product_attention`);
* stochastic depth: `Dropout` with `noise_shape=(None, 1, 1)`, which drops a sample's whole residual branch and
  scales the rest by 1 / (1 - rate) — DeiT's drop path — at rates rising linearly to `drop_path_rate` over the blocks;
* LayerNorm and the MLP's exact GELU: Keras' `LayerNormalization` and `Dense(activation="gelu")` with the element-wise
  computation done by two small XLA programs each (`tfmp.models.fused`: the same function, the same config and weights;
  measured faster than TensorFlow's op-by-op kernels in float32 and bf16).

Mixed precision (measured on Keras 3.15, tests/test_vit.py): the Dense, EinsumDense and attention matmuls run in the
policy's compute dtype; LayerNorm computes its statistics and normalisation in float32 and returns the compute
dtype, as does the GELU (`tfmp.models.fused`); attention casts its logits to float32 after the query-key product and
takes the softmax in float32.

`tfmp.models.export.portable` writes the fused layers back as Keras' own and turns `PatchEmbedding` into the
Keras-only layout tfmp's ViTs had before they took any resolution — `Reshape` / `Permute` / `Reshape` (the arithmetic
of a stride-`patch` convolution) and one `EinsumDense` whose bias spans (token, channel), the position embedding plus
the projection's bias — at the resolution the embedding was learned at, so an exported `encoder.keras` loads without
tfmp; `adopt` turns that layout (today's exports and those written before) back into `PatchEmbedding`, taking any
resolution again, and Keras' LayerNormalization and GELU Dense into the fused ones.

With `remat="blocks"` (or `"full"`: a ViT has no stages, so it is the same) each transformer block is one
checkpointed segment (`tfmp.models.remat`): the forward pass keeps one (tokens, width) tensor per block.
"""

from __future__ import annotations

import dataclasses

import keras
import tensorflow as tf

from tfmp.models import fused
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


def cubic_resize_matrix(source, target) -> tf.Tensor:
    """The (target, source) float32 matrix of bicubic resizing along one axis: half-pixel centres, Keys' cubic kernel
    with a = -0.5, taps outside the source dropped and the rest renormalised, no antialiasing — PIL's and
    jax.image.resize's cubic when enlarging (PyTorch's, which DINO uses, has a = -0.75). Not `tf.image.resize`: its
    bicubic reads the kernel from a 1024-entry table (off by up to 2e-3 here) and XLA has no kernel for it; two small
    matmuls compile anywhere, for sizes known or not when traced, and differentiate."""
    source, target = tf.cast(source, tf.float32), tf.cast(target, tf.float32)
    centres = (tf.range(target) + 0.5) * source / target - 0.5
    taps = tf.floor(centres)[:, None] + tf.constant([-1.0, 0.0, 1.0, 2.0])
    distance = tf.abs(centres[:, None] - taps)
    weights = tf.where(distance <= 1, (1.5 * distance - 2.5) * distance ** 2 + 1,
                       tf.where(distance < 2, ((-0.5 * distance + 2.5) * distance - 4) * distance + 2, 0.0))
    weights = tf.where((taps >= 0) & (taps < source), weights, 0.0)
    weights /= tf.reduce_sum(weights, axis=1, keepdims=True)
    # tf.one_hot of a tap outside [0, source) is all zeros: those taps carry no weight anyway.
    return tf.einsum("tk,tks->ts", weights, tf.one_hot(tf.cast(taps, tf.int32), tf.cast(source, tf.int32)))


def grid_of(images, patch: int) -> tuple:
    """(rows, columns) of `patch`-sided patches of a batch of images: Python ints where the sides are known."""
    return tuple(side // patch if side is not None else tf.shape(images)[axis] // patch
                 for axis, side in ((1, images.shape[1]), (2, images.shape[2])))


def patches(images, patch: int) -> tf.Tensor:
    """Images (batch, height, width, channels) -> (batch, rows * columns, patch * patch * channels): each patch
    flattened (its rows first, then columns, then channels), the patches in row-major order — how a stride-`patch`
    convolution reads them, `PatchEmbedding`'s tokens and MAE's pixel targets."""
    rows, columns = grid_of(images, patch)
    channels = images.shape[-1]
    grid = tf.reshape(images, [-1, rows, patch, columns, patch, channels])
    grid = tf.transpose(grid, [0, 1, 3, 2, 4, 5])
    return tf.reshape(grid, [-1, rows * columns, patch * patch * channels])


@keras.saving.register_keras_serializable(package="tfmp")
class PatchEmbedding(keras.layers.Layer):
    """Images (batch, height, width, channels) -> tokens (batch, patches, width), position embedding added.

    Each `patch` x `patch` patch (rows first, as a stride-`patch` convolution reads them) is flattened and projected by
    `kernel`; `position`, a (rows, columns, width) grid learned at `grid`, is added — resized to the image's grid when
    it has another one, in float32 (`cubic_resize_matrix`). The projection has no bias of its own: a bias per (token,
    channel) is the position embedding's.

    Args:
        patch: the patch side in pixels.
        width: the token width.
        grid: (rows, columns) of patches the position embedding is learned at.
    """

    def __init__(self, patch: int, width: int, grid: tuple[int, int], **kwargs):
        super().__init__(**kwargs)
        self.patch = int(patch)
        self.width = int(width)
        self.grid = (int(grid[0]), int(grid[1]))

    def build(self, input_shape):
        channels = input_shape[-1]
        self.kernel = self.add_weight(shape=(self.patch * self.patch * channels, self.width), name="kernel",
                                      initializer=keras.initializers.LecunNormal())
        # Kept in float32 when read (autocast=False): it is resized in float32, then cast with the tokens.
        self.position = self.add_weight(shape=(*self.grid, self.width), name="position", autocast=False,
                                        initializer=keras.initializers.TruncatedNormal(stddev=0.02))

    def call(self, images):
        rows, columns = grid_of(images, self.patch)
        tokens = tf.matmul(patches(images, self.patch), self.kernel)
        position = tf.reshape(self.position_grid(rows, columns), [rows * columns, self.width])
        return tokens + tf.cast(position, tokens.dtype)

    def position_grid(self, rows, columns) -> tf.Tensor:
        """The float32 position embedding on a (rows, columns) grid of patches."""
        if isinstance(rows, int) and isinstance(columns, int) and (rows, columns) == self.grid:
            return tf.convert_to_tensor(self.position)
        return tf.einsum("ir,jc,rcw->ijw", cubic_resize_matrix(self.grid[0], rows), cubic_resize_matrix(self.grid[1], columns),
                         self.position)

    def compute_output_shape(self, input_shape):
        sides = input_shape[1:3]
        tokens = None if None in sides else (sides[0] // self.patch) * (sides[1] // self.patch)
        return (input_shape[0], tokens, self.width)

    def get_config(self):
        return {**super().get_config(), "patch": self.patch, "width": self.width, "grid": self.grid}


def keras_patch_layers(images, embedding: PatchEmbedding):
    """`embedding`'s computation at the resolution its position embedding was learned at, from Keras' own layers: the
    layout `tfmp.models.export.portable` writes (the weights: the same kernel; the position embedding as the
    `EinsumDense`'s (token, channel) bias)."""
    (rows, columns), patch, channels = embedding.grid, embedding.patch, images.shape[-1]
    policy = embedding.dtype_policy
    x = keras.layers.Reshape((rows, patch, columns, patch, channels), name="patch_grid", dtype=policy)(images)
    x = keras.layers.Permute((1, 3, 2, 4, 5), name="patch_order", dtype=policy)(x)
    x = keras.layers.Reshape((rows * columns, patch * patch * channels), name="patches", dtype=policy)(x)
    return keras.layers.EinsumDense("btp,pc->btc", output_shape=(rows * columns, embedding.width), bias_axes="tc",
                                    name="patch_embedding", dtype=policy)(x)


KERAS_PATCH_LAYERS = ("patch_grid", "patch_order", "patches", "patch_embedding")


def patch_embedding_of(model: keras.Model) -> PatchEmbedding | None:
    """The `PatchEmbedding` a model in the Keras-only layout (`keras_patch_layers`, written by tfmp's exports, those
    before ViTs took any resolution included) computes, unbuilt; None for any other model."""
    layers = {layer.name: layer for layer in model.layers}
    grid, embedding = layers.get("patch_grid"), layers.get("patch_embedding")
    if not (isinstance(grid, keras.layers.Reshape) and isinstance(embedding, keras.layers.EinsumDense)
            and all(name in layers for name in KERAS_PATCH_LAYERS) and embedding.get_config()["bias_axes"] == "tc"):
        return None
    rows, patch, columns = grid.target_shape[:3]
    return PatchEmbedding(patch, embedding.kernel.shape[-1], (rows, columns), name="patch_embedding",
                          dtype=embedding.dtype_policy)


def token_encoder(encoder: keras.Model) -> tuple[PatchEmbedding, keras.Model]:
    """A tfmp ViT encoder in two parts that share its weights: its `PatchEmbedding` (images -> tokens with their
    positions) and a model from any number of those tokens to the final normalised tokens, (batch, tokens, width) —
    the transformer without the pooling, which MAE runs on the visible tokens only.

    Raises:
        ValueError: `encoder` is not a tfmp ViT (no `PatchEmbedding` feeding the blocks, no `final_norm`).
    """
    embedding = next((layer for layer in encoder.layers if isinstance(layer, PatchEmbedding)), None)
    names = {layer.name for layer in encoder.layers}
    if embedding is None or "final_norm" not in names:
        raise ValueError(f"{encoder.name} is not a tfmp ViT encoder (a PatchEmbedding, transformer blocks, final_norm)")
    return embedding, keras.Model(embedding.output, encoder.get_layer("final_norm").output, name=f"{encoder.name}_tokens")


def encoder_block(x, name: str, *, heads: int, mlp_width: int, drop_path: float = 0.0):
    """One pre-norm transformer block."""
    width = x.shape[-1]

    def drop_path_layer(branch, part):
        if not drop_path:
            return branch
        return keras.layers.Dropout(drop_path, noise_shape=(None, 1, 1), name=f"{name}_{part}_drop_path")(branch)

    y = fused.LayerNormalization(epsilon=1e-6, name=f"{name}_attention_norm")(x)
    y = keras.layers.MultiHeadAttention(heads, key_dim=width // heads, name=f"{name}_attention")(y, y)
    x = keras.layers.Add(name=f"{name}_attention_residual")([x, drop_path_layer(y, "attention")])
    y = fused.LayerNormalization(epsilon=1e-6, name=f"{name}_mlp_norm")(x)
    y = fused.Dense(mlp_width, activation="gelu", name=f"{name}_mlp_hidden")(y)
    y = keras.layers.Dense(width, name=f"{name}_mlp_output")(y)
    return keras.layers.Add(name=f"{name}_mlp_residual")([x, drop_path_layer(y, "mlp")])


def vision_transformer(input_shape: tuple[int, int, int], size: ViTSize, name: str, *, remat: str = "none",
                       drop_path_rate: float = 0.0) -> keras.Model:
    """A ViT encoder mapping images to `size.width` features (mean of the final tokens), its position embedding
    learned at `input_shape`'s grid of patches and taking images of any size whose sides are multiples of the patch.

    Raises:
        ValueError: the image sides are not multiples of the patch side.
    """
    if input_shape[0] % size.patch or input_shape[1] % size.patch:
        raise ValueError(f"{name}: image sides {input_shape[:2]} are not multiples of the patch side {size.patch}")
    inputs = keras.Input((None, None, input_shape[2]), name="images")
    grid = (input_shape[0] // size.patch, input_shape[1] // size.patch)
    x = PatchEmbedding(size.patch, size.width, grid, name="patch_embedding")(inputs)
    for block in range(size.depth):
        rate = drop_path_rate * block / max(size.depth - 1, 1)
        x = checkpointed(encoder_block, x, name=f"block{block}", remat=remat, heads=size.heads, mlp_width=size.mlp_width,
                         drop_path=rate)
    x = fused.LayerNormalization(epsilon=1e-6, name="final_norm")(x)
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
