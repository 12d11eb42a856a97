"""The `fivefold` command: every verb has --help; bad input is one line and exit code 2."""

import subprocess
import sys

import pytest

from fivefold.cli import build_parser, main

VERBS = ["plan", "estimate", "simulate", "dryrun", "train", "generate", "serve", "profile", "report", "convert"]


def test_every_verb_is_registered_with_help(capsys):
    for verb in VERBS:
        with pytest.raises(SystemExit) as exit_info:
            main([verb, "--help"])
        assert exit_info.value.code == 0
        assert verb in capsys.readouterr().out
    assert set(build_parser()._subparsers._group_actions[0].choices) == set(VERBS)


@pytest.mark.parametrize("argv, words", [
    (["estimate", "--model", "gpt5"], "error: --model='gpt5': unknown preset; known: tiny"),
    (["estimate", "--cluster", "1x8xV100"], "unknown device; known: A100-40GB"),
    (["estimate", "--model", "layers=2,hidden=64,heads=4,kv_heads=3"], "model.kv_heads=3: must divide heads=4"),
    (["estimate", "--cluster", "2x8xH100:nic=lots"], "expected a number with a unit"),
    (["estimate", "--cluster", "1x4xcpu", "--tp", "3"], "must divide the cluster's 4 devices"),
    (["estimate", "--cluster", "1x4xcpu", "--seq-len", "-5"], "train.seq_len=-5: must be a positive integer"),
    (["estimate", "--cluster", "1x4xcpu", "--layers-per-stage", "a,b", "--pp", "2"], "write integers"),
    (["estimate", "--plan", "/nonexistent/plan.toml"], "no such file"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, words):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_console_script_runs_as_module():
    result = subprocess.run([sys.executable, "-m", "fivefold", "estimate", "--model", "gpt5"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.startswith("error: --model='gpt5'")
