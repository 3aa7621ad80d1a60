"""Measuring a pretrained encoder: kNN accuracy, a linear probe, and a kNN monitor callback.

Both probes see the encoder frozen, in inference mode (BatchNorm moving statistics),
and only the labeled examples they are given — the same labeled subset the
supervised baseline trains on.
"""

from __future__ import annotations

import math
import weakref

import keras
import numpy as np
import tensorflow as tf

from tfmp.callbacks.telemetry import HistoryCSV
from tfmp.data.pipeline import in_memory_options


def extract_features(encoder: keras.Model, dataset: tf.data.Dataset, jit_compile: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Encodes a batched `(images, labels)` dataset; returns float32 features and labels.

    The kNN vote and the probe's standardisation run on the host (NumPy / Keras), on features
    already computed; only the encoder's forward pass is a device step (XLA with `jit_compile`)."""
    features, labels = [], []
    encode = _inference_function(encoder, jit_compile)
    for images, batch_labels in dataset:
        features.append(encode(images).numpy())
        labels.append(batch_labels.numpy())
    return np.concatenate(features), np.concatenate(labels)


_INFERENCE_FUNCTIONS: "weakref.WeakKeyDictionary[keras.Model, dict]" = weakref.WeakKeyDictionary()


def _inference_function(encoder: keras.Model, jit_compile: bool):
    """One traced forward pass per encoder (and XLA setting), reused by every extraction: a new
    `tf.function` per call would retrace each time (TF warns after five), and the kNN monitor
    extracts features every few epochs. Traced for any batch size up front, so the last, smaller batch does not
    trace it again (an encoder without a known input shape: traced again once, for a batch of any size)."""
    functions = _INFERENCE_FUNCTIONS.setdefault(encoder, {})
    if jit_compile not in functions:
        input_shape = getattr(encoder, "input_shape", None)
        signature = [tf.TensorSpec([None, *input_shape[1:]], tf.float32)] if isinstance(input_shape, tuple) else None
        functions[jit_compile] = tf.function(lambda images: tf.cast(encoder(images, training=False), tf.float32),
                                             jit_compile=jit_compile, input_signature=signature,
                                             reduce_retracing=signature is None)
    return functions[jit_compile]


def knn_accuracy(bank: np.ndarray, bank_labels: np.ndarray, queries: np.ndarray, query_labels: np.ndarray,
                 num_classes: int, k: int = 20, temperature: float = 0.1) -> float:
    """Weighted kNN on cosine similarity (Wu et al. 2018): each of the k nearest bank
    examples votes for its class with weight exp(similarity / temperature).

    Features are centred on the bank's mean first: post-ReLU, average-pooled features
    all lie in the positive orthant, where cosine similarities crowd near 1 (what centring
    buys is measured in BUILD_NOTES.md, "Layout and decisions").
    """
    center = bank.mean(axis=0, keepdims=True)
    bank, queries = bank - center, queries - center
    bank = bank / np.maximum(np.linalg.norm(bank, axis=1, keepdims=True), 1e-12)
    queries = queries / np.maximum(np.linalg.norm(queries, axis=1, keepdims=True), 1e-12)
    similarity = queries @ bank.T
    k = min(k, len(bank))
    nearest = np.argpartition(-similarity, k - 1, axis=1)[:, :k]
    weights = np.exp(np.take_along_axis(similarity, nearest, axis=1) / temperature)
    votes = np.zeros((len(queries), num_classes))
    np.add.at(votes, (np.arange(len(queries))[:, None], bank_labels[nearest]), weights)
    return float(np.mean(votes.argmax(axis=1) == query_labels))


MAX_STEPS_PER_EXECUTION = 256  # steps of a probe run inside one traced call (Keras' `steps_per_execution`)
EVALUATION_BATCH = 1024


def linear_probe(train_features: np.ndarray, train_labels: np.ndarray, test_features: np.ndarray, test_labels: np.ndarray,
                 num_classes: int, *, epochs: int = 200, learning_rate: float = 1e-2, weight_decay: float = 1e-4,
                 batch_size: int = 256, seed: int = 0, jit_compile: bool = False, compiled=None) -> float:
    """Trains a linear classifier on standardised frozen features; returns test accuracy.

    Runs outside any distribution strategy and in float32: the features are already
    computed, and a linear layer on a few thousand vectors takes seconds.

    All `epochs` (each a reshuffled pass in batches of `batch_size`, the last batch partial)
    run as one `fit()` epoch in executions of many steps, which saves Keras' per-epoch work
    when an epoch is one step; the optimisation is the same steps on the same batches.

    Args:
        compiled: a `tfmp.compilation.CompiledOnce` shared by probes of one recipe and feature size
            (the label draws): the probe's step is traced once for all of them.
    """
    keras.utils.set_random_seed(seed)
    # Standardised with the train features' mean and population variance, as Keras' Normalization
    # (and its `adapt`) would: on the host, so that the model holds no per-probe constants and one
    # compiled probe serves every draw.
    mean, scale = train_features.mean(axis=0), np.maximum(np.sqrt(train_features.var(axis=0)), keras.config.epsilon())
    train_features, test_features = [((features - mean) / scale).astype(np.float32) for features in (train_features, test_features)]
    model = keras.Sequential([keras.Input(train_features.shape[1:]), keras.layers.Dense(num_classes, dtype="float32")])
    batch_size = min(batch_size, len(train_features))
    steps = epochs * math.ceil(len(train_features) / batch_size)

    def compile_model(model):
        model.compile(optimizer=keras.optimizers.AdamW(learning_rate, weight_decay=weight_decay),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=jit_compile,
                      # A metric object, not "accuracy": Keras makes a named metric's variables inside the first trace
                      # of the step under TensorFlow's default strategy, and TensorFlow then traces the step again.
                      metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
                      steps_per_execution=min(steps, MAX_STEPS_PER_EXECUTION))  # Keras runs a shorter last execution

    if compiled is None:
        compile_model(model)
    else:
        model = compiled.compile(model, compile_model)
    batches = (tf.data.Dataset.from_tensor_slices((train_features, train_labels))
               .shuffle(len(train_features), seed=seed, reshuffle_each_iteration=True).batch(batch_size).repeat(epochs)
               .with_options(in_memory_options()))
    model.fit(batches, epochs=1, verbose=0, shuffle=False)  # the dataset shuffles
    return float(model.evaluate(test_features, test_labels, batch_size=EVALUATION_BATCH, verbose=0)[1])


class KNNMonitor(keras.callbacks.Callback):
    """Adds `knn_accuracy` of the encoder to the epoch logs every `every_epochs` epochs.

    Args:
        encoder: the encoder being pretrained.
        bank: batched labeled `(images, labels)` dataset the neighbours come from.
        queries: batched labeled dataset that is classified.
        num_classes: number of classes.
        every_epochs: how often to measure (and always after the first and the last epoch).
        jit_compile: compile the feature extraction with XLA.
    """

    runs_before = (HistoryCSV, keras.callbacks.TensorBoard)  # they write the logs it adds to

    def __init__(self, encoder, bank, queries, num_classes: int, every_epochs: int = 10, k: int = 20, jit_compile: bool = False):
        super().__init__()
        self.jit_compile = jit_compile
        self.encoder, self.bank, self.queries = encoder, bank, queries
        self.num_classes, self.every_epochs, self.k = num_classes, every_epochs, k
        self.last_accuracy = None
        self._measured_in_this_fit = False

    def on_train_begin(self, logs=None):
        self._measured_in_this_fit = False

    def on_epoch_end(self, epoch, logs=None):
        # Also after the first epoch of every fit (a resumed one too): history.csv (HistoryCSV, which runs after this)
        # takes its columns from the first logs it sees, so it has a kNN column only if that row has it.
        first, last = not self._measured_in_this_fit, epoch + 1 == self.params.get("epochs")
        self._measured_in_this_fit = True
        if not (first or last) and (epoch + 1) % self.every_epochs:
            return
        bank, bank_labels = extract_features(self.encoder, self.bank, self.jit_compile)
        queries, query_labels = extract_features(self.encoder, self.queries, self.jit_compile)
        self.last_accuracy = knn_accuracy(bank, bank_labels, queries, query_labels, self.num_classes, self.k)
        if logs is not None:
            logs["knn_accuracy"] = self.last_accuracy
