"""Copies between host and device that the host does not wait for: values and layout (CPU here; the GPU
tests of the overlapped decode cover pinned memory and events)."""

from __future__ import annotations

import pytest
import torch

from srt.forward.host_device import DeviceToHost, fill_at, host_to_device


def test_host_to_device_splits_one_copy_into_the_lists() -> None:
    tensors = host_to_device([[1, 2, 3], [], [7], [4, 5]], torch.device("cpu"))
    assert [t.tolist() for t in tensors] == [[1, 2, 3], [], [7], [4, 5]]
    assert all(t.dtype == torch.int64 for t in tensors)
    assert tensors[0].untyped_storage().data_ptr() == tensors[3].untyped_storage().data_ptr()  # one buffer
    # each starts 16-byte aligned (Triton specialises kernels on pointer alignment)
    assert all(t.data_ptr() % 16 == 0 for t in tensors)


def test_host_to_device_of_empty_lists() -> None:
    assert [t.tolist() for t in host_to_device([[], []], torch.device("cpu"))] == [[], []]
    assert host_to_device([], torch.device("cpu")) == []


def test_host_to_device_of_floats_keeps_values_and_alignment() -> None:
    tensors = host_to_device([[0.5], [1.0, -2.25, 3.0]], torch.device("cpu"), dtype=torch.float32)
    assert [t.tolist() for t in tensors] == [[0.5], [1.0, -2.25, 3.0]]
    assert all(t.dtype == torch.float32 and t.data_ptr() % 16 == 0 for t in tensors)


def test_fill_at_sets_the_indexed_entries_only() -> None:
    table = torch.arange(12).reshape(3, 4)
    fill_at(table, (torch.tensor([0, 2]), torch.tensor([1, 3])), 0)
    assert table.tolist() == [[0, 0, 2, 3], [4, 5, 6, 7], [8, 9, 10, 0]]
    mask = torch.zeros(5, dtype=torch.bool)
    fill_at(mask, (torch.tensor([1, 4]),), True)
    assert mask.tolist() == [False, True, False, False, True]


def test_device_to_host_keeps_the_values_of_when_it_started() -> None:
    """The copy sees the tensor as it was when queued, not a later overwrite (a graph's output buffer)."""
    ids = torch.tensor([3, 1, 4])
    copy = DeviceToHost([ids])
    ids.fill_(0)
    assert copy.get()[0].tolist() == [3, 1, 4]


@pytest.mark.gpu
def test_on_cuda_copies_keep_stream_order() -> None:
    device = torch.device("cuda")
    (ids,) = host_to_device([[3, 1, 4]], device)
    assert ids.is_cuda and ids.tolist() == [3, 1, 4]
    busy = torch.randn(4096, 4096, device=device)
    for _ in range(20):
        busy = busy @ busy / 64  # keeps the stream busy so the copy below is still queued when ids change
    ids.add_(busy[:3, 0].long() * 0)  # the device writes ids after the work above
    copy = DeviceToHost([ids])
    ids.fill_(0)  # queued after the copy: the copy sees [3, 1, 4]
    assert copy.get()[0].tolist() == [3, 1, 4]
