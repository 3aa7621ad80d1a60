"""MAE (tfmp/ssl/mae.py): its loss against NumPy, the encoder on the visible tokens only, masks drawn per example and
per replica from the seeds, two replicas equal one device, accumulation, a tiny ViT trained under every policy, the
XLA step, and the checks before a run."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import one_device_and_two_replicas
from tfmp import data, distribute, models, precision, training
from tfmp.config import Config, UsageError, validate
from tfmp.data import augment
from tfmp.ssl import mae
from tfmp.tasks import pretrain, stage, supervised

DECODER = dict(decoder_width=32, decoder_depth=1, decoder_heads=4)


def _mae(strategy=None, seed=0, **kwargs):
    keras.utils.set_random_seed(seed)
    with (strategy or tf.distribute.get_strategy()).scope():
        model = mae.MAE(models.build_encoder("vit_micro_p2", (8, 8, 1)), num_classes=10, seed=seed, total_steps=8,
                        augment_config=augment.AugmentConfig(crop_scale=(0.4, 1.0), flip=False), **{**DECODER, **kwargs})
        model.build((None, 8, 8, 1))
    return model


def _numpy_loss(predictions, images, order, keep, patch, normalize):
    """The loss written out patch by patch: each hidden patch's pixels (rows, columns, channels), normalised by their
    own mean and variance, against its prediction."""
    batch, height, width, _ = images.shape
    columns = width // patch
    errors = []
    for example in range(batch):
        for token in order[example, keep:]:  # the hidden ones
            row, column = divmod(int(token), columns)
            pixels = images[example, row * patch:(row + 1) * patch, column * patch:(column + 1) * patch, :].reshape(-1)
            if normalize:
                pixels = (pixels - pixels.mean()) / np.sqrt(pixels.var() + 1e-6)
            errors.append(np.mean((predictions[example, token] - pixels) ** 2))
    return np.mean(errors)


@pytest.mark.parametrize("normalize", [True, False])
def test_the_loss_matches_numpy(normalize):
    rng = np.random.default_rng(0)
    images = rng.uniform(size=(3, 8, 12, 2)).astype(np.float32)  # 4 x 6 patches of 2x2 px, 2 channels
    predictions = rng.normal(size=(3, 24, 8)).astype(np.float32)
    order = np.stack([rng.permutation(24) for _ in range(3)]).astype(np.int32)
    keep = mae.visible_count(24, 0.75)
    loss = mae.masked_patch_loss(tf.constant(predictions), mae.pixel_targets(tf.constant(images), 2, normalize),
                                 mae.hidden_mask(mae.token_places(tf.constant(order)), keep))
    expected = _numpy_loss(predictions.astype(np.float64), images.astype(np.float64), order, keep, 2, normalize)
    assert keep == 6 and float(loss) == pytest.approx(expected, rel=1e-5)


def test_the_encoder_sees_only_the_visible_tokens_at_their_positions():
    model = _mae()
    images = tf.random.stateless_uniform((4, 8, 8, 1), seed=[1, 2])
    order = mae.masking_order(tf.constant([3, 4]), 4, 16)
    keep = mae.visible_count(16, 0.75)
    seen = []
    token_encoder_call = model.token_encoder.call
    model.token_encoder.call = lambda tokens, **kwargs: seen.append(tokens.shape) or token_encoder_call(tokens, **kwargs)
    assert model.encode(images, order, keep, training=False).shape == (4, 4, 64)
    assert seen == [(4, 4, 64)]  # 4 of the 16 tokens went through the transformer
    # Every token visible, in a shuffled order: the positions travel with the tokens, so the mean of the encoded
    # tokens is the encoder's feature of the whole image.
    everything = model.encode(images, order, 16, training=False)
    np.testing.assert_allclose(tf.reduce_mean(everything, axis=1), model.encoder(images, training=False), atol=2e-5)


def test_masks_differ_across_examples_and_replicas_and_repeat_from_the_seed():
    strategy = distribute.get_strategy("mirrored")
    model = _mae(strategy, mask_ratio=0.5)
    with strategy.scope():
        model.compile(optimizer=keras.optimizers.AdamW(1e-3))
    images = tf.random.stateless_uniform((4, 8, 8, 1), seed=[1, 2])

    @tf.function
    def orders():
        return strategy.run(lambda: model.views(images)[1])

    first = [order.numpy() for order in strategy.experimental_local_results(orders())]
    again = [order.numpy() for order in strategy.experimental_local_results(orders())]
    for replica, repeated in zip(first, again):
        np.testing.assert_array_equal(replica, repeated)
        assert all(sorted(row) == list(range(16)) for row in replica.tolist())  # each a permutation of the tokens
        hidden = [frozenset(row[8:]) for row in replica.tolist()]
        assert len(set(hidden)) == 4  # a mask of its own per example
    assert not np.array_equal(first[0], first[1])  # and per replica


def _loss_and_gradients(model, images, order, replicas):
    with tf.GradientTape() as tape:
        loss = model._loss(images, order, None)
        scaled = loss / replicas  # Keras' convention: each replica's loss / N, gradients summed
    return loss, tape.gradient(scaled, model.trainable_variables)


def test_two_replicas_give_the_one_device_loss_and_gradients():
    images = tf.random.stateless_uniform((8, 8, 8, 1), seed=[1, 2])
    order = mae.masking_order(tf.constant([5, 6]), 8, 16)
    single = _mae()
    strategy = distribute.get_strategy("mirrored")
    mirrored = _mae(strategy)
    (loss, gradients), (losses, summed) = one_device_and_two_replicas(_loss_and_gradients, single, mirrored, strategy,
                                                                       images, order)
    assert np.mean(losses) == pytest.approx(float(loss), rel=1e-5)
    compared = 0
    for expected, total, variable in zip(gradients, summed, single.trainable_variables):
        if expected is None:  # the online probe: not part of MAE's loss
            assert "online_probe" in variable.path and total is None
            continue
        compared += 1
        np.testing.assert_allclose(total.numpy(), expected.numpy(), rtol=1e-3, atol=1e-6, err_msg=variable.path)
    assert compared == len(single.trainable_variables) - 2


def test_two_micro_batches_give_the_one_batch_gradient():
    """MAE's loss is a mean over examples: accumulation's sum of half-batch means / 2 is the whole batch's gradient."""
    digits = data.load("digits")
    images, labels = next(iter(digits.train.dataset(np.arange(32)).batch(32)))
    after = []
    for steps in (1, 2):
        model = _mae(gradient_accumulation_steps=steps)
        model.compile(optimizer=keras.optimizers.SGD(1.0))
        model.fit(images, labels, batch_size=32, shuffle=False, epochs=1, verbose=0)  # the same rows in the same order
        after.append([weight.numpy() for weight in model.trainable_weights])
    for one, two, weight in zip(*after, model.trainable_weights):
        np.testing.assert_allclose(two, one, rtol=1e-4, atol=1e-6, err_msg=weight.path)


