"""DINO: self-distillation with no labels (Caron et al. 2021), with multi-crop.

A student (the encoder and a DINO head) learns to match a momentum teacher (an EMA copy of both) across views of one
image: the teacher sees the 2 global crops, the student every crop — the 2 global ones and `local_crops` smaller
ones (multi-crop: more views for little compute; a ViT takes them through `tfmp.models.vit.PatchEmbedding`'s resized
position embedding). For each global crop q and each other crop v,

    loss = mean over pairs (q, v != q) of  -sum_k softmax((t_q - c) / tau_t)_k * log_softmax(s_v / tau_s)_k

with the teacher's outputs t centred by c (an EMA of their batch mean, averaged across replicas, so every replica
subtracts the same centre) and sharpened by a low temperature tau_t (warmed up linearly), the student's s at
tau_s. Centring and sharpening are what keep the teacher from collapsing; the teacher's momentum rises to 1 on a
cosine (`tfmp.ssl.momentum`).

The head (paper section 3.1 and its code's `DINOHead`): an MLP (GELU, two hidden layers), a bottleneck
L2-normalised, and a weight-normalised last layer with its gain fixed to 1 (`norm_last_layer=True`), which takes no
gradient during the first `freeze_last_layer_epochs` (the paper: 1 epoch). The head (see `dino_head` for why), the
softmaxes and the loss are float32 under every policy; the student's logits are bounded by 1 / tau_s (unit vectors
times unit columns). The paper clips each parameter's gradient to norm 3 (`--clipnorm=3`, `tfmp.clipping`, after
the replicas' sum).

Each replica draws its crops from its own stream (`tfmp.data.augment.step_seed`: run seed, step, replica).
With `--gradient_accumulation_steps` > 1 the student runs on micro-batches of the images, each with all of its crops
(the loss is a mean over examples); the teacher and the centre see the whole batch.
"""

from __future__ import annotations

import dataclasses

import keras
import tensorflow as tf

from tfmp import accumulation, registry
from tfmp.data import augment
from tfmp.models import vit
from tfmp.ssl.momentum import MomentumTwoViewModel

GLOBAL_CROPS = 2


@keras.saving.register_keras_serializable(package="tfmp")
class WeightNormalizedDense(keras.layers.Layer):
    """`x @ (V / ||V||)`, each output unit's weight vector scaled to norm 1: weight normalisation with its gain fixed to
    1, no bias (DINO's last layer)."""

    def __init__(self, units: int, **kwargs):
        super().__init__(**kwargs)
        self.units = int(units)

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], self.units), name="kernel",
                                      initializer=keras.initializers.TruncatedNormal(stddev=0.02))

    def call(self, inputs):
        return tf.matmul(inputs, tf.math.l2_normalize(self.kernel, axis=0))

    def compute_output_shape(self, input_shape):
        return (*input_shape[:-1], self.units)

    def get_config(self):
        return {**super().get_config(), "units": self.units}


def dino_head(input_dim: int, hidden_dim: int, bottleneck_dim: int, prototypes: int, name: str = "dino_head") -> keras.Sequential:
    """DINO's head: Dense-GELU, Dense-GELU, Dense to the bottleneck, L2 normalisation, the weight-normalised layer to
    the prototypes — float32 under every policy. Not for its softmax alone: the normalisation divides the gradient by
    the bottleneck's norm, small from the paper's initialisation (std 0.02), and under fp16 the bottleneck's bias
    gradient overflowed at a loss scale of 512 (measured at step 0 of the tiny ViT in tests/test_dino.py). The head
    runs on pooled features, a small part of the step."""
    initializer = keras.initializers.TruncatedNormal(stddev=0.02)
    head = keras.Sequential([
        keras.layers.Dense(hidden_dim, activation="gelu", kernel_initializer=initializer, dtype="float32", name=f"{name}_hidden1"),
        keras.layers.Dense(hidden_dim, activation="gelu", kernel_initializer=initializer, dtype="float32", name=f"{name}_hidden2"),
        keras.layers.Dense(bottleneck_dim, kernel_initializer=initializer, dtype="float32", name=f"{name}_bottleneck"),
        keras.layers.UnitNormalization(dtype="float32", name=f"{name}_normalize"),
        WeightNormalizedDense(prototypes, dtype="float32", name=f"{name}_prototypes"),
    ], name=name)
    head.build((None, input_dim))
    return head


def teacher_probabilities(teacher: tf.Tensor, center: tf.Tensor, teacher_temperature: tf.Tensor) -> tf.Tensor:
    """The teacher's logits centred and sharpened: `softmax((teacher - center) / temperature)`, float32."""
    return tf.nn.softmax((tf.cast(teacher, tf.float32) - center) / teacher_temperature, axis=-1)


