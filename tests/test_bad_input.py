"""Bad input leaves nothing behind: each check that can fail on what a user brings (data size
against batch, image files, encoder files, model against image size, the workdir itself) exits 2
with one line, no traceback, before anything is written, so the corrected command then runs in
the same workdir."""

import os

import numpy as np
import pytest
import tensorflow as tf

from conftest import AUTO_PRECISION
from tfmp import train


def _one_line_error(result, *expected):
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("tfmp.train: error: "), result.stderr[-2000:]
    for text in expected:
        assert text in last, last
    return last


def _image_folder(root, per_class=20, classes=("circle", "square")):
    rng = np.random.default_rng(0)
    for class_name in classes:
        os.makedirs(root / class_name)
        for index in range(per_class):
            pixels = rng.integers(0, 255, (16, 16, 1), dtype=np.uint8)
            tf.io.write_file(str(root / class_name / f"{index}.png"), tf.io.encode_png(pixels))
    return root


def test_a_small_folder_with_a_corrupt_image_then_the_corrected_commands(run_cli, tmp_path):
    folder = _image_folder(tmp_path / "images")  # 40 images: 32 to train on, 8 to test
    (folder / "square" / "broken.png").write_bytes(b"not a png at all")
    workdir = tmp_path / "run"
    args = ["--flagfile=experiments/digits_supervised.cfg", f"--dataset=folder:{folder}", f"--workdir={workdir}",
            f"--precision={AUTO_PRECISION}", "--strategy=off", "--epochs=1"]

    last = _one_line_error(run_cli(*args), "1 unreadable image file(s)", str(folder / "square" / "broken.png"),
                           "--skip_unreadable_images")
    assert not workdir.exists(), last

    last = _one_line_error(run_cli(*args, "--skip_unreadable_images"), "global_batch_size 128 exceeds the 32 training examples",
                           "lower --global_batch_size")
    assert not workdir.exists(), last

    result = run_cli(*args, "--skip_unreadable_images", "--global_batch_size=16")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "skipping 1 unreadable image file(s)" in result.stderr
    assert (workdir / "metrics.json").exists()


