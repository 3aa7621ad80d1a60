"""Every step tfmp runs compiles under XLA (`jit_compile=True`) on the CPU: the check for TPU readiness here.

TPUs compile every step with XLA, and Keras' `jit_compile="auto"` turns XLA on by itself on a
single GPU; an op without an XLA kernel (as `CropAndResize` was) would stop those runs.
"""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import AUTO_PRECISION, REPO
from tfmp import compilation, distribute, hardware, models
from tfmp.config import UsageError
from tfmp.data import augment
from tfmp.ssl.simclr import SimCLR


def test_resize_crops_matches_tensorflows_crop_and_resize():
    images = tf.random.stateless_uniform((16, 32, 32, 3), seed=[1, 2])
    boxes = augment.crop_boxes(16, tf.constant([3, 4]), scale=(0.08, 1.0))
    expected = tf.image.crop_and_resize(images, boxes, tf.range(16), (32, 32))
    np.testing.assert_allclose(augment.resize_crops(images, boxes), expected, atol=2e-5)


@pytest.mark.parametrize("channels", [pytest.param(1, marks=pytest.mark.slow), 3])  # 10-35 s each
def test_augmentations_compile_and_draw_the_same_views_with_and_without_xla(channels):
    images = tf.random.stateless_uniform((8, 32, 32, channels), seed=[1, 2])
    config = augment.AugmentConfig(noise_stddev=0.1)  # every op on: crop, flip, jitter, gray, blur, noise
    compiled = tf.function(lambda x, seed: augment.simclr_augment(x, seed, config), jit_compile=True)
    graph = tf.function(lambda x, seed: augment.simclr_augment(x, seed, config))
    seed = tf.constant([5, 6])
    np.testing.assert_allclose(compiled(images, seed), graph(images, seed), atol=1e-4)
    assert not np.allclose(compiled(images, seed), compiled(images, tf.constant([5, 7])))


def _digits_like(count=64, size=16):
    rng = np.random.default_rng(0)
    return rng.random((count, size, size, 1), dtype=np.float32), (np.arange(count) % 10).astype(np.int32)


def test_simclr_fit_with_jit_compile_on_two_replicas_trains_and_replicas_draw_different_crops():
    """XLA compiles one device's program: on mirrored replicas, each replica's augmentations (tfmp.compilation)."""
    strategy = distribute.get_strategy("mirrored")
    assert strategy.num_replicas_in_sync == 2
    images, labels = _digits_like()
    with strategy.scope():
        encoder = models.build_encoder("small_cnn", images.shape[1:], models.NormSettings(synchronized=True))
        model = SimCLR(encoder, num_classes=10, projection_dim=16, temperature=0.5,
                       augment_config=augment.AugmentConfig(crop_scale=(0.3, 1.0), blur_probability=0.5))
        model.build((None, *images.shape[1:]))
        model.compile(optimizer=keras.optimizers.AdamW(1e-3), jit_compile=True)
    assert model.jit_compile is False and model._compiled_views is not None  # Keras would fail on a multi-device step
    before = [weight.copy() for weight in encoder.get_weights()]
    history = model.fit(images, labels, batch_size=32, epochs=2, shuffle=False, verbose=0)
    assert all(np.isfinite(loss) for loss in history.history["loss"])
    assert any(not np.array_equal(old, new) for old, new in zip(before, encoder.get_weights()))
    assert distribute.check_replica_consistency(model) == []
    first_view = lambda batch: model.views(batch)[0]  # noqa: E731 — the step's own (XLA-compiled) view function
    assert distribute.augmentation_streams_differ(strategy, first_view, tf.constant(images[:8]))