def dino_loss(student: tf.Tensor, teacher: tf.Tensor, center: tf.Tensor, batch: tf.Tensor, student_temperature: float,
              teacher_temperature: tf.Tensor) -> tf.Tensor:
    """DINO's cross-entropy, float32, mean over the examples and the (teacher crop, other crop) pairs.

    Args:
        student: `[crops * batch, K]` logits, the crops one after another, the 2 global crops first.
        teacher: `[2 * batch, K]` logits of the global crops.
        center: `[K]` subtracted from the teacher's logits.
        batch: images per crop.
    """
    return cross_entropy(student, teacher_probabilities(teacher, center, teacher_temperature), batch, student_temperature)


def cross_entropy(student: tf.Tensor, targets: tf.Tensor, batch: tf.Tensor, student_temperature: float) -> tf.Tensor:
    """`dino_loss` given the teacher's probabilities `targets` (`teacher_probabilities`), `[2 * batch, K]`."""
    crops = tf.shape(student)[0] // batch
    student_log_probabilities = tf.nn.log_softmax(tf.cast(student, tf.float32) / student_temperature, axis=-1)
    student_log_probabilities = tf.reshape(student_log_probabilities, [crops, batch, -1])
    targets = tf.reshape(targets, [GLOBAL_CROPS, batch, -1])
    # cross[q, v]: mean over the batch of -sum_k p_teacher(q) log p_student(v)
    cross = -tf.einsum("qbk,vbk->qv", targets, student_log_probabilities) / tf.cast(batch, tf.float32)
    same = tf.eye(GLOBAL_CROPS, num_columns=crops)  # a global crop is not compared with itself
    pairs = tf.cast(GLOBAL_CROPS * crops - GLOBAL_CROPS, tf.float32)
    return tf.reduce_sum(cross * (1.0 - same)) / pairs


def local_crop_side(local_crop_size: int, image_side: int, patch: int) -> int:
    """The local crops' side: `local_crop_size`, or 96/224 of the image side (the paper's 96 px beside 224) rounded
    to the ViT's patch (1 for a CNN), at least one patch."""
    if local_crop_size:
        return local_crop_size
    return max(patch, round(image_side * 96 / 224 / patch) * patch)


