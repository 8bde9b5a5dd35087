"""CUDA graphs of whole steps by token count: short prefills, prompt chunks and mixed prefill + decode steps.

Eagerly, a step of a few hundred tokens is launch-bound: ~20 kernels per layer, each a Triton launch that
costs the host tens of microseconds (E4B, one 512-token prompt: 31.7 ms against a 3.1 ms floor). A step of
up to `max(token_counts)` tokens, from any mix of requests (decode rows, prompt chunks, prefix-hit tails,
speculative verify rows; each request's rows contiguous), instead replays the graph captured for the smallest
token count that holds it. What a graph of T tokens reads, R = min(T, --max-running-requests) and
L = min(T, --max-running-requests x the logits rows a request may have: K + 1 with MTP, whose verify items
need a row per draft, else 1):

    tokens    [T]      input id, position, KV slot               padding: id 0, position 0, slot 0
    requests  [R + 1]  req_to_token row, seq_len, prefix, new tokens
                       0 .. n-1: the batch's requests; n: the padding tokens' request (req_to_token's padding
                       row, seq_len 1: each padding token sees only slot 0); n+1 .. R: no tokens
    logits    [L]      the row, and that row's request row, seq_len and position     padding: row 0, slot 0

Attention runs the extend kernel over a tile table built on the device from the requests' token counts when
captured (its length depends only on T and R: `kernels/attention/extend.py`). With YOCO the KV-shared layers then run on
the L logits rows, one row each, as `SharedLayerGraphs` runs them. Logits rows past the batch's own are
computed and dropped.

Every graph writes its logits into one shared buffer ([L, vocab] float32 each would be 64 MB per graph at E4B's
vocabulary, 256 MB with MTP), which the MTP verify steps' graphs share too: read a step's outputs before the
next forward, as with the decode graphs. Without graphs (`use_graphs=False`: CPU tests) the same padded step
runs eagerly.
"""

from __future__ import annotations

import torch

from srt.forward.forward_batch import ForwardBatch, ForwardMode
from srt.layers.attention.base import AttentionBackend
from srt.layers.logits_processor import LogitsOutput
from srt.mem_cache.kv_pool import HybridKVPool
from srt.mem_cache.req_to_token_pool import ReqToTokenPool
from srt.model_executor.captured_steps import CapturedSteps, StaticInputs, load_host_lists


def default_token_counts(max_tokens: int, decode_rows: int = 0) -> list[int]:
    """64, 128, then every 128 up to 512 and every 256 above (padding wastes at most a third), to `max_tokens`;
    then `max_tokens + decode_rows`: a prompt chunk of `max_tokens` tokens beside one row of every decoding
    request (a mixed step of --chunked-prefill-size 2048 would otherwise run eagerly, launch-bound)."""
    counts = [n for n in (64, 128, 256, 384, 512) if n < max_tokens]
    counts += range(768, max_tokens, 256)
    return [*counts, max_tokens] + ([max_tokens + decode_rows] if decode_rows > 0 else [])


