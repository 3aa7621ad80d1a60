"""Every flag of `python -m tfmp.train --help`, generated from the config schema (not a hand list), given values a
user could type by mistake: each is refused in one line naming the flag, before anything is written, or accepted.
The refusals are then run through the real CLI for one value of every kind, and the corrected command runs."""

import dataclasses
import math
import os

import pytest
from absl import flags

from tfmp import config as tfmp_config
from tfmp.run_directory import check_before_run

# What a slip of the keyboard gives, by the field's type (absl parses the text as the flag's type).
SLIPS = {
    "int": ["-1", "-2147483649", "99999999999", "1.5", "ten", ""],
    "float": ["nan", "inf", "-inf", "-1", "1e400", "ten", ""],
    "str": ["", "-", "none", "x" * 300, "../..", "a\x00b"],
    "bool": ["maybe", "2"],
}
FIELDS = [(field.name, field.type) for field in dataclasses.fields(tfmp_config.Config)]


def _outcome(name, text, workdir):
    """("flag", message) when absl refuses the text, ("config", message) when tfmp does, ("accepted", value) else."""
    values = flags.FlagValues()
    tfmp_config.define_flags(values)
    try:
        values(["tfmp.train", f"--{name}={text}"])
    except flags.Error as error:
        return "flag", tfmp_config.flag_error_message(error)
    try:
        checked, _, _ = check_before_run(tfmp_config.from_flags(values), workdir)
    except tfmp_config.UsageError as error:
        return "config", str(error)
    return "accepted", getattr(checked, name)


@pytest.mark.parametrize("name, kind", FIELDS, ids=[name for name, _ in FIELDS])
def test_every_flag_refuses_slips_in_one_line_before_anything_is_written(name, kind, tmp_path):
    workdir = str(tmp_path / "run")
    for text in SLIPS[kind]:
        where, result = _outcome(name, text, workdir)
        assert not os.path.exists(workdir), (name, text)  # nothing written, refused or not
        if where == "accepted":
            # What passes is a value of the field's kind that a run can take: a finite number, a known name.
            assert not (isinstance(result, float) and not math.isfinite(result)), (name, text, result)
            continue
        assert "\n" not in result and result, (name, text)
        named = name in result or (kind == "str" and text and text[:40] in result) or where == "flag"
        assert named, (name, text, result)


SLOW = pytest.mark.slow  # ~10 s each: a real training run after the refusal


@pytest.mark.parametrize("args, fixed", [
    pytest.param(["--learning_rate=nan"], ["--learning_rate=0.003"], marks=SLOW),
    pytest.param(["--seed=-1"], ["--seed=1"], marks=SLOW),
    pytest.param(["--initial_loss_scale=0"], ["--initial_loss_scale=1024"], marks=SLOW),
    pytest.param(["--image_size=2048"], ["--image_size=16"], marks=SLOW),
    pytest.param(["--num_cpu_devices=64", "--strategy=mirrored"], ["--num_cpu_devices=2"], marks=SLOW),
    (["--float32_layers=^no_such_layer$"], ["--float32_layers=^logits$"]),  # refused after TensorFlow loaded
], ids=["nan learning rate", "negative seed", "zero loss scale", "huge image size", "64 devices", "pattern matching nothing"])
def test_the_cli_refuses_in_one_line_and_the_corrected_command_runs_in_the_same_workdir(run_cli, tmp_path, args, fixed):
    workdir = tmp_path / "run"
    common = ["--epochs=1", "--global_batch_size=256", "--precision=float32", "--strategy=off", f"--workdir={workdir}"]
    refused = run_cli(*common, *args)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr[-1500:]
    assert refused.stderr.startswith("tfmp.train: error: ") and not workdir.exists()
    corrected = run_cli(*common, *[arg for arg in args if arg.split("=")[0] not in {f.split("=")[0] for f in fixed}], *fixed)
    assert corrected.returncode == 0, corrected.stderr[-1500:]
