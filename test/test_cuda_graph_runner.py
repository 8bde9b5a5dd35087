"""Padded steps of the CUDA-graph runners give the logits of the plain forward.

On CPU the runners run their padded steps eagerly (`capture_cuda_graphs(use_graphs=False)`): the same static
buffers, padding rows and decode-shaped batches the captured graphs replay, so CI covers everything but the
capture itself. The GPU tests at the bottom capture real graphs and compare greedy outputs with eager runs.
"""

from __future__ import annotations

import pytest
import torch
from test_yoco import SCENARIOS, Driver, chunked_prefill, different_lengths, prompt, relative_error

from srt.layers.moe.experts import Experts
from srt.managers.inprocess import run_to_completion
from srt.managers.io_struct import TokenizedGenerateReq
from srt.managers.scheduler import Scheduler
from srt.model_executor.captured_steps import CapturedSteps, default_batch_sizes
from srt.model_executor.model_runner import ModelRunner
from srt.model_executor.static_batch import generate_greedy
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs

# padding changes matmul shapes, so BLAS may sum in another order: the fp32 bound of the YOCO tests
FP32_REL_TOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny matmuls run faster on one thread


def build_runner(path, padded_steps: bool, **overrides) -> ModelRunner:
    args = dict(model_path=str(path), device="cpu", dtype="float32", max_running_requests=4) | overrides
    runner = ModelRunner(ServerArgs(**args))
    if padded_steps:
        runner.capture_cuda_graphs(use_graphs=False)
    return runner


def spy_on_steps(steps: CapturedSteps, calls: list[int]) -> None:
    """Record the padded batch size of every step the runner runs."""
    run = steps.run
    steps.run = lambda batch_size: calls.append(batch_size) or run(batch_size)


def test_default_batch_sizes() -> None:
    assert default_batch_sizes(1) == [1]
    assert default_batch_sizes(4) == [1, 2, 4]
    assert default_batch_sizes(5) == [1, 2, 4, 5]
    assert default_batch_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert default_batch_sizes(42) == [1, 2, 4, 8, 16, 24, 32, 40, 42]


@pytest.mark.parametrize("variant", ["tiny-gemma-4-E2B-it", "tiny-gemma-4-E4B-it"])
@pytest.mark.parametrize("scenario", list(SCENARIOS), ids=lambda f: f.__name__)
def test_padded_steps_match_the_plain_forward(tiny_checkpoint, variant: str, scenario) -> None:
    """Decode and YOCO's shared layers through padded static buffers: same tokens, same logits (prefills run
    eagerly here, so that they take the shared-layer graphs; `test_extend_graphs.py` covers their own graphs)."""
    path = tiny_checkpoint(variant)
    padded = Driver(build_runner(path, True, cuda_graph_max_tokens=0))
    plain = Driver(build_runner(path, False))
    decode_calls: list[int] = []
    shared_calls: list[int] = []
    spy_on_steps(padded.runner.decode_graphs.steps, decode_calls)
    spy_on_steps(padded.runner.model.model.shared_layer_graphs.steps, shared_calls)
    vocab = plain.runner.model_config.vocab_size

    assert scenario(padded, vocab) == scenario(plain, vocab)

    for step, (a, b) in enumerate(zip(padded.outputs, plain.outputs, strict=True)):
        assert a.logits.shape == b.logits.shape
        if len(b.logits):
            assert relative_error(a.logits, b.logits) < FP32_REL_TOL, f"forward {step}"
    # every decode ran padded; prefills ran the shared layers padded unless a request had several logits rows
    expected = {
        different_lengths: ([4, 4, 4], [4]),
        chunked_prefill: ([2], [1, 1, 2]),
    }
    if scenario in expected:
        assert (decode_calls, shared_calls) == expected[scenario]
    padded.close()
    plain.close()


