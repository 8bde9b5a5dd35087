"""Every knob of srt in one dataclass; the CLI is generated from it, so each field's help is the doc."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
QUANTIZATIONS = ("fp8",)
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")  # as mem_cache/kv_cache_dtype.py resolves them (torch: import late)
ATTENTION_BACKENDS = ("auto", "torch_native", "triton")
SCHEDULE_POLICIES = ("lpm", "fcfs")
SPECULATIVE_ALGORITHMS = ("FROZEN_KV_MTP",)
MAX_SPECULATIVE_NUM_STEPS = 16
CHAT_PARSERS = ("gemma4", "none")  # --tool-call-parser, --reasoning-parser


LOG_LEVELS = ("debug", "info", "warning", "error")


def chat_template_text(value: str) -> str:
    """`--chat-template`: the file's text where `value` names a file, else `value` itself if it reads as a Jinja
    template; ValueError naming chat_template otherwise, or where the template does not parse."""
    import jinja2

    path = Path(value).expanduser()
    if path.is_file():
        text = path.read_text()
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise ValueError(f"chat_template must be a Jinja file's path or a Jinja template; no such file: {value}")
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"chat_template does not parse: {error} (line {error.lineno})") from None
    return text


def _arg(default: Any, help: str, choices: tuple[str, ...] | None = None, aliases: tuple[str, ...] = ()) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices, "aliases": aliases})


@dataclass
class ServerArgs:
    model_path: str = _arg(
        "",
        "Model to serve: a Hugging Face checkpoint directory, a model name in the local Hugging Face cache, "
        "or a built-in preset name (e.g. gemma-4-E4B-it) together with --load-format dummy.",
        aliases=("--model",),
    )
    tokenizer_path: str | None = _arg(None, "Tokenizer directory (default: the model directory).")
    chat_template: str | None = _arg(
        None,
        "A chat template instead of the checkpoint's (SGLang's and vLLM's flag): a Jinja file's path, or the "
        "template itself. Chat requests and /tokenize with messages render with it.",
    )
    load_format: str = _arg(
        "auto", "auto/safetensors: read the checkpoint; dummy: real shapes, seeded random weights.", LOAD_FORMATS
    )
    dtype: str = _arg("auto", "Weight and activation dtype; auto = bfloat16 on GPU, float32 on CPU.", DTYPES)
    quantization: str | None = _arg(
        None,
        "fp8: quantize the decoder's projections (q/k/v/o, gate/up/down; and MoE experts) to FP8 per output channel "
        "at load time, for a 16-bit checkpoint or dummy weights (SGLang's flag). Embeddings, the per-layer-input "
        "table and projection, the router, norms and the LM head stay in --dtype. An FP8 checkpoint needs no flag: "
        "its FP8 projections stay FP8.",
        QUANTIZATIONS,
    )
    dequantize_fp8_weights: bool = _arg(
        False,
        "Load an FP8 checkpoint's weights dequantized into --dtype (its 16-bit reference: numerics comparisons, "
        "A/B runs) instead of keeping the projections in FP8.",
    )
    device: str = _arg("auto", "Where the model runs; auto = cuda when available, else cpu.", DEVICES)
    seed: int = _arg(0, "Seed of dummy weights and of sampling for requests without their own seed.")
    kv_cache_dtype: str = _arg(
        "auto",
        "What the KV pools store (SGLang's flag): auto = the model's dtype; fp8_e4m3 = float8_e4m3fn with "
        "float32 per-tensor scales per layer, from the checkpoint's k_scale / v_scale where it has them, else "
        "1.0: one byte per element, so about twice the tokens of bf16 fit.",
        KV_CACHE_DTYPES,
    )
    attention_backend: str = _arg(
        "auto", "Attention kernels; auto = triton on GPU, torch_native (reference) on CPU.", ATTENTION_BACKENDS
    )
    context_length: int | None = _arg(
        None, "Longest prompt + output in tokens (default: the model's max_position_embeddings)."
    )
    max_total_tokens: int | None = _arg(
        None, "Tokens of the full-attention KV pool; overrides the size derived from --mem-fraction-static."
    )
    mem_fraction_static: float = _arg(
        0.85, "Fraction of GPU memory for weights plus KV pools; the KV pools get what the weights leave."
    )
    swa_full_tokens_ratio: float | None = _arg(
        None,
        "Sliding-window pool tokens / full pool tokens (default 0.15 for MoE checkpoints, 0.8 for dense).",
    )
    max_running_requests: int = _arg(64, "Most requests in the running batch at once (of each --dp-size replica).")
    max_prefill_tokens: int = _arg(
        16384, "Most tokens one step computes: prompt tokens plus one per decoding request beside them."
    )
    chunked_prefill_size: int = _arg(
        8192,
        "Most prompt tokens one step computes; longer prompts are computed in chunks of this many tokens, one "
        "chunked request at a time (0: off, only --max-prefill-tokens bounds a step).",
    )
    schedule_policy: str = _arg(
        "lpm", "Admission order: lpm = longest cached prefix first, fcfs = arrival order.", SCHEDULE_POLICIES
    )
    disable_radix_cache: bool = _arg(False, "Do not reuse KV of shared prompt prefixes across requests.")
    disable_cuda_graph: bool = _arg(
        False,
        "Launch every kernel of every step eagerly instead of replaying CUDA graphs captured at start-up (decode "
        "steps, steps of up to --cuda-graph-max-tokens tokens, YOCO's KV-shared layers; GPU with the triton "
        "backend only).",
    )
    skip_server_warmup: bool = _arg(
        False,
        "Start serving without first running two short requests through the model. On a GPU the warm-up "
        "compiles the prefill kernels (seconds) before the server reports ready instead of during the first "
        "request.",
    )
    disable_mixed_batches: bool = _arg(
        False,
        "Run prompt chunks in steps of their own. By default a step that computes prompt chunks also carries "
        "one token of every decoding request, so decoding never waits for a whole prompt (A/B runs).",
    )
    disable_overlap_schedule: bool = _arg(
        False,
        "Read each step's sampled tokens on the host before launching the next step. By default the next step "
        "(decode tokens, prompt chunks) is launched first, its decoding requests' input tokens taken from the "
        "device, so the host's work between steps runs while the GPU computes.",
    )
    cuda_graph_max_bs: int | None = _arg(
        None, "Largest batch captured in a CUDA graph (default: --max-running-requests); larger ones run eagerly."
    )
    cuda_graph_max_tokens: int = _arg(
        2048,
        "Steps of up to this many tokens (short prefills, prompt chunks, mixed prefill + decode steps), plus one "
        "decode row per running request beside them, replay CUDA graphs captured per token count; longer ones run "
        "eagerly (0: no such graphs, only decode ones).",
    )
    # ---- image input ----
    mm_encoder_budget_mb: int = _arg(
        2048,
        "Activation memory (MiB, estimated) one vision-tower call may use; same-size images beyond it are "
        "encoded in several calls.",
    )
    mm_embedding_cache_tokens: int = _arg(
        8192, "Image soft tokens whose embeddings stay cached by image content (a repeated image is not re-encoded)."
    )
    disable_batched_mm_encoder: bool = _arg(
        False, "Encode images one by one (a tower and an embedder call per image) instead of batched (A/B runs)."
    )
    allowed_local_media_path: str | None = _arg(
        None, "Directory under which requests may name local image files (file:// URLs or paths); default: none."
    )
    media_fetch_timeout: float = _arg(
        10.0,
        "Seconds an image or video given by an http(s) URL may take to download (encoded size capped at 32 MiB "
        "for images, 256 MiB for videos); a slower or larger one fails the request with HTTP 400.",
    )
    # ---- speculative decoding ----
    speculative_algorithm: str | None = _arg(
        None,
        "FROZEN_KV_MTP: a Gemma 4 assistant drafts tokens over the target's KV (picked automatically when the "
        "draft model is a gemma4_assistant).",
        SPECULATIVE_ALGORITHMS,
    )
    speculative_draft_model_path: str | None = _arg(
        None, "Draft model: an assistant checkpoint directory or preset (e.g. gemma-4-E4B-it-assistant)."
    )
    speculative_num_steps: int = _arg(3, f"Draft tokens per round (1 to {MAX_SPECULATIVE_NUM_STEPS}).")
    # ---- parallelism ----
    tp_size: int = _arg(
        1,
        "Tensor-parallel ranks: one scheduler process per rank, each on its own GPU (--base-gpu-id onwards), "
        "every layer's heads and MLP width split over them (NCCL on GPUs, gloo on CPUs).",
        aliases=("--tensor-parallel-size",),
    )
    dp_size: int = _arg(
        1,
        "Data-parallel replicas on this node: each a whole model with its own KV pools and --tp-size GPUs; "
        "the tokenizer side sends each request to the replica with the fewest requests in flight.",
        aliases=("--data-parallel-size",),
    )
    base_gpu_id: int = _arg(
        0, "The GPU of the first rank on this node; rank r of replica d uses GPU base + d * tp-size + r."
    )
    nnodes: int = _arg(
        1, "Machines the --tp-size ranks are spread over (--tp-size / --nnodes ranks each); start every node."
    )
    node_rank: int = _arg(
        0,
        "This machine's place among --nnodes (0 serves HTTP and runs the first ranks; others run only their "
        "ranks and wait).",
    )
    dist_init_addr: str | None = _arg(
        None,
        "HOST:PORT of node 0's torch.distributed TCP store, the same on every node (default: a free loopback "
        "port, one node only).",
    )
    # ---- serving ----
    host: str = _arg("127.0.0.1", "Address the HTTP server listens on (0.0.0.0: every interface).")
    port: int = _arg(30000, "Port of the HTTP server.")
    served_model_name: str | None = _arg(
        None, "Model name the OpenAI API reports and accepts (default: the --model argument as given)."
    )
    tool_call_parser: str | None = _arg(
        None,
        "How chat replies' tool calls are read (SGLang's flag): gemma4 = <|tool_call>call:NAME{...}<tool_call|> "
        "becomes message.tool_calls; none = replies stay text. Default: gemma4, the format of every checkpoint "
        "srt serves.",
        CHAT_PARSERS,
    )
    reasoning_parser: str | None = _arg(
        None,
        "How chat replies' thinking is read (SGLang's flag): gemma4 = <|channel>thought ... <channel|> becomes "
        "message.reasoning_content; none = replies stay text. Default: gemma4.",
        CHAT_PARSERS,
    )
    log_interval: float = _arg(
        10.0, "Seconds between status log lines (requests, KV usage, throughput) while busy; 0: never."
    )
    log_level: str = _arg("info", "Log level of every serving process.", LOG_LEVELS)
    max_request_body_mb: float = _arg(
        64.0,
        "Largest HTTP request body accepted, in MiB; a larger one gets HTTP 413 before it is read to the end.",
    )
    max_queued_requests: int | None = _arg(
        None,
        "Most requests waiting for a place in the running batch; beyond --max-running-requests + this many in "
        "flight, a new request gets HTTP 429 with Retry-After (each of n samples counts). Default: 4 x "
        "--max-running-requests (x --dp-size), so a queued request waits for at most about four batches ahead of it.",
    )
    request_timeout: float | None = _arg(
        None,
        "Seconds a request may wait in the queue before it is admitted to the running batch; one that waits "
        "longer is dropped and answered HTTP 429 (a stream: an error event). Default: no limit.",
    )
    api_key: str | None = _arg(
        None,
        "Require this key (SGLang's and vLLM's flag): every request but /health, /health_generate and /metrics "
        "must send `Authorization: Bearer KEY` (the openai client's api_key), else HTTP 401. Default: no key.",
    )
    exit_on_child_death: bool = _arg(
        True,
        "Stop the server with exit code 1 when the scheduler or detokenizer process dies (open requests get "
        "errors first), so a supervisor restarts it. On by default; --no-exit-on-child-death keeps the server "
        "up, answering 503.",
    )

    def __post_init__(self) -> None:
        if self.speculative_draft_model_path and self.speculative_algorithm is None:
            self.speculative_algorithm = _speculative_algorithm_of(self.speculative_draft_model_path)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first field that is out of range."""
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) is not None and getattr(self, f.name) not in choices:
                raise ValueError(f"{f.name} must be one of {', '.join(choices)}; got {getattr(self, f.name)!r}")
        if not 0 < self.mem_fraction_static <= 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1]; got {self.mem_fraction_static}")
        if self.swa_full_tokens_ratio is not None and self.swa_full_tokens_ratio <= 0:
            raise ValueError(f"swa_full_tokens_ratio must be > 0; got {self.swa_full_tokens_ratio}")
        if self.max_total_tokens is not None and self.max_total_tokens <= 0:
            raise ValueError(f"max_total_tokens must be > 0; got {self.max_total_tokens}")
        if self.max_prefill_tokens <= 0:
            raise ValueError(f"max_prefill_tokens must be > 0; got {self.max_prefill_tokens}")
        if self.chunked_prefill_size < 0:
            raise ValueError(f"chunked_prefill_size must be >= 0; got {self.chunked_prefill_size}")
        if self.max_running_requests <= 0:
            raise ValueError(f"max_running_requests must be > 0; got {self.max_running_requests}")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs <= 0:
            raise ValueError(f"cuda_graph_max_bs must be > 0; got {self.cuda_graph_max_bs}")
        if self.cuda_graph_max_tokens < 0:
            raise ValueError(f"cuda_graph_max_tokens must be >= 0; got {self.cuda_graph_max_tokens}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535]; got {self.port}")
        if self.max_request_body_mb <= 0:
            raise ValueError(f"max_request_body_mb must be > 0; got {self.max_request_body_mb}")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0; got {self.max_queued_requests}")
        if self.chat_template is not None:
            chat_template_text(self.chat_template)
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0; got {self.request_timeout}")
        if self.log_interval < 0:
            raise ValueError(f"log_interval must be >= 0; got {self.log_interval}")
        if not self.media_fetch_timeout > 0:
            raise ValueError(f"media_fetch_timeout must be > 0; got {self.media_fetch_timeout}")
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1; got {self.tp_size}")
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be >= 1; got {self.dp_size}")
        if self.dp_size > 1 and self.nnodes > 1:
            raise ValueError("dp_size > 1 runs its replicas on one node; nnodes must be 1")
        if self.base_gpu_id < 0:
            raise ValueError(f"base_gpu_id must be >= 0; got {self.base_gpu_id}")
        if self.nnodes < 1 or self.tp_size % self.nnodes:
            raise ValueError(f"nnodes must be >= 1 and divide tp_size {self.tp_size}; got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes - 1}]; got {self.node_rank}")
        if self.tp_size > 1 and self.dequantize_fp8_weights:
            raise ValueError("dequantize_fp8_weights is a one-rank reference path; with tp_size > 1 FP8 stays FP8")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("dist_init_addr (HOST:PORT of node 0) is needed when nnodes > 1")
        if self.dist_init_addr is not None and not _is_host_port(self.dist_init_addr):
            raise ValueError(f"dist_init_addr must be HOST:PORT; got {self.dist_init_addr!r}")
        if self.speculative_algorithm and not self.speculative_draft_model_path:
            raise ValueError(f"speculative_algorithm {self.speculative_algorithm} needs speculative_draft_model_path")
        if not 1 <= self.speculative_num_steps <= MAX_SPECULATIVE_NUM_STEPS:
            raise ValueError(
                f"speculative_num_steps must be in [1, {MAX_SPECULATIVE_NUM_STEPS}]; got {self.speculative_num_steps}"
            )

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """One `--flag` per field, with the field's help text and default."""
        for f in dataclasses.fields(ServerArgs):
            flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
            kind = _cli_type(f)
            if kind is bool:
                # a switch that is on by default also gets its --no- form
                action = argparse.BooleanOptionalAction if f.default else "store_true"
                parser.add_argument(*flags, dest=f.name, action=action, default=f.default, help=f.metadata["help"])
                continue
            parser.add_argument(
                *flags,
                dest=f.name,
                type=kind,
                default=f.default,
                choices=f.metadata.get("choices"),
                help=_help_with_default(f),
            )

    @classmethod
    def from_cli(cls, namespace: argparse.Namespace) -> ServerArgs:
        return cls(**{f.name: getattr(namespace, f.name) for f in dataclasses.fields(cls)})


def _speculative_algorithm_of(draft_model_path: str) -> str:
    """The algorithm a draft model implies: FROZEN_KV_MTP for a Gemma 4 assistant."""
    from srt.configs.assistant_config import ASSISTANT_MODEL_TYPE, draft_model_type  # transformers: import late

    model_type = draft_model_type(draft_model_path)
    if model_type != ASSISTANT_MODEL_TYPE:
        raise ValueError(
            f"cannot pick a speculative algorithm for draft model {draft_model_path!r} (model_type {model_type!r}); "
            f"srt drafts with Gemma 4 assistants ({ASSISTANT_MODEL_TYPE}, FROZEN_KV_MTP)"
        )
    return "FROZEN_KV_MTP"


def _is_host_port(address: str) -> bool:
    host, _, port = address.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


def _help_with_default(f: dataclasses.Field) -> str:
    """The field's help, with its default appended unless the help already explains it."""
    text = f.metadata["help"]
    return text if "default" in text.lower() else f"{text} (default: {f.default})"


def _cli_type(f: dataclasses.Field) -> type:
    annotation = str(f.type)
    for name, kind in (("bool", bool), ("int", int), ("float", float)):
        if annotation.startswith(name):
            return kind
    return str
