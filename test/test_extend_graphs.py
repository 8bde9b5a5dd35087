"""Steps captured per token count (prefills, chunks, mixed prefill + decode) give the logits of the plain forward.

On CPU the padded steps run eagerly (`capture_cuda_graphs(use_graphs=False)`): the same static buffers, padding
tokens, padding request and padded logits rows the captured graphs replay. The GPU test at the bottom captures
real graphs and compares them with eager runs.
"""

from __future__ import annotations

import pytest
import torch
from test_cuda_graph_runner import FP32_REL_TOL, build_runner, spy_on_steps
from test_mixed_batches import CHUNK
from test_scheduler import assert_idle_and_consistent, greedy, make_scheduler, prompts
from test_yoco import SCENARIOS, Driver, chunked_prefill, prompt, relative_error
from test_yoco import greedy as greedy_tokens

from srt.forward.forward_batch import ForwardMode
from srt.layers.moe.experts import Experts
from srt.managers.inprocess import run_to_completion
from srt.model_executor.extend_graphs import default_token_counts
from srt.model_executor.model_runner import ModelRunner
from srt.server_args import ServerArgs

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny matmuls run faster on one thread

VARIANTS = ["tiny-gemma-4-E2B-it", "tiny-gemma-4-E4B-it", "tiny-gemma-4-26B-A4B-it", "tiny-gemma-4-31B-it"]


def test_default_token_counts() -> None:
    assert default_token_counts(2048) == [64, 128, 256, 384, 512, 768, 1024, 1280, 1536, 1792, 2048]
    assert default_token_counts(100) == [64, 100]
    assert default_token_counts(64) == [64]
    # a chunk of 2048 prompt tokens beside a decode row of each of 64 running requests stays graphed
    assert default_token_counts(2048, 64)[-2:] == [2048, 2112]
    assert default_token_counts(16) == [16]


def assert_same_outputs(padded: Driver, plain: Driver) -> None:
    for step, (a, b) in enumerate(zip(padded.outputs, plain.outputs, strict=True)):
        assert a.logits.shape == b.logits.shape
        if len(b.logits):
            assert relative_error(a.logits, b.logits) < FP32_REL_TOL, f"forward {step}"
        assert a.yoco_skipped_rows == b.yoco_skipped_rows, f"forward {step}"


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("scenario", list(SCENARIOS), ids=lambda f: f.__name__)
def test_padded_token_steps_match_the_plain_forward(tiny_checkpoint, variant: str, scenario) -> None:
    """Prompts, a prefix hit's tails, chunks beside a decoding request: same tokens, same logits; a step with more
    logits rows than it has room for (prompt logprobs) runs eagerly."""
    path = tiny_checkpoint(variant)
    padded, plain = Driver(build_runner(path, True)), Driver(build_runner(path, False))
    calls: list[int] = []
    spy_on_steps(padded.runner.extend_graphs.steps, calls)
    vocab = plain.runner.model_config.vocab_size

    assert scenario(padded, vocab) == scenario(plain, vocab)

    assert_same_outputs(padded, plain)
    extend_forwards = {
        "different_lengths": [128],  # 69 tokens
        "prefix_hit": [64, 64],
        "chunked_prefill": [64, 64, 64],
        "prompt_logprobs": [],  # 17 and 13 logits rows > 4 (max_running_requests): eager
    }
    assert calls == extend_forwards[scenario.__name__]
    padded.close()
    plain.close()


def different_lengths_prompts(d: Driver, vocab: int) -> list[list[int]]:
    """`different_lengths` without its decode steps: its 5-, 23- and 41-token prompts in one 69-token step.

    The interpreted Triton decode kernel costs most of a padded decode step on CPU; its padded decode steps are
    `test_padded_steps_with_the_triton_backend` (test_cuda_graph_runner.py: `different_lengths` whole), and
    `chunked_prefill` here still ends with one."""
    prompts = [(name, prompt(vocab, n, seed)) for seed, (name, n) in enumerate([("a", 5), ("b", 23), ("c", 41)])]
    return [greedy_tokens(d.forward(ForwardMode.EXTEND, prompts, logits_rows=[4, 27, 68]))]


