"""The optimizers' update rules written once (tfmp/update_rules.py) compute what Keras' optimizers (and tfmp's LARS)
do, and an option they do not implement is refused in one line instead of silently ignored."""

import ast
import pathlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmp
from tfmp import optimizers, sharding, update_rules

STEPS = 5


def _variables():
    rng = np.random.default_rng(0)
    return [keras.Variable(rng.normal(size=(4, 3)).astype("float32"), name="kernel"),
            keras.Variable(rng.normal(size=(3,)).astype("float32"), name="bias")]


def _gradients(step):
    rng = np.random.default_rng(100 + step)
    return [tf.constant(rng.normal(size=(4, 3)).astype("float32")), tf.constant(rng.normal(size=(3,)).astype("float32"))]


OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),  # the bias excluded below
    "sgd": lambda: keras.optimizers.SGD(0.05),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "sgd_nesterov_decay": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    "lars": lambda: optimizers.LARS(0.1, momentum=0.9, weight_decay=1e-4),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_each_rule_computes_what_the_optimizer_does(name):
    keras_variables = _variables()
    optimizer = OPTIMIZERS[name]()
    if getattr(optimizer, "weight_decay", None) and name != "lars":
        optimizer.exclude_from_weight_decay(var_names=["bias"])
    weights = [tf.convert_to_tensor(variable.value) for variable in keras_variables]
    slots = [{slot: tf.zeros_like(weight) for slot in update_rules.slot_names(optimizer)} for weight in weights]
    optimizer.build(keras_variables)
    for step in range(1, STEPS + 1):
        gradients = _gradients(step)
        optimizer.apply(gradients, keras_variables)
        for index, variable in enumerate(keras_variables):
            weights[index], slots[index] = update_rules.update(optimizer, variable, weights[index], gradients[index], slots[index],
                                                               tf.constant(optimizer.learning_rate.numpy()), float(step))
    moved = max(float(np.abs(variable.numpy() - original).max()) for variable, original in zip(keras_variables, _variables()))
    assert moved > 1e-3  # the comparison below is not between two unmoved sets
    # Bit for bit: the same operations in the same order, constants included (Adam's `1 - beta_1` was once computed
    # from float32(beta_1): a few roundings a step, which 20 AdamW steps under zero1 grew to 1.3e-6 on an AVX2 CPU).
    for variable, weight in zip(keras_variables, weights):
        np.testing.assert_array_equal(weight.numpy(), variable.numpy(), err_msg=variable.name)


@pytest.mark.parametrize("optimizer, refused", [
    (lambda: keras.optimizers.Adam(amsgrad=True), "does not support amsgrad=True"),  # zero1 ran plain Adam, silently
    (lambda: keras.optimizers.SGD(clipvalue=1.0), "does not support clipvalue"),  # (global_)clipnorm: the step's
    # The moving average is a slot of the sharded state (tfmp.averaging); copying it into the weights every N steps is not.
    (lambda: keras.optimizers.SGD(use_ema=True, ema_overwrite_frequency=10), "does not support ema_overwrite_frequency"),
    (lambda: keras.optimizers.RMSprop(), "supports AdamW, Adam, SGD and LARS, not RMSprop")])
def test_an_option_the_rules_do_not_implement_is_refused_in_one_line(optimizer, refused):
    with pytest.raises(ValueError, match=refused) as error:
        sharding.ZeroOneOptimizer(optimizer())
    assert "\n" not in str(error.value) and str(error.value).startswith("sharding=zero1 ")


def test_the_optimizers_and_sharding_import_circle_is_gone():
    """The update rules lived twice (LARS in optimizers.py, a copy of every rule in sharding.py, which imported
    optimizers.py for LARS while optimizers.py imported sharding.py for zero1)."""
    root = pathlib.Path(tfmp.__file__).parent

    def imported(module):
        tree = ast.parse((root / module).read_text(encoding="utf-8"))
        names = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        names |= {f"{node.module}.{alias.name}" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
                  for alias in node.names}
        return names

    sharding_modules = sorted(str(path.relative_to(root)) for path in (root / "sharding").glob("*.py"))
    assert "sharding/optimizer.py" in sharding_modules
    for module in sharding_modules:
        assert not any(name.startswith("tfmp.optimizers") for name in imported(module)), module
    assert not any(name.startswith(("tfmp.sharding", "tfmp.optimizers")) for name in imported("update_rules.py"))
    assert "tfmp.update_rules" in {f"tfmp.{name.split('.')[-1]}" for name in imported("sharding/optimizer.py")}