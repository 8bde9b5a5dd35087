"""YOCO fast prefill: the KV-shared layers of E2B/E4B run only on the rows whose logits are needed.

Every scenario runs on two ModelRunners over the same tiny checkpoint, one built with YOCO on and one with
`GEMMA4_YOCO=0`: greedy tokens must be identical and logits agree within 1e-4 relative (fp32). Forward hooks
on the KV-shared layers count the rows they actually see, independently of the runner's own counter.
Batches are built by hand the way the scheduler will: a prefix already in the pools, prefill chunks (no
logits rows until the last), prompt logprobs (every row from the logprob start), mixed extend + decode.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import pytest
import torch

from srt.forward.forward_batch import ForwardBatch, ForwardMode
from srt.layers.logits_processor import LogitsOutput
from srt.model_executor.model_runner import ModelRunner
from srt.models.gemma4 import YOCO_ENV
from srt.server_args import ServerArgs

VARIANTS = ["tiny-gemma-4-E2B-it", "tiny-gemma-4-E4B-it"]
FP32_REL_TOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny matmuls run faster on one thread


def build_runner(path, monkeypatch: pytest.MonkeyPatch, yoco: bool) -> ModelRunner:
    monkeypatch.setenv(YOCO_ENV, "1" if yoco else "0")
    runner = ModelRunner(ServerArgs(model_path=str(path), device="cpu", dtype="float32"))
    monkeypatch.delenv(YOCO_ENV)  # read once, at build time: the runner must not depend on it later
    return runner


@dataclass
class Driver:
    """Runs hand-built ForwardBatches on a runner and records what the KV-shared layers saw."""

    runner: ModelRunner
    req_rows: dict[str, int] = field(default_factory=dict)  # request name -> req_to_token row
    seq_lens: dict[str, int] = field(default_factory=dict)
    owned_slots: list[torch.Tensor] = field(default_factory=list)
    shared_rows: list[list[int]] = field(default_factory=list)  # per forward: rows seen by each shared layer
    outputs: list[LogitsOutput] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.free_at_start = self.runner.token_allocator.available()
        model = self.runner.model
        model.register_forward_pre_hook(lambda module, args: self.shared_rows.append([]))
        for layer in self.hooked_layers:
            layer.register_forward_pre_hook(lambda module, args: self.shared_rows[-1].append(args[0].shape[0]))

    @property
    def hooked_layers(self) -> list[torch.nn.Module]:
        """The KV-shared layers; without KV sharing, the last layer."""
        first_shared = self.runner.model_config.first_kv_shared_layer
        layers = list(self.runner.model.model.layers)
        return layers[first_shared:] if first_shared is not None else layers[-1:]

    def rows_in_shared_layers(self) -> list[int]:
        """Per forward, the rows every KV-shared layer ran on (0 when they did not run)."""
        counts = []
        for seen in self.shared_rows:
            assert seen == [] or (len(seen) == len(self.hooked_layers) and len(set(seen)) == 1), seen
            counts.append(seen[0] if seen else 0)
        return counts

    def forward(self, mode: ForwardMode, work: list[tuple[str, list[int]]], logits_rows: list[int]) -> LogitsOutput:
        """One forward of `work` (request name, its new tokens) in batch order; returns the logits rows."""
        runner = self.runner
        for name, _ in work:
            if name not in self.req_rows:
                self.req_rows[name] = runner.req_to_token_pool.alloc()
                self.seq_lens[name] = 0
        slots = runner.token_allocator.alloc(sum(len(tokens) for _, tokens in work))
        self.owned_slots.append(slots)
        offset = 0
        for name, tokens in work:
            runner.req_to_token_pool.write(
                self.req_rows[name], self.seq_lens[name], slots[offset : offset + len(tokens)]
            )
            offset += len(tokens)
        batch = ForwardBatch.build(
            mode=mode,
            new_token_ids=[tokens for _, tokens in work],
            prefix_lens=[self.seq_lens[name] for name, _ in work],
            req_pool_indices=[self.req_rows[name] for name, _ in work],
            out_cache_loc=slots,
            logits_rows=logits_rows,
            req_to_token_pool=runner.req_to_token_pool,
            kv_pool=runner.kv_pool,
        )
        for name, tokens in work:
            self.seq_lens[name] += len(tokens)
        output = runner.forward(batch)
        assert output.logits.shape == (len(logits_rows), runner.model_config.vocab_size)
        # a captured step's outputs live in buffers the next step overwrites
        output = output._replace(logits=output.logits.clone(), hidden_states=output.hidden_states.clone())
        self.outputs.append(output)
        return output

    def close(self) -> None:
        for slots in self.owned_slots:
            self.runner.token_allocator.free(slots)
        for row in self.req_rows.values():
            self.runner.req_to_token_pool.free(row)
        self.runner.token_allocator.check_integrity()
        self.runner.req_to_token_pool.check_integrity()
        assert self.runner.token_allocator.available() == self.free_at_start


def prompt(vocab_size: int, length: int, seed: int) -> list[int]:
    return torch.randint(3, vocab_size, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(output: LogitsOutput) -> list[int]:
    return output.logits.argmax(dim=-1).tolist()


# Each scenario drives a Driver like a scheduler would and returns the greedy tokens it produced.


def different_lengths(d: Driver, vocab: int) -> list[list[int]]:
    """Prompts of 5, 23 and 41 tokens (two longer than the sliding window 16), then 3 decode steps."""
    prompts = {name: prompt(vocab, n, seed) for seed, (name, n) in enumerate([("a", 5), ("b", 23), ("c", 41)])}
    out = d.forward(ForwardMode.EXTEND, list(prompts.items()), logits_rows=[4, 27, 68])
    tokens = [greedy(out)]
    for _ in range(3):
        out = d.forward(
            ForwardMode.DECODE, [(name, [t]) for name, t in zip(prompts, tokens[-1], strict=True)], [0, 1, 2]
        )
        tokens.append(greedy(out))
    return tokens


def prefix_hit(d: Driver, vocab: int) -> list[list[int]]:
    """A forward caches 18 + 10 prompt tokens (no logits rows); a second one computes only the rest."""
    a, b = prompt(vocab, 30, 10), prompt(vocab, 20, 11)
    d.forward(ForwardMode.EXTEND, [("a", a[:18]), ("b", b[:10])], logits_rows=[])
    out = d.forward(ForwardMode.EXTEND, [("a", a[18:]), ("b", b[10:])], logits_rows=[11, 21])
    tokens = [greedy(out)]
    out = d.forward(ForwardMode.DECODE, [("a", [tokens[0][0]]), ("b", [tokens[0][1]])], [0, 1])
    return [*tokens, greedy(out)]


def chunked_prefill(d: Driver, vocab: int) -> list[list[int]]:
    """A 41-token prompt in chunks of 16, 16, 9 beside a 7-token prompt that finishes and then decodes."""
    long, short = prompt(vocab, 41, 20), prompt(vocab, 7, 21)
    out = d.forward(ForwardMode.EXTEND, [("long", long[:16]), ("short", short)], logits_rows=[22])
    tokens = [greedy(out)]
    out = d.forward(ForwardMode.EXTEND, [("long", long[16:32]), ("short", tokens[-1])], logits_rows=[16])
    tokens.append(greedy(out))
    out = d.forward(ForwardMode.EXTEND, [("long", long[32:]), ("short", tokens[-1])], logits_rows=[8, 9])
    tokens.append(greedy(out))
    out = d.forward(ForwardMode.DECODE, [("long", tokens[-1][:1]), ("short", tokens[-1][1:])], [0, 1])
    return [*tokens, greedy(out)]


def prompt_logprobs(d: Driver, vocab: int) -> list[list[int]]:
    """Request p asks for prompt logprobs from position 5 (rows 17..31) beside two requests that do not."""
    prompts = [("x", prompt(vocab, 12, 30)), ("p", prompt(vocab, 20, 31)), ("y", prompt(vocab, 9, 32))]
    out = d.forward(ForwardMode.EXTEND, prompts, logits_rows=[11, *range(12 + 5, 32), 40])
    # prompt logprobs from position 0 of the only request: every row is needed, nothing to skip
    out_all = d.forward(ForwardMode.EXTEND, [("z", prompt(vocab, 13, 33))], logits_rows=list(range(13)))
    return [greedy(out), greedy(out_all)]


# scenario -> (rows the shared layers run on per forward with YOCO, tokens per forward)
SCENARIOS = {
    different_lengths: ([3, 3, 3, 3], [69, 3, 3, 3]),
    prefix_hit: ([0, 2, 2], [28, 22, 2]),
    chunked_prefill: ([1, 1, 2, 2], [23, 17, 10, 2]),
    prompt_logprobs: ([17, 13], [41, 13]),
}


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """Largest absolute difference over the largest reference magnitude."""
    return float((ours - reference).abs().max() / reference.abs().max())


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("scenario", list(SCENARIOS), ids=lambda f: f.__name__)
def test_yoco_matches_full_prefill(tiny_checkpoint, monkeypatch, caplog, variant: str, scenario) -> None:
    path = tiny_checkpoint(variant)
    with caplog.at_level(logging.INFO, logger="srt.models.gemma4"):
        on, off = Driver(build_runner(path, monkeypatch, True)), Driver(build_runner(path, monkeypatch, False))
    assert "YOCO fast prefill: on" in caplog.text and "YOCO fast prefill: off" in caplog.text
    vocab = on.runner.model_config.vocab_size

    tokens_on, tokens_off = scenario(on, vocab), scenario(off, vocab)

    assert tokens_on == tokens_off
    for step, (a, b) in enumerate(zip(on.outputs, off.outputs, strict=True)):
        assert a.logits.shape == b.logits.shape
        if len(b.logits):
            assert relative_error(a.logits, b.logits) < FP32_REL_TOL, f"forward {step}"
    expected_rows, batch_tokens = SCENARIOS[scenario]
    assert on.rows_in_shared_layers() == expected_rows
    assert off.rows_in_shared_layers() == batch_tokens
    skipped = [n - rows for n, rows in zip(batch_tokens, expected_rows, strict=True)]
    assert [out.yoco_skipped_rows for out in on.outputs] == skipped
    assert on.runner.yoco_rows_skipped_total == sum(skipped)
    assert [out.yoco_skipped_rows for out in off.outputs] == [0] * len(batch_tokens)
    assert off.runner.yoco_rows_skipped_total == 0
    on.close()
    off.close()


def test_prefix_hit_and_chunks_match_a_whole_prefill(tiny_checkpoint, monkeypatch) -> None:
    """With YOCO on, a prefix hit and a chunked prompt give the logits of the same prompts prefilled whole."""
    driver = Driver(build_runner(tiny_checkpoint("tiny-gemma-4-E2B-it"), monkeypatch, True))
    vocab = driver.runner.model_config.vocab_size
    a, long = prompt(vocab, 30, 10), prompt(vocab, 41, 20)
    whole = driver.forward(ForwardMode.EXTEND, [("a0", a), ("long0", long)], logits_rows=[29, 70])
    driver.forward(ForwardMode.EXTEND, [("a1", a[:18]), ("long1", long[:16])], logits_rows=[])
    split = driver.forward(ForwardMode.EXTEND, [("a1", a[18:]), ("long1", long[16:])], logits_rows=[11, 36])
    assert relative_error(split.logits, whole.logits) < FP32_REL_TOL
    assert driver.rows_in_shared_layers() == [2, 0, 2]
    driver.close()


def test_no_kv_sharing_is_a_no_op(monkeypatch) -> None:
    """26B-A4B has no KV-shared layers: with YOCO on, its last layer still runs on every row."""
    monkeypatch.setenv(YOCO_ENV, "1")
    args = ServerArgs(model_path="tiny-gemma-4-26B-A4B-it", load_format="dummy", device="cpu", dtype="float32")
    driver = Driver(ModelRunner(args))
    assert driver.runner.model_config.first_kv_shared_layer is None
    vocab = driver.runner.model_config.vocab_size
    out = driver.forward(ForwardMode.EXTEND, [("a", prompt(vocab, 6, 1)), ("b", prompt(vocab, 9, 2))], [5, 14])
    assert driver.rows_in_shared_layers() == [15]
    assert out.yoco_skipped_rows == 0 and driver.runner.yoco_rows_skipped_total == 0
    driver.close()


def test_select_rows_lays_out_the_subset(tiny_checkpoint, monkeypatch) -> None:
    runner = build_runner(tiny_checkpoint("tiny-gemma-4-E4B-it"), monkeypatch, True)
    batch = ForwardBatch.build(
        mode=ForwardMode.EXTEND,
        new_token_ids=[[11, 12, 13, 14], [21, 22, 23], [31], [41, 42]],
        prefix_lens=[3, 0, 7, 5],
        req_pool_indices=[4, 5, 6, 7],
        out_cache_loc=torch.arange(101, 111),
        logits_rows=[],
        req_to_token_pool=runner.req_to_token_pool,
        kv_pool=runner.kv_pool,
    )

    sub = batch.select_rows(torch.tensor([2, 3, 7, 9]))

    assert sub.input_ids.tolist() == [13, 14, 31, 42]
    assert sub.positions.tolist() == [5, 6, 7, 6]
    assert sub.out_cache_loc.tolist() == [103, 104, 108, 110]
    assert sub.extend_seq_lens_cpu == sub.extend_seq_lens.tolist() == [2, 0, 1, 1]
    assert sub.extend_prefix_lens_cpu == sub.extend_prefix_lens.tolist() == [5, 3, 7, 6]
    assert sub.seq_lens_cpu == [7, 3, 8, 7] and sub.seq_lens.tolist() == [7, 3, 8, 7]
    assert sub.req_pool_indices.tolist() == [4, 5, 6, 7]
    assert sub.logits_rows.tolist() == [0, 1, 2, 3]
    assert sub.attn_metadata is None
    assert batch.select_rows([]).extend_seq_lens_cpu == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="not contiguous"):
        batch.select_rows([0, 2])
    with pytest.raises(ValueError, match="ascending"):
        batch.select_rows([3, 2])
    with pytest.raises(ValueError, match="ascending"):
        batch.select_rows([10])


def test_forward_batch_host_logits_rows_must_match_the_device_ones(tiny_checkpoint, monkeypatch) -> None:
    """The model reads "is every row needed?" from the host list; a batch whose two lists disagree is refused."""
    runner = build_runner(tiny_checkpoint("tiny-gemma-4-E4B-it"), monkeypatch, True)
    batch = ForwardBatch.build(
        mode=ForwardMode.EXTEND,
        new_token_ids=[[11, 12, 13]],
        prefix_lens=[0],
        req_pool_indices=[0],
        out_cache_loc=torch.arange(1, 4),
        logits_rows=[2],
        req_to_token_pool=runner.req_to_token_pool,
        kv_pool=runner.kv_pool,
    )
    assert batch.logits_rows_cpu == [2]
    with pytest.raises(ValueError, match="logits_rows_cpu has 0 rows, logits_rows 1"):
        dataclasses.replace(batch, logits_rows_cpu=[])
