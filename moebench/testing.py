"""Test helpers shipped with the package (used by moebench's tests and usable by others)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

# Calls that make the host wait for the device (or have a data-dependent output shape).
_SYNCING = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__,
    torch.Tensor.nonzero, torch.nonzero, torch.Tensor.unique, torch.unique, torch.masked_select,
    torch.Tensor.masked_select, torch.bincount, torch.Tensor.bincount, torch.Tensor.__int__,
    torch.Tensor.__float__, torch.Tensor.__index__, torch.repeat_interleave,
}


class HostSyncError(RuntimeError):
    pass


class _ForbidHostSync(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SYNCING:
            raise HostSyncError(f"{getattr(func, '__qualname__', func)} waits on the device")
        if func is torch.where and len(args) + len(kwargs) == 1:
            raise HostSyncError("torch.where(cond) is nonzero(): it waits on the device")
        if func is torch.Tensor.__getitem__ and _has_bool_tensor(args[1:]):
            raise HostSyncError("boolean-mask indexing waits on the device")
        return func(*args, **kwargs)


def _has_bool_tensor(items) -> bool:
    for item in items:
        if isinstance(item, torch.Tensor) and item.dtype == torch.bool:
            return True
        if isinstance(item, (tuple, list)) and _has_bool_tensor(item):
            return True
    return False


@contextlib.contextmanager
def forbid_host_sync() -> Iterator[None]:
    """Raise :class:`HostSyncError` on any Python-level call that would sync with the device.

    On CPU nothing ever waits, so this is how CPU tests prove a code path is sync-free; on
    CUDA, combine it with ``torch.cuda.set_sync_debug_mode("error")``, which also catches
    syncs inside C++ ops.
    """
    with _ForbidHostSync():
        yield
