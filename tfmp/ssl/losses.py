"""The losses of tfmp's SSL methods, each over the *global* batch on any number of replicas.

All are computed in float32 whatever the dtype policy: NT-Xent's mask constant (1e9) does not
fit in float16, logits of 1/temperature overflow fp16 quickly once scaled, and the variance,
covariance and cross-correlation statistics of VICReg and Barlow Twins sum thousands of
products. Each function returns this replica's loss such that the mean over replicas (what
Keras' gradient sum over replicas of loss / N gives) equals one device's loss on the global
batch — tests/test_ssl_methods.py checks losses and gradients on 2 replicas against 1 device.

* `nt_xent` (SimCLR) and `info_nce` (MoCo v3): negatives gathered from all replicas;
* `byol_loss`: per example, so a replica's mean is its share;
* `vicreg_loss`, `barlow_twins_loss`: statistics over the gathered global batch (the
  all-gather is differentiable), so every replica computes the global loss itself.
"""

from __future__ import annotations

import tensorflow as tf

LARGE_NUMBER = 1e9


def cross_replica_concat(tensor: tf.Tensor) -> tf.Tensor:
    """Concatenates `tensor` from all replicas along axis 0 (identity on one replica).

    TensorFlow's `all_gather` is differentiable: the gradient of a replica's slice is
    the all-reduced sum of the upstream gradients for that slice, so the gradients of
    every replica's loss reach the encoder that produced each embedding.
    """
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return tensor
    return context.all_gather(tensor, axis=0)


def _replica_offset(local_batch: tf.Tensor) -> tf.Tensor:
    """Index of this replica's first example in the gathered global batch."""
    context = tf.distribute.get_replica_context()
    replica_id = tf.cast(context.replica_id_in_sync_group, tf.int32) if context is not None else 0
    return replica_id * local_batch


def nt_xent(z1: tf.Tensor, z2: tf.Tensor, temperature: float) -> tuple[tf.Tensor, tf.Tensor]:
    """The SimCLR loss for this replica's anchors against the global batch.

    Args:
        z1, z2: [local_batch, dim] projections of the two views of the same images.
        temperature: softmax temperature.

    Returns:
        `(loss, accuracy)`: the mean loss over this replica's 2 x local_batch anchors,
        and how often the positive is the top candidate. Averaged over replicas, both
        equal the single-device values on the global batch.
    """
    z1 = tf.math.l2_normalize(tf.cast(z1, tf.float32), axis=1)
    z2 = tf.math.l2_normalize(tf.cast(z2, tf.float32), axis=1)
    local_batch = tf.shape(z1)[0]
    all_z1, all_z2 = cross_replica_concat(z1), cross_replica_concat(z2)
    labels = _replica_offset(local_batch) + tf.range(local_batch)
    self_mask = tf.one_hot(labels, tf.shape(all_z1)[0]) * LARGE_NUMBER

    logits_11 = tf.matmul(z1, all_z1, transpose_b=True) / temperature - self_mask
    logits_22 = tf.matmul(z2, all_z2, transpose_b=True) / temperature - self_mask
    logits_12 = tf.matmul(z1, all_z2, transpose_b=True) / temperature
    logits_21 = tf.matmul(z2, all_z1, transpose_b=True) / temperature
    loss_1 = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, tf.concat([logits_12, logits_11], axis=1))
    loss_2 = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, tf.concat([logits_21, logits_22], axis=1))
    loss = 0.5 * (tf.reduce_mean(loss_1) + tf.reduce_mean(loss_2))
    correct = tf.cast(tf.equal(tf.argmax(logits_12, axis=1, output_type=tf.int32), labels), tf.float32)
    return loss, tf.reduce_mean(correct)


def info_nce(queries: tf.Tensor, keys: tf.Tensor, temperature: float) -> tuple[tf.Tensor, tf.Tensor]:
    """MoCo v3's contrastive loss (Chen, Xie & He 2021): each query against the keys of the global batch.

    The keys come from the momentum network and take no gradient; the positive of query i
    is key i. Multiplied by 2 x temperature, as in MoCo v3, so the gradient's scale does not
    depend on the temperature.

    Returns:
        `(loss, accuracy)`: mean over this replica's queries, and how often the positive wins.
    """
    queries = tf.math.l2_normalize(tf.cast(queries, tf.float32), axis=1)
    keys = tf.math.l2_normalize(tf.cast(tf.stop_gradient(keys), tf.float32), axis=1)
    local_batch = tf.shape(queries)[0]
    logits = tf.matmul(queries, cross_replica_concat(keys), transpose_b=True) / temperature
    labels = _replica_offset(local_batch) + tf.range(local_batch)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)) * (2.0 * temperature)
    correct = tf.cast(tf.equal(tf.argmax(logits, axis=1, output_type=tf.int32), labels), tf.float32)
    return loss, tf.reduce_mean(correct)