class ExtendGraphs:
    """The whole model's step (logits of the logits rows included) captured per token count."""

    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        req_to_token_pool: ReqToTokenPool,
        kv_pool: HybridKVPool,
        token_counts: list[int],
        max_requests: int,
        use_graphs: bool,
        pool: tuple | None = None,
        verify_rows: int = 0,
        logits_per_request: int = 1,
        logits_out: torch.Tensor | None = None,
    ) -> None:
        """`verify_rows`: the graphs of speculative verify steps (`ForwardBatch.verify_rows`: K + 1), whose every
        token is a logits row, padding included, so that the whole step runs on one batch. `logits_per_request`:
        logits rows a request may have (K + 1 for MTP verify items). `logits_out`: a [rows, vocab] float32 buffer
        to write logits into, shared with graphs never replayed at the same time (used where it has rows
        enough)."""
        self.model, self.backend = model, backend
        self.verify_rows = verify_rows
        self.req_to_token_pool, self.kv_pool = req_to_token_pool, kv_pool
        self.max_requests = max_requests
        self.max_logits_rows = max_requests * logits_per_request
        self.use_graphs = use_graphs
        self.yoco = model.model.yoco_layer is not None
        device, padding_row = kv_pool.device, req_to_token_pool.padding_row
        self.tokens = StaticInputs(max(token_counts), device, {"input_ids": 0, "positions": 0, "out_cache_loc": 0})
        # the padding values of requests past the padding tokens' own: no tokens, one token of KV (slot 0)
        request_ids = {"req_pool_indices": padding_row, "seq_lens": 1, "extend_prefix_lens": 1, "extend_seq_lens": 0}
        self.requests = StaticInputs(max_requests + 1, device, request_ids)
        logits_ids = {"logits_rows": 0, "logits_req_pool_indices": padding_row, "logits_seq_lens": 1}
        self.logits = StaticInputs(self.max_logits_rows, device, logits_ids | {"logits_positions": 0})
        vocab = model.config.vocab_size
        if logits_out is not None and logits_out.shape[0] >= self.max_logits_rows and logits_out.shape[1] == vocab:
            self.logits_out = logits_out
        else:
            self.logits_out = torch.empty((self.max_logits_rows, vocab), dtype=torch.float32, device=device)
        self._host: dict[str, list[int]] = {}  # the padded batch's host lists, for eager steps (torch_native)
        # verify graphs: every token a logits row, in order (no logits inputs to load per step)
        self.every_row = torch.arange(max(token_counts), device=device) if verify_rows else None
        self.steps = CapturedSteps(self._step, token_counts, use_graphs, pool, "steps by token count")

    def rows(self, num_tokens: int) -> tuple[int, int]:
        """(R, L) of a step of `num_tokens` (padded) tokens: the most requests and logits rows it takes."""
        return min(num_tokens, self.max_requests), min(num_tokens, self.max_logits_rows)

    def can_run(self, batch: ForwardBatch) -> bool:
        if not 0 < batch.num_tokens <= self.steps.max_batch_size or not batch.req_pool_indices_cpu:
            return False  # too long, or laid out without the host copies the padding is built from
        requests, logits_rows = self.rows(self.steps.padded_size(batch.num_tokens))
        return 0 < batch.batch_size <= requests and len(batch.logits_rows_cpu) <= logits_rows

    def __call__(self, batch: ForwardBatch) -> LogitsOutput:
        """Logits of `batch.logits_rows`; KV of the batch's tokens is written to the pools."""
        tokens = self.steps.padded_size(batch.num_tokens)
        requests, logits_rows = self.rows(tokens)
        self.tokens.load(
            {"input_ids": batch.input_ids, "positions": batch.positions, "out_cache_loc": batch.out_cache_loc},
            batch.num_tokens,
            tokens,
        )
        host = padded_host_lists(batch, tokens, requests, logits_rows, self.req_to_token_pool.padding_row)
        loads = [(self.requests, host, requests + 1)]
        if not self.verify_rows:
            loads.append((self.logits, host, logits_rows))
        load_host_lists(loads)
        self._host = host
        out = self.steps.run(tokens)
        n = len(batch.logits_rows_cpu)
        greedy_ids = None if out.greedy_ids is None else out.greedy_ids[:n]
        skipped = batch.num_tokens - n if self.yoco and not batch.every_row_is_a_logits_row else 0
        return LogitsOutput(out.logits[:n], out.hidden_states[:n], skipped, greedy_ids)

    @torch.no_grad()
    def _step(self, tokens: int) -> LogitsOutput:
        requests, rows = self.rows(tokens)  # rows: the logits rows
        host = self._host
        if self.use_graphs:  # capturing: the kernels read only the static inputs; these lists choose the kernels
            host = padded_host_lists(None, tokens, requests, rows, self.req_to_token_pool.padding_row)
        token_view, request_view = self.tokens.view(tokens), self.requests.view(requests + 1)
        pools = {"req_to_token_pool": self.req_to_token_pool, "kv_pool": self.kv_pool}
        if self.verify_rows:
            # every token a logits row, in order (padding rows' logits are dropped): one batch through every
            # layer, whose attention takes each request's rows together, KV-shared layers included
            logits_rows, logits_rows_cpu, logits_subset = self.every_row[:tokens], list(range(tokens)), None
        else:
            logits_rows, logits_rows_cpu = self.logits.view(rows)["logits_rows"], host["logits_rows"]
            logits_subset = self._logits_subset(rows, host, pools)
        batch = ForwardBatch(
            mode=ForwardMode.EXTEND,
            input_ids=token_view["input_ids"],
            positions=token_view["positions"],
            req_pool_indices=request_view["req_pool_indices"],
            seq_lens=request_view["seq_lens"],
            extend_prefix_lens=request_view["extend_prefix_lens"],
            extend_seq_lens=request_view["extend_seq_lens"],
            out_cache_loc=token_view["out_cache_loc"],
            logits_rows=logits_rows,
            **pools,
            req_pool_indices_cpu=host["req_pool_indices"],
            seq_lens_cpu=host["seq_lens"],
            extend_prefix_lens_cpu=host["extend_prefix_lens"],
            extend_seq_lens_cpu=host["extend_seq_lens"],
            logits_rows_cpu=logits_rows_cpu,
            # laid out here, padded: never "every row in order", even with as many logits rows as tokens
            logits_subset=logits_subset,
            verify_rows=self.verify_rows,
        )
        out = self.model(batch, self.backend)
        logits = self.logits_out[:rows]
        logits.copy_(out.logits)
        return LogitsOutput(logits, out.hidden_states, out.yoco_skipped_rows, out.greedy_ids)

    def _logits_subset(self, rows: int, host: dict[str, list[int]], pools: dict) -> ForwardBatch:
        """The step's `rows` logits rows as a batch of their own (YOCO's KV-shared layers), from the static inputs."""
        logits_view = {name.removeprefix("logits_"): t for name, t in self.logits.view(rows).items()}
        positions = logits_view["positions"]
        return ForwardBatch(
            mode=ForwardMode.DECODE,  # one row per "request": attention's decode kernel, as in SharedLayerGraphs
            input_ids=positions,  # unused: the KV-shared layers start from hidden states
            positions=positions,
            req_pool_indices=logits_view["req_pool_indices"],
            seq_lens=logits_view["seq_lens"],
            extend_prefix_lens=positions,
            extend_seq_lens=torch.ones_like(positions),
            out_cache_loc=torch.zeros_like(positions),  # unused: they write no KV
            logits_rows=torch.arange(rows, device=self.kv_pool.device),
            **pools,
            req_pool_indices_cpu=host["logits_req_pool_indices"],
            seq_lens_cpu=host["logits_seq_lens"],
            extend_prefix_lens_cpu=host["logits_positions"],
            extend_seq_lens_cpu=[1] * rows,
            logits_rows_cpu=list(range(rows)),
        )


