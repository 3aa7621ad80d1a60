"""MAE: masked autoencoders (He et al. 2022) — a ViT learns by reconstructing the patches it did not see.

Each image (one augmented view: the random resized crop and flip of the augmentation flags) is cut into patches; a
random `mask_ratio` of them is hidden, drawn per example from the run's seeded streams (`tfmp.data.augment.step_seed`:
run seed, step, replica — distinct across examples and replicas, the same on a rerun). The encoder runs on the
visible tokens only, with their position embeddings (`tfmp.models.vit.token_encoder`): at 75% masked, a quarter of
the tokens — the point of MAE, measured in BUILD_NOTES.md. A light decoder takes the encoded visible tokens, projected
to its width, and a learned mask token in every hidden position, adds fixed 2-D sine-cosine positions, runs a few
transformer blocks and predicts each patch's pixels. The loss is the mean squared error on the hidden patches only,
against pixels normalised per patch (mean 0, variance 1: the paper's `norm_pix_loss`, its better setting) or raw.

Precision: the decoder's blocks run in the policy's compute dtype, its pixel prediction and the loss in float32 (an
fp16 pixel error squared stays far from overflow: targets are normalised, the predictions start near 0).

The online probe reads the mean of the encoded visible tokens (stop-gradient; the kNN monitor and the evaluation see
the encoder on whole images, as after pretraining). ViT encoders only: a CNN has no tokens to drop (refused in one
line). The encoder saved is the ViT alone, for `linear_eval` and `finetune` (the paper evaluates MAE by fine-tuning:
`--task=finetune --layer_decay=0.75`).
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from tfmp import accumulation, registry
from tfmp.data import augment
from tfmp.models import fused, vit
from tfmp.ssl.two_view import TwoViewModel


def visible_count(tokens: int, mask_ratio: float) -> int:
    """Tokens left visible: MAE's `int(tokens * (1 - mask_ratio))`."""
    return int(tokens * (1 - mask_ratio))


def masking_order(seed: tf.Tensor, batch, tokens: int) -> tf.Tensor:
    """`[batch, tokens]` int32: each example's tokens in a random order of its own (the first ones stay visible)."""
    noise = tf.random.stateless_uniform(tf.stack([batch, tokens]), seed, alg=augment.RNG_ALGORITHM)
    return tf.argsort(noise, axis=1)


def token_places(order: tf.Tensor) -> tf.Tensor:
    """`[batch, tokens]` int32: where each token falls in its example's `order` (the inverse permutation)."""
    return tf.argsort(order, axis=1)


def hidden_mask(places: tf.Tensor, keep: int) -> tf.Tensor:
    """`[batch, tokens]` float32, 1 where a token is hidden: its place (`token_places`) is `keep` or later."""
    return tf.cast(places >= keep, tf.float32)


def pixel_targets(images: tf.Tensor, patch: int, normalize: bool) -> tf.Tensor:
    """`[batch, tokens, patch * patch * channels]` float32 pixels of each patch, normalised per patch if asked."""
    targets = vit.patches(tf.cast(images, tf.float32), patch)
    if not normalize:
        return targets
    mean, variance = tf.nn.moments(targets, axes=[-1], keepdims=True)
    return (targets - mean) / tf.sqrt(variance + 1e-6)


def masked_patch_loss(predictions: tf.Tensor, targets: tf.Tensor, hidden: tf.Tensor) -> tf.Tensor:
    """Mean over the hidden patches of the mean squared pixel error (float32)."""
    error = tf.reduce_mean(tf.square(tf.cast(predictions, tf.float32) - targets), axis=-1)
    return tf.reduce_sum(error * hidden) / tf.maximum(tf.reduce_sum(hidden), 1.0)


def sine_cosine_positions(rows: int, columns: int, width: int) -> np.ndarray:
    """MAE's fixed 2-D position embedding, `[rows * columns, width]` float32: half the channels encode the row, half
    the column, each as sines and cosines of geometrically spaced frequencies (`get_2d_sincos_pos_embed`)."""
    quarter = width // 4
    frequencies = 1.0 / 10000 ** (np.arange(quarter, dtype=np.float64) / quarter)
    row, column = np.meshgrid(np.arange(rows, dtype=np.float64), np.arange(columns, dtype=np.float64), indexing="ij")

    def encode(position):
        angles = position.reshape(-1, 1) * frequencies
        return np.concatenate([np.sin(angles), np.cos(angles)], axis=1)

    embedding = np.concatenate([encode(row), encode(column)], axis=1)
    return np.pad(embedding, [(0, 0), (0, width - embedding.shape[1])]).astype(np.float32)


