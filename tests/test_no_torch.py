"""spec/, cost/, planner/ and sim/ never import torch: planning works on a machine without PyTorch."""

import ast
import pathlib
import subprocess
import sys
import textwrap

import fivefold

PACKAGE = pathlib.Path(fivefold.__file__).parent
TORCH_FREE = ["spec", "cost", "planner", "sim", "batching"]

BLOCK_TORCH = textwrap.dedent("""
    import importlib, importlib.abc, pkgutil, sys

    class NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"torch is blocked in this test (imported as {{name}})")
            return None

    sys.meta_path.insert(0, NoTorch())
    import fivefold
    for package in {packages}:
        module = importlib.import_module("fivefold." + package)
        for info in pkgutil.walk_packages(module.__path__, module.__name__ + "."):
            importlib.import_module(info.name)
    import fivefold.cli
    from fivefold.cli import main
    code = main(["estimate", "--model", "llama3-8b", "--cluster", "1x8xH100-SXM", "--tp", "2", "--json"])
    assert code == 0, code
    code = main(["plan", "--model", "tiny", "--cluster", "1x4xcpu", "--json"])
    assert code == 0, code
    code = main(["estimate", "--serve", "--model", "llama3-8b", "--cluster", "1x8xH100-SXM", "--tp", "2", "--json"])
    assert code == 0, code
    print("OK no torch")
""")


def test_planning_packages_import_and_run_without_torch():
    script = BLOCK_TORCH.format(packages=TORCH_FREE)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "OK no torch" in result.stdout


def test_no_torch_import_statement_in_planning_sources():
    offenders = []
    for package in TORCH_FREE:
        for path in (PACKAGE / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                offenders += [f"{path.relative_to(PACKAGE)}: {n}" for n in names if n.split(".")[0] == "torch"]
    assert offenders == []
