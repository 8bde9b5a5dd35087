"""Named serving workloads: the published shapes, what the server must run them with, and their runs.

Every workload sends random token-id prompts of exactly `input_len` tokens (range ratio 1) and asks for
exactly `output_len` tokens each (`ignore_eos`, temperature 0). A workload is one or more runs, each at one
concurrency (`--max-concurrency`): with all requests sent at once, that many are open at any time.

| workload     | in / out    | runs: concurrency x prompts (warm-up)  | server                | YOCO A/B |
|--------------|-------------|----------------------------------------|-----------------------|----------|
| fast-prefill | 8192 / 150  | 8 x 32 (8), 32 x 128 (8)               | --disable-radix-cache | on, off  |
| yoco-30x7000 | 7000 / 10   | 30 x 30 (2)                            | --disable-radix-cache | on, off  |
| chat         | 1000 / 1000 | 32 x 128 (8)                           |                       | on       |
| summarize    | 8000 / 1000 | 32 x 128 (8)                           |                       | on       |
| random-mm    | 50 / 10     | 32 x 128 (8); 6 images of 480x480 each | --disable-radix-cache | on       |
| smoke        | 32 / 4      | 2 x 4 (1), 4 x 8 (1)                   | --disable-radix-cache | on, off  |

Prompts per run are 4 x the concurrency (4 waves: enough TTFT samples for a p99 over 128 requests, a
bounded run on an H100: fast-prefill's 128 x 8192 prompts are ~1M prefill tokens, ~15 s on E4B), except
yoco-30x7000, which keeps the published 30 prompts (and the 2 warm-up requests of the earlier serving
figures). Warm-up requests run before each timed run and are not counted: min(concurrency, 8). `smoke` is
a tiny shape for checking the tooling on CPU with a tiny model; it is not a published workload.

`random-mm` is the image shape of vLLM's and SGLang's batched-encoder figures: through the chat API, each
request's one user message holds 6 images of 480x480 random pixels (JPEG data: URLs, all different: the
encoder cache finds none) and ~50 tokens of random text; the prompt the server counts also holds each image's
soft tokens (280 by default) and the chat template. `--random-image-count` and `--random-image-size` override
the images.
"""

from __future__ import annotations

from dataclasses import dataclass

PROMPTS_PER_CONCURRENCY = 4
MAX_WARMUP = 8


@dataclass(frozen=True)
class Run:
    """One timed run of a workload."""

    concurrency: int
    num_prompts: int
    warmup_requests: int


@dataclass(frozen=True)
class Workload:
    name: str
    input_len: int
    output_len: int
    runs: tuple[Run, ...]
    server_args: tuple[str, ...]  # flags launch_server needs for this workload
    yoco: tuple[bool, ...]  # GEMMA4_YOCO settings serving_ab.py runs by default, in order
    about: str
    images: int = 0  # random images per request (chat only)
    image_size: tuple[int, int] = (0, 0)  # (width, height)

    @property
    def backend(self) -> str:
        """The endpoint it loads: chat when requests carry images, else completions (exact token ids)."""
        return "chat" if self.images else "completions"

    @property
    def disables_radix_cache(self) -> bool:
        return "--disable-radix-cache" in self.server_args


def run_at(concurrency: int, num_prompts: int | None = None, warmup_requests: int | None = None) -> Run:
    """A run at `concurrency`; by default 4 prompts per slot and min(concurrency, 8) warm-up requests."""
    return Run(
        concurrency=concurrency,
        num_prompts=num_prompts or PROMPTS_PER_CONCURRENCY * concurrency,
        warmup_requests=min(concurrency, MAX_WARMUP) if warmup_requests is None else warmup_requests,
    )


RADIX_OFF = ("--disable-radix-cache",)
YOCO_AB = (True, False)

WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(
            "fast-prefill", 8192, 150, (run_at(8), run_at(32)), RADIX_OFF, YOCO_AB,
            "long prompts, short answers: YOCO's fast prefill at two concurrencies",
        ),
        Workload(
            "yoco-30x7000", 7000, 10, (run_at(30, 30, 2),), RADIX_OFF, YOCO_AB,
            "30 prompts of 7000 tokens at once: prefill throughput",
        ),
        Workload("chat", 1000, 1000, (run_at(32),), (), (True,), "chat-sized prompts and answers"),
        Workload("summarize", 8000, 1000, (run_at(32),), (), (True,), "long prompts, long answers"),
        Workload(
            "random-mm", 50, 10, (run_at(32),), RADIX_OFF, (True,),
            "6 images of 480x480 and 50 tokens of text per chat request: the batched image encoder",
            images=6, image_size=(480, 480),
        ),
        Workload(
            "smoke", 32, 4, (run_at(2, 4, 1), run_at(4, 8, 1)), RADIX_OFF, YOCO_AB,
            "tiny shapes for checking the tooling on CPU (not a published workload)",
        ),
    )
}  # fmt: skip


def get_workload(name: str) -> Workload:
    """The workload called `name`; ValueError listing the known ones otherwise."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    return WORKLOADS[name]


def describe() -> str:
    """One line per workload, for --help."""
    lines = []
    for w in WORKLOADS.values():
        runs = ", ".join(f"{r.concurrency} x {r.num_prompts} ({r.warmup_requests})" for r in w.runs)
        server = " ".join(w.server_args) or "default server"
        yoco = "/".join("on" if on else "off" for on in w.yoco)
        images = f" + {w.images} images of {w.image_size[0]}x{w.image_size[1]} (chat)" if w.images else ""
        lines.append(
            f"  {w.name:<13} {w.input_len} in{images} / {w.output_len} out; concurrency x prompts (warm-up):"
            f" {runs}; {server}; YOCO {yoco}"
        )
    return "\n".join(lines)