def test_a_bad_jpeg_is_refused_in_exactly_one_line(run_cli, tmp_path):
    """libjpeg printed its own lines ("Improper call to JPEG library in state 201", "Input file read error") on stderr
    before tfmp's one-line refusal."""
    folder = _image_folder(tmp_path / "images")
    good = tf.io.encode_jpeg(np.full((16, 16, 1), 128, np.uint8)).numpy()
    (folder / "circle" / "cut.jpg").write_bytes(good[: len(good) // 2])
    (folder / "square" / "bad.jpg").write_bytes(b"\xff\xd8\xff\xe0" + bytes(40))
    workdir = tmp_path / "run"
    result = run_cli("--flagfile=experiments/digits_supervised.cfg", f"--dataset=folder:{folder}", f"--workdir={workdir}",
                     "--strategy=off", "--global_batch_size=8", "--epochs=1")
    last = _one_line_error(result, "2 unreadable image file(s)", f"{folder / 'circle' / 'cut.jpg'}: jpeg::Uncompress failed")
    assert result.stderr.strip().splitlines() == [last]
    assert "{{function_node" not in last and "[Op:" not in last
    assert not workdir.exists()


def test_batch_larger_than_digits_writes_nothing(run_cli, tmp_path):
    workdir = tmp_path / "run"
    _one_line_error(run_cli(f"--workdir={workdir}", "--global_batch_size=4096", "--strategy=off"),
                    "exceeds the 1437 training examples")
    assert not workdir.exists()


def test_a_model_too_large_for_the_images(run_cli, tmp_path):
    workdir = tmp_path / "run"
    _one_line_error(run_cli(f"--workdir={workdir}", "--model=resnet50", "--strategy=off"),
                    "model resnet50 needs images of at least", "set --image_size", "digits has 8x8x1 images")
    assert not workdir.exists()


def test_an_image_size_the_model_cannot_take_names_the_resized_shape(run_cli, tmp_path):
    """It said "(digits has 9x9x1 images)": the data set's images are 8x8; --image_size made them 9x9."""
    workdir = tmp_path / "run"
    _one_line_error(run_cli(f"--workdir={workdir}", "--model=vit_micro_p2", "--image_size=9", "--strategy=off"),
                    "must be a multiple of 2, got 9x9", "(--image_size=9 resizes digits's images to 9x9x1)")
    assert not workdir.exists()


@pytest.mark.parametrize("flags, expected", [
    (["--seed=99999999999999999999"], "seed must be in [0, 4294967295], got 99999999999999999999"),  # was a traceback
    (["--seed=4294967296"], "seed must be in [0, 4294967295], got 4294967296"),
    # Was accepted, recorded in config.json and silently trained as the default warmup (capped at the run's length).
    (["--warmup_epochs=1e9"], "warmup_epochs 1e+09 exceeds epochs 15: the learning rate would never reach --learning_rate; "
                              "use at most 15"),
    (["--warmup_epochs=3.5", "--epochs=3"], "warmup_epochs 3.5 exceeds epochs 3"),
    (["--global_batch_size=128", "--gradient_accumulation_steps=3"], "gradient_accumulation_steps 3 does not divide "
                                                                     "global_batch_size 128"),
    (["--strategy=mirrored", "--num_cpu_devices=2", "--global_batch_size=132", "--gradient_accumulation_steps=4"],
     "gradient_accumulation_steps 4 does not divide the per-replica batch of 66 examples into equal micro-batches; use "
     "one of 1, 2, 3, 6, 11, 22, 33, 66")])
def test_a_number_the_run_cannot_honour_is_refused_before_anything_runs(run_cli, tmp_path, flags, expected):
    workdir = tmp_path / "run"
    _one_line_error(run_cli(f"--workdir={workdir}", *flags), expected)
    assert not workdir.exists()


def test_the_largest_seed_and_a_warmup_of_the_whole_run_are_accepted():
    from tfmp.config import Config, validate

    assert validate(Config(seed=2 ** 32 - 1, warmup_epochs=15.0, epochs=15)).seed == 2 ** 32 - 1
    smoke = validate(Config(smoke=True, warmup_epochs=5.0, epochs=15))
    assert (smoke.epochs, smoke.warmup_epochs) == (2, 2.0)  # --smoke runs 2 epochs: its warmup fits in them


def test_sharding_is_one_setting_and_its_previous_name_still_works(tmp_path, caplog, monkeypatch):
    """`--optimizer_sharding=zero1` became `--sharding=zero1` (ZeRO's stage names); workdirs whose config.json
    spells the old name resume, and the two names given with different values are refused."""
    import json

    from tfmp.config import Config, UsageError, load_json, renamed_settings_given, validate

    assert validate(Config(optimizer_sharding="zero1")).sharding == "zero1"
    assert validate(Config(optimizer_sharding="zero1")).optimizer_sharding == ""
    assert renamed_settings_given(Config(optimizer_sharding="zero1")) == [
        "--optimizer_sharding=zero1 is now --sharding=zero1 (the old name still works)"]
    assert validate(Config(optimizer_sharding="zero1", sharding="zero1")).sharding == "zero1"
    with pytest.raises(UsageError, match=r"^--optimizer_sharding=none and --sharding=zero1 disagree; give --sharding only$"):
        validate(Config(optimizer_sharding="none", sharding="zero1"))
    with pytest.raises(UsageError, match=r"^unknown sharding 'zero9'; valid: none, zero1, zero2, zero3$"):
        validate(Config(sharding="zero9"))
    with pytest.raises(UsageError, match=r"^unknown optimizer_sharding 'zero2'; valid: none, zero1$"):
        validate(Config(optimizer_sharding="zero2"))
    from tfmp import launch, logs, train
    from tfmp.run_directory import check_before_run

    def notes_said(action):
        monkeypatch.setattr(logs, "_SAID", set())
        with caplog.at_level("WARNING"):
            caplog.clear()
            result = action()
        return result, [record.getMessage() for record in caplog.records if "is now --sharding" in record.getMessage()]

    # The CLI says it once, where the run is checked; the launcher, which checks its workers' flags, leaves it to them.
    checked, said = notes_said(lambda: check_before_run(*train.parse(["tfmp.train", "--optimizer_sharding=zero1",
                                                                      f"--workdir={tmp_path / 'run'}"])))
    assert checked[0].sharding == "zero1" and said == ["--optimizer_sharding=zero1 is now --sharding=zero1 (the old name still works)"]
    code, said = notes_said(lambda: launch.main(["tfmp.launch", "--optimizer_sharding=zero1", "--epochs=0", "--workdir=x"]))
    assert code == 2 and said == []
    written_before = Config().to_dict()  # a config.json of a zero1 run written before the rename
    del written_before["sharding"]
    written_before["optimizer_sharding"] = "zero1"
    (tmp_path / "config.json").write_text(json.dumps(written_before))
    earlier = load_json(str(tmp_path / "config.json"))
    assert earlier.sharding == "zero1" and not validate(Config(sharding="zero1")).differences(earlier)


def test_an_encoder_file_that_is_not_one(run_cli, tmp_path):
    encoder = tmp_path / "encoder.keras"
    encoder.write_bytes(os.urandom(512))
    workdir = tmp_path / "run"
    workdir.mkdir()  # an existing, empty workdir stays empty
    _one_line_error(run_cli(f"--workdir={workdir}", "--task=linear_eval", f"--encoder={encoder}", "--strategy=off"),
                    f"encoder {encoder}: cannot load")
    assert os.listdir(workdir) == []


def _read_only_workdir(tmp_path):
    """A directory this process cannot write to: permissions, or (as root, whom permissions do
    not stop) a folder on a read-only file system."""
    if os.geteuid() != 0:
        folder = tmp_path / "read_only"
        folder.mkdir(mode=0o500)
        return str(folder)
    candidate = "/sys/tfmp-run"  # sysfs refuses new folders, root or not
    try:
        os.mkdir(candidate)
    except OSError:
        return candidate
    os.rmdir(candidate)
    pytest.skip("running as root without a read-only file system to write to")


@pytest.mark.parametrize("case", ["is a file", "inside a file", "read-only"])
def test_a_workdir_that_cannot_be_written(case, tmp_path, capsys):
    occupied = tmp_path / "occupied"
    occupied.write_text("someone's notes")
    workdir = {"is a file": lambda: str(occupied), "inside a file": lambda: str(occupied / "run"),
               "read-only": lambda: _read_only_workdir(tmp_path)}[case]()
    code = train.main(["tfmp.train", f"--workdir={workdir}", "--strategy=off"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"tfmp.train: error: workdir {workdir} is ")
    assert "choose another --workdir" in lines[0]
    assert occupied.read_text() == "someone's notes"


class MineMethod:  # a user's own SSL method as the registry sees it: its class names the settings it reads
    settings = ("projection_dim", "temperature")


def test_a_method_setting_the_task_does_not_read_is_refused_in_one_line(run_cli, tmp_path):
    """`--task=byol --temperature=0.1` was accepted, recorded in config.json and silently ignored."""
    from tfmp import registry
    from tfmp.config import Config, UsageError
    from tfmp.tasks.stage import check_method_settings

    check_method_settings(Config(task="simclr", temperature=0.1))  # read by the task: accepted
    check_method_settings(Config(task="byol", target_momentum=0.996))
    with pytest.raises(UsageError, match=r"^--temperature applies to --task=simclr\|mocov3 only, not --task=byol; remove it$"):
        check_method_settings(Config(task="byol", temperature=0.1))
    with pytest.raises(UsageError, match=r"^--redundancy_weight applies to --task=barlow_twins only, not --task=supervised"):
        check_method_settings(Config(task="supervised", redundancy_weight=0.1))
    registry.SSL_METHODS.register("mine", f"{__name__}:MineMethod")  # a user's method is asked too
    try:
        check_method_settings(Config(task="mine", temperature=0.3))
        with pytest.raises(UsageError, match=r"^--temperature applies to --task=simclr\|mocov3\|mine only"):
            check_method_settings(Config(task="vicreg", temperature=0.3))
    finally:
        registry.SSL_METHODS.unregister("mine")
    workdir = tmp_path / "run"
    _one_line_error(run_cli(f"--workdir={workdir}", "--task=byol", "--temperature=0.1", "--dry_run"),
                    "--temperature applies to --task=simclr|mocov3 only, not --task=byol; remove it")
    assert not workdir.exists()
