"""`python -m tfmp.bench` on a tiny configuration."""

import importlib.util
import json
import os
import re
import subprocess
import sys

import keras
import numpy as np
import pytest

from conftest import REPO
from tfmp import bench, models
from tfmp.diagnostics import flops


@pytest.mark.slow  # ~14 s; the bench also runs (with XLA) in tests/test_xla.py
def test_bench_prints_one_json_line_per_precision():
    """Also: with TF_ENABLE_ONEDNN_OPTS unset, the bench (like tfmp.train) turns oneDNN on, so
    TF counts tensor bytes even on CPUs where its default is off."""
    environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    environment.pop("TF_ENABLE_ONEDNN_OPTS", None)
    result = subprocess.run([sys.executable, "-m", "tfmp.bench", "--model=small_cnn", "--batch=8", "--steps=2", "--repeats=2",
                             "--warmup=1", "--precision=fp32,bf16", "--allow_emulated_bf16"], cwd=REPO, env=environment,
                            capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [json.loads(line) for line in result.stdout.strip().splitlines()]
    assert [line["precision"] for line in lines] == ["float32", "mixed_bfloat16"]
    # It talks while it measures: what it will do, a header per configuration with an ETA once one is measured.
    progress = result.stderr.splitlines()
    assert progress[0].startswith("tfmp.bench: 2 configuration(s), each a fresh process")
    headers = [line for line in progress if line.startswith("[")]
    assert headers[0].startswith("[1/2] float32, remat none") and "ETA after the first configuration" in headers[0]
    assert headers[1].startswith("[2/2] mixed_bfloat16, remat none") and re.search(r"ETA \d+:\d\d$", headers[1])
    for line in lines:
        assert line["images_per_second"] > 0 and line["peak_rss_mb"] > 0 and line["gflops_per_second"] > 0
        assert line["peak_tensor_mb"] > 0 and line["remat"] == "none"
        assert line["mfu"] > 0 and "FLOP/cycle" in line["mfu_peak_formula"]
        assert abs(line["step_time_ms"] - 8000 / line["images_per_second"]) < 0.1  # batch 8 / median step


def test_bench_without_cpu_allocation_statistics_reports_no_tensor_peak():
    """With oneDNN off (TF's default on CPUs without AVX512_VNNI/BF16/AMX) TF counts no CPU
    allocations: the bench still measures time and RSS and says null for the tensor peak."""
    environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_ENABLE_ONEDNN_OPTS="0")
    result = subprocess.run([sys.executable, "-m", "tfmp.bench", "--model=small_cnn", "--batch=8", "--steps=1", "--repeats=1",
                             "--warmup=1", "--precision=fp32", "--method=supervised"], cwd=REPO, env=environment,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    line = json.loads(result.stdout)
    assert line["peak_tensor_mb"] is None and line["images_per_second"] > 0 and line["peak_rss_mb"] > 0


def test_analytic_flops_of_a_dense_layer():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="dense")])
    assert bench.forward_flops_per_example(model, (4,)) == 2 * 4 * 3


def test_analytic_flops_of_the_cifar_resnet18_forward_pass():
    # 0.56 GMACs for ResNet-18 on 32x32 CIFAR images (the commonly quoted figure): 1.11 GFLOPs.
    flops = bench.forward_flops_per_example(models.build_encoder("resnet18_cifar", (32, 32, 3)), (32, 32, 3))
    assert 1.05e9 < flops < 1.15e9


