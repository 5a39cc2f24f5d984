"""Bad input said in one line, exit 2, before the expensive work: each case runs the command in a
fresh interpreter and checks that torch was never imported when the fault is one of sizes or paths."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Runs ``moebench ARGS``; on the way out writes whether torch got imported to the file $TORCH_SEEN.
_RUN = """
import atexit, os, sys
atexit.register(lambda: open(os.environ["TORCH_SEEN"], "w").write(str("torch" in sys.modules)))
from moebench.cli import main
main()
"""


def moebench(args: list[str], tmp_path, timeout: float = 120) -> tuple[int, str, str, bool]:
    """``(exit code, stdout, stderr, whether torch was imported)`` of ``moebench ARGS``."""
    seen = tmp_path / "torch-seen"
    env = os.environ | {"TORCH_SEEN": str(seen)}
    done = subprocess.run([sys.executable, "-c", _RUN, *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=tmp_path)
    return done.returncode, done.stdout, done.stderr, seen.read_text() == "True"


SMALL = ["--d-model", "32", "--hidden", "32", "--experts", "4", "--top-k", "2"]


@pytest.mark.slow
@pytest.mark.parametrize(("args", "message"), [
    (["bench", "moe-layer", "--tokens", "1180591620717411303424"],
     "error: the layer T=1180591620717411303424 D=512 H=512 E=64 K=8 needs at least"),
    (["bench", "moe-layer", "--top-k", "9", "--experts", "8"], "error: --top-k 9 exceeds --experts 8"),
    (["bench", "moe-layer", *SMALL, "--out", ""], "error: --out '': an empty path names no file"),
    (["bench", "moe-layer", *SMALL, "--out", "no/such/folder/r.json"], "error: --out no/such/folder/r.json: folder "),
    (["run", "smoke", "--out", ""], "error: --out '': an empty path names no folder"),
])
def test_sizes_and_paths_are_refused_before_torch(args, message, tmp_path):
    code, _, err, torch_imported = moebench(args, tmp_path)
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith(message), err
    assert not torch_imported


@pytest.mark.parametrize(("target", "message"), [
    ("ro/run.log", "ro/run.log: {tmp}/ro is not writable"),
    # the log makes its folders: the last one that exists is checked
    ("ro/new/sub/run.log", "ro/new/sub/run.log: {tmp}/ro is not writable"),
    ("", "'': an empty path names no file"),
])
def test_train_mllog_that_cannot_be_written_fails_before_training(target, message, tmp_path, monkeypatch):
    """The log is written after training: a read-only folder trained for minutes, then failed. Root
    writes through permission bits, so "not writable" is what os.access answers for ro/."""
    from click.testing import CliRunner

    from moebench import cli as cli_module

    (tmp_path / "ro").mkdir()
    real_access = os.access
    monkeypatch.setattr(cli_module.os, "access",
                        lambda p, mode: False if os.path.abspath(p) == str(tmp_path / "ro") else real_access(p, mode))
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli_module.cli, ["train", "--steps", "1", "--mllog", target])
    assert isinstance(result.exception, cli_module.ConfigError)
    assert str(result.exception) == f"--mllog {message.format(tmp=tmp_path)}"
