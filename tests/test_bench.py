"""`python -m tfmp.bench` on a tiny configuration."""

import json
import os
import subprocess
import sys

import keras
import pytest

from conftest import REPO
from tfmp import bench, models


def test_bench_prints_one_json_line_per_precision():
    """Also: with TF_ENABLE_ONEDNN_OPTS unset, the bench (like tfmp.train) turns oneDNN on, so
    TF counts tensor bytes even on CPUs where its default is off."""
    environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    environment.pop("TF_ENABLE_ONEDNN_OPTS", None)
    result = subprocess.run([sys.executable, "-m", "tfmp.bench", "--model=small_cnn", "--batch=8", "--steps=2", "--repeats=2",
                             "--warmup=1", "--precision=fp32,bf16"], cwd=REPO, env=environment, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [json.loads(line) for line in result.stdout.strip().splitlines()]
    assert [line["precision"] for line in lines] == ["float32", "mixed_bfloat16"]
    for line in lines:
        assert line["images_per_second"] > 0 and line["peak_rss_mb"] > 0 and line["gflops_per_second"] > 0
        assert line["peak_tensor_mb"] > 0 and line["remat"] == "none"
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


def test_bench_usage_error(capsys):
    assert bench.main(["tfmp.bench", "--model=vit"]) == 2
    assert "unknown model 'vit'" in capsys.readouterr().err
    assert bench.main(["tfmp.bench", "--remat=none,everything"]) == 2
    assert "unknown remat mode 'everything'; valid: none, blocks, full" in capsys.readouterr().err


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
