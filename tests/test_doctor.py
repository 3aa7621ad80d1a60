"""The precision doctor and float32 layer overrides."""

import keras
import numpy as np
import pytest

from tfmp import doctor, models, precision, train
from tfmp.diagnostics import precision_report


def _planted_model():
    """`hot` multiplies by 1e4 (its outputs overflow float16); `clean` brings values back down."""
    return keras.Sequential([
        keras.Input((4,)),
        keras.layers.Dense(8, kernel_initializer=keras.initializers.Constant(1e4), name="hot"),
        keras.layers.Dense(3, kernel_initializer=keras.initializers.Constant(1e-6), name="clean"),
    ])


def test_a_planted_overflowing_layer_is_named_and_a_clean_one_is_not():
    batches = [(np.full((16, 4), 10.0, np.float32), np.zeros(16, np.int64))] * 3
    report = precision_report(_planted_model(), batches, steps=2)
    assert report.overflowing_layers("float16") == ["hot"]
    assert report.overflowing_layers("bfloat16") == []
    hot = next(layer for layer in report.layers if layer.name == "hot")
    assert hot.max_activation == pytest.approx(4e5) and hot.overflow["float16"] > 0
    assert "hot" in report.table() and "clean" in report.table()
    lowest, highest = report.loss_scale_range()
    assert 1.0 <= lowest <= highest


def test_the_report_leaves_the_model_as_it_was():
    model = _planted_model()
    calls = {layer.name: layer.call for layer in model.layers}
    precision_report(model, [(np.ones((2, 4), np.float32), np.zeros(2, np.int64))], steps=1)
    assert {layer.name: layer.call for layer in model.layers} == calls


def test_keep_float32_by_regex():
    precision.set_policy("mixed_float16")
    model = models.build_classifier(models.build_encoder("small_cnn", (8, 8, 1)), 10)
    changed = precision.keep_float32(model, r"^stage1_")
    assert sorted(changed) == ["stage1_bn", "stage1_conv", "stage1_relu"]
    encoder = model.get_layer("small_cnn")
    assert encoder.get_layer("stage1_conv").compute_dtype == "float32"
    assert encoder.get_layer("stage0_conv").compute_dtype == "float16"
    assert model(np.zeros((2, 8, 8, 1), np.float32)).dtype == "float32"
    with pytest.raises(ValueError, match="matches no layer"):
        precision.keep_float32(model, "^nothing$")
    with pytest.raises(ValueError, match="not a valid regular expression"):
        precision.keep_float32(model, "(")


def test_doctor_cli_reports_and_recommends(capsys):
    assert doctor.main(["tfmp.doctor", "--flagfile=experiments/digits_supervised.cfg", "--steps=1"]) == 0
    out = capsys.readouterr().out
    assert "stage0_conv" in out and "recommendations:" in out
    expected, _ = precision.resolve("auto")
    assert f"--precision={expected} on this machine" in out


def test_doctor_cli_usage_error(capsys):
    assert doctor.main(["tfmp.doctor", "--model=vit"]) == 2
    assert capsys.readouterr().err.strip() == ("tfmp.doctor: error: unknown model 'vit'; valid: small_cnn, resnet18_cifar, resnet50, "
                                               "vit_micro_p2, vit_tiny_p4, vit_small_p16, vit_base_p16")


def test_float32_layers_flag_trains(tmp_path):
    code = train.main(["tfmp.train", f"--workdir={tmp_path / 'run'}", "--epochs=1", "--precision=bf16", "--strategy=off",
                       "--float32_layers=^logits$"])
    assert code == 0


