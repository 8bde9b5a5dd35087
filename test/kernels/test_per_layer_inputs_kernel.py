"""kernels/per_layer_inputs.py: the model's per-layer inputs in one kernel against the torch ops."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import DEVICE, EPS, random_weight
from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

from srt.kernels.per_layer_inputs import combine_per_layer_inputs, combine_per_layer_inputs_reference
from srt.layers.embedding import ScaledEmbedding

TOKENS, LAYERS, PLE_DIM, VOCAB = 5, 3, 32, 50


def inputs(dtype: torch.dtype) -> tuple:
    """(projected, its scale, norm weight, eps, table, table scale, ids) as the model passes them."""
    generator = torch.Generator().manual_seed(3)
    table = torch.randn(VOCAB, LAYERS * PLE_DIM, generator=generator).to(DEVICE, dtype)
    weight = random_weight(PLE_DIM, generator).to(DEVICE, dtype)
    projected = (20 * torch.randn(TOKENS, LAYERS * PLE_DIM, generator=generator)).to(DEVICE, dtype)
    ids = torch.tensor([0, 49, 7, 7, 13], device=DEVICE)
    return projected, 64**-0.5, weight, EPS, table, PLE_DIM**0.5, ids


def test_reference_is_the_models_torch_ops() -> None:
    """(RMSNorm(projected * scale) + scaled table rows) / sqrt(2), per layer slice, as transformers computes it."""
    projected, scale, weight, eps, table, table_scale, ids = inputs(torch.float32)
    norm = Gemma4RMSNorm(PLE_DIM, eps=eps).to(DEVICE)
    embedding = ScaledEmbedding(VOCAB, LAYERS * PLE_DIM, table_scale).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(weight)
        embedding.weight.copy_(table)
        normed = norm((projected * scale).view(TOKENS, LAYERS, PLE_DIM))
        expected = (normed + embedding(ids).view(TOKENS, LAYERS, PLE_DIM)) * 2.0**-0.5
    got = combine_per_layer_inputs_reference(projected, scale, weight, eps, table, table_scale, ids)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_the_reference(dtype: torch.dtype) -> None:
    args = inputs(dtype)
    want = combine_per_layer_inputs(*args, use_triton=False)
    got = combine_per_layer_inputs(*args, use_triton=True)
    assert torch.equal(want, combine_per_layer_inputs_reference(*args))
    assert got.shape == (TOKENS, LAYERS, PLE_DIM) and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # the norm's 1/sqrt vs pow(-0.5) can move a rounded value by an ulp, which the sum carries
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-7)
        assert (got == want).float().mean() > 0.9
