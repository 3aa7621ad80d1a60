"""NT-Xent (normalised temperature-scaled cross entropy), with negatives from all replicas.

Computed in float32 whatever the dtype policy: the mask constant (1e9) does not fit
in float16, and logits of 1/temperature overflow fp16's range quickly once scaled.
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
    context = tf.distribute.get_replica_context()
    replica_id = tf.cast(context.replica_id_in_sync_group, tf.int32) if context is not None else 0
    labels = replica_id * local_batch + tf.range(local_batch)
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
