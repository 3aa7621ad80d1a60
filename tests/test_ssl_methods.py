"""The SSL methods: each loss against NumPy, 2 replicas against 1 device, the EMA target, fp16, resume.

Every method is a `TwoViewModel` (tfmp/ssl/two_view.py); BYOL and MoCo v3 add a momentum target
(tfmp/ssl/momentum.py). These tests take the shapes users and the CLI take: the method built
around a tfmp encoder, trained with `fit()` or stepped under `strategy.run`.
"""

import json
import os
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import REPO, one_device_and_two_replicas
from tfmp import data, distribute, models, precision, registry, ssl, training
from tfmp.config import Config, validate
from tfmp.data import augment
from tfmp.ssl import guard, probes
from tfmp.ssl.losses import barlow_twins_loss, byol_loss, info_nce, vicreg_loss
from tfmp.ssl.momentum import momentum_at
from tfmp.runtime import Runtime
from tfmp.tasks import pretrain

METHODS = registry.SSL_METHODS.names()
# Methods that take any encoder and compare views through `ssl_loss`: the tests below run them on the small CNN (MAE,
# ViT only, has its own in tests/test_mae.py).
ANY_ENCODER_METHODS = [name for name in METHODS if not registry.SSL_METHODS.load(name).vit_only]
SYNCHRONIZED = models.NormSettings(synchronized=True)

# ---------------------------------------------------------------------------- losses against NumPy


def _normalise(x):
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _log_softmax(logits):
    shifted = logits - logits.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def _pair(rows=12, dim=6, seed=0):
    rng = np.random.default_rng(seed)
    z1 = rng.normal(size=(rows, dim))
    return z1.astype(np.float32), (z1 + 0.3 * rng.normal(size=(rows, dim))).astype(np.float32)


def test_info_nce_matches_numpy():
    queries, keys = _pair()
    logits = _normalise(queries.astype(np.float64)) @ _normalise(keys.astype(np.float64)).T / 0.5
    expected = -np.mean(np.diag(_log_softmax(logits))) * 2 * 0.5
    loss, accuracy = info_nce(tf.constant(queries), tf.constant(keys), 0.5)
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    assert float(accuracy) == pytest.approx(np.mean(logits.argmax(axis=1) == np.arange(len(queries))))


def test_byol_loss_matches_numpy():
    predictions, targets = _pair()
    cosine = np.sum(_normalise(predictions.astype(np.float64)) * _normalise(targets.astype(np.float64)), axis=1)
    assert float(byol_loss(tf.constant(predictions), tf.constant(targets))) == pytest.approx(np.mean(2 - 2 * cosine), rel=1e-5)


def test_vicreg_loss_matches_numpy():
    z1, z2 = _pair()
    x, y = z1.astype(np.float64), z2.astype(np.float64)
    invariance = np.mean((x - y) ** 2)
    variance = sum(np.mean(np.maximum(0, 1 - np.sqrt(z.var(axis=0, ddof=1) + 1e-4))) / 2 for z in (x, y))
    covariance = 0.0
    for z in (x, y):
        matrix = np.cov(z, rowvar=False)
        covariance += (np.sum(matrix ** 2) - np.sum(np.diag(matrix) ** 2)) / z.shape[1]
    loss, terms = vicreg_loss(tf.constant(z1), tf.constant(z2), 25.0, 25.0, 1.0)
    assert float(terms["invariance"]) == pytest.approx(invariance, rel=1e-5)
    assert float(terms["variance"]) == pytest.approx(variance, rel=1e-5, abs=1e-7)
    assert float(terms["covariance"]) == pytest.approx(covariance, rel=1e-5)
    assert float(loss) == pytest.approx(25 * invariance + 25 * variance + covariance, rel=1e-5)


def test_barlow_twins_loss_matches_numpy():
    z1, z2 = _pair()
    standardise = lambda z: (z - z.mean(axis=0)) / np.sqrt(z.var(axis=0) + 1e-5)  # noqa: E731
    correlation = standardise(z1.astype(np.float64)).T @ standardise(z2.astype(np.float64)) / len(z1)
    on_diagonal = np.sum((np.diag(correlation) - 1) ** 2)
    off_diagonal = np.sum(correlation ** 2) - np.sum(np.diag(correlation) ** 2)
    loss, terms = barlow_twins_loss(tf.constant(z1), tf.constant(z2), 0.02)
    assert float(terms["on_diagonal"]) == pytest.approx(on_diagonal, rel=1e-4)
    assert float(terms["off_diagonal"]) == pytest.approx(off_diagonal, rel=1e-4)
    assert float(loss) == pytest.approx(on_diagonal + 0.02 * off_diagonal, rel=1e-4)


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16])
def test_statistics_losses_are_float32_for_low_precision_inputs(dtype):
    z1, z2 = (tf.cast(z * 50.0, dtype) for z in _pair(rows=64, dim=32))  # large activations: fp16 sums would overflow
    for loss, _ in (vicreg_loss(z1, z2), barlow_twins_loss(z1, z2)):
        assert loss.dtype == tf.float32 and np.isfinite(float(loss))


