"""The README's promises: its library example runs as written, its commands are the ones CI runs."""

import json
import math
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO


def _readme():
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as file:
        return file.read()


def _python_blocks():
    blocks = re.findall(r"```python\n(.*?)```", _readme(), flags=re.S)
    assert len(blocks) == 2, "README.md holds two python examples: the library diff's script and the custom train_step"
    return blocks


def test_library_example_runs_and_resumes(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(_python_blocks()[0])
    environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    first = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=environment, capture_output=True, text=True,
                           timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    accuracy = float(re.search(r"^accuracy ([0-9.]+)", first.stdout, flags=re.M).group(1))
    assert accuracy > 0.8
    assert f"ckpt-{3 * math.ceil(1797 / 64)}.index" in os.listdir(tmp_path / "runs" / "my_digits" / "checkpoints")  # by step
    # Run again: the checkpoint of epoch 3 is restored and fit() has no epoch left to run.
    second = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=environment, capture_output=True, text=True,
                            timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "Epoch" not in second.stdout
    assert float(re.search(r"^accuracy ([0-9.]+)", second.stdout, flags=re.M).group(1)) == accuracy


def test_custom_train_step_example_trains_under_fp16_without_the_forgotten_scale_loss_warning(tmp_path):
    block = _python_blocks()[1]
    assert 'set_policy("mixed_float16")' in block
    script = tmp_path / "custom_step.py"
    script.write_text(block + "\nassert isinstance(model.optimizer, tfmp.precision.LossScaleOptimizer)\n")
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    first, last = map(float, re.search(r"^loss ([0-9.e+-]+) -> ([0-9.e+-]+)", result.stdout, flags=re.M).groups())
    assert last < 0.2 * first  # it really trains: the gradients reached the weights at full size
    assert "scale_loss" not in result.stderr

    # The same model without the scale_loss line: one warning, and training barely moves.
    forgetful = block.replace("self.optimizer.scale_loss(loss)", "loss")
    script.write_text(forgetful)
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("never went through optimizer.scale_loss()") == 1
    first, last = map(float, re.search(r"^loss ([0-9.e+-]+) -> ([0-9.e+-]+)", result.stdout, flags=re.M).groups())
    assert last > 0.9 * first


def test_ci_runs_the_readme_test_command():
    commands = re.search(r"```bash\n(.*?)```", _readme(), flags=re.S).group(1).strip().splitlines()
    assert commands[-1].split("#")[0].strip().endswith("pytest"), "README.md's first block ends with the test command"
    test_command = commands[-1].split("#")[0].split("&&")[-1].strip()
    with open(os.path.join(REPO, ".ci", "run"), encoding="utf-8") as file:
        ci_lines = [line.strip() for line in file]
    assert test_command in ci_lines


def _colab_cells() -> list[str]:
    section = _readme().split("\n## Colab\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```ipython\n(.*?)```", section, flags=re.S)


@pytest.mark.slow  # ~3 min: a clone, a pip install, the smoke run and the library cell
def test_the_colab_cells_run_as_a_notebook_on_cpu(tmp_path, monkeypatch):
    """The README's Colab cells, in their order, in one Jupyter kernel whose working folder holds the clone — as
    Colab has it. The clone is of this checkout; `/content` is a temporary folder; the kernel is a virtual environment
    over this one's packages, so the cells' `pip install` cannot touch the environment running the tests. The last
    cell downloads CIFAR-10 and is not run."""
    import nbclient
    import nbformat

    cells = _colab_cells()
    assert len(cells) == 4 and "tfds build cifar10" in cells[-1]
    content = tmp_path / "content"
    content.mkdir()
    environment = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(environment)], check=True)
    kernel = tmp_path / "jupyter" / "kernels" / "colab"
    kernel.mkdir(parents=True)
    (kernel / "kernel.json").write_text(json.dumps({
        "argv": [str(environment / "bin" / "python"), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "colab", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("PATH", f"{environment / 'bin'}{os.pathsep}{os.environ['PATH']}")  # the cells' `pip`, `python`
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
    monkeypatch.delenv("PYTHONPATH", raising=False)  # a checkout on the path would shadow what the cells install

    sources = [cell.replace("<this repository>", REPO).replace("/content", str(content)) for cell in cells[:-1]]
    sources.append("print('tfmp from', tfmp.__file__, 'accuracy', history.history['accuracy'][-1])")
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in sources])
    nbclient.NotebookClient(notebook, kernel_name="colab", timeout=900,
                            resources={"metadata": {"path": str(content)}}).execute()  # raises on a Python error

    def output(index):
        return "".join(part.get("text", "") for part in notebook.cells[index].outputs)
    # A shell command's failure is no Python error: read what the cells printed.
    assert "Successfully installed" in output(0) and "tfmp" in output(0), output(0)[-2000:]
    assert re.search(r"^done: .*metrics\.json", output(1), flags=re.M), output(1)[-3000:]
    checked = re.search(r"^tfmp from (\S+) accuracy ([0-9.]+)", output(3), flags=re.M)
    assert checked, output(3)[-2000:]
    assert str(environment) in checked.group(1), checked.group(1)  # the installed package, not the clone folder
    assert float(checked.group(2)) > 0.5
    assert any(name.endswith(".index") for name in os.listdir(content / "runs" / "notebook" / "checkpoints"))