# float32 on one device: the XLA test below; 2 replicas (16 s) under -m slow: the one-device-equals-two-replicas test
# above checks their loss and gradients in the default suite.
@pytest.mark.parametrize("setup", ["bf16", "fp16", pytest.param("two_replicas", marks=pytest.mark.slow)])
def test_a_tiny_vit_trains(setup):
    if setup in ("bf16", "fp16"):
        precision.set_policy({"bf16": "mixed_bfloat16", "fp16": "mixed_float16"}[setup])
    strategy = distribute.get_strategy("mirrored") if setup == "two_replicas" else tf.distribute.get_strategy()
    model = _mae(strategy)
    with strategy.scope():
        model.compile(optimizer=precision.wrap_optimizer(keras.optimizers.AdamW(1e-3)))
    before = [weight.numpy() for weight in model.trainable_weights]
    digits = data.load("digits")
    # Two steps an epoch: 16-bit steps are TensorFlow's slow path on a CPU (fp16 always, bf16 without bf16 units:
    # 64 s on a Zen 3 with 256 examples).
    examples = 256 if setup == "two_replicas" else 64
    history = model.fit(data.classification_pipeline(digits.train, 32, training=True, indices=np.arange(examples)),
                        epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all(), history.history
    assert history.history["loss"][-1] < history.history["loss"][0]
    if setup == "fp16":
        assert int(model.optimizer.iterations) == 4  # no step skipped: the loss scale did not overflow
    moved = [not np.array_equal(old, weight.numpy()) for old, weight in zip(before, model.trainable_weights)]
    assert all(moved), [weight.path for weight, changed in zip(model.trainable_weights, moved) if not changed]


# The encoder on every token (the step-time comparison's other side) under -m slow: 21 s.
@pytest.mark.parametrize("visible_only", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_the_step_compiles_with_xla(visible_only):
    model = _mae(visible_only=visible_only)
    model.compile(optimizer=keras.optimizers.AdamW(1e-3), jit_compile=True)
    before = [weight.numpy() for weight in model.trainable_weights]
    digits = data.load("digits")
    history = model.fit(data.classification_pipeline(digits.train, 32, training=True, indices=np.arange(128)), epochs=2, verbose=0)
    assert model.jit_compile and np.isfinite(history.history["loss"]).all()
    assert history.history["loss"][-1] < history.history["loss"][0]
    moved = [not np.array_equal(old, weight.numpy()) for old, weight in zip(before, model.trainable_weights)]
    assert all(moved), [weight.path for weight, changed in zip(model.trainable_weights, moved) if not changed]


def _checked(**changes):
    config = Config(**{"task": "mae", "model": "vit_micro_p2", **changes})
    stage.check_method_settings(config)
    pretrain.check_inputs(config, data.load("digits"))


def test_the_checks_before_a_run():
    _checked()
    with pytest.raises(UsageError, match="--task=mae needs a ViT encoder .* not --model=small_cnn; valid: vit_micro_p2"):
        _checked(model="small_cnn")
    with pytest.raises(UsageError, match="--mask_ratio=0.97 leaves 0 of 16 patches visible"):
        _checked(mask_ratio=0.97)
    with pytest.raises(UsageError, match="--decoder_heads=5 does not divide --decoder_width=512"):
        _checked(decoder_heads=5)
    with pytest.raises(UsageError, match="--mask_ratio applies to --task=mae only, not --task=simclr"):
        stage.check_method_settings(Config(task="simclr", mask_ratio=0.5))
    with pytest.raises(UsageError, match="--temperature applies to --task=simclr|mocov3 only, not --task=mae"):
        stage.check_method_settings(Config(task="mae", temperature=0.5))


def test_the_fixed_decoder_positions_tell_every_token_apart():
    positions = mae.sine_cosine_positions(4, 6, 32)
    assert positions.shape == (24, 32)
    distances = np.linalg.norm(positions[:, None] - positions[None], axis=-1)
    assert distances[~np.eye(24, dtype=bool)].min() > 0.1
    # the first half of the channels encodes the row: equal along a row of patches, different across rows
    np.testing.assert_array_equal(positions[0, :16], positions[5, :16])
    assert not np.array_equal(positions[0, :16], positions[6, :16])


@pytest.mark.slow  # ~55 s: a pretraining, its probes and two fine-tunes
def test_compare_finetune_fine_tunes_a_copy_of_the_pretrained_encoder_per_draw(tmp_path, monkeypatch):
    """--compare_finetune: each label draw fine-tunes a fresh copy of the encoder just pretrained (the one saved), with
    --layer_decay (the baseline's recipe drops it); finetune_accuracy is reported per draw."""
    images = tf.random.stateless_uniform((4, 8, 8, 1), seed=[1, 2])
    stages = []
    fit_classifier = pretrain.fit_classifier

    def spy(config, data_, runtime, directory, *, encoder=None, **kwargs):
        stages.append((config.layer_decay, None if encoder is None else encoder(images, training=False).numpy()))
        return fit_classifier(config, data_, runtime, directory, encoder=encoder, **kwargs)

    monkeypatch.setattr(pretrain, "fit_classifier", spy)
    config = validate(Config(task="mae", model="vit_micro_p2", precision="float32", strategy="off", epochs=1,
                             global_batch_size=128, label_fraction=0.05, label_draws=2, probe_epochs=1, baseline_epochs=2,
                             compare_finetune=True, layer_decay=0.75, flip=False, **DECODER))
    metrics = training.run(config, str(tmp_path))
    saved = keras.models.load_model(str(tmp_path / "encoder.keras"))(images, training=False).numpy()
    assert len(stages) == 2
    for layer_decay, features in stages:
        assert layer_decay == 0.75
        np.testing.assert_allclose(features, saved, atol=1e-5)  # each draw starts from the pretrained encoder
    assert supervised.baseline_config(config).layer_decay == 1.0
    assert len(metrics["finetune_accuracy_per_draw"]) == 2 and 0 <= metrics["finetune_accuracy"] <= 1
    assert metrics["finetune_accuracy"] == pytest.approx(np.mean(metrics["finetune_accuracy_per_draw"]))


def test_compare_finetune_is_refused_outside_pretraining():
    with pytest.raises(UsageError, match="--compare_finetune is for pretraining tasks .* not --task=supervised"):
        validate(Config(task="supervised", compare_finetune=True))
    with pytest.raises(UsageError, match="--layer_decay=0.75 is for --task=finetune or --compare_finetune"):
        validate(Config(task="mae", model="vit_micro_p2", layer_decay=0.75))


def test_the_memory_estimate_counts_the_visible_tokens_and_the_decoder():
    """A quarter of the tokens through the encoder (4 of 16) plus the decoder by its size against the encoder's
    (2 blocks of 32 against 4 of 64: 1/4): half a full-size view, which DINO's estimate without local crops counts 2 of."""
    from tfmp.runtime import Runtime

    digits = data.load("digits")
    runtime = Runtime.for_strategy(tf.distribute.get_strategy())
    config = Config(task="mae", model="vit_micro_p2", global_batch_size=64, decoder_width=32, decoder_depth=2, decoder_heads=4)
    assert mae.MAE.views_per_example(config, (8, 8, 1)) == 4 / 16 + (2 * 32) / (4 * 64)
    masked = training._memory_estimate(config, digits, runtime)
    two_views = training._memory_estimate(Config(task="dino", model="vit_micro_p2", global_batch_size=64, local_crops=0),
                                          digits, runtime)
    per_view = (two_views.activations_bytes - two_views.fixed_activations_bytes) / 2
    assert masked.activations_bytes - masked.fixed_activations_bytes == pytest.approx(0.5 * per_view, rel=1e-6)