# ---------------------------------------------------------------------------- methods on 2 replicas


def _method(name, strategy, seed=0, **kwargs):
    keras.utils.set_random_seed(seed)
    with strategy.scope():
        encoder = models.build_encoder("small_cnn", (8, 8, 1), SYNCHRONIZED)
        options = {"total_steps": 20} if issubclass(registry.SSL_METHODS.load(name), ssl.MomentumTwoViewModel) else {}
        model = registry.SSL_METHODS.load(name)(encoder, projection_dim=16, norm=SYNCHRONIZED, seed=seed, num_classes=10,
                                  augment_config=augment.AugmentConfig(crop_scale=(0.5, 1.0), flip=False), **options, **kwargs)
        model.build((None, 8, 8, 1))
    return model


def _loss_and_gradients(model, first, second, num_replicas):
    targets = model.target_outputs(first, second)
    with tf.GradientTape() as tape:
        features = model.encoder(tf.concat([first, second], axis=0), training=True)
        loss, _ = model.ssl_loss(features, tf.shape(first)[0], targets)
        scaled = loss / num_replicas  # Keras' convention: each replica's loss / N, gradients summed
    return loss, tape.gradient(scaled, model.trainable_variables)


@pytest.mark.parametrize("name", ANY_ENCODER_METHODS)
def test_two_replicas_give_the_one_device_loss_and_gradients(name):
    images = tf.random.stateless_uniform((8, 8, 8, 1), seed=[1, 2])
    first, second = images, tf.image.flip_left_right(images) * 0.9  # fixed "views": the same on both set-ups

    single = _method(name, tf.distribute.get_strategy())
    strategy = distribute.get_strategy("mirrored")
    assert strategy.num_replicas_in_sync == 2
    mirrored = _method(name, strategy)
    for a, b in zip(single.weights, mirrored.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())

    (loss, gradients), (losses, summed) = one_device_and_two_replicas(_loss_and_gradients, single, mirrored, strategy,
                                                                       first, second)
    assert np.mean(losses) == pytest.approx(float(loss), rel=2e-5)
    assert len(gradients) == len(summed) == len(single.trainable_variables)
    compared = 0
    for expected, total, variable in zip(gradients, summed, single.trainable_variables):
        assert (expected is None) == (total is None), variable.path
        if expected is None:  # the online probe: not part of the SSL loss
            assert "online_probe" in variable.path
            continue
        compared += 1
        total = total.numpy()
        # float32 sums in another order: differences scale with the gradient's magnitude (Barlow Twins' are ~4).
        scale = max(1.0, float(np.abs(expected.numpy()).max()))
        np.testing.assert_allclose(total, expected.numpy(), rtol=1e-3, atol=2e-5 * scale, err_msg=variable.path)
    assert compared == len(single.trainable_variables) - 2  # all but the probe's kernel and bias


# ---------------------------------------------------------------------------- the momentum target


@pytest.mark.parametrize("replicas", [1, 2])
def test_the_ema_target_after_n_steps_is_the_closed_form(replicas):
    """Online weights held fixed (learning rate 0), target started at 0: after N steps it is
    (1 - prod_k m_k) * online, m_k the cosine schedule — on every replica's copy."""
    strategy = distribute.get_strategy("mirrored") if replicas == 2 else tf.distribute.get_strategy()
    model = _method("byol", strategy, target_momentum=0.9)
    with strategy.scope():
        model.compile(optimizer=keras.optimizers.SGD(0.0))
    for variable in model.target_weights():
        variable.assign(tf.zeros_like(variable))
    digits = data.load("digits")
    steps = 5
    model.fit(data.classification_pipeline(digits.train, 32, training=True, indices=np.arange(32 * steps)), epochs=1, verbose=0)

    remaining = np.prod([float(momentum_at(step, 20, 0.9)) for step in range(steps)])
    assert 0.3 < remaining < 0.7  # the schedule moved the target a good way, so the check below has teeth
    for target, online in zip(model.target_weights(), model.online_target_weights()):
        for copy in strategy.experimental_local_results(target.value):
            np.testing.assert_allclose(copy.numpy(), (1 - remaining) * online.numpy(), rtol=1e-5, atol=1e-7, err_msg=target.path)