@pytest.mark.parametrize("task, flags, layers", [
    ("mae", ["--mask_ratio=0.5", "--decoder_width=32", "--decoder_depth=1", "--decoder_heads=4"],
     ["mae_decoder_pixels", "mae_decoder_block0_mlp_hidden", "block3_mlp_output", "patch_embedding"]),
    ("dino", ["--prototypes=64", "--local_crops=2", "--projection_dim=16"],
     ["dino_head/dino_head_prototypes", "dino_head/dino_head_bottleneck", "block3_mlp_output", "patch_embedding"]),
    # the teacher follows the student's sharded weights; the crops split over the replicas (~22 s: slow)
    pytest.param("dino", ["--prototypes=64", "--local_crops=2", "--projection_dim=16", "--sharding=zero3",
                          "--strategy=mirrored"],
                 ["dino_head/dino_head_prototypes", "dino_head/dino_head_bottleneck", "block3_mlp_output",
                  "patch_embedding"], marks=pytest.mark.slow),
])
def test_doctor_measures_an_ssl_methods_own_step(capsys, task, flags, layers):
    """--task=<SSL method>: the report covers the method's heads or decoder, with gradients, as its step runs them."""
    assert doctor.main(["tfmp.doctor", f"--task={task}", "--model=vit_micro_p2", "--global_batch_size=32", "--steps=1",
                        *flags]) == 0
    out = capsys.readouterr().out
    assert f"precision doctor: --task={task} with vit_micro_p2 on digits, 1 batch(es) of 32" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line and line.split()[0] in layers}
    assert set(rows) == set(layers), out
    for name, row in rows.items():
        assert float(row[2]) > 0, f"{name} took no gradient: {row}"  # max |grad|


def test_doctor_refuses_what_the_method_refuses(capsys):
    assert doctor.main(["tfmp.doctor", "--task=mae", "--model=small_cnn", "--steps=1"]) == 2
    assert "--task=mae needs a ViT encoder" in capsys.readouterr().err


def test_the_report_over_two_replicas_with_sharded_weights_is_the_one_device_report():
    """A ViT classifier whose weights are sharded (zero3, blocks as units) on 2 replicas, each batch split over them:
    the same layers, maxima, out-of-range fractions and loss-scale range as the same model on one device."""
    import tensorflow as tf

    from tfmp import distribute, sharding

    rng = np.random.default_rng(0)
    batches = [(rng.normal(size=(16, 8, 8, 1)).astype(np.float32) * 3, rng.integers(0, 10, 16)) for _ in range(2)]
    reports = {}
    for where in ("one device", "zero3"):
        strategy = distribute.get_strategy("mirrored") if where == "zero3" else tf.distribute.get_strategy()
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = models.build_classifier(models.build_encoder("vit_micro_p2", (8, 8, 1)), 10)
            if where == "zero3":
                sharding.ShardedOptimizer(keras.optimizers.SGD(), stage="zero3", units=models.block_of).build(
                    model.trainable_variables)
        data = tf.data.Dataset.from_tensor_slices(tuple(np.concatenate(part) for part in zip(*batches))).batch(16)
        reports[where] = precision_report(model, data, steps=2, strategy=strategy)
    one, sharded = reports["one device"], reports["zero3"]
    assert [layer.name for layer in sharded.layers] == [layer.name for layer in one.layers]
    assert len(one.layers) > 40 and any(layer.max_gradient > 0 for layer in one.layers)
    for expected, got in zip(one.layers, sharded.layers):
        assert got.max_activation == pytest.approx(expected.max_activation, rel=1e-4), got.name
        assert got.max_gradient == pytest.approx(expected.max_gradient, rel=1e-4, abs=1e-12), got.name
        for form in ("float16", "bfloat16"):
            assert got.overflow[form] == pytest.approx(expected.overflow[form], abs=1e-3), got.name
            assert got.underflow[form] == pytest.approx(expected.underflow[form], abs=1e-3), got.name
    assert sharded.typical_small_gradient == pytest.approx(one.typical_small_gradient, rel=1e-3)
    assert sharded.loss_scale_range() == one.loss_scale_range()


def test_doctor_cli_under_zero3_shards_the_weights_over_the_replicas(capsys):
    assert doctor.main(["tfmp.doctor", "--model=vit_micro_p2", "--sharding=zero3", "--strategy=mirrored",
                        "--global_batch_size=32", "--steps=1"]) == 0
    out, err = capsys.readouterr()
    assert "eagerly" not in err  # TensorFlow's advice to wrap strategy.run in a tf.function: eager on purpose here
    assert ("precision doctor: vit_micro_p2 as a classifier on digits, 1 batch(es) of 32, weights sharded (zero3) "
            "over 2 replicas, measured in float32") in out
    assert "block3_mlp_output" in out and "recommendations:" in out
    assert doctor.main(["tfmp.doctor", "--sharding=zero3", "--strategy=multi_worker_mirrored", "--steps=1"]) == 2
    assert "runs on one machine's replicas" in capsys.readouterr().err
