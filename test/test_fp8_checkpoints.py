"""FP8 checkpoints in the compressed-tensors format (#26, the CPU reference path): a tiny checkpoint written per
channel and in 128 x 128 blocks loads (its decoder projections kept in FP8, multiplied weight-only on CPU), and
srt on it equals transformers on the same weights dequantized (by this test's own arithmetic): greedy tokens
identical, every prompt and output logprob within 1e-4. Formats srt does not load fail with the reason."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_scheduler import greedy, make_scheduler, prompts
from transformers import Gemma4ForCausalLM as ReferenceModel

from srt.managers.inprocess import run_to_completion
from srt.model_loader.fp8 import FP8
from srt.tools.make_checkpoint import make_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


def dequantized_copy(src, dst) -> int:
    """`src` with every FP8 weight turned back into float32 (scale per row, or per 128 x 128 tile) and no
    quantization_config; returns how many weights were FP8."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    per_channel = config.pop("quantization_config")["config_groups"]["group_0"]["weights"]["strategy"] == "channel"
    (dst / "config.json").write_text(json.dumps(config))
    tensors = load_file(dst / "model.safetensors")
    quantized = [name for name, t in tensors.items() if t.dtype == FP8]
    for name in quantized:
        q, scale = tensors[name].float(), tensors.pop(f"{name}_scale").float()
        if per_channel:
            tensors[name] = q * scale
        else:
            w = torch.empty_like(q)
            for i in range(scale.shape[0]):
                for j in range(scale.shape[1]):
                    w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = (
                        q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] * scale[i, j]
                    )
            tensors[name] = w
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return len(quantized)


@pytest.mark.parametrize("variant", ["E4B", "26B-A4B"])
@pytest.mark.parametrize("scheme", ["fp8-dynamic", "fp8-block"])
def test_fp8_checkpoint_equals_transformers_on_its_dequantized_weights(tmp_path, variant, scheme) -> None:
    path = make_checkpoint(f"tiny-gemma-4-{variant}-it", tmp_path / "fp8", quantize=scheme)
    reference_path = tmp_path / "dequantized"
    assert dequantized_copy(path, reference_path) > 0
    ids = prompts(1, seed=6, low=20, high=21)[0]
    scheduler = make_scheduler(path)
    request = greedy("p", ids, max_new_tokens=6, return_logprob=True, logprob_start_len=1, top_logprobs_num=1)
    result = run_to_completion(scheduler, [request])["p"]

    reference = ReferenceModel.from_pretrained(reference_path, dtype=torch.float32, attn_implementation="eager")
    expected = reference.eval().generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert result.output_ids == expected[0, len(ids) :].tolist()
    with torch.no_grad():
        logprobs = torch.log_softmax(reference(expected).logits[0].double(), dim=-1)
    assert [lp.token_id for lp in result.input_logprobs] == ids[1:]
    for offset, lp in enumerate(result.input_logprobs):  # prompt token 1 + offset, scored by row offset
        assert lp.logprob == pytest.approx(float(logprobs[offset, ids[offset + 1]]), abs=1e-4)
    for step, lp in enumerate(result.output_logprobs):
        assert lp.logprob == pytest.approx(float(logprobs[len(ids) - 1 + step, lp.token_id]), abs=1e-4)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"quant_method": "gptq"}, "quantization method 'gptq' is not supported"),
        ({"activations_dynamic": False}, "static activation scales are not supported"),
        ({"num_bits": 4}, "only 8-bit float weights are supported"),
    ],
)
def test_unsupported_quantization_fails_with_the_reason(tmp_path, change, message) -> None:
    path = make_checkpoint("tiny-gemma-4-E4B-it", tmp_path / "fp8", quantize="fp8-dynamic")
    config = json.loads((path / "config.json").read_text())
    quant = config["quantization_config"]
    group = quant["config_groups"]["group_0"]
    if "quant_method" in change:
        quant["quant_method"] = change["quant_method"]
    if "activations_dynamic" in change:
        group["input_activations"]["dynamic"] = False
    if "num_bits" in change:
        group["weights"]["num_bits"] = change["num_bits"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        make_scheduler(path)
