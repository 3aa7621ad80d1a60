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


def _module_level_imports() -> dict[str, set[str]]:
    """tfmp module -> the tfmp modules it imports at module level (imports inside functions are deferred on purpose)."""
    import ast

    root = os.path.join(REPO, "tfmp")
    graph = {}
    for folder, _, files in os.walk(root):
        for file_name in files:
            if not file_name.endswith(".py"):
                continue
            path = os.path.join(folder, file_name)
            module = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".").removesuffix(".__init__")
            with open(path, encoding="utf-8") as file:
                tree = ast.parse(file.read())
            imported = set()
            for node in tree.body:  # top level only
                if isinstance(node, ast.Import):
                    imported |= {alias.name for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module:
                    imported |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
            graph[module] = imported
    return {module: {name for name in imports if name in graph and name != module} for module, imports in graph.items()}


def test_no_import_cycles_between_the_rooms():
    """tfmp.training runs tasks; tfmp.tasks build on tfmp.ssl; tfmp.ssl imports neither (issue 12's cycle stays gone)."""
    graph = _module_level_imports()

    def reaches(start, goal, seen=()):
        return any(name == goal or (name not in seen and reaches(name, goal, (*seen, name))) for name in graph.get(start, ()))

    rooms = ("tfmp.training", "tfmp.tasks", "tfmp.tasks.pretrain", "tfmp.tasks.supervised", "tfmp.ssl", "tfmp.ssl.simclr")
    cycles = [module for module in rooms if reaches(module, module)]
    assert not cycles, f"import cycles through {cycles}"
    assert not any(name.startswith(("tfmp.tasks", "tfmp.training")) for module in graph if module.startswith("tfmp.ssl")
                   for name in graph[module])


def test_no_line_of_the_project_is_longer_than_its_limit():
    """setup.cfg's max-line-length (140), over every Python file tracked in the repository."""
    import configparser

    settings = configparser.ConfigParser()
    settings.read(os.path.join(REPO, "setup.cfg"))
    limit = settings.getint("flake8", "max-line-length")
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    long_lines = []
    for path in tracked:
        with open(os.path.join(REPO, path), encoding="utf-8") as file:
            long_lines += [f"{path}:{number}" for number, line in enumerate(file, 1) if len(line.rstrip("\n")) > limit]
    assert tracked and long_lines == []


def test_import_tfmp_works_beside_a_folder_named_tfmp(tmp_path):
    """Colab's layout: the clone in /content/tfmp, the notebook in /content. The folder must not shadow the package."""
    (tmp_path / "tfmp").mkdir()
    (tmp_path / "tfmp" / "README.md").write_text("a clone's top folder, not a package\n")
    result = subprocess.run([sys.executable, "-c", "import tfmp; print(tfmp.__version__, tfmp.config.Config().task)"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-1500:]
    assert result.stdout.split() == [tfmp.__version__, "supervised"]
