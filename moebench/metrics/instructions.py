"""Instructions each timed step executes, counted by valgrind's callgrind: a clock that neither load nor
the host's own speed can move (``train.instructions``; docs/report.md, "Which clock").

Wall time and process CPU time both move with how fast the machine runs: a shared host's other tenants
change its cache, memory bandwidth and clock from minute to minute, which no guest-side clock separates
from the code's own cost. An instruction count depends only on the binary, its inputs and its
environment, so two runs of one commit count nearly the same (the spread is measured and stated in
docs/report.md), whatever else the machine does.

The process runs under ``valgrind --tool=callgrind`` with instrumentation off (so importing torch and
the warm-up run at nearly native speed); the first timed step turns instrumentation on
(``callgrind_control -i on``), each timed step collects between two client requests and dumps its count
(``torch._C._valgrind_toggle`` / ``_valgrind_toggle_and_dump_stats``), and the window's end turns
instrumentation off again. Under valgrind the steps run about 60x slower: the wall and CPU clocks of
such a run (its record has ``step_ginstructions``) time valgrind, not the code.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from moebench.errors import ConfigError
from moebench.launch.procs import SAFE_PATH_ENV, die_with_parent
from moebench.metrics import CPU_PEAK_FILE_ENV
from moebench.metrics.flops import shared_cpu_peak

# MKL's default GEMM path generates code at run time that valgrind translates again on every call: a 64 x 64
# fp32 matmul took 25.2 ms under valgrind against 0.007 ms natively; with MKL's reproducible code path 0.145 ms
# (scripts/valgrind_matmul_cost.py, one thread). Both sides of a comparison count this path.
CALLGRIND_MKL_ENV = {"MKL_CBWR": "COMPATIBLE"}
# Set for a process started under callgrind: its dump files' prefix (``<prefix>.<pid>.<n>``).
CALLGRIND_OUT_ENV = "MOEBENCH_CALLGRIND_OUT"


def valgrind_missing() -> str | None:
    """Why this machine cannot count instructions, or None."""
    missing = [tool for tool in ("valgrind", "callgrind_control") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found (Debian/Ubuntu: apt-get install valgrind)"
    if not torch._C._valgrind_supported_platform():
        return "this torch build has no valgrind client requests"
    return None


def callgrind_command(out_dir: Path) -> tuple[list[str], dict[str, str]]:
    """The valgrind command line a counting process runs under (nothing instrumented or collected until the
    timed window asks; valgrind's own messages in ``out_dir/valgrind.log``) and the environment it adds."""
    prefix = out_dir / "callgrind"
    argv = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no",
            f"--callgrind-out-file={prefix}.%p", f"--log-file={out_dir / 'valgrind.log'}"]
    return argv, {**CALLGRIND_MKL_ENV, CALLGRIND_OUT_ENV: str(prefix)}


def run_under_callgrind(cli_argv: list[str]) -> int:
    """Run ``moebench <cli_argv>`` (a one-process ``train``) under callgrind, its output this process's; its
    exit code. valgrind's own log is shown only when the run fails; the dump files go with it."""
    why = valgrind_missing()
    if why is not None:
        raise ConfigError(f"train.instructions=true counts instructions with valgrind: {why}")
    out_dir = Path(tempfile.mkdtemp(prefix="moebench-callgrind-"))
    parent = os.getpid()
    try:
        argv, env = callgrind_command(out_dir)
        # the CPU peak MFU divides by, calibrated here at native speed on the run's one thread: under
        # valgrind its bf16 matmuls would take minutes and measure valgrind (a sweep's shared file, if
        # this is the first point to need it, gets the native figure too)
        peak_file = os.environ.get(CPU_PEAK_FILE_ENV) or str(out_dir / "cpu_peak")
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            shared_cpu_peak(Path(peak_file), 1)
        finally:
            torch.set_num_threads(threads)
        code = subprocess.run([*argv, sys.executable, "-m", "moebench.cli", *cli_argv],
                              env={**os.environ, **SAFE_PATH_ENV, **env, CPU_PEAK_FILE_ENV: peak_file},
                              preexec_fn=lambda: die_with_parent(signal.SIGKILL, parent=parent)).returncode
        log = out_dir / "valgrind.log"
        if code and log.exists():
            print(f"valgrind's log (train.instructions=true), its end:\n{log.read_text()[-2000:]}", file=sys.stderr)
        return code
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def under_callgrind() -> bool:
    return bool(os.environ.get(CALLGRIND_OUT_ENV))


def dump_total(path: Path) -> int:
    """The instructions (``Ir``) a callgrind dump file counted: its ``totals:`` line."""
    for line in path.read_text().splitlines():
        if line.startswith(("totals:", "summary:")):
            return int(line.split()[1])
    raise ValueError(f"{path}: no totals line (not a callgrind dump?)")


class InstructionCounter:
    """Counts the instructions between :meth:`start` and :meth:`stop`; only inside a process run under
    :func:`callgrind_command` (the trainer starts one for ``train.instructions``)."""

    def __init__(self) -> None:
        if not under_callgrind():
            raise ConfigError("train.instructions=true: this process does not run under callgrind; "
                              "run it through `moebench train` or a suite, which start it under valgrind")
        self._prefix = f"{os.environ[CALLGRIND_OUT_ENV]}.{os.getpid()}"
        self._dumps = 0
        self.instrumenting = False

    def _instrument(self, on: bool) -> None:
        # callgrind reads the command between basic blocks of this process, which keeps running (in wait())
        subprocess.run(["callgrind_control", "-i", "on" if on else "off", str(os.getpid())], check=True,
                       capture_output=True, timeout=600)
        self.instrumenting = on

    def start(self) -> None:
        if not self.instrumenting:
            self._instrument(True)
        torch._C._valgrind_toggle()

    def stop(self) -> int:
        """The instructions since :meth:`start`."""
        torch._C._valgrind_toggle_and_dump_stats()
        self._dumps += 1
        path = Path(f"{self._prefix}.{self._dumps}")
        total = dump_total(path)
        path.unlink()
        return total

    def finish(self) -> None:
        """Instrumentation off: what follows the timed window runs at nearly native speed again."""
        if self.instrumenting:
            self._instrument(False)