def test_the_optimizer_keeps_no_slots_for_the_target():
    model = _method("mocov3", tf.distribute.get_strategy())
    model.compile(optimizer=keras.optimizers.AdamW(1e-3))
    model.optimizer.build(model.trainable_variables)
    target = {id(variable) for variable in model.target_weights()}
    assert target and not target & {id(variable) for variable in model.trainable_variables}
    assert len(model.optimizer.variables) == 2 + 2 * len(model.trainable_variables)  # iteration, lr, 2 Adam slots each


def test_on_one_device_fit_creates_no_variable_inside_the_traced_step():
    """Keras builds the optimizer inside the first trace of the step under TensorFlow's default strategy, and
    TensorFlow then traces the step a second time (a DINO test's fit traced its step twice, 9 s each on a Zen 3); a
    method's `compile` builds it first (`compilation.build_optimizer_before_tracing`)."""
    model = _method("byol", tf.distribute.get_strategy())
    model.compile(optimizer=keras.optimizers.AdamW(1e-3))
    made_inside = []

    def recording(next_creator, **kwargs):
        if tf.inside_function():
            made_inside.append(kwargs.get("name"))
        return next_creator(**kwargs)

    with tf.variable_creator_scope(recording):
        model.fit(np.random.default_rng(0).random((16, 8, 8, 1), dtype=np.float32), batch_size=8, epochs=1, verbose=0)
    assert made_inside == [] and int(model.optimizer.iterations.numpy()) == 2


# Under -m slow: fp16 is TensorFlow's slow path on a CPU (BYOL and VICReg took 60-65 s each on the 2-core Xeon with
# AMX). The default suite keeps fp16 SSL through SimCLR's planted overflow (tests/test_ssl.py).
# DINO's local crops of 8 px digits are 3 px, which the small CNN refuses (the CLI's check says so): global crops only.
SMALL_CNN_SETTINGS = {"dino": {"local_crops": 0}}


