"""Copies between the host and the device that the host does not wait for.

A decode step is prepared while the step before it runs on the GPU (the overlap schedule): nothing on that
path may wait for the device. A plain `torch.tensor(values, device="cuda")` copies from pageable memory and
waits; `host_to_device` copies from pinned memory instead. `DeviceToHost` starts a copy of a step's outputs to
pinned memory and reads them later, after the next step is launched.
"""

from __future__ import annotations

import array

import torch

ALIGN_BYTES = 16  # each list starts 16-byte aligned in the shared buffer
ARRAY_TYPECODES = {torch.int64: "q", torch.int32: "i", torch.float32: "f"}


def host_to_device(
    lists: list[list[int]] | list[list[float]], device: torch.device | str, dtype: torch.dtype = torch.int64
) -> list[torch.Tensor]:
    """`dtype` (int64, int32 or float32) tensors of `lists` on `device`, in one copy (views of one buffer).

    Each view starts 16-byte aligned, as a tensor of its own would: Triton specialises kernels on the alignment
    of pointer arguments, and views at arbitrary offsets would compile new variants as batch sizes change.
    """
    # an array, not a list: torch.tensor(list) converts ~1 us per 20 values, which an 8k prompt's step
    # (positions and ids, ~16k values) paid on the host while the GPU waited; the array converts 4x faster
    typecode = ARRAY_TYPECODES[dtype]
    align = ALIGN_BYTES // dtype.itemsize
    starts, flat = [], array.array(typecode)
    for values in lists:
        flat.extend([0] * (-len(flat) % align))
        starts.append(len(flat))
        flat.extend(values)
    pinned = torch.device(device).type == "cuda"
    host = torch.empty(len(flat), dtype=dtype, pin_memory=pinned)
    if flat:
        host.copy_(torch.frombuffer(flat, dtype=dtype))
    # the caching host allocator keeps the pinned block until the copy has run
    whole = host.to(device, non_blocking=pinned)
    return [whole[start : start + len(values)] for start, values in zip(starts, lists, strict=True)]


def fill_at(tensor: torch.Tensor, indices: tuple[torch.Tensor, ...], value: float | bool) -> None:
    """tensor[indices] = value without waiting for the device: `tensor[i] = 0` on a GPU copies the Python
    scalar from pageable host memory, which waits for everything queued on the stream first."""
    tensor.index_put_(indices, torch.full((), value, dtype=tensor.dtype, device=tensor.device))


class DeviceToHost:
    """A copy of device tensors to the host, started now and read by `get()` (which waits for it only).

    The copies are queued on the current stream behind the work that produces the tensors, so they see its
    results, and ahead of later work that may overwrite them (a CUDA graph's output buffers).
    """

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._event = None
        if tensors and tensors[0].is_cuda:
            self._copies = [t.to("cpu", non_blocking=True) for t in tensors]  # pinned destinations
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._copies = [t.clone() for t in tensors]

    def get(self) -> list[torch.Tensor]:
        if self._event is not None:
            self._event.synchronize()
        return self._copies