def padded_host_lists(
    batch: ForwardBatch | None, tokens: int, requests: int, rows: int, padding_row: int
) -> dict[str, list[int]]:
    """The host lists of `batch` padded to a step of `tokens` tokens, `requests` requests and `rows` logits rows
    (see the module's diagram); `batch=None`: of a batch with no tokens of its own (what a graph is captured on)."""
    if batch is None:
        own = {"req_pool_indices": [], "seq_lens": [], "extend_prefix_lens": [], "extend_seq_lens": []}
        logits_rows, real_tokens = [], 0
    else:
        own = {
            "req_pool_indices": batch.req_pool_indices_cpu,
            "seq_lens": batch.seq_lens_cpu,
            "extend_prefix_lens": batch.extend_prefix_lens_cpu,
            "extend_seq_lens": batch.extend_seq_lens_cpu,
        }
        logits_rows, real_tokens = batch.logits_rows_cpu, batch.num_tokens
    empty = requests - len(own["seq_lens"])  # requests after the padding tokens' one
    host = {
        "req_pool_indices": [*own["req_pool_indices"], padding_row] + [padding_row] * empty,
        "seq_lens": [*own["seq_lens"], 1] + [1] * empty,
        "extend_prefix_lens": [*own["extend_prefix_lens"], 0] + [1] * empty,
        "extend_seq_lens": [*own["extend_seq_lens"], tokens - real_tokens] + [0] * empty,
    }
    owners = batch.requests_of_rows(logits_rows) if batch is not None else []
    starts = batch.extend_start_loc_cpu if batch is not None else []
    padding = rows - len(logits_rows)
    host["logits_rows"] = [*logits_rows] + [0] * padding
    host["logits_req_pool_indices"] = [own["req_pool_indices"][i] for i in owners] + [padding_row] * padding
    host["logits_seq_lens"] = [own["seq_lens"][i] for i in owners] + [1] * padding
    host["logits_positions"] = [
        own["extend_prefix_lens"][i] + row - starts[i] for i, row in zip(owners, logits_rows, strict=True)
    ] + [0] * padding
    return host