def byol_loss(predictions: tf.Tensor, targets: tf.Tensor) -> tf.Tensor:
    """BYOL's normalised MSE, `2 - 2 cos(prediction, target)`, mean over this replica's examples (Grill et al. 2020)."""
    predictions = tf.math.l2_normalize(tf.cast(predictions, tf.float32), axis=1)
    targets = tf.math.l2_normalize(tf.cast(tf.stop_gradient(targets), tf.float32), axis=1)
    return tf.reduce_mean(2.0 - 2.0 * tf.reduce_sum(predictions * targets, axis=1))


def _off_diagonal_squares(matrix: tf.Tensor) -> tf.Tensor:
    return tf.reduce_sum(tf.square(matrix)) - tf.reduce_sum(tf.square(tf.linalg.diag_part(matrix)))


def vicreg_loss(z1: tf.Tensor, z2: tf.Tensor, invariance_weight: float = 25.0, variance_weight: float = 25.0,
                covariance_weight: float = 1.0, epsilon: float = 1e-4) -> tuple[tf.Tensor, dict]:
    """VICReg (Bardes, Ponce & LeCun 2022) over the global batch: invariance (MSE between the views),
    variance (hinge keeping each dimension's standard deviation at 1 or above) and covariance
    (off-diagonal covariance squared, per dimension).

    Returns:
        `(loss, {"invariance", "variance", "covariance"})`, the same on every replica.
    """
    z1 = cross_replica_concat(tf.cast(z1, tf.float32))
    z2 = cross_replica_concat(tf.cast(z2, tf.float32))
    count = tf.cast(tf.shape(z1)[0], tf.float32)
    dim = tf.cast(tf.shape(z1)[1], tf.float32)
    invariance = tf.reduce_mean(tf.square(z1 - z2))
    variance, covariance = 0.0, 0.0
    for z in (z1, z2):
        centred = z - tf.reduce_mean(z, axis=0, keepdims=True)
        unbiased_variance = tf.reduce_sum(tf.square(centred), axis=0) / (count - 1.0)
        variance += tf.reduce_mean(tf.nn.relu(1.0 - tf.sqrt(unbiased_variance + epsilon))) / 2.0
        covariance += _off_diagonal_squares(tf.matmul(centred, centred, transpose_a=True) / (count - 1.0)) / dim
    loss = invariance_weight * invariance + variance_weight * variance + covariance_weight * covariance
    return loss, {"invariance": invariance, "variance": variance, "covariance": covariance}


def barlow_twins_loss(z1: tf.Tensor, z2: tf.Tensor, redundancy_weight: float = 0.0051,
                      epsilon: float = 1e-5) -> tuple[tf.Tensor, dict]:
    """Barlow Twins (Zbontar et al. 2021) over the global batch: the cross-correlation of the two views'
    standardised projections pushed to the identity (diagonal to 1, off-diagonal to 0 with weight
    `redundancy_weight`).

    Returns:
        `(loss, {"on_diagonal", "off_diagonal"})`, the same on every replica.
    """
    z1 = cross_replica_concat(tf.cast(z1, tf.float32))
    z2 = cross_replica_concat(tf.cast(z2, tf.float32))
    count = tf.cast(tf.shape(z1)[0], tf.float32)

    def standardise(z):  # BatchNorm without affine parameters: batch mean, biased variance
        mean, variance = tf.nn.moments(z, axes=[0], keepdims=True)
        return (z - mean) / tf.sqrt(variance + epsilon)

    correlation = tf.matmul(standardise(z1), standardise(z2), transpose_a=True) / count
    on_diagonal = tf.reduce_sum(tf.square(tf.linalg.diag_part(correlation) - 1.0))
    off_diagonal = _off_diagonal_squares(correlation)
    return on_diagonal + redundancy_weight * off_diagonal, {"on_diagonal": on_diagonal, "off_diagonal": off_diagonal}