@pytest.mark.parametrize("variant", ["tiny-gemma-4-26B-A4B-it", "tiny-gemma-4-31B-it"])
def test_padded_decode_without_kv_sharing(tiny_checkpoint, variant: str) -> None:
    path = tiny_checkpoint(variant)
    padded, plain = Driver(build_runner(path, True)), Driver(build_runner(path, False))
    assert padded.runner.model.model.shared_layer_graphs is None
    vocab = plain.runner.model_config.vocab_size
    assert different_lengths(padded, vocab) == different_lengths(plain, vocab)
    for a, b in zip(padded.outputs, plain.outputs, strict=True):
        assert relative_error(a.logits, b.logits) < FP32_REL_TOL
    padded.close()
    plain.close()


def test_padded_steps_with_the_triton_backend(tiny_checkpoint) -> None:
    """The Triton kernels (interpreted on CPU) read the padding row and slot like the GPU graphs do."""
    path = tiny_checkpoint("tiny-gemma-4-E2B-it")
    padded = Driver(build_runner(path, True, attention_backend="triton"))
    plain = Driver(build_runner(path, False))
    vocab = plain.runner.model_config.vocab_size
    assert different_lengths(padded, vocab) == different_lengths(plain, vocab)
    for a, b in zip(padded.outputs, plain.outputs, strict=True):
        assert relative_error(a.logits, b.logits) < FP32_REL_TOL
    padded.close()
    plain.close()


def test_batches_larger_than_the_largest_size_run_eagerly(tiny_checkpoint) -> None:
    path = tiny_checkpoint("tiny-gemma-4-E4B-it")
    runner = build_runner(path, True, max_running_requests=8, cuda_graph_max_bs=2)
    plain = build_runner(path, False, max_running_requests=8)
    calls: list[int] = []
    spy_on_steps(runner.decode_graphs.steps, calls)
    vocab = runner.model_config.vocab_size
    prompts = [prompt(vocab, n, seed) for seed, n in enumerate([3, 9, 17])]
    ours = generate_greedy(runner, prompts, 3)
    assert ours.output_ids == generate_greedy(plain, prompts, 3).output_ids
    assert calls == []  # 3 rows > 2: eager
    generate_greedy(runner, prompts[:2], 3)
    assert calls == [2, 2]


@pytest.mark.parametrize("padded_steps", [True, False])
def test_overlapped_decode_gives_the_same_outputs(tiny_checkpoint, padded_steps: bool) -> None:
    """Decode steps fed their input ids from the device, read one step late, change nothing."""
    runner = build_runner(tiny_checkpoint("tiny-gemma-4-E4B-it"), padded_steps)
    vocab = runner.model_config.vocab_size
    prompts = [prompt(vocab, n, seed) for seed, n in enumerate([3, 9, 17])]
    overlapped = generate_greedy(runner, prompts, 6, overlap=True)
    serial = generate_greedy(runner, prompts, 6, overlap=False)
    assert overlapped.output_ids == serial.output_ids
    assert len(overlapped.step_seconds) == len(overlapped.step_logits) == 6
    for a, b in zip(overlapped.step_logits, serial.step_logits, strict=True):
        assert torch.equal(a, b)
    allocator = runner.token_allocator
    allocator.check_integrity()
    runner.req_to_token_pool.check_integrity()
    assert runner.req_to_token_pool.in_use() == 0
    assert allocator.full.available() == allocator.full_size and allocator.swa.available() == allocator.swa_size


