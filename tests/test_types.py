"""mypy finds no type error in the torch-free packages (spec, cost, planner, sim). Settings: [tool.mypy] in
pyproject.toml; the cache (.mypy_cache, ignored by git) makes a re-run take a few seconds."""

import pathlib

from mypy import api as mypy_api  # the dev extra

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHECKED = ["spec", "cost", "planner", "sim", "batching"]


def test_mypy_finds_no_errors_in_spec_cost_planner_sim():
    paths = [str(ROOT / "src" / "fivefold" / package) for package in CHECKED]
    stdout, stderr, status = mypy_api.run(["--config-file", str(ROOT / "pyproject.toml"),
                                           "--cache-dir", str(ROOT / ".mypy_cache"), *paths])
    assert status == 0, stdout + stderr
    assert "Success: no issues found" in stdout
