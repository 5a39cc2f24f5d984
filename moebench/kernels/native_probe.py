"""``python -m moebench.kernels.native_probe FMT KIND DEVICE_INDEX``: the native-kernel probe in a process of its own.

Prints one JSON line, ``{"error": null}`` when the native ``FMT`` GEMMs of ``KIND`` agree with their
emulated twin on CUDA device ``DEVICE_INDEX`` (:func:`moebench.kernels.quantized.native_disagreement`),
else ``{"error": "..."}``. A device-side assert kills this process, not the run that asked
(:func:`moebench.kernels.quantized.run_probe` reads the exit code).
"""

from __future__ import annotations

import json
import sys

import torch

from moebench.kernels.quantized import native_disagreement


def main(argv: list[str]) -> int:
    fmt, kind, index = argv
    error = native_disagreement(fmt, torch.device("cuda", int(index)), kind)
    if error is None:
        torch.cuda.synchronize(int(index))  # an asynchronous device fault surfaces here, as a crash
    print(json.dumps({"error": error}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
