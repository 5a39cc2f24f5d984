"""Byte widths the planner uses for each precision mode, mirroring how moebench trains.

moebench keeps parameters in fp32 (they are the master weights) and computes under
autocast, so in ``bf16`` mode matmul inputs and outputs are bf16 while the residual
stream, norms and parameters stay fp32. The ``fp8`` / ``mxfp8`` modes are bf16 plus
quantized expert GEMMs (:mod:`moebench.kernels.quantized`): the forward expert GEMMs run on
E4M3 operands (``fp8``: one scale per row/column; ``mxfp8``: one E8M0 scale per 32
elements), the backward GEMMs in bf16 on the saved bf16 operands. Tokens are quantized
for the dispatch in ``mxfp8`` mode (E4M3 rows + E8M0 scales on the wire, forward only); every
other EP transfer carries compute-dtype rows.
"""

from __future__ import annotations

from dataclasses import dataclass

from moebench.config import Config
from moebench.plan.devices import Device

MX_BLOCK = 32  # elements sharing one E8M0 scale byte in MXFP8


@dataclass(frozen=True)
class Precision:
    mode: str  # resolved: fp32 | bf16 | fp8 | mxfp8
    compute_bytes: int  # matmul operands/outputs under autocast (4 in fp32 mode)

    @property
    def mixed(self) -> bool:
        """Autocast is on: matmul inputs are cast copies, separate from the fp32 tensors."""
        return self.compute_bytes != 4

    @property
    def quantized(self) -> bool:
        return self.mode in ("fp8", "mxfp8")

    @property
    def quant_bytes(self) -> float:
        """Bytes per quantized element, its share of the scales included (per-row fp8 scales
        are one per thousands of elements and left out)."""
        return 1 + 1 / MX_BLOCK if self.mode == "mxfp8" else 1.0

    def native_on(self, device: Device) -> bool:
        """Whether the device runs this mode's expert GEMMs on fp8 tensor cores."""
        if self.mode == "mxfp8":
            return device.mxfp8_native
        return self.mode == "fp8"  # every planned device (SM90+) has fp8 tensor cores


def resolve_precision(cfg: Config, on_gpu: bool) -> Precision:
    """``auto`` is bf16 on GPU and fp32 on CPU, as the trainer resolves it."""
    mode = cfg.precision.mode
    if mode == "auto":
        mode = "bf16" if on_gpu else "fp32"
    return Precision(mode=mode, compute_bytes=4 if mode == "fp32" else 2)
