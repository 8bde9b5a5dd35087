"""`launch_server` / `python -m srt.launch_server`: serve a model over HTTP.

launch_server --model google/gemma-4-E4B-it --port 30000
launch_server --model tiny-gemma-4-E4B-it --load-format dummy     # random weights, real shapes
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence

from srt.server_args import ServerArgs


def parse_args(argv: Sequence[str] | None = None) -> ServerArgs:
    """ServerArgs from the command line, with --model resolved to a checkpoint (exit 2 with the reason if not)."""
    parser = argparse.ArgumentParser(
        prog="launch_server",
        description="Serve a Gemma 4 model over an OpenAI-compatible HTTP API.",
    )
    ServerArgs.add_cli_args(parser)
    namespace = parser.parse_args(argv)
    from srt.entrypoints.engine import make_server_args  # imported late: `--help` stays fast

    fields = vars(namespace)
    try:
        return make_server_args(fields.pop("model_path"), **fields)
    except ValueError as error:
        parser.error(str(error))


def main(argv: Sequence[str] | None = None) -> None:
    server_args = parse_args(argv)
    logging.basicConfig(
        level=server_args.log_level.upper(), format="[%(asctime)s server] %(levelname)s %(name)s: %(message)s"
    )
    # Until uvicorn installs its own handlers, SIGTERM must still unwind (and so stop the children).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    from srt.entrypoints.http_server import launch_server
    from srt.entrypoints.processes import run_node_ranks

    try:
        if server_args.node_rank > 0:  # only this node's ranks: node 0 serves HTTP
            run_node_ranks(server_args)
        else:
            launch_server(server_args)
    except KeyboardInterrupt:
        pass
    except RuntimeError as error:  # a child failed to start (its traceback is the message) or died
        logging.getLogger("srt").error("%s", error)
        # Every child is stopped and the socket files are gone by now. Skip the interpreter's teardown: its
        # last garbage collection over the tokenizer's and FastAPI's objects took 1-5 s on the CI machine,
        # and a supervisor waiting to restart the server should not wait for it.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    main()
