"""Wait until a server answers /health, then print copy-paste examples (`make serve` uses this).

python -m srt.entrypoints.ready_banner --url http://127.0.0.1:30000 --model NAME [--pid PID] [--random-weights]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import urllib.request

POLL_S = 0.5


def wait_ready(url: str, pid: int | None, timeout: float) -> bool:
    """True once GET {url}/health answers 200; False if `pid` exits first or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pid is not None and not _running(pid):
            return False
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as response:
                if response.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(POLL_S)
    return False


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


RANDOM_WEIGHTS_NOTE = """
Its weights are random (a tiny test checkpoint or --load-format dummy): it answers with gibberish. That is
expected; serve a real checkpoint (launch_server --model DIR) for real text.
"""


def examples(url: str, model: str, random_weights: bool = False) -> str:
    """The banner: where srt serves, copy-paste requests, and a word on gibberish if the weights are random."""
    body = f'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 16}}'
    note = RANDOM_WEIGHTS_NOTE if random_weights else ""
    return f"""
srt is serving {model} on {url}.{note} Try:

  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{body}'

  {sys.executable} -c "from openai import OpenAI; c = OpenAI(base_url='{url}/v1', api_key='none'); \\
print(c.completions.create(model='{model}', prompt='Once upon a time', max_tokens=16).choices[0].text)"

Ctrl-C stops the server.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--pid", type=int, help="give up if this process (the server) exits first")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--random-weights", action="store_true", help="say that the model's output is gibberish")
    args = parser.parse_args()
    if not wait_ready(args.url, args.pid, args.timeout):
        sys.exit(f"the server at {args.url} did not become ready")
    print(examples(args.url, args.model, args.random_weights), flush=True)


if __name__ == "__main__":
    main()
