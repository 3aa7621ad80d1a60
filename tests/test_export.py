"""Exported models load anywhere: `tfmp.models.export.portable` swaps tfmp's layers for Keras'
own, and the `.keras` file loads in a fresh process that never imports tfmp (safe mode), giving
the outputs the trained model gives."""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

from tfmp import models
from tfmp.models import export
from tfmp.models.layers import BatchNormalization
from tfmp.models.remat import CheckpointedBlock

LOAD_WITHOUT_TFMP = """
import json, sys
import keras, numpy as np
model = keras.saving.load_model(sys.argv[1], safe_mode=True)
assert not any(name == "tfmp" or name.startswith("tfmp.") for name in sys.modules), "tfmp was imported"
np.save(sys.argv[3], keras.ops.convert_to_numpy(model(np.load(sys.argv[2]), training=False)).astype(np.float32))
def layers(model):
    for layer in model.layers:
        yield layer
        if isinstance(layer, keras.Model):
            yield from layers(layer)
print(json.dumps({layer.name: layer.dtype_policy.name for layer in layers(model)
                  if layer.weights and not isinstance(layer, keras.Model)}))
"""


def _trained_statistics(model, seed=0):
    """Gives every BatchNorm non-trivial moving statistics and affine weights, as training would."""
    rng = np.random.default_rng(seed)
    for layer in _nested(model):
        if isinstance(layer, keras.layers.BatchNormalization):
            layer.set_weights([rng.uniform(0.5, 1.5, w.shape).astype(np.float32) if "variance" in w.path or "gamma" in w.path
                               else rng.normal(0, 0.2, w.shape).astype(np.float32) for w in layer.weights])
    return model


def _nested(model):
    for layer in model.layers:
        yield layer
        if isinstance(layer, keras.Model):
            yield from _nested(layer)
        if isinstance(layer, CheckpointedBlock):
            yield from _nested(layer.block)


def _images(shape, count=4):
    return np.random.default_rng(1).random((count, *shape), np.float32)


@pytest.mark.parametrize("name, remat", [("small_cnn", "none"), ("resnet18_cifar", "none"), ("resnet18_cifar", "blocks"),
                                         ("resnet18_cifar", "full")])
def test_portable_has_only_keras_layers_and_computes_the_same(name, remat):
    encoder = _trained_statistics(models.build_encoder(name, (32, 32, 3), remat=remat))
    assert any(isinstance(layer, BatchNormalization) for layer in _nested(encoder))
    assert not export.uses_only_keras_layers(encoder)

    exported = export.portable(encoder)
    assert export.uses_only_keras_layers(exported)
    assert not any(isinstance(layer, (BatchNormalization, CheckpointedBlock)) for layer in _nested(exported))
    images = _images((32, 32, 3))
    for training in (False, True):  # moving statistics, and batch statistics
        np.testing.assert_allclose(exported(images, training=training), encoder(images, training=training), rtol=1e-4, atol=1e-4)
    assert len(exported.weights) == len(encoder.weights)


def test_adopt_brings_back_the_fused_batch_norm_with_the_same_statistics():
    encoder = _trained_statistics(models.build_encoder("resnet18_cifar", (32, 32, 3)))
    back = export.adopt(export.portable(encoder))
    assert any(isinstance(layer, BatchNormalization) for layer in _nested(back))
    images = _images((32, 32, 3))
    np.testing.assert_allclose(back(images, training=False), encoder(images, training=False), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name, shape", [("resnet18_cifar", (32, 32, 3)),
                                         pytest.param("vit_micro_p2", (16, 16, 3), marks=pytest.mark.slow)])
@pytest.mark.parametrize("policy, tolerance", [("float32", 1e-4), ("mixed_bfloat16", 5e-2)])
def test_an_exported_encoder_loads_in_a_process_without_tfmp(policy, tolerance, name, shape, tmp_path):
    keras.mixed_precision.set_global_policy(policy)
    encoder = _trained_statistics(models.build_encoder(name, shape, remat="blocks"))
    images = _images(shape)
    expected = keras.ops.convert_to_numpy(encoder(images, training=False)).astype(np.float32)
    path, inputs, outputs = (str(tmp_path / name) for name in ("encoder.keras", "images.npy", "outputs.npy"))
    export.portable(encoder).save(path)
    np.save(inputs, images)

    environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run([sys.executable, "-c", LOAD_WITHOUT_TFMP, path, inputs, outputs], env=environment,
                            capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    policies = json.loads(result.stdout.strip().splitlines()[-1])
    trained = {layer.name: layer.dtype_policy.name for layer in _nested(encoder)
               if layer.weights and not isinstance(layer, (keras.Model, CheckpointedBlock))}
    assert {name: policies[name] for name in trained} == trained  # every layer keeps the policy it was trained under
    assert policy in policies.values()
    np.testing.assert_allclose(np.load(outputs), expected, rtol=tolerance, atol=tolerance)