@pytest.mark.parametrize("micro_batches", [1, 2])  # 2: gradient caching's loops and state replay, compiled too
def test_simclr_fit_with_jit_compile_on_one_device_compiles_the_whole_step(micro_batches):
    images, labels = _digits_like()
    encoder = models.build_encoder("small_cnn", images.shape[1:])
    model = SimCLR(encoder, num_classes=10, projection_dim=16, temperature=0.5, augment_config=augment.AugmentConfig(blur_probability=0.5),
                   gradient_accumulation_steps=micro_batches)
    model.build((None, *images.shape[1:]))
    model.compile(optimizer=keras.optimizers.AdamW(1e-3), jit_compile=True)
    assert model.jit_compile is True and model._compiled_views is None
    history = model.fit(images, labels, batch_size=32, epochs=2, shuffle=False, verbose=0)
    assert all(np.isfinite(loss) for loss in history.history["loss"])


def test_supervised_classifier_with_batchnorm_compiles_on_one_device():
    images, labels = _digits_like()
    model = models.build_classifier(models.build_encoder("resnet18_cifar", images.shape[1:]), 10)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=True)
    history = model.fit(images, labels, batch_size=32, epochs=1, verbose=0)
    assert model.jit_compile is True and np.isfinite(history.history["loss"][-1])


# The SimCLR step under XLA is also compiled in-process above; its bench run (16 s) is in `-m slow`.
@pytest.mark.parametrize("method", [pytest.param("simclr", marks=pytest.mark.slow), "supervised"])
def test_bench_runs_the_step_with_xla(method):
    result = subprocess.run([sys.executable, "-m", "tfmp.bench", "--model=small_cnn", f"--method={method}", "--jit_compile", "--batch=8",
                             "--steps=1", "--repeats=1", "--warmup=1", "--precision=fp32"], cwd=REPO, capture_output=True, text=True,
                            timeout=600, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert result.returncode == 0, result.stderr[-3000:]
    line = json.loads(result.stdout)
    assert line["jit_compile"] is True and line["method"] == method and line["images_per_second"] > 0


@pytest.mark.slow  # 24 s: the default suite compiles each of these steps in-process
def test_the_cli_runs_simclr_probes_and_baseline_with_jit_compile_true(run_cli, tmp_path):
    workdir = tmp_path / "run"
    result = run_cli("--flagfile=experiments/digits_simclr.cfg", "--epochs=1", "--warmup_epochs=0", "--probe_epochs=2",
                     "--baseline_epochs=1", "--label_draws=1", "--label_fraction=0.1", "--jit_compile=true",
                     f"--precision={AUTO_PRECISION}", "--strategy=off", f"--workdir={workdir}")
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((workdir / "metrics.json").read_text())
    assert metrics["jit_compile"] is True
    assert metrics["linear_probe_accuracy"] > 0.2 and np.isfinite(metrics["train_loss"])
    assert "jit_compile: True (explicit choice)" in result.stdout  # the run's narrative goes to stdout (tfmp.logs)


@pytest.fixture
def hardware_like(monkeypatch):
    def pretend(gpus=(), tpu=False):
        monkeypatch.setattr(hardware, "gpu_compute_capabilities", lambda: list(gpus))
        monkeypatch.setattr(hardware, "tpu_present", lambda: tpu)

    return pretend


@pytest.mark.parametrize("machine, replicas, expected", [
    (dict(tpu=True), 8, True),
    (dict(gpus=[(8, 0)]), 1, True),
    (dict(gpus=[(8, 0), (8, 0)]), 2, False),
    (dict(), 1, False),
    (dict(), 2, False),
])
def test_auto_jit_compile_follows_the_devices(hardware_like, machine, replicas, expected):
    hardware_like(**machine)
    enabled, reason = compilation.resolve("auto", replicas)
    assert enabled is expected and reason and "\n" not in reason
    assert compilation.resolve("true", replicas) == (True, "explicit choice")
    assert compilation.resolve("false", replicas) == (False, "explicit choice")


def test_unknown_jit_compile_lists_the_choices(run_cli, tmp_path):
    with pytest.raises(UsageError, match="unknown jit_compile 'maybe'; valid: auto, true, false"):
        compilation.resolve("maybe")
    result = run_cli("--jit_compile=maybe", f"--workdir={tmp_path / 'run'}")
    assert result.returncode == 2 and result.stderr.strip() == "tfmp.train: error: unknown jit_compile 'maybe'; valid: auto, true, false"
    assert not (tmp_path / "run").exists()
