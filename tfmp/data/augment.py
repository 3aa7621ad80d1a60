"""SimCLR augmentations as batched, stateless TensorFlow ops.

Each op draws its random parameters per example from *stateless* random ops with an
explicit seed. The caller derives that seed from the run's `--seed`, the training
step and the replica id (`step_seed`), which gives the three properties tfmp promises:

* every replica draws a different augmentation stream (the replica id is folded in);
* the whole run is reproducible from `--seed` (no hidden RNG state);
* resuming from a checkpoint continues the same streams (the step is checkpointed).

Images are float32 in [0, 1] with 1 or 3 channels; augmentation runs in float32
whatever the dtype policy (the encoder casts to its compute dtype afterwards).
Colour ops that need three channels (saturation, hue, grayscale) are skipped for
one-channel images.
"""

from __future__ import annotations

import dataclasses
import math

import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class AugmentConfig:
    """Strengths and probabilities of the SimCLR augmentations (SimCLR paper defaults).

    Attributes:
        crop_scale: (min, max) area fraction of the random resized crop.
        crop_ratio: (min, max) aspect ratio of the crop.
        flip: random horizontal flips (off for digits: a mirrored 3 is not a 3).
        color_jitter: strength s; brightness/contrast/saturation 0.8 s, hue 0.2 s.
        color_jitter_probability: how often colour jitter is applied.
        grayscale_probability: how often an RGB image is turned gray.
        blur_probability: how often a Gaussian blur (sigma in [0.1, 2.0] px at 32 px,
            scaled with the image) is applied.
        noise_stddev: additive Gaussian pixel noise (0: off).
    """

    crop_scale: tuple[float, float] = (0.08, 1.0)
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: bool = True
    color_jitter: float = 0.5
    color_jitter_probability: float = 0.8
    grayscale_probability: float = 0.2
    blur_probability: float = 0.5
    noise_stddev: float = 0.0


# One algorithm everywhere: `auto_select` (TF's default) may pick another generator under XLA than
# in a plain graph, and a run must draw the same augmentations with and without jit_compile.
RNG_ALGORITHM = "philox"


def step_seed(base_seed: int, step: tf.Tensor, replica_id: tf.Tensor | int) -> tf.Tensor:
    """A [2] int32 seed unique to (run seed, step, replica)."""
    seed = tf.stack([tf.constant(base_seed, tf.int32), tf.cast(step, tf.int32)])
    return tf.random.experimental.stateless_fold_in(seed, tf.cast(replica_id, tf.int32), alg=RNG_ALGORITHM)


def split_seed(seed: tf.Tensor, count: int) -> list[tf.Tensor]:
    """`count` independent seeds derived from `seed`."""
    return tf.unstack(tf.random.experimental.stateless_split(seed, num=count, alg=RNG_ALGORITHM))


def _unit_uniform(seed, shape) -> tf.Tensor:
    """Uniform floats in [0, 1) from 24 random bits each.

    TF's XLA and CPU kernels draw the same Philox bits for a seed but turn them into floats
    differently (measured: same uint32 draws, different `stateless_uniform` floats), so the
    bits are drawn as integers and converted here: the same numbers with and without XLA."""
    bits = tf.random.stateless_uniform(shape, seed, minval=None, maxval=None, dtype=tf.uint32, alg=RNG_ALGORITHM)
    return tf.cast(tf.bitwise.right_shift(bits, 8), tf.float32) * (1.0 / (1 << 24))


def _uniform(seed, batch, low=0.0, high=1.0):
    return low + (high - low) * _unit_uniform(seed, [batch])


def _normal(seed, shape) -> tf.Tensor:
    """Standard normal draws (Box-Muller over `_unit_uniform`, so XLA and graphs agree)."""
    radius_seed, angle_seed = split_seed(seed, 2)
    radius = tf.sqrt(-2.0 * tf.math.log1p(-_unit_uniform(radius_seed, shape)))  # log1p(-u): u < 1, never log(0)
    return radius * tf.cos(2.0 * math.pi * _unit_uniform(angle_seed, shape))


def _apply_where(mask, augmented, original):
    return tf.where(tf.reshape(mask, [-1, 1, 1, 1]), augmented, original)


