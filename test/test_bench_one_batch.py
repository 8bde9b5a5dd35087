"""`bench/bench_one_batch.py --correctness-test` as a user runs it: a subprocess writing JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from transformers import Gemma4ForCausalLM as ReferenceModel

REPO = Path(__file__).resolve().parents[1]


def test_correctness_mode_writes_greedy_outputs_of_the_batch(tiny_checkpoint, tmp_path) -> None:
    path = tiny_checkpoint("tiny-gemma-4-E2B-it")
    prompts = [[2, 17, 300, 45], [2] + list(range(100, 130)), [2, 9]]
    prompt_file, out_file = tmp_path / "prompts.json", tmp_path / "out.json"
    prompt_file.write_text(json.dumps(prompts))
    command = [
        sys.executable, str(REPO / "bench" / "bench_one_batch.py"), "--model-path", str(path), "--device", "cpu",
        "--dtype", "float32", "--correctness-test", "--prompt-ids-file", str(prompt_file),
        "--max-new-tokens", "6", "--json", str(out_file),
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, timeout=300)
    outputs = json.loads(out_file.read_text())["output_ids"]

    reference = ReferenceModel.from_pretrained(path, attn_implementation="eager").eval()
    for prompt, output in zip(prompts, outputs):
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None)[
            0, len(prompt) :
        ].tolist()
        assert output == expected
