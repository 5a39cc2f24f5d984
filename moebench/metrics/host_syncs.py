"""Host syncs: Python-level torch calls that make the host wait for the device (or whose output
shape depends on device data), recognised as a :class:`~torch.overrides.TorchFunctionMode` sees them.

One home for the list: :func:`moebench.testing.forbid_host_sync` raises on them (how CPU tests prove
a path sync-free), :class:`CountHostSyncs` counts them (the record's ``host_syncs_per_step``, taken in
one untimed step). Syncs inside C++ ops are invisible here; on CUDA,
``torch.cuda.set_sync_debug_mode`` catches those.
"""

from __future__ import annotations

import sys
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

_SYNCING = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__,
    torch.Tensor.nonzero, torch.nonzero, torch.Tensor.unique, torch.unique, torch.masked_select,
    torch.Tensor.masked_select, torch.bincount, torch.Tensor.bincount, torch.Tensor.__int__,
    torch.Tensor.__float__, torch.Tensor.__index__, torch.repeat_interleave,
}


def _has_bool_tensor(items) -> bool:
    for item in items:
        if isinstance(item, torch.Tensor) and item.dtype == torch.bool:
            return True
        if isinstance(item, (tuple, list)) and _has_bool_tensor(item):
            return True
    return False


def sync_reason(func, args: tuple, kwargs: dict) -> str | None:
    """Why calling ``func(*args, **kwargs)`` waits on the device, or None when it does not."""
    if func in _SYNCING:
        return f"{getattr(func, '__qualname__', func)} waits on the device"
    if func is torch.where and len(args) + len(kwargs) == 1:
        return "torch.where(cond) is nonzero(): it waits on the device"
    if func is torch.Tensor.__getitem__ and _has_bool_tensor(args[1:]):
        return "boolean-mask indexing waits on the device"
    return None


def _call_site() -> str:
    """``module.function`` of the innermost moebench frame calling into torch (or ``outside moebench``)."""
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith("moebench.") and module != __name__:
            return f"{module}.{frame.f_code.co_name}"
        frame = frame.f_back
    return "outside moebench"


class CountHostSyncs(TorchFunctionMode):
    """Counts the host syncs of the code run inside it: ``total``, and ``by_site``
    (``"moebench.kernels.expert_backends.looped: tolist"``: the moebench function that made the call,
    and the call)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_site: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.by_site.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if sync_reason(func, args, kwargs) is not None:
            self.by_site[f"{_call_site()}: {getattr(func, '__name__', func)}"] += 1
        return func(*args, **kwargs)