def test_padded_token_steps_with_the_triton_backend(tiny_checkpoint) -> None:
    """The Triton kernels (interpreted on CPU) read the padding tokens' request, the tile table of a padded step
    and the padded logits rows like the GPU graphs do."""
    path = tiny_checkpoint("tiny-gemma-4-E4B-it")
    small = dict(cuda_graph_max_tokens=96, max_running_requests=8)
    padded = Driver(build_runner(path, True, attention_backend="triton", **small))
    plain = Driver(build_runner(path, False, max_running_requests=8))
    calls: list[int] = []
    spy_on_steps(padded.runner.extend_graphs.steps, calls)
    vocab = plain.runner.model_config.vocab_size
    for scenario in (different_lengths_prompts, chunked_prefill):
        assert scenario(padded, vocab) == scenario(plain, vocab)
    assert calls == [96, 64, 64, 64]
    assert_same_outputs(padded, plain)
    padded.close()
    plain.close()


def test_steps_past_the_largest_token_count_run_eagerly(tiny_checkpoint) -> None:
    path = tiny_checkpoint("tiny-gemma-4-E4B-it")
    padded, plain = Driver(build_runner(path, True, cuda_graph_max_tokens=32)), Driver(build_runner(path, False))
    calls: list[int] = []
    spy_on_steps(padded.runner.extend_graphs.steps, calls)
    vocab = plain.runner.model_config.vocab_size
    for driver in (padded, plain):
        driver.forward(ForwardMode.EXTEND, [("a", prompt(vocab, 37, 1))], logits_rows=[36])  # > 32 + 4: eager
        driver.forward(ForwardMode.EXTEND, [("b", prompt(vocab, 20, 2))], logits_rows=[19])
        # the last count holds 32 tokens and a decode row of each of the 4 running requests
        driver.forward(ForwardMode.EXTEND, [("c", prompt(vocab, 34, 3))], logits_rows=[33])
    assert calls == [32, 36]
    assert_same_outputs(padded, plain)
    padded.close()
    plain.close()


def test_scheduler_with_padded_token_steps_matches_one_at_a_time(tiny_checkpoint) -> None:
    """Mixed steps (prompt chunks beside decoding requests) of every size through padded token steps."""
    path = tiny_checkpoint("tiny-gemma-4-E4B-it")
    scheduler = make_scheduler(path, chunked_prefill_size=CHUNK, max_running_requests=4)
    scheduler.runner.capture_cuda_graphs(use_graphs=False)
    calls: list[int] = []
    spy_on_steps(scheduler.runner.extend_graphs.steps, calls)
    requests = [greedy(str(i), ids, max_new_tokens=6) for i, ids in enumerate(prompts(5, seed=8, low=5, high=40))]
    alone_scheduler = make_scheduler(path)
    alone = {r.rid: run_to_completion(alone_scheduler, [r])[r.rid].output_ids for r in requests}
    together = run_to_completion(scheduler, requests)
    assert {rid: result.output_ids for rid, result in together.items()} == alone
    assert len(calls) > len(requests) and set(calls) == {64}  # every step of <= 8 + 4 tokens
    assert_idle_and_consistent(scheduler)