def _bilinear_weights(start: tf.Tensor, length: tf.Tensor, size: int, source_size: int | None = None) -> tf.Tensor:
    """[batch, size, source_size] bilinear sampling weights: output pixel i of image b reads input pixels
    around `start[b] + i * length[b] / (size - 1)` (pixel units), as `tf.image.crop_and_resize` does.

    The tent function max(0, 1 - |position - k|) is exactly bilinear interpolation's weight of input
    pixel k, and is zero outside the image (crop_and_resize's extrapolation value 0)."""
    steps = tf.range(size, dtype=tf.float32) / max(size - 1, 1)
    positions = start[:, None] + length[:, None] * steps[None, :]  # [batch, size]
    pixels = tf.range(size if source_size is None else source_size, dtype=tf.float32)
    return tf.nn.relu(1.0 - tf.abs(positions[:, :, None] - pixels[None, None, :]))


def crop_boxes(batch: tf.Tensor, seed: tf.Tensor, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)) -> tf.Tensor:
    """[batch, 4] random boxes (top, left, bottom, right; normalised), area fraction in `scale`,
    aspect ratio in `ratio` (log-uniform), placed uniformly inside the image."""
    area_seed, ratio_seed, y_seed, x_seed = split_seed(seed, 4)
    area = _uniform(area_seed, batch, *scale)
    aspect = tf.exp(_uniform(ratio_seed, batch, math.log(ratio[0]), math.log(ratio[1])))
    box_width = tf.minimum(tf.sqrt(area * aspect), 1.0)
    box_height = tf.minimum(tf.sqrt(area / aspect), 1.0)
    top = _uniform(y_seed, batch) * (1.0 - box_height)
    left = _uniform(x_seed, batch) * (1.0 - box_width)
    return tf.stack([top, left, top + box_height, left + box_width], axis=1)


def resize_crops(images: tf.Tensor, boxes: tf.Tensor, size: int | None = None) -> tf.Tensor:
    """Each image's box, resized (bilinear) to `size` x `size` pixels (default: back to the image's size).

    Same result as `tf.image.crop_and_resize(images, boxes, range(batch), (height, width))` to
    float32 round-off, computed as two batched matrix products with per-image interpolation
    matrices: `CropAndResize` has no XLA kernel, so TPUs (which compile every step) and
    `jit_compile=True` could not run it.
    """
    height, width = images.shape[1], images.shape[2]
    out_height, out_width = (height, width) if size is None else (size, size)
    top, left, bottom, right = tf.unstack(boxes, axis=1)
    rows = _bilinear_weights(top * (height - 1), (bottom - top) * (height - 1), out_height, height)  # [batch, out, in rows]
    columns = _bilinear_weights(left * (width - 1), (right - left) * (width - 1), out_width, width)  # [batch, out, in cols]
    return tf.einsum("bih,bhwc,bjw->bijc", rows, images, columns)


def random_resized_crop(images: tf.Tensor, seed: tf.Tensor, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3),
                        size: int | None = None) -> tf.Tensor:
    """Crops a random box (`crop_boxes`) per image, resized to `size` (default: back to the image's size)."""
    return resize_crops(images, crop_boxes(tf.shape(images)[0], seed, scale, ratio), size)


