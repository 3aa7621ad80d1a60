"""The memory planner: what fits a device of `--device_memory`, the cheapest change that makes a run fit, and a run
predicted not to fit refused before anything is written."""

import json
import re

import pytest

from tfmp import train
from tfmp.config import Config, UsageError, parse_memory_size, validate
from tfmp.diagnostics import planner
from tfmp.diagnostics.memory import MemoryEstimate

MIB = 2 ** 20


def _estimate(activations_mib, state_mib=40):
    return MemoryEstimate("float32", 64, state_mib * MIB // 4, state_mib * MIB // 4, state_mib * MIB // 2, activations_mib * MIB)


@pytest.mark.parametrize("text, expected", [("16GiB", 16 * 2 ** 30), ("15.5GB", 15_500_000_000), ("512 MiB", 512 * MIB), ("4096", 4096)])
def test_memory_sizes_are_read_in_both_units(text, expected):
    assert parse_memory_size(text) == expected


@pytest.mark.parametrize("text", ["16XB", "-1GiB", "0GiB", "many"])
def test_a_bad_memory_size_is_refused_in_one_line_naming_the_forms(text):
    with pytest.raises(UsageError, match=r"device_memory must be a size such as 16GiB, 15.5GB or 512MiB"):
        validate(Config(device_memory=text))


def test_the_plan_names_the_cheapest_remat_and_the_largest_batch_that_fit():
    estimates = {"none": _estimate(600), "blocks": _estimate(200), "full": _estimate(100)}
    plan = planner.plan(estimates.__getitem__, device_bytes=400 * MIB, remat="none", per_replica_batch=64)
    # usable: 300 MiB; state 40 MiB; activations 600 MiB at 64 images -> 9.375 MiB an image -> 27 images fit
    assert (plan.fits, plan.cheapest_fitting, plan.largest_batch) == (False, "blocks", 27)
    assert "needs --remat=blocks" in plan.summary() and "at most 27 images/replica with --remat=none" in plan.summary()
    roomy = planner.plan(estimates.__getitem__, device_bytes=4096 * MIB, remat="full", per_replica_batch=64)
    assert roomy.fits and "--remat=none also fits" in roomy.summary()  # the faster choice is named
    tight = planner.plan(estimates.__getitem__, device_bytes=50 * MIB, remat="none", per_replica_batch=64)
    assert not tight.fits and "optimizer state alone take" in tight.summary()


def test_on_several_replicas_the_plan_names_the_sharding_stages_that_fit():
    """usable 300 MiB; weights 60, gradients 60, AdamW state 120 MiB (240), activations at 64 images on top."""
    def summary(activations_mib, replicas=2):
        estimates = {"none": _estimate(activations_mib, state_mib=240), "blocks": _estimate(50, state_mib=240)}
        return planner.plan(estimates.__getitem__, device_bytes=400 * MIB, remat="none", per_replica_batch=64,
                            replicas=replicas).summary()

    # 340 MiB; zero1 halves the state: 280 MiB fits, named first (no extra compute); zero2 is not needed.
    assert summary(100).endswith("needs --sharding=zero1 (280 MiB, the optimizer state split over 2 replicas) or "
                                 "--remat=blocks (290 MiB) or at most 38 images/replica with --remat=none")
    # 440 MiB; zero1 leaves 380. Accumulating unsharded never fits (two gradient sizes, 120 MiB, on the 240 MiB
    # state); under zero2 they are 60 MiB and the state 180: 4 micro-batches of 16 images, 290 MiB.
    assert summary(200).endswith("needs --remat=blocks (290 MiB) or --sharding=zero2 with "
                                 "--gradient_accumulation_steps=4 (290 MiB) or at most 19 images/replica with --remat=none")
    assert "--sharding" not in summary(200, replicas=1)


def test_a_state_too_large_for_one_device_is_sent_to_zero3_with_the_replicas_it_needs():
    """usable 300 MiB; weights 120, gradients 120, AdamW state 240 MiB: 480 MiB of state, 50 MiB of activations."""
    def summary(precision, replicas):
        estimate = MemoryEstimate(precision, 64, 120 * MIB, 120 * MIB, 240 * MIB, 50 * MIB)
        return planner.plan(lambda mode: estimate, device_bytes=400 * MIB, remat="none", per_replica_batch=64,
                            replicas=replicas).summary()

    # bf16: zero3 on 2 replicas holds 60 + 60 + 120 MiB, plus the activations (the 16-bit copies among them): 290 MiB.
    assert summary("mixed_bfloat16", 2).endswith("needs --sharding=zero3 (290 MiB, weights, gradients and optimizer "
                                                 "state split over 2 replicas)")
    # float32: the gathered float32 weights a backward pass needs are held too (410 MiB): the state fits on 2.
    assert summary("float32", 2).endswith("needs --sharding=zero3 on at least 2 replicas for the state alone (then add "
                                          "--remat or smaller batches as the activations need)")
    # One replica to shard over: the plan still names how many zero3 needs.
    assert "needs --sharding=zero3 on at least 2 replicas" in summary("mixed_bfloat16", 1)


@pytest.mark.parametrize("device_bytes, usable", [(2 ** 10, "768 bytes usable of 1 KiB"), (2 ** 20, "768 KiB usable of 1 MiB"),
                                                  (2 ** 40, "768 GiB usable of 1 TiB"), (1536 * MIB, "1.12 GiB usable of 1.5 GiB")])
def test_the_plan_reads_its_figures_in_units_that_fit_their_size(device_bytes, usable):
    """A small --device_memory printed "0.00 GiB (0.00 GiB usable of 0.00 GiB)"."""
    estimates = {"none": _estimate(600), "blocks": _estimate(200), "full": _estimate(100)}
    summary = planner.plan(estimates.__getitem__, device_bytes=device_bytes, remat="none", per_replica_batch=64).summary()
    assert usable in summary and "0.00" not in summary
    assert planner.readable_bytes(40 * MIB) == "40 MiB" and planner.readable_bytes(3 * 2 ** 50 // 2) == "1.5 PiB"


@pytest.mark.slow  # ~40 s of CLI dry runs; the plan's logic is tested above, the CLI's refusal below
def test_the_recommendation_changes_as_the_device_memory_shrinks(tmp_path, capsys):
    verdicts = []
    for memory in ("8GiB", "1536MiB", "600MiB", "100MiB"):
        workdir = tmp_path / memory
        assert train.main(["tfmp.train", f"--workdir={workdir}", "--dry_run", "--model=resnet18_cifar", "--image_size=32",
                           "--precision=float32", "--strategy=off", "--global_batch_size=256", f"--device_memory={memory}"]) == 0
        plan = json.loads((workdir / "memory_estimate.json").read_text())["plan"]
        verdicts.append((plan["fits"], plan["cheapest_fitting_remat"], plan["summary"]))
        assert plan["summary"] in capsys.readouterr().out
    # 8 GiB: fits as asked; 1.5 GiB: --remat=blocks or 2 micro-batches; 600 MiB: no remat mode, 8 micro-batches or a
    # smaller batch; 100 MiB: the state alone.
    assert [verdict[:2] for verdict in verdicts] == [(True, "none"), (False, "blocks"), (False, None), (False, None)]
    assert verdicts[0][2].startswith("memory plan: fits: --remat=none at 256 images/replica")
    assert "needs --remat=blocks" in verdicts[1][2] and "or --gradient_accumulation_steps=2 with --remat=none" in verdicts[1][2]
    assert re.search(r"needs --gradient_accumulation_steps=8 with --remat=none \(\d+ MiB, the same global batch\) "
                     r"or at most \d+ images/replica with --remat=none$", verdicts[2][2]), verdicts[2][2]
    assert "weights, gradients and optimizer state alone take" in verdicts[3][2]
    # The run asked for with the micro-batches the plan named fits.
    workdir = tmp_path / "micro-batches"
    assert train.main(["tfmp.train", f"--workdir={workdir}", "--dry_run", "--model=resnet18_cifar", "--image_size=32",
                       "--precision=float32", "--strategy=off", "--global_batch_size=256", "--device_memory=600MiB",
                       "--gradient_accumulation_steps=8"]) == 0
    estimate = json.loads((workdir / "memory_estimate.json").read_text())
    assert estimate["plan"]["fits"] and estimate["gradient_accumulation_steps"] == 8
    assert estimate["accumulator_bytes"] == 2 * estimate["gradients_bytes"]


def test_a_run_predicted_not_to_fit_is_refused_and_writes_nothing_unless_told_to_ignore_it(tmp_path, capsys):
    workdir = tmp_path / "run"
    common = ["tfmp.train", f"--workdir={workdir}", "--precision=float32", "--strategy=off", "--epochs=1", "--global_batch_size=128"]
    assert train.main([*common, "--device_memory=1MiB"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "memory plan: does not fit" in error and "--ignore_memory_estimate" in error
    assert not workdir.exists()
    assert train.main([*common, "--device_memory=1MiB", "--ignore_memory_estimate"]) == 0
    ignored = json.loads((workdir / "metrics.json").read_text())
    # The plan built the model again (once per remat mode it needed); the run still starts from the seed's weights.
    assert train.main(["tfmp.train", f"--workdir={tmp_path / 'plain'}", *common[2:]]) == 0
    plain = json.loads((tmp_path / "plain" / "metrics.json").read_text())
    assert ignored["train_loss"] == plain["train_loss"] and ignored["eval_accuracy"] == plain["eval_accuracy"]
