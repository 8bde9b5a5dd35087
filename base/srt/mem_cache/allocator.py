"""Token-slot allocators for the full and sliding-window KV pools.

Slot 0 of every pool is a padding slot: it is never handed out, padded rows of a batch write there, and an
unmapped sliding-window index points there, so every index a kernel sees can be read.

    full pool   [0 | 1 2 3 4 5 6 ... F]      every token of every live request has a full slot
    SWA pool    [0 | 1 2 3 ... S]            only tokens still inside some sliding window have one
    full_to_swa[full_slot] -> swa slot, or 0 once the token's SWA KV is freed
"""

from __future__ import annotations

import torch

from srt import envs
from srt.forward.host_device import fill_at


class OutOfSlotsError(RuntimeError):
    """Raised when more slots are asked for than are free (callers check `available` first)."""


class TokenSlotAllocator:
    """Free list over slots 1..size. Allocation takes from the front, freed slots go to the back."""

    def __init__(self, size: int, device: torch.device | str = "cpu") -> None:
        self.size = size
        self.device = torch.device(device)
        self._free = torch.arange(1, size + 1, dtype=torch.int64, device=self.device)

    def available(self) -> int:
        return self._free.shape[0]  # not len(): Tensor.__len__ is Python, asked several times a step

    def alloc(self, count: int) -> torch.Tensor:
        if count > self._free.shape[0]:
            raise OutOfSlotsError(f"asked for {count} KV slots, {self._free.shape[0]} free of {self.size}")
        slots, self._free = self._free[:count], self._free[count:]
        return slots

    def free(self, slots: torch.Tensor) -> None:
        if slots.shape[0]:
            self._free = torch.cat([self._free, slots.to(device=self.device, dtype=torch.int64)])

    def free_slots(self) -> torch.Tensor:
        return self._free

    def check_integrity(self) -> None:
        # tensor ops on the list's own device: the server checks pools of a million slots when it goes idle
        free = self._free
        if len(free) and not (1 <= int(free.min()) and int(free.max()) <= self.size):
            raise AssertionError(f"free slot out of range 1..{self.size}")
        if len(torch.unique(free)) != len(free):
            raise AssertionError("a slot is on the free list twice")


class SWATokenAllocator:
    """Allocates a full slot and an SWA slot per token and keeps `full_to_swa` between them."""

    def __init__(self, full_size: int, swa_size: int, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.full = TokenSlotAllocator(full_size, device)
        self.swa = TokenSlotAllocator(swa_size, device)
        self.full_to_swa = torch.zeros(full_size + 1, dtype=torch.int64, device=self.device)

    @property
    def full_size(self) -> int:
        return self.full.size

    @property
    def swa_size(self) -> int:
        return self.swa.size

    def available(self) -> int:
        """Tokens that can be allocated now (each needs one slot of each pool)."""
        return min(self.full.available(), self.swa.available())

    def alloc(self, count: int) -> torch.Tensor:
        """Full slots for `count` new tokens, each mapped to a fresh SWA slot."""
        if count > self.available():
            raise OutOfSlotsError(
                f"asked for {count} KV slots; free: full {self.full.available()}, swa {self.swa.available()}"
            )
        full_slots = self.full.alloc(count)
        self.full_to_swa[full_slots] = self.swa.alloc(count)
        return full_slots

    def free(self, full_slots: torch.Tensor, swa_from: int | None = None) -> None:
        """Free tokens entirely: their full slots and whatever SWA slots they still hold.

        `swa_from`: the caller knows that full_slots[:swa_from] hold no SWA slot and the rest all hold one (a
        request's own tokens and its `swa_freed_upto`), so no mask is read back (`free_swa`)."""
        if swa_from is None:
            self.free_swa(full_slots)
        else:
            self.free_swa(full_slots[swa_from:], all_hold_swa=True)
        self.full.free(full_slots)

    def free_whole_and_swa(self, full_slots: torch.Tensor, num_whole: int) -> None:
        """Free the first `num_whole` tokens entirely and only the SWA slots of the rest (tokens that left every
        sliding window), every one holding an SWA slot: the same free lists as `free` of the first tokens, then
        `free_swa` of the rest, in one gather and one append per pool."""
        self.free_swa(full_slots, all_hold_swa=True)
        if num_whole:
            self.full.free(full_slots[:num_whole])

    def free_swa(self, full_slots: torch.Tensor, all_hold_swa: bool = False) -> None:
        """Free the SWA slots of tokens that left every sliding window; their full slots stay.

        `all_hold_swa`: the caller knows every token still holds an SWA slot (a running request's own tokens
        at or after its `swa_freed_upto`), so the free list grows by exactly their number. Otherwise the
        unmapped ones are masked out, and the mask's count is a read-back the host waits for on a GPU.
        """
        if not full_slots.shape[0]:
            return
        swa_slots = self.full_to_swa[full_slots]
        if not all_hold_swa:
            swa_slots = swa_slots[swa_slots != 0]
        elif debug_kv_indices() and not bool((swa_slots != 0).all()):
            raise AssertionError("a token freed as holding an SWA slot holds none")
        self.swa.free(swa_slots)
        fill_at(self.full_to_swa, (full_slots,), 0)

    def translate(self, full_slots: torch.Tensor) -> torch.Tensor:
        """SWA slots of the given tokens (0, the padding slot, where freed)."""
        swa_slots = self.full_to_swa[full_slots]
        if debug_kv_indices():
            check_indices(swa_slots, self.swa.size, "swa")
        return swa_slots

    def check_integrity(self) -> None:
        self.full.check_integrity()
        self.swa.check_integrity()
        if self.full_to_swa[0] != 0:
            raise AssertionError("the padding slot is mapped to an SWA slot")
        mapped = self.full_to_swa[self.full_to_swa != 0]
        if len(torch.unique(mapped)) != len(mapped):
            raise AssertionError("two full slots map to the same SWA slot")
        if len(mapped) + self.swa.available() != self.swa.size:
            raise AssertionError(f"SWA slots: {len(mapped)} mapped + {self.swa.available()} free != {self.swa.size}")
        free_full = self.full.free_slots()
        if len(free_full) and bool((self.full_to_swa[free_full] != 0).any()):
            raise AssertionError("a free full slot still maps to an SWA slot")


def debug_kv_indices() -> bool:
    """`SRT_DEBUG_KV_INDICES=1` checks every KV index before it reaches a kernel (slow; for debugging)."""
    return envs.SRT_DEBUG_KV_INDICES.enabled()


def check_indices(indices: torch.Tensor, pool_size: int, pool_name: str) -> None:
    if len(indices) and (int(indices.min()) < 0 or int(indices.max()) > pool_size):
        raise IndexError(f"{pool_name} KV index out of range 0..{pool_size}: {indices.tolist()}")