class DINO(MomentumTwoViewModel):
    """DINO around any encoder (ViT or CNN) mapping images to a feature vector.

    Args:
        projection_dim: the head's bottleneck width (256 in the paper).
        projection_hidden_dim: the head's hidden width (2048 in the paper; 0: the encoder's feature size).
        prototypes: the head's output size K.
        local_crops, local_crop_size, local_crop_min_scale: multi-crop (`tfmp.config` explains them);
            `local_crop_size` 0 = 96/224 of the image side, rounded to the patch.
        student_temperature, teacher_temperature, warmup_teacher_temperature, warmup_teacher_temperature_epochs,
            center_momentum, freeze_last_layer_epochs: DINO's (`tfmp.config`).
        epochs: the run's epochs (the schedules above are in epochs).
        **kwargs: `MomentumTwoViewModel`'s.
    """

    metric_names = ("teacher_entropy", "teacher_temperature")
    batch_coupled_loss = False
    settings = ("projection_dim", "projection_hidden_dim", "target_momentum", "prototypes", "local_crops", "local_crop_size",
                "local_crop_min_scale", "student_temperature", "teacher_temperature", "warmup_teacher_temperature",
                "warmup_teacher_temperature_epochs", "center_momentum", "freeze_last_layer_epochs")

    def __init__(self, encoder: keras.Model, *, projection_dim: int = 256, projection_hidden_dim: int = 0,
                 prototypes: int = 4096, local_crops: int = 6, local_crop_size: int = 0, local_crop_min_scale: float = 0.05,
                 student_temperature: float = 0.1, teacher_temperature: float = 0.04,
                 warmup_teacher_temperature: float = 0.04, warmup_teacher_temperature_epochs: float = 0.0,
                 center_momentum: float = 0.9, freeze_last_layer_epochs: float = 1.0, epochs: int = 1,
                 target_momentum: float = 0.996, norm=None, **kwargs):
        del norm  # the DINO head has no BatchNorm
        super().__init__(encoder, target_momentum=target_momentum, **kwargs)
        hidden = projection_hidden_dim or self.feature_dim
        self.projector = dino_head(self.feature_dim, hidden, projection_dim, prototypes)
        self.make_target()
        self.prototypes = prototypes
        self.local_crops = local_crops
        self.local_crop_size = local_crop_size
        self.local_crop_min_scale = local_crop_min_scale
        self.student_temperature = student_temperature
        self.teacher_temperature = teacher_temperature
        self.warmup_teacher_temperature = warmup_teacher_temperature
        self.steps_per_epoch = self.total_steps / max(epochs, 1)
        self.warmup_teacher_temperature_steps = warmup_teacher_temperature_epochs * self.steps_per_epoch
        self.freeze_last_layer_steps = round(freeze_last_layer_epochs * self.steps_per_epoch)
        self.center_momentum = center_momentum
        # The same on every replica: each assigns the centre from the replicas' mean ("mean" of equal values).
        self.center = self.add_weight(shape=(prototypes,), initializer="zeros", trainable=False, name="center",
                                      aggregation="mean")

    @classmethod
    def from_run_config(cls, encoder: keras.Model, config, **common) -> "DINO":
        return super().from_run_config(encoder, config, epochs=config.epochs, **common)  # its schedules are in epochs

    @classmethod
    def check_inputs(cls, config, image_shape: tuple[int, int, int]) -> None:
        from tfmp import models
        from tfmp.config import UsageError

        if config.local_crops:
            side = cls._run_local_side(config, image_shape)
            try:
                models.check_image_size(config.model, (side, side, image_shape[2]))
            except ValueError as error:
                reason = str(error).split("; set --image_size")[0]
                raise UsageError(f"--task=dino's local crops would be {side}x{side} px: {reason}; set --local_crop_size, "
                                 "--local_crops=0 or a larger --image_size") from None

    @classmethod
    def views_per_example(cls, config, image_shape: tuple[int, int, int]) -> float:
        """The 2 global crops and each local one by its share of the pixels (the teacher's forward pass keeps nothing)."""
        if not config.local_crops:
            return 2.0
        return 2.0 + config.local_crops * (cls._run_local_side(config, image_shape) / image_shape[0]) ** 2

    @staticmethod
    def _run_local_side(config, image_shape: tuple[int, int, int]) -> int:
        """The local crops' side a run's config gives (the patch of `--model`, 1 for a CNN)."""
        return local_crop_side(config.local_crop_size, image_shape[0], getattr(registry.ENCODERS.load(config.model), "patch_size", 1))

    # ------------------------------------------------------------------ crops

    def local_size(self, image_side: int) -> int:
        patch = next((layer.patch for layer in self.encoder.layers if isinstance(layer, vit.PatchEmbedding)), 1)
        return local_crop_side(self.local_crop_size, image_side, patch)

    def _draw_views(self, images: tf.Tensor, seed: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor | None]:
        """(the 2 global crops, `[2 * batch, ...]`; the local crops, `[local_crops * batch, s, s, C]`, or None)."""
        seeds = augment.split_seed(seed, GLOBAL_CROPS + self.local_crops)
        global_crops = tf.concat([augment.simclr_augment(images, crop_seed, self.augment_config) for crop_seed in seeds[:2]], 0)
        if not self.local_crops:
            return global_crops, None
        local_config = dataclasses.replace(self.augment_config,
                                           crop_scale=(self.local_crop_min_scale, self.augment_config.crop_scale[0]))
        size = self.local_size(images.shape[1])
        local_crops = tf.concat([augment.simclr_augment(images, crop_seed, local_config, size) for crop_seed in seeds[2:]], 0)
        return global_crops, local_crops

    # ------------------------------------------------------------------ schedules

    def teacher_temperature_now(self) -> tf.Tensor:
        if self.warmup_teacher_temperature_steps <= 0:
            return tf.constant(self.teacher_temperature, tf.float32)
        step = tf.cast(self.optimizer.iterations, tf.float32)
        progress = tf.minimum(step / self.warmup_teacher_temperature_steps, 1.0)
        return self.warmup_teacher_temperature + (self.teacher_temperature - self.warmup_teacher_temperature) * progress

    def last_layer(self) -> keras.Variable:
        return self.projector.layers[-1].kernel

    # ------------------------------------------------------------------ the step

    def target_outputs(self, first: tf.Tensor, second: tf.Tensor):
        """(the teacher's float32 logits of the 2 global crops, `[first; second]`; the teacher temperature now)."""
        teacher = self.target_projector(self.target_encoder(tf.concat([first, second], axis=0), training=True), training=True)
        return tf.stop_gradient(tf.cast(teacher, tf.float32)), self.teacher_temperature_now()

    def ssl_loss(self, features: tf.Tensor, batch_size: tf.Tensor, targets) -> tuple[tf.Tensor, dict]:
        """DINO's loss of the encoder's `features` of every crop (the 2 global crops first) against `targets`."""
        teacher, temperature = targets
        student = self.projector(features, training=True)
        probabilities = teacher_probabilities(teacher, self.center, temperature)
        loss = cross_entropy(student, probabilities, batch_size, self.student_temperature)
        entropy = -tf.reduce_mean(tf.reduce_sum(probabilities * tf.math.log(probabilities + 1e-12), axis=-1))
        return loss, {"teacher_entropy": entropy, "teacher_temperature": temperature}

    def student_features(self, global_crops: tf.Tensor, local_crops: tf.Tensor | None) -> tf.Tensor:
        """The encoder's features of every crop, the global ones first: one call per crop size."""
        features = self.encoder(global_crops, training=True)
        if local_crops is None:
            return features
        return tf.concat([features, self.encoder(local_crops, training=True)], axis=0)

    def batch_loss(self, images: tf.Tensor) -> tf.Tensor:
        global_crops, local_crops = self.views(images)
        batch = tf.shape(images)[0]
        targets = self.target_outputs(global_crops[:batch], global_crops[batch:])
        return self.ssl_loss(self.student_features(global_crops, local_crops), batch, targets)[0]

    def train_step(self, data):
        images, labels = self._images_and_labels(data)
        global_crops, local_crops = self.views(images)
        batch = tf.shape(images)[0]
        targets = self.target_outputs(global_crops[:batch], global_crops[batch:])
        variables = self.trainable_variables
        steps = self.gradient_accumulation_steps
        owner = accumulation.gradient_owner(self.optimizer, steps, variables)  # zero2: this replica's chunks summed
        if steps == 1:
            with tf.GradientTape() as tape:
                features = self.student_features(global_crops, local_crops)
                loss = self._for_optimizer(self._tracked_loss(features, batch, targets, labels))
            gradients = tape.gradient(loss, variables)
        else:
            gradients = self._accumulated_gradients(global_crops, local_crops, batch, targets, labels, variables, owner)
        # The last layer is frozen at first (the paper: it stabilises the start); Keras still applies weight decay to it.
        open_ = tf.cast(self.optimizer.iterations >= self.freeze_last_layer_steps, tf.float32)
        last = self.last_layer()
        gradients = [gradient * open_ if variable is last and gradient is not None else gradient
                     for gradient, variable in zip(gradients, variables)]
        accumulation.apply_gradients(self.optimizer, gradients, variables, owner)
        self.update_center(targets[0])
        self.after_update()
        return {metric.name: metric.result() for metric in self.metrics}

    def _accumulated_gradients(self, global_crops, local_crops, batch, targets, labels, variables, owner) -> list:
        """The step's gradient over `gradient_accumulation_steps` micro-batches of the images, each with every one of
        their crops and the teacher's outputs for them (DINO's loss is a mean over examples: the micro-batches' losses
        sum to the batch's). A batch they do not divide is padded, each crop with copies of its last row."""
        steps = self.gradient_accumulation_steps
        rows = accumulation.padded_rows(batch, steps)

        def micro(tensor, crops):  # [crops * batch, ...] -> [steps, crops * rows / steps, ...], crop after crop
            return accumulation.view_micro_batches(accumulation.pad_view_rows(tensor, crops, batch, rows), steps, crops)

        teacher, temperature = targets
        micro_global, micro_teacher = micro(global_crops, GLOBAL_CROPS), micro(teacher, GLOBAL_CROPS)
        micro_local = None if local_crops is None else micro(local_crops, self.local_crops)
        micro_labels = None if labels is None else accumulation.micro_batches(accumulation.pad_rows(labels, rows, value=-1), steps)

        def gradients_of(index):
            with tf.GradientTape() as tape:
                features = self.student_features(micro_global[index], None if micro_local is None else micro_local[index])
                loss = self._tracked_loss(features, rows // steps, (micro_teacher[index], temperature),
                                          None if micro_labels is None else micro_labels[index])
                loss = self._for_optimizer(loss / steps)
            return tape.gradient(loss, variables)

        return accumulation.sum_gradients(gradients_of, steps, variables, owner)

    def update_center(self, teacher: tf.Tensor) -> None:
        """`c <- m c + (1 - m) mean(teacher logits)`, the mean over every replica's global crops."""
        context = tf.distribute.get_replica_context()
        total, count = tf.reduce_sum(teacher, axis=0), tf.cast(tf.shape(teacher)[0], tf.float32)
        if context is not None and context.num_replicas_in_sync > 1:
            total, count = context.all_reduce(tf.distribute.ReduceOp.SUM, [total, count])
        self.center.assign(self.center * self.center_momentum + (1.0 - self.center_momentum) * total / count)
