"""Count what would make the host wait for the GPU, on a CPU run: each call site of a device read-back.

On a GPU the host waits for the stream (everything queued so far) when it reads a device tensor
(`.tolist()`, `.item()`, `bool()`, `.cpu()`), indexes one with a boolean mask (the result's length is
read back) or a Python list, assigns it a Python scalar (`t[i] = 0`: list and scalar are copied from pageable
memory), copies a host list with `torch.tensor(..., device=...)` (a pageable copy that synchronises the
stream) or waits for a `DeviceToHost` copy. On the CPU none of these waits, so a CPU run counts them instead:
tensors the host made (`torch.tensor` without a device) and the copies `DeviceToHost.get` returns are host
tensors, reading them costs nothing; every other read is counted by its call site. The model's forwards
(`CapturedSteps.run`, graph replays on a GPU) are not counted: only the host code around them.
"""

from __future__ import annotations

import sys
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from srt.forward.host_device import DeviceToHost
from srt.model_executor.captured_steps import CapturedSteps

REPO = Path(__file__).resolve().parents[1]
READS = ("tolist", "item", "__bool__", "__int__", "__float__", "cpu", "numpy", "nonzero")


class DeviceReads:
    """Call sites of device read-backs while `counting()` is active: `sites` maps "file:line (kind)" to a count."""

    def __init__(self) -> None:
        self.sites: Counter[str] = Counter()
        self._host: set[int] = set()  # ids of live host tensors (a WeakSet would compare tensors with ==)
        self._paused = 0

    @property
    def total(self) -> int:
        return sum(self.sites.values())

    def is_host(self, tensor: torch.Tensor) -> bool:
        return id(tensor) in self._host or (tensor._base is not None and id(tensor._base) in self._host)

    def _add_host(self, tensor: torch.Tensor) -> None:
        self._host.add(id(tensor))
        weakref.finalize(tensor, self._host.discard, id(tensor))

    def _record(self, kind: str) -> None:
        if self._paused:
            return
        frame = sys._getframe(2)
        while frame is not None and not frame.f_code.co_filename.startswith(str(REPO)):
            frame = frame.f_back  # past torch's own frames (Tensor.__iter__, ...)
        where = "?" if frame is None else f"{Path(frame.f_code.co_filename).relative_to(REPO)}:{frame.f_lineno}"
        self.sites[f"{where} ({kind})"] += 1

    @contextmanager
    def counting(self) -> Iterator[DeviceReads]:
        patches: list[tuple[object, str, object]] = []

        def patch(owner: object, name: str, make: Callable[[Callable], Callable]) -> None:
            original = getattr(owner, name)
            patches.append((owner, name, original))
            setattr(owner, name, make(original))

        for name in READS:
            patch(torch.Tensor, name, lambda original, name=name: self._read(original, name))
        patch(torch.Tensor, "__getitem__", lambda original: self._indexing(original, "mask index"))
        patch(torch.Tensor, "__setitem__", lambda original: self._indexing(original, "mask assign"))
        patch(torch, "tensor", self._new_tensor)
        patch(torch.Tensor, "to", self._to_device)
        patch(DeviceToHost, "get", self._copies)
        patch(CapturedSteps, "run", self._not_counted)
        try:
            yield self
        finally:
            for owner, name, original in reversed(patches):
                setattr(owner, name, original)

    def _read(self, original: Callable, kind: str) -> Callable:
        def read(tensor, *args, **kwargs):
            if not self.is_host(tensor):
                self._record(kind)
            return original(tensor, *args, **kwargs)

        return read

    def _indexing(self, original: Callable, kind: str) -> Callable:
        def index(tensor, key, *args):
            keys = key if isinstance(key, tuple) else (key,)
            if not self.is_host(tensor):
                if any(isinstance(k, torch.Tensor) and k.dtype == torch.bool for k in keys):
                    self._record(kind)
                elif any(isinstance(k, list) for k in keys):  # copied from pageable memory, which waits
                    self._record(f"{kind.split()[1]} by a list")
                elif args and isinstance(args[0], (bool, int, float)):  # the same for the scalar
                    self._record("scalar assign")
            self._paused += 1
            try:
                return original(tensor, key, *args)
            finally:
                self._paused -= 1

        return index

    def _new_tensor(self, original: Callable) -> Callable:
        def new(*args, **kwargs):
            if kwargs.get("device") is not None:
                self._record("blocking copy to the device")
                return original(*args, **kwargs)
            tensor = original(*args, **kwargs)
            self._add_host(tensor)
            return tensor

        return new

    def _to_device(self, original: Callable) -> Callable:
        def to(tensor, *args, **kwargs):
            out = original(tensor, *args, **kwargs)
            to_device = any(isinstance(a, torch.device) for a in (*args, kwargs.get("device")))
            # on the CPU a copy to "the device" is the host tensor itself; on a GPU it is a device tensor
            return out.detach() if to_device and out is tensor and self.is_host(tensor) else out

        return to

    def _copies(self, original: Callable) -> Callable:
        def get(copy):
            self._record("wait for DeviceToHost")
            tensors = original(copy)
            for tensor in tensors:
                self._add_host(tensor)
            return tensors

        return get

    def _not_counted(self, original: Callable) -> Callable:
        def run(steps, *args, **kwargs):
            self._paused += 1
            try:
                return original(steps, *args, **kwargs)
            finally:
                self._paused -= 1

        return run
