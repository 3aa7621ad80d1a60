"""The public surface of `import tfmp`: every submodule in the package, and every one the README
names, is reachable as an attribute, and `import tfmp` alone does not start TensorFlow."""

import os
import pkgutil
import re
import subprocess
import sys

import tfmp
from conftest import REPO

CHECK_IN_A_FRESH_PROCESS = """
import sys
import tfmp
assert "tensorflow" not in sys.modules, "import tfmp started TensorFlow"
for name in sys.argv[1:]:
    module = tfmp
    for part in name.split("."):
        module = getattr(module, part)
print(tfmp.diagnostics.precision_report.__name__)
"""


def _package_modules() -> set[str]:
    return {name for _, name, _ in pkgutil.iter_modules(tfmp.__path__) if not name.startswith("_")}


def _readme_modules() -> set[str]:
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as file:
        text = file.read()
    dotted = re.findall(r"\btfmp\.([a-z_]+(?:\.[a-z_]+)*)", text)
    paths = [path.replace("/", ".").removesuffix(".py").rstrip(".") for path in re.findall(r"\btfmp/([a-z_/]+(?:\.py)?)", text)]
    return {name for name in dotted + paths if name}


def test_every_submodule_is_listed_for_lazy_import():
    assert _package_modules() == set(tfmp._SUBMODULES)


def test_every_submodule_and_every_module_the_readme_names_is_reachable_from_import_tfmp():
    names = sorted(_package_modules() | _readme_modules())
    assert "callbacks" in names and "diagnostics" in names
    environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run([sys.executable, "-c", CHECK_IN_A_FRESH_PROCESS, *names], env=environment, capture_output=True,
                            text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "precision_report"