def test_scheduler_with_padded_steps_matches_one_at_a_time(tiny_checkpoint) -> None:
    """Requests joining and leaving the decode batch change its padded size; outputs stay each request's own."""
    args = ServerArgs(model_path=str(tiny_checkpoint("tiny-gemma-4-E4B-it")), device="cpu", dtype="float32")
    args.max_running_requests = 4
    scheduler = Scheduler(args)
    scheduler.runner.capture_cuda_graphs(use_graphs=False)
    calls: list[int] = []
    spy_on_steps(scheduler.runner.decode_graphs.steps, calls)
    lengths = [6, 2, 9, 4, 7]
    greedy = dict(temperature=0.0, ignore_eos=True)
    requests = [
        TokenizedGenerateReq(f"r{i}", prompt(1024, n, i), SamplingParams(max_new_tokens=m, **greedy))
        for i, (n, m) in enumerate(zip([5, 23, 41, 12, 7], lengths, strict=True))
    ]
    together = run_to_completion(scheduler, requests)
    alone = {req.rid: run_to_completion(scheduler, [req])[req.rid].output_ids for req in requests}
    assert {rid: result.output_ids for rid, result in together.items()} == alone
    assert [len(ids) for ids in alone.values()] == lengths
    assert {1, 2, 4} <= set(calls)
    scheduler.check_integrity()
    assert scheduler.req_to_token_pool.in_use() == 0


# ---- GPU: real graphs ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(
    "variant", ["tiny-gemma-4-E2B-it", "tiny-gemma-4-E4B-it", "tiny-gemma-4-26B-A4B-it", "tiny-gemma-4-31B-it"]
)
def test_cuda_graphs_give_the_eager_greedy_outputs(tiny_checkpoint, variant: str) -> None:
    path = tiny_checkpoint(variant)
    # the pools hold the whole static batch (26B-A4B's default SWA ratio 0.15 would not)
    common = dict(
        model_path=str(path),
        device="cuda",
        # float32: in bf16 a tiny random model meets near-tied logits (and MoE routing) within a few steps,
        # where any change of kernel or summation order may flip the greedy token
        dtype="float32",
        max_running_requests=16,
        max_total_tokens=8192,
        swa_full_tokens_ratio=1.0,
    )
    graphs = ModelRunner(ServerArgs(**common))
    eager = ModelRunner(ServerArgs(**common, disable_cuda_graph=True))
    assert graphs.decode_graphs is not None and graphs.decode_graphs.steps.use_graphs
    assert eager.decode_graphs is None
    for module in eager.model.modules():
        if isinstance(module, Experts):
            module.backend = "triton"  # what the captured graphs run; eager would take grouped_mm at few rows
    vocab = graphs.model_config.vocab_size
    for batch in (1, 3, 16):
        prompts = [prompt(vocab, 5 + 11 * i, i) for i in range(batch)]
        ours, reference = generate_greedy(graphs, prompts, 12), generate_greedy(eager, prompts, 12)
        assert ours.output_ids == reference.output_ids, f"batch {batch}"
        for a, b in zip(ours.step_logits, reference.step_logits, strict=True):
            assert relative_error(a, b) < 1e-3
    del graphs, eager
    torch.cuda.empty_cache()


@pytest.mark.gpu
def test_overlapped_decode_under_cuda_graphs_gives_the_same_outputs(tiny_checkpoint) -> None:
    """Replays fed by the previous replay's ids on the device, read one step late: the same tokens and logits
    as steps read back before the next launch."""
    common = dict(model_path=str(tiny_checkpoint("tiny-gemma-4-E4B-it")), device="cuda", dtype="float32")
    runner = ModelRunner(ServerArgs(**common, max_running_requests=16, max_total_tokens=8192))
    assert runner.decode_graphs is not None and runner.decode_graphs.steps.use_graphs
    vocab = runner.model_config.vocab_size
    for batch in (1, 3, 16):
        prompts = [prompt(vocab, 5 + 11 * i, i) for i in range(batch)]
        overlapped = generate_greedy(runner, prompts, 12, overlap=True)
        serial = generate_greedy(runner, prompts, 12, overlap=False)
        assert overlapped.output_ids == serial.output_ids, f"batch {batch}"
        for a, b in zip(overlapped.step_logits, serial.step_logits, strict=True):
            assert torch.equal(a, b)
    runner.token_allocator.check_integrity()
    del runner
    torch.cuda.empty_cache()