def test_a_whole_chunk_beside_decoding_requests_stays_padded(tiny_checkpoint) -> None:
    """--chunked-prefill-size equal to --cuda-graph-max-tokens: a full chunk beside the decoding requests' rows
    takes the largest padded step (64 + 4), not an eager forward, and gives the tokens each request gives alone."""
    path = tiny_checkpoint("tiny-gemma-4-E4B-it")
    scheduler = make_scheduler(path, chunked_prefill_size=64, cuda_graph_max_tokens=64, max_running_requests=4)
    scheduler.runner.capture_cuda_graphs(use_graphs=False)
    graphs = scheduler.runner.extend_graphs
    calls: list[int] = []
    spy_on_steps(graphs.steps, calls)
    eager: list[int] = []
    can_run = graphs.can_run
    graphs.can_run = lambda batch: can_run(batch) or eager.append(batch.num_tokens) or False
    requests = [greedy(str(i), ids, max_new_tokens=6) for i, ids in enumerate(prompts(4, seed=3, low=70, high=130))]
    alone_scheduler = make_scheduler(path)
    alone = {r.rid: run_to_completion(alone_scheduler, [r])[r.rid].output_ids for r in requests}
    together = run_to_completion(scheduler, requests)
    assert {rid: result.output_ids for rid, result in together.items()} == alone
    assert eager == [] and 68 in calls, (eager, calls)
    assert_idle_and_consistent(scheduler)


# ---- GPU: real graphs ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
def test_token_step_graphs_give_the_eager_outputs(tiny_checkpoint, variant: str) -> None:
    path = tiny_checkpoint(variant)
    common = dict(
        model_path=str(path),
        device="cuda",
        dtype="float32",  # bf16 random tiny models meet near-ties where any change of kernel flips a token
        max_running_requests=16,  # the scenarios' requests all keep their rows
        max_total_tokens=8192,
        swa_full_tokens_ratio=1.0,
    )
    graphs, eager = (
        Driver(ModelRunner(ServerArgs(**common))),
        Driver(ModelRunner(ServerArgs(**common, disable_cuda_graph=True))),
    )
    assert graphs.runner.extend_graphs is not None and graphs.runner.extend_graphs.steps.use_graphs
    for module in eager.runner.model.modules():
        if isinstance(module, Experts):
            module.backend = "triton"  # what the captured graphs run; eager would take grouped_mm at few rows
    calls: list[int] = []
    spy_on_steps(graphs.runner.extend_graphs.steps, calls)
    vocab = graphs.runner.model_config.vocab_size
    for scenario in SCENARIOS:
        assert scenario(graphs, vocab) == scenario(eager, vocab), scenario.__name__
    assert calls == [128, 64, 64, 64, 64, 64, 64]  # the prompt with 17 logits rows > 16 ran eagerly
    # the largest graph: --cuda-graph-max-tokens (2048) and a row for each of 16 requests beside them
    for driver in (graphs, eager):
        driver.forward(ForwardMode.EXTEND, [("long", prompt(vocab, 2050, 9))], logits_rows=[2049])
    assert calls[-1] == 2048 + 16
    for a, b in zip(graphs.outputs, eager.outputs, strict=True):
        if len(b.logits):
            assert relative_error(a.logits, b.logits) < 1e-3
    graphs.close()
    eager.close()
    del graphs, eager
    torch.cuda.empty_cache()


@pytest.mark.parametrize("variant", ["tiny-gemma-4-E4B-it", "tiny-gemma-4-31B-it"])
def test_as_many_padded_logits_rows_as_tokens(tiny_checkpoint, variant: str) -> None:
    """A 64-token step of a runner taking 64 requests pads its logits rows to 64, one per token: they are still
    gathered rows (each request's last), not every row in order."""
    path = tiny_checkpoint(variant)
    padded = Driver(build_runner(path, True, max_running_requests=64))
    plain = Driver(build_runner(path, False, max_running_requests=64))
    calls: list[int] = []
    spy_on_steps(padded.runner.extend_graphs.steps, calls)
    vocab = plain.runner.model_config.vocab_size
    for driver in (padded, plain):
        driver.forward(ForwardMode.EXTEND, [("a", prompt(vocab, 30, 1)), ("b", prompt(vocab, 20, 2))], [29, 49])
    assert calls == [64]
    assert_same_outputs(padded, plain)
    padded.close()
    plain.close()
