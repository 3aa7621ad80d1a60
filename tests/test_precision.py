"""tfmp.precision: names, `auto` resolution, policies, and loss scaling."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmp import hardware, models, precision
from tfmp.config import UsageError


@pytest.mark.parametrize("alias, canonical", [("fp32", "float32"), ("FP16", "mixed_float16"), ("bf16", "mixed_bfloat16"),
                                              ("mixed_bfloat16", "mixed_bfloat16"), ("auto", "auto")])
def test_aliases_resolve_to_canonical_names(alias, canonical):
    assert precision.canonical_name(alias) == canonical


def test_unknown_precision_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown precision 'fp8'; valid: float32, mixed_float16, mixed_bfloat16"):
        precision.resolve("fp8")


@pytest.fixture
def machine_like(monkeypatch):
    """Pretends to be a given machine: CPU flags, GPU compute capabilities, TPU presence."""

    def pretend(cpu_flags=(), gpus=(), tpu=False):
        monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset(cpu_flags))
        monkeypatch.setattr(hardware, "gpu_compute_capabilities", lambda: list(gpus))
        monkeypatch.setattr(hardware, "tpu_present", lambda: tpu)

    return pretend


@pytest.mark.parametrize("machine, expected", [
    (dict(tpu=True), "mixed_bfloat16"),
    (dict(gpus=[(8, 0), (9, 0)]), "mixed_bfloat16"),
    (dict(gpus=[(7, 5)]), "mixed_float16"),
    (dict(gpus=[(8, 6), (7, 0)]), "mixed_float16"),  # the weakest GPU decides
    (dict(gpus=[(6, 1)]), "float32"),
    (dict(cpu_flags={"avx512f", "avx512_bf16"}), "mixed_bfloat16"),
    (dict(cpu_flags={"amx_bf16"}), "mixed_bfloat16"),
    (dict(cpu_flags={"avx2", "f16c"}), "float32"),  # never fp16 on a CPU
])
def test_auto_follows_the_hardware(machine_like, machine, expected):
    machine_like(**machine)
    policy, reason = precision.resolve("auto")
    assert policy == expected
    assert reason and "\n" not in reason


def test_auto_on_this_machine_matches_its_cpu_flags():
    expected = "mixed_bfloat16" if {"avx512_bf16", "amx_bf16"} & hardware.cpu_flags() else "float32"
    assert precision.set_policy("auto") == expected
    assert keras.mixed_precision.global_policy().name == expected


def test_bf16_on_a_gpu_below_8_0_is_an_error(machine_like):
    machine_like(gpus=[(7, 0)])
    with pytest.raises(ValueError, match="compute capability >= 8.0, found 7.0"):
        precision.resolve("bf16")


def _tfmp_warnings(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.levelname == "WARNING" and record.name.startswith("tfmp")]


def test_fp16_on_a_cpu_warns_once_in_tfmp_s_log_not_as_a_python_warning(machine_like, caplog, monkeypatch):
    from tfmp import logs

    monkeypatch.setattr(logs, "_SAID", set())
    machine_like(cpu_flags={"avx512_bf16"})
    with warnings.catch_warnings(), caplog.at_level("WARNING", logger="tfmp"):
        warnings.simplefilter("error")  # a UserWarning pointing at precision.py's source line was the old form
        assert precision.resolve("fp16")[0] == "mixed_float16"
        assert precision.resolve("fp16")[0] == "mixed_float16"
    assert _tfmp_warnings(caplog) == ["mixed_float16 on a CPU is slower than float32 (no fp16 arithmetic units); use "
                                      "mixed_bfloat16 where the CPU has AVX512_BF16/AMX, else float32"]


def test_bf16_on_a_cpu_without_bf16_units_warns_and_with_them_does_not(machine_like, caplog, monkeypatch):
    from tfmp import logs

    monkeypatch.setattr(logs, "_SAID", set())
    machine_like(cpu_flags={"avx2", "fma"})
    with caplog.at_level("WARNING", logger="tfmp"):
        assert precision.resolve("bf16") == ("mixed_bfloat16", "explicit choice (emulated on this CPU)")
    assert len(_tfmp_warnings(caplog)) == 1 and "emulated through float32" in _tfmp_warnings(caplog)[0]
    caplog.clear()
    machine_like(cpu_flags={"avx512_bf16"})
    with caplog.at_level("WARNING", logger="tfmp"):
        assert precision.resolve("bf16") == ("mixed_bfloat16", "explicit choice")
    assert _tfmp_warnings(caplog) == []


@pytest.mark.parametrize("policy, compute_dtype", [("float32", "float32"), ("mixed_float16", "float16"),
                                                   ("mixed_bfloat16", "bfloat16")])
def test_layers_compute_in_the_policy_dtype_with_float32_variables_and_logits(policy, compute_dtype):
    precision.set_policy(policy)
    encoder = models.build_encoder("small_cnn", (8, 8, 1))
    classifier = models.build_classifier(encoder, 10)
    conv = encoder.get_layer("stage0_conv")
    assert conv.compute_dtype == compute_dtype
    assert all(variable.dtype == "float32" for variable in classifier.weights)
    features = encoder(np.zeros((2, 8, 8, 1), np.float32))
    assert features.dtype == compute_dtype
    assert classifier(np.zeros((2, 8, 8, 1), np.float32)).dtype == "float32"


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16", "mixed_float16"])
def test_loss_scale_optimizer_only_under_fp16(policy):
    precision.set_policy(policy)
    wrapped = precision.wrap_optimizer(keras.optimizers.SGD(0.1))
    assert isinstance(wrapped, keras.optimizers.LossScaleOptimizer) == (policy == "mixed_float16")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=wrapped, loss="mse")
    # compile() must neither add a second wrapper nor replace tfmp's.
    assert isinstance(model.optimizer, precision.LossScaleOptimizer) == (policy == "mixed_float16")


def _fp16_model_and_optimizer(**wrap_options):
    precision.set_policy("mixed_float16")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1, dtype="float32")])
    optimizer = precision.wrap_optimizer(keras.optimizers.SGD(0.1), **wrap_options)
    optimizer.build(model.trainable_variables)
    return model, optimizer


def _apply(optimizer, model, value):
    grads = [tf.fill(v.shape, value) for v in model.trainable_variables]
    optimizer.apply(grads, model.trainable_variables)


def test_fp16_step_with_non_finite_gradients_is_skipped_and_weights_unchanged():
    model, optimizer = _fp16_model_and_optimizer(initial_loss_scale=1024.0, hysteresis=1)
    before = [v.numpy().copy() for v in model.trainable_variables]
    _apply(optimizer, model, np.inf)
    for old, variable in zip(before, model.trainable_variables):
        np.testing.assert_array_equal(old, variable.numpy())
    assert precision.skipped_steps(optimizer) == 1
    assert precision.current_loss_scale(optimizer) == 512.0
    _apply(optimizer, model, 1.0)  # a finite step does move the weights
    assert any(not np.array_equal(old, v.numpy()) for old, v in zip(before, model.trainable_variables))


def test_dynamic_scale_never_drops_below_min_scale():
    model, optimizer = _fp16_model_and_optimizer(initial_loss_scale=8.0, min_scale=2.0, hysteresis=1)
    before = [v.numpy().copy() for v in model.trainable_variables]
    for _ in range(10):
        _apply(optimizer, model, np.nan)
    assert precision.current_loss_scale(optimizer) == 2.0
    assert precision.skipped_steps(optimizer) == 10
    for old, variable in zip(before, model.trainable_variables):
        np.testing.assert_array_equal(old, variable.numpy())


def test_before_its_first_applied_step_the_scale_halves_on_every_overflow():
    model, optimizer = _fp16_model_and_optimizer(initial_loss_scale=64.0, hysteresis=3)
    for expected in (32.0, 16.0, 8.0):
        _apply(optimizer, model, np.inf)
        assert precision.current_loss_scale(optimizer) == expected
    _apply(optimizer, model, 0.0)  # the first applied step: hysteresis from now on
    _apply(optimizer, model, np.inf)
    assert precision.current_loss_scale(optimizer) == 8.0


def test_an_overflowing_start_skips_no_more_steps_than_keras_own_optimizer():
    """The same script with Keras' LossScaleOptimizer and tfmp's: gradients overflow fp16 until the scale is low."""
    precision.set_policy("mixed_float16")
    x, y = np.full((96, 4), 30.0, np.float32), np.zeros((96, 1), np.float32)
    skipped = {}
    for name, wrap in (("keras", keras.optimizers.LossScaleOptimizer), ("tfmp", precision.wrap_optimizer)):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, kernel_initializer="ones"),
                                  keras.layers.Dense(1, dtype="float32", kernel_initializer="ones")])
        model.compile(optimizer=wrap(keras.optimizers.SGD(1e-9)), loss="mse")
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        skipped[name] = 12 - int(model.optimizer.iterations.numpy())  # steps taken minus steps applied
    assert 0 < skipped["tfmp"] <= skipped["keras"], skipped


def test_hysteresis_delays_halving_until_consecutive_overflows():
    model, optimizer = _fp16_model_and_optimizer(initial_loss_scale=64.0, hysteresis=3)
    _apply(optimizer, model, 0.0)  # past the start, where every overflow halves
    _apply(optimizer, model, np.inf)
    _apply(optimizer, model, np.inf)
    _apply(optimizer, model, 0.0)  # a finite step resets the streak
    _apply(optimizer, model, np.inf)
    _apply(optimizer, model, np.inf)
    assert precision.current_loss_scale(optimizer) == 64.0
    _apply(optimizer, model, np.inf)
    assert precision.current_loss_scale(optimizer) == 32.0


def test_dynamic_scale_grows_after_growth_steps():
    model, optimizer = _fp16_model_and_optimizer(initial_loss_scale=4.0, loss_scale_growth_steps=3)
    for _ in range(3):
        _apply(optimizer, model, 0.0)
    assert precision.current_loss_scale(optimizer) == 8.0


def test_fixed_loss_scale_stays_fixed_and_still_skips():
    model, optimizer = _fp16_model_and_optimizer(loss_scale=128)
    for value in (np.inf, np.inf, np.inf, 0.0, 0.0):
        _apply(optimizer, model, value)
    assert precision.current_loss_scale(optimizer) == 128.0
    assert precision.skipped_steps(optimizer) == 3
    assert float(optimizer.scale_loss(tf.constant(1.0))) == 128.0


@pytest.mark.parametrize("bad", ["huge", -1, 0])
def test_bad_fixed_loss_scale_is_refused(bad):
    precision.set_policy("mixed_float16")
    with pytest.raises(ValueError, match="loss_scale must be 'dynamic' or a positive number"):
        precision.wrap_optimizer(keras.optimizers.SGD(0.1), loss_scale=bad)


def test_usage_error_is_a_value_error():
    # Library users catching ValueError also catch tfmp's input errors.
    assert issubclass(UsageError, ValueError)


def test_fp16_model_with_its_loss_scale_optimizer_round_trips_through_a_keras_file_in_safe_mode(tmp_path):
    precision.set_policy("mixed_float16")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1, dtype="float32")])
    model.compile(optimizer=precision.wrap_optimizer(keras.optimizers.SGD(0.1), initial_loss_scale=1024.0, min_scale=4.0, hysteresis=3),
                  loss="mse")
    x = np.random.default_rng(0).random((32, 4), dtype=np.float32)
    model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0)
    _apply(model.optimizer, model, np.inf)  # one skipped step, so the state is not the initial one
    path = str(tmp_path / "fp16.keras")
    model.save(path)

    loaded = keras.saving.load_model(path)  # safe_mode=True is Keras' default
    optimizer = loaded.optimizer
    assert type(optimizer) is precision.LossScaleOptimizer
    assert (optimizer.min_scale, optimizer.hysteresis, optimizer.dynamic) == (4.0, 3, True)
    assert precision.skipped_steps(optimizer) == 1 and int(optimizer.overflow_streak.numpy()) == 1
    assert precision.current_loss_scale(optimizer) == precision.current_loss_scale(model.optimizer)
    assert int(optimizer.iterations.numpy()) == int(model.optimizer.iterations.numpy()) == 4
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    assert loaded.layers[0].compute_dtype == "float16"