def test_bench_refuses_emulated_bf16_unless_allowed(monkeypatch, capsys):
    monkeypatch.setattr(bench, "bf16_emulated", lambda: True)
    assert bench.main(["tfmp.bench", "--model=small_cnn", "--precision=float32,bf16"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "mixed_bfloat16 is emulated on this CPU" in line and "--allow_emulated_bf16" in line


def test_bench_usage_error(capsys):
    assert bench.main(["tfmp.bench", "--model=vit"]) == 2
    assert "unknown model 'vit'" in capsys.readouterr().err
    assert bench.main(["tfmp.bench", "--remat=none,everything"]) == 2
    assert "unknown remat mode 'everything'; valid: none, blocks, full" in capsys.readouterr().err


@pytest.mark.parametrize("child_code", [-6, 1])
def test_bench_exits_non_zero_when_a_configuration_fails(monkeypatch, capsys, child_code):
    """A child measuring one configuration that aborts (SIGABRT: -6) or fails is an error, named, not a silent 0."""
    outcomes = iter([child_code, 0])

    def fake_run(command, **kwargs):
        code = next(outcomes)
        return subprocess.CompletedProcess(command, code, stdout="" if code else '{"images_per_second": 1.0}\n')

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    assert bench.main(["tfmp.bench", "--model=small_cnn", "--precision=float32,float32"]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    ended = "signal 6" if child_code < 0 else "exit code 1"
    assert errors == [f"tfmp.bench: error: float32, remat none failed ({ended}); no measurement for it"]


@pytest.mark.slow  # 20 s: the matrix script around tfmp.bench, whose per-line output the default suite tests
def test_benchmark_matrix_writes_results_summary_and_chart(tmp_path):
    script = os.path.join(REPO, "experiments", "benchmarks", "run_benchmarks.py")
    result = subprocess.run([sys.executable, script, "--model=small_cnn", "--runners=tfmp,keras", "--precisions=float32",
                             "--batches=8", "--steps=1", "--rounds=1", f"--out={tmp_path}"], cwd=REPO,
                            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [(row["runner"], row["batch"]) for row in summary] == [("tfmp", 8), ("keras", 8)]
    assert all(row["min"] <= row["images_per_second"] <= row["max"] for row in summary)
    assert (tmp_path / "benchmark.png").stat().st_size > 1000
    assert "| tfmp | float32 | 8 |" in result.stdout


def test_benchmark_matrix_without_matplotlib_says_so_before_measuring(tmp_path):
    script = os.path.join(REPO, "experiments", "benchmarks", "run_benchmarks.py")
    hide_matplotlib = ("import runpy, sys; sys.modules['matplotlib'] = None; sys.argv = sys.argv[1:]; "
                       "runpy.run_path(sys.argv[0], run_name='__main__')")
    out = tmp_path / "bench"
    result = subprocess.run([sys.executable, "-c", hide_matplotlib, script, "--runners=tfmp", f"--out={out}"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        'run_benchmarks: error: the chart needs matplotlib, which is not installed; pip install -e ".[bench]", or pass --no_chart']
    assert not out.exists()


@pytest.mark.parametrize("precision, flags, vendor, family, expected", [
    ("float32", {"avx2", "fma"}, "AuthenticAMD", 25, 32),                        # Zen 3: 2 x 256-bit FMA
    ("mixed_bfloat16", {"avx2", "fma"}, "AuthenticAMD", 25, 32),                 # ... bf16 emulated through float32
    ("float32", {"avx2", "fma", "avx512f", "avx512_bf16"}, "AuthenticAMD", 25, 32),  # Zen 4
    ("mixed_bfloat16", {"avx2", "fma", "avx512f", "avx512_bf16"}, "AuthenticAMD", 25, 64),
    ("float32", {"avx2", "fma", "avx512f"}, "AuthenticAMD", 26, 64),            # Zen 5: 2 x 512-bit FMA
    ("float32", {"avx2", "fma", "avx512f", "amx_bf16"}, "GenuineIntel", 6, 64),  # Sapphire Rapids
    ("mixed_bfloat16", {"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"}, "GenuineIntel", 6, 1024),
    ("mixed_float16", {"avx2", "fma"}, "GenuineIntel", 6, 32),
])
def test_peak_flops_per_cycle_from_known_cpu_flags(precision, flags, vendor, family, expected):
    per_cycle, units = flops.flops_per_cycle(precision, frozenset(flags), vendor, family)
    assert per_cycle == expected and units


def test_mfu_is_achieved_over_cores_times_clock_times_flops_per_cycle(monkeypatch):
    monkeypatch.setenv("TFMP_CPU_GHZ", "2.5")
    monkeypatch.setattr(flops.hardware, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    monkeypatch.setattr(flops, "_cpuinfo_fields", lambda: {"vendor_id": "AuthenticAMD", "cpu family": "25"})
    peak = flops.cpu_peak("float32", cores=2)
    assert peak.flops_per_second == 2 * 2.5e9 * 32
    assert peak.formula == "2 cores x 2.500 GHz (TFMP_CPU_GHZ) x 32 FLOP/cycle (AVX2: 2 x 256-bit FMA, float32) = 160 GFLOP/s"
    figures = flops.utilisation(1e9, 80.0, "float32")  # 80 GFLOP/s achieved
    assert figures["achieved_gflops_per_second"] == 80.0 and figures["mfu"] == 80e9 / (len(os.sched_getaffinity(0)) * 2.5e9 * 32)


def _run_benchmarks_module():
    path = os.path.join(REPO, "experiments", "benchmarks", "run_benchmarks.py")
    spec = importlib.util.spec_from_file_location("run_benchmarks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_supervised_matrix_times_the_supervised_step_on_both_sides():
    run_benchmarks = _run_benchmarks_module()
    assert "--method=supervised" in run_benchmarks.tfmp_command("float32", 64, 5, method="supervised")
    command = run_benchmarks.peer_command("mixed_bfloat16", 64, 5, peer="/peers/torch_simclr_peer.py", method="supervised")
    assert command[3] == run_benchmarks.SUPERVISED_PEER and "--peer=/peers/torch_simclr_peer.py" in command
    assert "--precision=bf16" in command
    assert run_benchmarks.peer_command("float32", 64, 5, peer="/peers/torch_simclr_peer.py")[3] == "/peers/torch_simclr_peer.py"


def test_the_supervised_peer_trains_the_simclr_peers_resnet(tmp_path):
    """Where PyTorch is installed (never a tfmp dependency): one real step of the supervised peer."""
    pytest.importorskip("torch")
    peer = tmp_path / "peer.py"  # the SimCLR peer's network, as that file defines it
    peer.write_text("import torch\nclass CifarResNet18(torch.nn.Module):\n"
                    "    def __init__(self):\n        super().__init__()\n        self.conv = torch.nn.Conv2d(3, 512, 3)\n"
                    "    def forward(self, x):\n        return self.conv(x).mean((2, 3))\n")
    script = os.path.join(REPO, "experiments", "benchmarks", "torch_supervised_peer.py")
    result = subprocess.run([sys.executable, script, f"--peer={peer}", "--precision=fp32", "--batch=4", "--steps=1"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    row = json.loads(result.stdout.strip().splitlines()[-1])
    assert row["method"] == "supervised" and row["batch"] == 4 and row["images_per_second"] > 0
    assert np.isfinite(row["final_loss"])