def random_flip(images: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
    flip = _uniform(seed, tf.shape(images)[0]) < 0.5
    return _apply_where(flip, tf.reverse(images, axis=[2]), images)


def _grayscale(images: tf.Tensor) -> tf.Tensor:
    if images.shape[-1] == 1:
        return images
    return tf.image.rgb_to_grayscale(images)


def _rotate_hue(images: tf.Tensor, angle: tf.Tensor) -> tf.Tensor:
    """Rotates hue by `angle` radians per image, as a rotation of the chroma plane in YIQ."""
    yiq = tf.image.rgb_to_yiq(images)
    cos, sin = tf.reshape(tf.cos(angle), [-1, 1, 1]), tf.reshape(tf.sin(angle), [-1, 1, 1])
    luma, i_channel, q_channel = tf.unstack(yiq, axis=-1)
    rotated = tf.stack([luma, cos * i_channel - sin * q_channel, sin * i_channel + cos * q_channel], axis=-1)
    return tf.image.yiq_to_rgb(rotated)


def color_jitter(images: tf.Tensor, seed: tf.Tensor, strength: float) -> tf.Tensor:
    """Brightness, contrast, saturation (0.8 s) and hue (0.2 s) jitter, drawn per image."""
    batch = tf.shape(images)[0]
    brightness_seed, contrast_seed, saturation_seed, hue_seed = split_seed(seed, 4)

    def factor(factor_seed, amount):
        return tf.reshape(_uniform(factor_seed, batch, max(0.0, 1 - amount), 1 + amount), [-1, 1, 1, 1])

    images = images * factor(brightness_seed, 0.8 * strength)
    mean = tf.reduce_mean(_grayscale(images), axis=[1, 2, 3], keepdims=True)
    images = (images - mean) * factor(contrast_seed, 0.8 * strength) + mean
    if images.shape[-1] == 3:
        gray = _grayscale(images)
        images = (images - gray) * factor(saturation_seed, 0.8 * strength) + gray
        images = _rotate_hue(images, _uniform(hue_seed, batch, -0.2 * strength, 0.2 * strength) * 2 * math.pi)
    return tf.clip_by_value(images, 0.0, 1.0)


def gaussian_blur(images: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
    """Separable Gaussian blur with a per-image sigma (SimCLR: [0.1, 2.0] px at 32 px, kernel 10% of the side)."""
    size = images.shape[1]
    radius = max(1, int(round(0.05 * size)))
    scale = size / 32.0
    sigma = _uniform(seed, tf.shape(images)[0], 0.1 * scale, 2.0 * scale)
    offsets = tf.range(-radius, radius + 1, dtype=tf.float32)
    weights = tf.exp(-tf.square(offsets)[None, :] / (2.0 * tf.square(sigma)[:, None]))
    weights = weights / tf.reduce_sum(weights, axis=1, keepdims=True)  # [batch, 2 * radius + 1]

    def blur_along(x, axis):
        padding = [[0, 0], [0, 0], [0, 0], [0, 0]]
        padding[axis] = [radius, radius]
        padded = tf.pad(x, padding, mode="REFLECT")
        length = x.shape[axis]
        shifted = [tf.gather(padded, tf.range(k, k + length), axis=axis) for k in range(2 * radius + 1)]
        return tf.einsum("kbhwc,bk->bhwc", tf.stack(shifted), weights)

    return blur_along(blur_along(images, 1), 2)


def simclr_augment(images: tf.Tensor, seed: tf.Tensor, config: AugmentConfig = AugmentConfig(),
                   size: int | None = None) -> tf.Tensor:
    """One SimCLR view of a batch: crop, flip, colour jitter, grayscale, blur, noise.

    Args:
        images: [batch, height, width, 1 or 3] float32 in [0, 1].
        seed: [2] int32 stateless seed (see `step_seed`).
        config: strengths and probabilities.
        size: the view's side in pixels (multi-crop's local crops); default the images' size.

    Returns:
        Augmented images, [batch, size, size, channels] (default the images' shape), float32 in [0, 1].
    """
    images = tf.cast(images, tf.float32)
    batch = tf.shape(images)[0]
    (crop_seed, flip_seed, jitter_seed, jitter_gate, gray_gate, blur_seed, blur_gate, noise_seed) = split_seed(seed, 8)
    images = random_resized_crop(images, crop_seed, config.crop_scale, config.crop_ratio, size)
    if config.flip:
        images = random_flip(images, flip_seed)
    if config.color_jitter > 0 and config.color_jitter_probability > 0:
        jittered = color_jitter(images, jitter_seed, config.color_jitter)
        images = _apply_where(_uniform(jitter_gate, batch) < config.color_jitter_probability, jittered, images)
    if images.shape[-1] == 3 and config.grayscale_probability > 0:
        gray = tf.image.grayscale_to_rgb(_grayscale(images))
        images = _apply_where(_uniform(gray_gate, batch) < config.grayscale_probability, gray, images)
    if config.blur_probability > 0 and images.shape[1] >= 16:
        images = _apply_where(_uniform(blur_gate, batch) < config.blur_probability, gaussian_blur(images, blur_seed), images)
    if config.noise_stddev > 0:
        images = images + config.noise_stddev * _normal(noise_seed, tf.shape(images))
    return tf.clip_by_value(images, 0.0, 1.0)
