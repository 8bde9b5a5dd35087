"""Run lm-eval tasks through a running srt server and through lm-eval's own Hugging Face backend on the same
checkpoint; print the largest per-sample |Δ loglikelihood| and how many generations differ.

    cd test/data/lm_eval && python ../../../bench/lm_eval_compare.py --base-url http://127.0.0.1:30000 \\
        --model /path/to/checkpoint --tasks srt_tiny_mc,srt_tiny_gen

Paths in the task files are relative, hence the `cd`. The server must serve the checkpoint under its path
(`--served-model-name` defaults to it). srt is asked as lm-eval's `local-completions` model with text prompts
(`tokenized_requests=False`): lm-eval then finds `/tokenizer_info` and tokenizes with the server's own
tokenizer (its `remote` backend). Exits 1 if any loglikelihood differs by more than --tolerance.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Any

DEFAULT_TOLERANCE = 1e-4


@dataclass
class Comparison:
    max_abs_delta: float  # over every loglikelihood request of every task
    loglikelihoods: int
    generations: int
    differing_generations: int

    def summary(self) -> str:
        return (
            f"max |Δ loglikelihood| = {self.max_abs_delta:.3g} over {self.loglikelihoods} requests; "
            f"{self.differing_generations} of {self.generations} generations differ"
        )


def srt_model_args(base_url: str, model: str) -> str:
    """lm-eval's `--model_args` for srt with text prompts (the exact setting docs/usage.md gives)."""
    return f"model={model},base_url={base_url}/v1/completions,tokenized_requests=False,max_length=512"


def hf_model_args(model: str) -> str:
    return f"pretrained={model},dtype=float32,device=cpu"


def make_lm(model: str, model_args: str) -> Any:
    """lm-eval's model object (an `lm_eval.api.model.LM`) as `--model model --model_args model_args` makes it."""
    from lm_eval.api.registry import get_model

    return get_model(model).create_from_arg_string(model_args, {"batch_size": 1})


def evaluate(lm: Any, tasks: list[str], include_path: str) -> dict[str, list[dict]]:
    """Per task, lm-eval's logged samples (one dict per document, its requests' responses in `resps`)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=include_path, include_defaults=False)  # indexing every task: 10 s
    results = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, log_samples=True)
    return {task: sorted(samples, key=lambda s: s["doc_id"]) for task, samples in results["samples"].items()}


def compare(srt: dict[str, list[dict]], hf: dict[str, list[dict]]) -> Comparison:
    worst, lls, gens, differ = 0.0, 0, 0, 0
    for task, samples in hf.items():
        for ours, theirs in zip(srt[task], samples, strict=True):
            for a, b in zip(_responses(ours), _responses(theirs), strict=True):
                if isinstance(b, str):
                    gens += 1
                    differ += a != b
                else:
                    lls += 1
                    worst = max(worst, abs(a - b))
    return Comparison(worst, lls, gens, differ)


def _responses(sample: dict) -> list[Any]:
    """A document's responses: a loglikelihood float per choice, or the generated text."""
    out = []
    for resp in sample["resps"]:
        value = resp[0]
        out.append(value if isinstance(value, str) else float(value[0]))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True, help="the srt server, e.g. http://127.0.0.1:30000")
    parser.add_argument("--model", required=True, help="the checkpoint directory the server serves")
    parser.add_argument("--tasks", default="srt_tiny_mc,srt_tiny_gen")
    parser.add_argument("--include-path", default=".", help="directory of the task files (default: here)")
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    tasks = args.tasks.split(",")
    srt_lm = make_lm("local-completions", srt_model_args(args.base_url, args.model))
    print(f"lm-eval tokenizes with the {srt_lm.tokenizer_backend!r} backend")  # "remote": the server's /tokenize
    srt = evaluate(srt_lm, tasks, args.include_path)
    hf = evaluate(make_lm("hf", hf_model_args(args.model)), tasks, args.include_path)
    result = compare(srt, hf)
    print(result.summary())
    return 0 if result.max_abs_delta <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