def pixel_decoder(width: int, depth: int, heads: int, pixels: int, name: str = "mae_decoder") -> keras.Model:
    """Tokens `[batch, tokens, width]` -> `[batch, tokens, pixels]`: `depth` pre-norm transformer blocks, a LayerNorm,
    and a float32 projection to each patch's pixels."""
    tokens = keras.Input((None, width), name="decoder_tokens")
    x = tokens
    for block in range(depth):
        x = vit.encoder_block(x, f"{name}_block{block}", heads=heads, mlp_width=4 * width)
    x = fused.LayerNormalization(epsilon=1e-6, name=f"{name}_norm")(x)
    return keras.Model(tokens, keras.layers.Dense(pixels, dtype="float32", name=f"{name}_pixels")(x), name=name)


class MAE(TwoViewModel):
    """MAE around a tfmp ViT encoder.

    Args:
        mask_ratio: fraction of each image's patches hidden from the encoder.
        decoder_width, decoder_depth, decoder_heads: the decoder's transformer.
        norm_pixel_loss: reconstruct pixels normalised per patch (True) or raw.
        visible_only: False runs the encoder on every token, a learned mask token in the hidden ones (SimMIM's
            way), the decoder unchanged: the comparison that measures what dropping tokens saves.
        **kwargs: `TwoViewModel`'s.
    """

    batch_coupled_loss = False  # a mean over examples: accumulation sums micro-batches
    vit_only = True
    settings = ("mask_ratio", "decoder_width", "decoder_depth", "decoder_heads", "norm_pixel_loss")

    def __init__(self, encoder: keras.Model, *, mask_ratio: float = 0.75, decoder_width: int = 512, decoder_depth: int = 8,
                 decoder_heads: int = 16, norm_pixel_loss: bool = True, visible_only: bool = True, norm=None, **kwargs):
        del norm  # no BatchNorm
        super().__init__(encoder, **kwargs)
        self.embedding, self.token_encoder = vit.token_encoder(encoder)
        self.patch = self.embedding.patch
        self.mask_ratio = mask_ratio
        self.norm_pixel_loss = norm_pixel_loss
        self.visible_only = visible_only
        self.decoder_width = decoder_width
        channels = encoder.input_shape[-1]
        self.decoder_embed = keras.layers.Dense(decoder_width, name="mae_decoder_embed")
        self.decoder_embed.build((None, None, self.feature_dim))
        self.decoder = pixel_decoder(decoder_width, decoder_depth, decoder_heads, self.patch * self.patch * channels)
        initializer = keras.initializers.RandomNormal(stddev=0.02)
        self.mask_token = self.add_weight(shape=(decoder_width,), initializer=initializer, name="mask_token")
        if not visible_only:
            self.encoder_mask_token = self.add_weight(shape=(self.feature_dim,), initializer=initializer,
                                                      name="encoder_mask_token")

    @classmethod
    def check_inputs(cls, config, image_shape: tuple[int, int, int]) -> None:
        from tfmp.config import UsageError

        patch = getattr(registry.ENCODERS.load(config.model), "patch_size", None)
        if patch is None:
            vits = [name for name in registry.ENCODERS.names() if getattr(registry.ENCODERS.load(name), "patch_size", None)]
            raise UsageError(f"--task=mae needs a ViT encoder (it drops the masked patches' tokens), not --model={config.model}; "
                             f"valid: {', '.join(vits)}")
        tokens = (image_shape[0] // patch) * (image_shape[1] // patch)
        keep = visible_count(tokens, config.mask_ratio)
        if not 1 <= keep < tokens:
            raise UsageError(f"--mask_ratio={config.mask_ratio:g} leaves {keep} of {tokens} patches visible; each image needs "
                             f"at least one visible and one hidden (e.g. --mask_ratio=0.75)")
        if config.decoder_width % config.decoder_heads:
            raise UsageError(f"--decoder_heads={config.decoder_heads} does not divide --decoder_width={config.decoder_width}")

    @classmethod
    def views_per_example(cls, config, image_shape: tuple[int, int, int]) -> float:
        """The visible share of one view through the encoder, and the decoder (every token) by its size relative to
        the encoder's (its activations grow with blocks x width)."""
        patch = registry.ENCODERS.load(config.model).patch_size
        tokens = (image_shape[0] // patch) * (image_shape[1] // patch)
        size = vit.SIZES.get(config.model)
        decoder = config.decoder_depth * config.decoder_width / (size.depth * size.width) if size else 0.0
        return visible_count(tokens, config.mask_ratio) / tokens + decoder

    # ------------------------------------------------------------------ views and masks

    def _draw_views(self, images: tf.Tensor, seed: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """(one augmented view of each image; each image's tokens in the random order that hides the later ones)."""
        view_seed, mask_seed = augment.split_seed(seed, 2)
        view = augment.simclr_augment(images, view_seed, self.augment_config)
        rows, columns = vit.grid_of(view, self.patch)
        return view, masking_order(mask_seed, tf.shape(view)[0], rows * columns)

    # ------------------------------------------------------------------ the model

    def encode(self, view: tf.Tensor, order: tf.Tensor, keep: int, training: bool = True) -> tf.Tensor:
        """The encoder's final tokens: of the `keep` visible ones `[batch, keep, width]`, in `order`'s order (or of
        every token, the hidden ones given the encoder's mask token, with `visible_only=False`)."""
        tokens = self.embedding(view)
        if self.visible_only:
            return self.token_encoder(tf.gather(tokens, order[:, :keep], batch_dims=1), training=training)
        hidden = hidden_mask(token_places(order), keep)[..., None]
        tokens = tokens * tf.cast(1.0 - hidden, tokens.dtype) + tf.cast(hidden * self.encoder_mask_token, tokens.dtype)
        return self.token_encoder(tokens, training=training)

    def reconstruct(self, encoded: tf.Tensor, places: tf.Tensor, keep: int, rows: int, columns: int,
                    training: bool = True) -> tf.Tensor:
        """The decoder's float32 pixel predictions for every patch, `[batch, tokens, pixels]`, in image order
        (`places`: `token_places` of the masking order)."""
        x = self.decoder_embed(encoded)
        if self.visible_only:  # the mask token in every hidden place, then the tokens back in image order
            batch = tf.shape(x)[0]
            masks = tf.broadcast_to(tf.cast(self.mask_token, x.dtype), tf.stack([batch, rows * columns - keep, self.decoder_width]))
            x = tf.gather(tf.concat([x, masks], axis=1), places, batch_dims=1)
        else:
            hidden = tf.cast(hidden_mask(places, keep)[..., None], x.dtype)
            x = x * (1 - hidden) + hidden * tf.cast(self.mask_token, x.dtype)
        x = x + tf.constant(sine_cosine_positions(rows, columns, self.decoder_width), x.dtype)
        return self.decoder(x, training=training)

    def reconstruction_loss(self, view: tf.Tensor, order: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, int]:
        """(MAE's loss of a view whose tokens are hidden by `order`; the encoded tokens; how many are visible)."""
        rows, columns = vit.grid_of(view, self.patch)
        keep = visible_count(rows * columns, self.mask_ratio)
        places = token_places(order)  # once a step: the decoder's unshuffle and the loss's mask both read it
        encoded = self.encode(view, order, keep)
        predictions = self.reconstruct(encoded, places, keep, rows, columns)
        loss = masked_patch_loss(predictions, pixel_targets(view, self.patch, self.norm_pixel_loss), hidden_mask(places, keep))
        return loss, encoded, keep

    def batch_loss(self, images: tf.Tensor) -> tf.Tensor:
        return self.reconstruction_loss(*self.views(images))[0]

    def _loss(self, view: tf.Tensor, order: tf.Tensor, labels) -> tf.Tensor:
        """MAE's loss of a batch (and the probe's), this replica's share, metrics updated."""
        loss, encoded, keep = self.reconstruction_loss(view, order)
        self.loss_tracker.update_state(loss)
        if labels is None:
            return loss
        visible = encoded if self.visible_only else tf.gather(encoded, order[:, :keep], batch_dims=1)
        probe_loss, logits, weights = self._probe_loss(tf.reduce_mean(visible, axis=1), labels)
        self.probe_loss_tracker.update_state(probe_loss)
        self.probe_accuracy.update_state(tf.maximum(labels, 0), logits, sample_weight=weights)
        return loss + probe_loss

    def train_step(self, data):
        images, labels = self._images_and_labels(data)
        view, order = self.views(images)
        variables = self.trainable_variables
        steps = self.gradient_accumulation_steps
        if steps > 1:  # a batch the micro-batches do not divide becomes equal ones (copied rows, unlabeled)
            rows = accumulation.padded_rows(tf.shape(view)[0], steps)
            view, order = accumulation.pad_rows(view, rows), accumulation.pad_rows(order, rows)
            labels = None if labels is None else accumulation.pad_rows(labels, rows, value=-1)
        micro_view, micro_order, micro_labels = accumulation.micro_batches((view, order, labels), steps)
        owner = accumulation.gradient_owner(self.optimizer, steps, variables)

        def gradients_of(index):
            with tf.GradientTape() as tape:
                loss = self._loss(micro_view[index], micro_order[index], None if micro_labels is None else micro_labels[index])
                loss = self._for_optimizer(loss / steps)
            return tape.gradient(loss, variables)

        accumulation.apply_gradients(self.optimizer, accumulation.sum_gradients(gradients_of, steps, variables, owner),
                                     variables, owner)
        return {metric.name: metric.result() for metric in self.metrics}

