"""kernels/logits.py: the one-pass softcap and its argmax against torch (Triton's interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import DEVICE

from srt.kernels.logits import softcap_logits, softcap_logits_reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcap_logits_matches_torch(dtype: torch.dtype) -> None:
    """The one-pass softcap (tanh from exp, Taylor series near 0) against torch.tanh, over small to huge logits."""
    logits = torch.cat([torch.randn(3, 1000) * scale for scale in (1e-3, 1.0, 30.0, 1e4)], dim=1).to(DEVICE, dtype)
    got = softcap_logits(logits, 30.0, use_triton=True)
    expected = softcap_logits_reference(logits, 30.0)
    assert got.logits.dtype == torch.float32 and got.greedy_ids is None
    torch.testing.assert_close(got.logits, expected, rtol=2e-6, atol=2e-6)


def test_softcap_argmax_is_torch_argmax_of_the_softcapped_logits() -> None:
    """The argmax found by the softcap pass: a vocabulary of two blocks and a bit (4096 each), ties at the row's
    maximum in one block and across blocks (the lowest id wins, as in torch.argmax), a NaN (it wins, as in
    torch.argmax), a row of equal values, and logits large enough that distinct raw values cap to one."""
    vocab = 2 * 4096 + 10
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(0)) * 3
    logits[1, [17, 4095, 4096, 8200]] = 50.0
    logits[2, 8195] = float("nan")
    logits[2, 3] = 100.0
    logits[3] = 1.0
    logits[4, [5000, 6000]] = torch.tensor([1000.0, 2000.0])  # both cap to 30.0 in float32
    got = softcap_logits(logits.to(DEVICE), 30.0, use_triton=True, with_argmax=True)
    torch.testing.assert_close(
        got.logits.cpu(), softcap_logits_reference(logits, 30.0), rtol=2e-6, atol=2e-6, equal_nan=True
    )
    expected = torch.argmax(got.logits.cpu(), dim=-1)
    assert got.greedy_ids.dtype == torch.int64
    assert got.greedy_ids.cpu().tolist() == expected.tolist()
    assert expected[1:].tolist() == [17, 8195, 0, 5000]