@pytest.mark.slow
@pytest.mark.parametrize("name", ANY_ENCODER_METHODS)
def test_each_method_under_fp16_finishes_with_finite_weights(name):
    precision.set_policy("mixed_float16")
    model = _method(name, tf.distribute.get_strategy(), **SMALL_CNN_SETTINGS.get(name, {}))
    model.compile(optimizer=precision.wrap_optimizer(keras.optimizers.AdamW(1e-3)))
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    digits = data.load("digits")
    history = model.fit(data.classification_pipeline(digits.train, 64, training=True, indices=np.arange(256)), epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert all(np.isfinite(variable.numpy()).all() for variable in model.weights)


# ---------------------------------------------------------------------------- kill -9, rerun

BYOL_ARGS = ["--task=byol", "--dataset=digits", "--model=small_cnn", "--precision=float32", "--strategy=off", "--epochs=4",
             "--global_batch_size=64", "--checkpoint_every_steps=5", "--label_fraction=0.05", "--probe_epochs=5",
             "--flip=false", "--seed=3"]


def _registered_checkpoints(workdir):
    state = os.path.join(workdir, "checkpoints", "checkpoint")
    if not os.path.exists(state):
        return []
    with open(state, encoding="utf-8") as file:
        return [line.split('"')[1] for line in file if line.startswith("all_model_checkpoint_paths")]


def _checkpointed_target(path, config):
    """The target network's values in checkpoint `path`, read with TF's own Checkpoint API into a fresh model."""
    assert any("target_encoder" in key for key, _ in tf.train.list_variables(path))
    assert any("target_projector" in key for key, _ in tf.train.list_variables(path))
    fresh = pretrain.build_method(config, data.load("digits"), Runtime.for_strategy(tf.distribute.get_strategy()), total_steps=88)
    initial = [weight.numpy().copy() for weight in fresh.target_weights()]
    tf.train.Checkpoint(model=fresh).read(path).expect_partial()
    return initial, [weight.numpy() for weight in fresh.target_weights()]


@pytest.mark.slow  # 22 s: a CLI run killed with SIGKILL, then rerun in-process
def test_a_byol_run_killed_with_sigkill_restores_its_target_bit_for_bit(tmp_path):
    workdir = str(tmp_path / "run")
    environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    process = subprocess.Popen([sys.executable, "-m", "tfmp.train", *BYOL_ARGS, f"--workdir={workdir}"], cwd=REPO, env=environment,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while len(_registered_checkpoints(workdir)) < 2 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # polling for a file, not timing the test
    assert process.poll() is None, process.communicate()[1][-2000:]
    process.send_signal(signal.SIGKILL)
    process.wait()
    newest = os.path.join(workdir, "checkpoints", os.path.basename(_registered_checkpoints(workdir)[-1]))

    class RecordTargetAtStart(keras.callbacks.Callback):
        """Runs after tfmp's Checkpointing has restored (extra callbacks come after tfmp's); the first fit() only (a
        run resumed inside an epoch finishes that epoch in a fit() of its own first)."""

        restored = None

        def on_train_begin(self, logs=None):
            if self.restored is None:
                self.restored = [weight.numpy().copy() for weight in self.model.target_weights()]

    config = validate(Config(**{arg.split("=")[0][2:]: _parse(arg.split("=")[1]) for arg in BYOL_ARGS}))
    initial, saved = _checkpointed_target(newest, config)  # before the rerun rotates the file away
    recorder = RecordTargetAtStart()
    metrics = training.run(config, workdir, extra_callbacks=[recorder])
    assert metrics["resumed_from_step"] == int(newest.rsplit("-", 1)[1]) > 0

    assert len(recorder.restored) == len(saved) > 0
    assert any(not np.array_equal(a, b) for a, b in zip(initial, saved)), "training moved the target before the kill"
    for restored, value in zip(recorder.restored, saved):
        np.testing.assert_array_equal(restored, value)
    with open(os.path.join(workdir, "metrics.json"), encoding="utf-8") as file:
        assert json.load(file)["method"] == "byol"


def _parse(text):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text, text)


# ---------------------------------------------------------------------------- the task and its encoder


@pytest.mark.parametrize("name", [pytest.param(name, marks=() if name == "byol" else pytest.mark.slow) for name in METHODS])
def test_every_method_writes_an_encoder_linear_eval_serves(name, tmp_path):
    model = "vit_micro_p2" if registry.SSL_METHODS.load(name).vit_only else "small_cnn"
    common = dict(dataset="digits", model=model, precision="float32", strategy="off", epochs=1, global_batch_size=128,
                  label_fraction=0.05, probe_epochs=5, flip=False)
    settings = {} if model != "small_cnn" else SMALL_CNN_SETTINGS.get(name, {})
    metrics = training.run(Config(task=name, **common, **settings), str(tmp_path / "pretrain"))
    assert metrics["method"] == name and np.isfinite(metrics["train_loss"])
    evaluation = training.run(Config(task="linear_eval", encoder=str(tmp_path / "pretrain" / "encoder.keras"), **common),
                              str(tmp_path / "eval"))
    assert evaluation["linear_probe_accuracy"] > 0.2  # chance is 0.1 on digits' 10 classes
    assert evaluation["knn_accuracy"] == pytest.approx(metrics["knn_accuracy"])  # the same encoder, the same labels


# ---------------------------------------------------------------------------- the small-data guard


def _watch(curve, epochs=100, **kwargs):
    watch = guard.PlateauWatch(**kwargs)
    watch.set_params({"epochs": epochs})
    watch.set_model(keras.Sequential())
    for epoch, accuracy in curve:
        watch.on_epoch_end(epoch - 1, {"loss": 1.0, "knn_accuracy": accuracy})
    return watch


def test_the_plateau_watch_sees_a_flat_knn_curve_with_epochs_left():
    rising = [(10, 0.60), (20, 0.70), (30, 0.78), (40, 0.84), (50, 0.87)]
    assert _watch(rising).plateau is None
    flat = rising[:3] + [(40, 0.785), (50, 0.781), (60, 0.786)]
    watch = _watch(flat, stop=True)
    assert watch.plateau == {"epoch": 60, "knn_accuracy": 0.786, "epochs": 100, "gain": pytest.approx(0.006)}
    assert watch.model.stop_training
    assert "plateaued at 0.786 by epoch 60 of 100" in guard.verdict({}, watch)[0]
    assert _watch(flat, epochs=70).plateau is None  # flat near the end is how a finished curve looks, not waste


def test_the_verdict_names_a_probe_that_did_not_beat_the_baseline():
    metrics = {"linear_probe_accuracy": 0.80, "supervised_baseline_accuracy": 0.846, "labeled_examples": 30,
               "linear_probe_accuracy_per_draw": [0.8] * 5, "unlabeled_examples": 200}
    (warning,) = guard.verdict(metrics)
    assert "linear probe 0.800 vs supervised baseline 0.846 on the same 30 labels (mean of 5 draws)" in warning
    assert guard.verdict({**metrics, "linear_probe_accuracy": 0.9}) == []
    assert guard.verdict({"linear_probe_accuracy": 0.5}) == []  # no baseline run: nothing to compare


def test_repeated_feature_extraction_traces_once():
    encoder = models.build_encoder("small_cnn", (8, 8, 1))
    digits = data.load("digits")
    pipeline = data.classification_pipeline(digits.test, 100, training=False)  # 360 images: a smaller last batch
    for _ in range(3):
        probes.extract_features(encoder, pipeline)
    assert probes._inference_function(encoder, False).experimental_get_tracing_count() <= 2
