"""The detokenizer process: token ids from the scheduler in, text deltas to the tokenizer manager out.

It keeps one `IncrementalDetokenizer` per request, from the scheduler's `DetokenizeInit` to the request's
last output. When a stop string ends a request it cuts the output there, reports it finished, and tells the
scheduler to stop generating (an `AbortReq`: the request's slots are freed within a step). Outputs of a
request it no longer tracks (the tokens the scheduler made before that abort arrived) are dropped.
Every other message (errors, stats) is passed through unchanged.
"""

from __future__ import annotations

import dataclasses
import logging
import traceback
from multiprocessing.connection import Connection

import zmq

from srt.managers.detokenizer import IncrementalDetokenizer
from srt.managers.io_struct import (
    AbortReq,
    BatchStrOut,
    BatchTokenIDOut,
    DetokenizeInit,
    FinishReason,
    GenerateError,
    ReqOutput,
    StrOutput,
)
from srt.managers.ipc import PARENT_CHECK_INTERVAL_S, PortArgs, ReadyReport, parent_alive, report, setup_child, socket
from srt.managers.tokenizer_loader import load_decoder
from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


def run_detokenizer_process(
    server_args: ServerArgs, port_args: PortArgs, ready_pipe: Connection, parent_pid: int
) -> None:
    """Process entry point: load the tokenizer, report readiness (or the error), then serve until orphaned."""
    setup_child("detokenizer", server_args.log_level)
    try:
        manager = DetokenizerManager(load_decoder(server_args), port_args)
    except Exception:
        report(ready_pipe, ReadyReport(ok=False, error=traceback.format_exc()))
        return
    report(ready_pipe, ReadyReport(ok=True))
    manager.run(parent_pid)


class DetokenizerManager:
    def __init__(self, tokenizer, port_args: PortArgs) -> None:
        self.tokenizer = tokenizer
        self.context = zmq.Context()
        self.recv_socket = socket(self.context, zmq.PULL, port_args.detokenizer_input, bind=True)
        self.send_socket = socket(self.context, zmq.PUSH, port_args.tokenizer_input, bind=False)
        self.abort_sockets = [  # one per data-parallel replica
            socket(self.context, zmq.PUSH, address, bind=False) for address in port_args.replica_inputs
        ]
        self.states: dict[str, IncrementalDetokenizer] = {}
        self.replica_of: dict[str, int] = {}
        self.port_args = port_args

    def run(self, parent_pid: int) -> None:
        while parent_alive(parent_pid):
            if not self.recv_socket.poll(int(PARENT_CHECK_INTERVAL_S * 1000)):
                continue
            self.handle(self.recv_socket.recv_pyobj())
        logger.info("parent process is gone; exiting")
        self.port_args.cleanup()  # a parent killed by SIGKILL could not remove the socket files

    def handle(self, message: object) -> None:
        if isinstance(message, DetokenizeInit):
            self.states[message.rid] = IncrementalDetokenizer(self.tokenizer, message.stop, message.skip_special_tokens)
            self.replica_of[message.rid] = message.replica
        elif isinstance(message, BatchTokenIDOut):
            outputs = [out for out in map(self.detokenize, message.outputs) if out is not None]
            if outputs:
                self.send_socket.send_pyobj(BatchStrOut(outputs, message.times.stamp("detokenizer")))
        else:
            if isinstance(message, GenerateError):
                self.states.pop(message.rid, None)
                self.replica_of.pop(message.rid, None)
            self.send_socket.send_pyobj(message)

    def detokenize(self, output: ReqOutput) -> StrOutput | None:
        state = self.states.get(output.rid)
        if state is None:
            return None  # ended by a stop string already: the scheduler is being told to stop
        result = state.add(output.new_token_ids, finished=output.finished)
        if result.stop_matched is not None:
            if not output.finished:
                self.abort_sockets[self.replica_of[output.rid]].send_pyobj(AbortReq(output.rid))
            output = cut_at_stop(output, result.num_tokens, result.stop_matched)
        if output.finished:
            del self.states[output.rid]
            del self.replica_of[output.rid]
        if not (output.new_token_ids or output.input_logprobs or output.finished):
            return None  # a prefill chunk: nothing to tell
        return StrOutput(output, result.text)


def cut_at_stop(output: ReqOutput, num_tokens: int, stop: str) -> ReqOutput:
    """The output up to the token that completed `stop`, finished by it."""
    dropped = len(output.new_token_ids) - num_tokens
    return dataclasses.replace(
        output,
        new_token_ids=output.new_token_ids[:num_tokens],
        output_logprobs=output.output_logprobs[:num_tokens],
        completion_tokens=output.completion_tokens - dropped,
        finished_reason=FinishReason("stop", stop),
    )
