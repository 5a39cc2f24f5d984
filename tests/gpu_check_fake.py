"""Sections for the GPU check's orchestration test (``--plugin gpu_check_fake``): one that ends
its process as a device-side assert would, one that raises, one that outlives its budget (a hung
kernel), one that passes."""

from __future__ import annotations

import os
import sys
import time
from typing import Any


def crashes(ctx: dict[str, Any]) -> dict[str, Any]:
    sys.stderr.write("CUDA error: device-side assert triggered\n")
    sys.stderr.flush()
    os.abort()


def raises(ctx: dict[str, Any]) -> dict[str, Any]:
    raise RuntimeError("wrong answer")


def hangs(ctx: dict[str, Any]) -> dict[str, Any]:
    time.sleep(600)
    return {"ok": True}


def passes(ctx: dict[str, Any]) -> dict[str, Any]:
    return {"ok": True, "dense_seen": ctx["dense_fwd_bwd_tflops"]}


SECTIONS = [("fake_crash", crashes, 30), ("fake_raise", raises, 30), ("fake_hang", hangs, 1), ("fake_pass", passes, 30)]
