"""How a training process ends: without the interpreter's finalisation, once its work is recorded.

Two processes of ``moebench train`` leave this way. The local leader, once its ranks are gone:
in-process torchrun spends seconds in finalisation (garbage-collecting its store and agent), a
leader that would outlive its ranks, and its point, by that long. A rank, once its process
group is torn down and its record written: with gloo the interpreter's C++ static destructors
intermittently abort ("terminate called without an active exception"), which would turn a
finished, recorded run into a failed launch.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def leave(code: int) -> NoReturn:
    """Flush stdout and stderr, then end this process with ``code`` and no finalisation."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
