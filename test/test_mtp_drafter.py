"""The Gemma 4 MTP assistant drafts what transformers' SinglePositionMultiTokenCandidateGenerator drafts.

For every variant's tiny target + tiny assistant (fp32, real checkpoints on disk): a batch of requests of
different lengths (some longer than the sliding window) is prefilled in srt, then srt drafts K tokens for all
of them at once; transformers drafts for each request alone from its own target forward. The ids must be
equal, the pools untouched by drafting (the assistant writes no KV) and intact afterwards.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import GenerationConfig
from transformers.generation.candidate_generator import SinglePositionMultiTokenCandidateGenerator

from srt.configs import presets
from srt.configs.assistant_config import AssistantConfig
from srt.configs.model_config import ModelConfig
from srt.entrypoints.launch_server import parse_args
from srt.forward.forward_batch import ForwardBatch, ForwardMode
from srt.layers.logits_processor import LogitsOutput
from srt.model_executor.model_runner import ModelRunner
from srt.server_args import ServerArgs
from srt.speculative.frozen_kv_mtp import DraftRequests

VARIANTS = ["E2B", "E4B", "26B-A4B", "31B"]
NUM_STEPS = 4
PROMPT_LENS = [5, 23, 40]  # tiny sliding window: 16


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny matmuls run faster on one thread


def prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENS]


def transformers_drafts(target_dir, assistant_dir, prompt: list[int], next_token: int) -> list[int]:
    """The oracle: the target's forward over the prompt, then the candidate generator's drafts after the prompt
    and the token the target chose next (no KV yet), as between two rounds of assisted generation."""
    target = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    assistant = transformers.AutoModelForCausalLM.from_pretrained(assistant_dir, dtype=torch.float32).eval()
    assert type(assistant).__name__ == "Gemma4AssistantForCausalLM"
    ids = torch.tensor([prompt])
    with torch.no_grad():
        outputs = target(ids, output_hidden_states=True, return_shared_kv_states=True, use_cache=False)
    config = GenerationConfig(num_assistant_tokens=NUM_STEPS, max_length=1024, pad_token_id=0)
    generator = SinglePositionMultiTokenCandidateGenerator(
        ids,
        assistant,
        target.get_input_embeddings(),
        config,
        {},
        eos_token_id=torch.tensor([-1]),  # never stop
    )
    generator.num_assistant_tokens = NUM_STEPS
    # the newest token was sampled from row len - 1, the last row with KV
    ids = torch.tensor([[*prompt, next_token]])
    candidates, _ = generator.get_candidates(
        ids, {"attention_mask": torch.ones_like(ids)}, outputs, False, len(prompt) - 1
    )
    return candidates[0, len(prompt) + 1 :].tolist()


# the reference backend for every variant; the Triton kernels (interpreted on CPU) for one
CASES = [(variant, "torch_native") for variant in VARIANTS] + [("E4B", "triton")]


@pytest.mark.parametrize(("variant", "backend"), CASES)
def test_drafts_equal_transformers_for_a_batch(variant, backend, tiny_checkpoint):
    target_dir = tiny_checkpoint(f"tiny-gemma-4-{variant}-it")
    assistant_dir = tiny_checkpoint(f"tiny-gemma-4-{variant}-it-assistant")
    args = ServerArgs(
        model_path=str(target_dir),
        device="cpu",
        dtype="float32",
        max_total_tokens=256,
        swa_full_tokens_ratio=1.0,
        attention_backend=backend,
        speculative_draft_model_path=str(assistant_dir),
        speculative_num_steps=NUM_STEPS,
    )
    assert args.speculative_algorithm == "FROZEN_KV_MTP"  # picked from the draft's config
    runner = ModelRunner(args)
    batch_prompts = prompts(runner.model_config.vocab_size)
    rows, slots, output = prefill_prompts(runner, batch_prompts)
    hidden, next_tokens = output.hidden_states.clone(), output.logits.argmax(dim=-1)
    kv_before = [t.clone() for t in (*runner.kv_pool._k.values(), *runner.kv_pool._v.values())]

    requests = DraftRequests(next_tokens, hidden, list(PROMPT_LENS), rows)
    drafts = runner.drafter.draft(requests, runner.req_to_token_pool, runner.kv_pool, runner.attn_backend)

    assert drafts.shape == (len(rows), NUM_STEPS)
    kv_after = [*runner.kv_pool._k.values(), *runner.kv_pool._v.values()]
    assert all(torch.equal(a, b) for a, b in zip(kv_before, kv_after, strict=True)), "drafting wrote KV"
    expected = [
        transformers_drafts(target_dir, assistant_dir, prompt, token)
        for prompt, token in zip(batch_prompts, next_tokens.tolist(), strict=True)
    ]
    assert drafts.tolist() == expected
    runner.token_allocator.free(slots)
    for row in rows:
        runner.req_to_token_pool.free(row)
    runner.kv_pool.check_integrity()
    runner.req_to_token_pool.check_integrity()


def prefill_prompts(runner: ModelRunner, prompts: list[list[int]]) -> tuple[list[int], torch.Tensor, LogitsOutput]:
    """(request rows, KV slots, output) of one prefill of `prompts`, each in a fresh row (a draft's starting point);
    the caller frees the rows and slots."""
    lens = [len(prompt) for prompt in prompts]
    rows = [runner.req_to_token_pool.alloc() for _ in prompts]
    slots = runner.token_allocator.alloc(sum(lens))
    starts = [sum(lens[:i]) for i in range(len(lens))]
    for row, start, n in zip(rows, starts, lens, strict=True):
        runner.req_to_token_pool.write(row, 0, slots[start : start + n])
    last_rows = [start + n - 1 for start, n in zip(starts, lens, strict=True)]
    batch = ForwardBatch.build(
        ForwardMode.EXTEND, prompts, [0] * len(rows), rows, slots, last_rows, runner.req_to_token_pool, runner.kv_pool
    )
    return rows, slots, runner.forward(batch)


def test_dummy_weights_draft_from_presets():
    runner = ModelRunner(
        ServerArgs(
            model_path="tiny-gemma-4-E4B-it",
            load_format="dummy",
            device="cpu",
            max_total_tokens=64,
            speculative_draft_model_path="tiny-gemma-4-E4B-it-assistant",
            speculative_num_steps=16,
        )
    )
    row, slots = runner.req_to_token_pool.alloc(), runner.token_allocator.alloc(3)
    runner.req_to_token_pool.write(row, 0, slots)
    hidden = torch.randn(1, runner.model_config.hidden_size)
    requests = DraftRequests(torch.tensor([5]), hidden, [3], [row])
    drafts = runner.drafter.draft(requests, runner.req_to_token_pool, runner.kv_pool, runner.attn_backend)
    assert drafts.shape == (1, 16) and 0 <= int(drafts.min()) and int(drafts.max()) < runner.model_config.vocab_size
    runner.kv_pool.check_integrity()


def test_published_pairs_fit_and_assistant_layers_read_the_last_owners():
    for name in presets.PUBLISHED:
        target = ModelConfig.from_preset(name)
        assistant = AssistantConfig.for_target(presets.assistant_config(f"{name}-assistant"), target)
        owners = [spec.kv_owner for spec in assistant.layers]
        owning = [spec for spec in target.layers if spec.owns_kv]
        last_sliding = max(s.layer_id for s in owning if s.is_sliding)
        last_full = max(s.layer_id for s in owning if not s.is_sliding)
        assert owners == [last_sliding] * 3 + [last_full], name
        assert [spec.layer_id for spec in assistant.layers] == list(range(target.num_layers, target.num_layers + 4))


def test_mismatched_pair_fails_with_one_message():
    target = ModelConfig.from_preset("gemma-4-E2B-it")
    with pytest.raises(ValueError, match="does not fit the target") as error:
        AssistantConfig.for_target(presets.assistant_config("gemma-4-E4B-it-assistant"), target)
    assert "backbone_hidden_size 2560 != target hidden_size 1536" in str(error.value)
    assert "KV heads" in str(error.value)
    with pytest.raises(ValueError, match="head_dim 64 and 2 KV heads, the target's layer 11 64 and 1"):
        ModelRunner(
            ServerArgs(
                model_path="tiny-gemma-4-31B-it",
                load_format="dummy",
                device="cpu",
                max_total_tokens=64,
                speculative_draft_model_path="tiny-gemma-4-E4B-it-assistant",
            )
        )


def test_speculative_flags_and_bad_input(tiny_checkpoint):
    args = parse_args(
        ["--model", "tiny-gemma-4-E4B-it", "--load-format", "dummy"]
        + ["--speculative-draft-model-path", "tiny-gemma-4-E4B-it-assistant", "--speculative-num-steps", "5"]
    )
    assert (args.speculative_algorithm, args.speculative_num_steps) == ("FROZEN_KV_MTP", 5)
    assert (
        ServerArgs(model_path="x", speculative_draft_model_path="tiny-gemma-4-E4B-it-assistant").speculative_num_steps
        == 3
    )
    for bad in (0, 17):
        with pytest.raises(ValueError, match=r"speculative_num_steps must be in \[1, 16\]"):
            ServerArgs(
                model_path="x", speculative_draft_model_path="tiny-gemma-4-E4B-it-assistant", speculative_num_steps=bad
            )
    with pytest.raises(ValueError, match="needs speculative_draft_model_path"):
        ServerArgs(model_path="x", speculative_algorithm="FROZEN_KV_MTP")
    with pytest.raises(ValueError, match="cannot pick a speculative algorithm"):
        ServerArgs(model_path="x", speculative_draft_model_path=str(tiny_checkpoint("tiny-gemma-4-E2B-it")))
