"""Constrained decoding with xgrammar: the per-request matcher, the sampler's mask, Gemma 4's call grammar, and
constrained requests beside free ones in the scheduler (the free ones' tokens must not change)."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch
from serving_fixtures import CONTEXT_LENGTH, PRESET, reference_scheduler

from srt.entrypoints.openai.tool_grammar import tool_call_grammar
from srt.entrypoints.openai.tool_parser import parse_tool_calls
from srt.managers.inprocess import run_to_completion
from srt.managers.io_struct import TokenizedGenerateReq
from srt.managers.scheduler import Scheduler
from srt.sampling.batch_sampler import BatchSampler, RequestSampling
from srt.sampling.grammar import GrammarCompiler, GrammarMatchers, RequestGrammar, check_grammar, tokenizer_info
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs
from srt.tools.tokenizer_builder import build_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 1024
STOP_IDS = [1, 50, 106]  # <eos>, <|tool_response>, <turn|>: the tiny checkpoints' EOS ids
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "opts": {"type": "object", "properties": {"metric": {"type": "boolean"}, "n": {"type": "number"}}},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3},
    },
    "required": ["city", "days"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}},
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(VOCAB)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer_info(tokenizer, VOCAB, STOP_IDS))


@pytest.fixture(scope="module")
def matchers(tokenizer):
    return GrammarMatchers(lambda: tokenizer_info(tokenizer, VOCAB, STOP_IDS))


def allowed(grammar: RequestGrammar) -> list[int]:
    mask = torch.zeros(1, VOCAB // 32, dtype=torch.int32)
    grammar.fill_mask(mask, 0)
    bits = (mask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten().nonzero().flatten().tolist()


def random_walk(grammar: RequestGrammar, rng: random.Random, limit: int = 300) -> list[int]:
    """Tokens drawn uniformly from what the grammar allows, until it terminates."""
    out = []
    while not grammar.terminated and len(out) < limit:
        token = rng.choice(allowed(grammar))
        assert grammar.accept_tokens([token]) == 1
        out.append(token)
    assert grammar.terminated
    return out


def test_bad_grammars_are_refused_by_name():
    check_grammar("json_schema", json.dumps(SCHEMA))
    check_grammar("regex", "(yes|no)[0-9]{2}")
    for kind, source, words in [
        ("json_schema", '{"type": "objec"}', "objec"),
        ("json_schema", "{not json", "not valid JSON"),
        ("json_schema", "[1, 2]", "JSON object"),
        ("regex", "(abc", "parenthesis"),
        ("ebnf", "root ::= missing", "missing"),
    ]:
        with pytest.raises(ValueError, match=words) as error:
            check_grammar(kind, source)
        assert str(error.value).startswith(kind)
    with pytest.raises(ValueError, match="cannot be combined"):
        SamplingParams(regex="a", ebnf='root ::= "a"').validate()


def test_accept_rollback_and_draft_checks(compiler, matchers, tokenizer):
    grammar = matchers.matcher(compiler.compile("regex", "(yes|no)[0-9]{2}"))
    ids = tokenizer("yes42", add_special_tokens=False)["input_ids"]
    bad = tokenizer("maybe", add_special_tokens=False)["input_ids"]
    assert grammar.valid_prefix_len(bad) == 0 and grammar.num_accepted == 0
    assert grammar.valid_prefix_len(ids + bad) == len(ids) and grammar.num_accepted == 0  # state kept
    assert grammar.accept_tokens(ids) == len(ids)
    assert set(allowed(grammar)) == set(STOP_IDS)  # complete: only a stop token may follow
    grammar.rollback(len(ids))
    assert grammar.num_accepted == 0 and grammar.accept_tokens(ids[:1]) == 1
    with pytest.raises(ValueError):
        grammar.rollback(2)
    grammar.catch_up(ids)  # accepts the tokens it has not seen
    assert grammar.num_accepted == len(ids)
    with pytest.raises(RuntimeError, match="breaks"):
        grammar.catch_up([*ids, bad[0]])


def test_strings_stay_utf8_where_xgrammar_takes_surrogate_bytes(compiler, matchers, tokenizer):
    """xgrammar takes ED A0 80 (U+D800, not UTF-8) inside a JSON string; the guard masks and refuses the A0."""
    vocab = tokenizer_info(tokenizer, VOCAB, STOP_IDS).decoded_vocab
    byte_token = {text[0]: i for i, text in enumerate(vocab) if len(text) == 1}
    grammar = matchers.matcher(compiler.compile("json_schema", json.dumps(SCHEMA)))
    opening = tokenizer('{"city": "', add_special_tokens=False)["input_ids"]
    assert grammar.accept_tokens(opening) == len(opening)
    assert grammar.valid_prefix_len([byte_token[0xED], byte_token[0xA0], byte_token[0x80]]) == 1
    assert grammar.valid_prefix_len([byte_token[0xED], byte_token[0x9F], byte_token[0xBF]]) == 3  # U+D7FF
    grammar.accept_tokens([byte_token[0xED]])
    after_ed = set(allowed(grammar))
    assert byte_token[0x80] in after_ed and byte_token[0x9F] in after_ed
    assert not any(vocab[i][0] in range(0xA0, 0xC0) for i in after_ed)
    grammar.rollback(1)  # the whole mask again once ED is taken back
    assert byte_token[0xA0] not in allowed(grammar) and len(allowed(grammar)) > len(after_ed)


def test_sampler_masks_constrained_rows_and_leaves_free_rows_alone(compiler, matchers, tokenizer):
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    grammar = matchers.matcher(compiler.compile("regex", "(yes|no)[0-9]{2}"))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3)]
    outputs: list[list[int]] = [[], [], []]

    def requests(grammars):
        return [RequestSampling(p, None, [2], outputs[i], False, 0, grammars[i]) for i, p in enumerate(params)]

    free = BatchSampler.build(requests([None] * 3), VOCAB, "cpu").sample(logits, logits.argmax(-1))
    mixed_sampler = BatchSampler.build(requests([None, grammar, None]), VOCAB, "cpu")
    mixed = mixed_sampler.sample(logits, logits.argmax(-1))
    assert mixed.next_token_ids[0] == free.next_token_ids[0]
    assert int(mixed.next_token_ids[1]) in allowed(grammar)
    assert int(mixed.next_token_ids[1]) == max(allowed(grammar), key=lambda i: logits[1, i])
    # the next step catches the grammar up with the token the scheduler appended
    outputs[1].append(int(mixed.next_token_ids[1]))
    second = mixed_sampler.sample(logits, logits.argmax(-1))
    assert grammar.num_accepted == 1 and int(second.next_token_ids[1]) in allowed(grammar)


def test_tool_call_grammar_gives_calls_that_validate(compiler, matchers, tokenizer):
    rng = random.Random(0)
    names = frozenset({"get_weather", "noop"})
    for forced, single in [(None, False), ("get_weather", True), (None, True)]:
        serialized = compiler.compile("ebnf", tool_call_grammar(TOOLS, forced, single))
        for _ in range(5):
            ids = random_walk(matchers.matcher(serialized), rng)
            assert ids[-1] in STOP_IDS
            content, calls = parse_tool_calls(tokenizer.decode(ids[:-1], skip_special_tokens=False), names)
            assert content == "" and calls
            assert not single or len(calls) == 1
            for call in calls:
                assert forced is None or call.name == forced
                arguments = json.loads(call.arguments)
                jsonschema.validate(arguments, SCHEMA if call.name == "get_weather" else {"const": {}})


def test_control_tokens_are_never_text_but_the_call_syntax_keeps_its_own(compiler, matchers, tokenizer):
    """xgrammar read `<pad>`, `<|channel>`, ... as their names' characters inside a JSON string, and a reply
    sampled at temperature 1 lost them (or opened a reasoning section there): no control token but the stop ids
    is ever allowed in a JSON reply, while the tool-call grammar starts with Gemma's `<|tool_call>` token."""
    vocab = tokenizer.get_vocab()
    control = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special} - set(STOP_IDS)
    assert {vocab["<pad>"], vocab["<|channel>"], vocab["<|turn>"]} <= control
    rng = random.Random(1)
    schema = compiler.compile("json_schema", json.dumps(SCHEMA))
    for _ in range(20):
        grammar = matchers.matcher(schema)
        inside_string = tokenizer('{"city": "', add_special_tokens=False)["input_ids"]
        assert grammar.accept_tokens(inside_string) == len(inside_string)
        assert not control & set(allowed(grammar))
        assert not control & set(random_walk(grammar, rng))
    call = matchers.matcher(compiler.compile("ebnf", tool_call_grammar(TOOLS, None, False)))
    assert vocab["<|tool_call>"] in allowed(call)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_constrained_and_free_requests_in_one_batch(tiny_checkpoint, compiler, tokenizer, device):
    """Greedy free requests get the tokens they get alone; the constrained ones beside them match their schema."""
    model = tiny_checkpoint(PRESET)
    if device == "cpu":
        scheduler = reference_scheduler(model)
    else:  # the GPU's defaults: triton kernels, CUDA graphs, the overlap schedule for the free-only batch
        scheduler = Scheduler(ServerArgs(model_path=str(model), device="cuda", context_length=CONTEXT_LENGTH))
    prompts = [tokenizer(f"Request {i}: the weather is")["input_ids"] for i in range(4)]
    schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}})

    def request(i: int, constrained: bool) -> TokenizedGenerateReq:
        extra = {"json_schema": schema} if constrained else {"ignore_eos": True}
        params = SamplingParams(temperature=0.0, max_new_tokens=12, **extra)
        req = TokenizedGenerateReq(f"{'c' if constrained else 'f'}{i}", prompts[i], params)
        req.grammar = compiler.compile("json_schema", schema) if constrained else None
        return req

    alone = run_to_completion(scheduler, [request(0, False), request(1, False)])
    mixed = run_to_completion(scheduler, [request(i, i >= 2) for i in range(4)] + [request(0, True)])
    for rid in ("f0", "f1"):
        assert mixed[rid].output_ids == alone[rid].output_ids
    for rid in ("c2", "c3", "c0"):
        ids = mixed[rid].output_ids
        assert ids[-1] in STOP_IDS
        jsonschema.validate(json.loads(tokenizer.decode(ids[:-1])), json.loads(schema))
    scheduler.check_integrity()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_constrained_requests_verify_drafts_against_their_grammar(tiny_checkpoint, compiler, tokenizer, device):
    """With MTP a constrained request verifies drafts, each verify row masked by its grammar after the drafts
    before it: with drafts right for a varying number of leading tokens and wrong after (often tokens the
    grammar refuses), greedy outputs equal those without MTP; sampled ones match the schema."""
    from test_mtp_scheduler import K, knowing_drafter

    model, assistant = tiny_checkpoint(PRESET), tiny_checkpoint(f"{PRESET}-assistant")

    def scheduler(**overrides) -> Scheduler:
        # a bounded pool: on a GPU the default takes most of its memory, and this test builds several schedulers
        args = ServerArgs(model_path=str(model), device=device, dtype="float32", context_length=CONTEXT_LENGTH,
                          max_total_tokens=4096, **overrides)  # fmt: skip
        return Scheduler(args)

    def request(rid: str, prompt: str, **params) -> TokenizedGenerateReq:
        params = SamplingParams(max_new_tokens=100, json_schema=json.dumps(SCHEMA), **params)
        req = TokenizedGenerateReq(rid, tokenizer(prompt)["input_ids"], params)
        req.grammar = compiler.compile("json_schema", json.dumps(SCHEMA))
        return req

    greedy = [request(f"c{i}", f"Request {i}: the weather is", temperature=0.0) for i in range(3)]
    free = TokenizedGenerateReq("f", tokenizer("Free")["input_ids"], SamplingParams(temperature=0.0, max_new_tokens=12))
    expected = run_to_completion(scheduler(), [*greedy, free])
    mtp = scheduler(speculative_draft_model_path=str(assistant), speculative_num_steps=K)
    continuations = {r.rid: list(r.input_ids) + expected[r.rid].output_ids for r in [*greedy, free]}
    knowing_drafter(mtp, continuations, mtp.runner.model_config.vocab_size)
    results = run_to_completion(mtp, [*greedy, free])
    assert {rid: r.output_ids for rid, r in results.items()} == {rid: r.output_ids for rid, r in expected.items()}
    assert all(results[r.rid].spec_verify_ct > 0 for r in greedy)
    assert sum(results[r.rid].spec_accepted_tokens for r in greedy) > 0
    mtp.check_integrity()

    real = scheduler(speculative_draft_model_path=str(assistant), speculative_num_steps=K)
    sampled = [request(f"s{i}", f"Sample {i}:", temperature=1.0, seed=i) for i in range(4)]
    for rid, result in run_to_completion(real, sampled).items():
        ids = result.output_ids
        assert ids[-1] in STOP_IDS and result.spec_verify_ct > 0, (rid, tokenizer.decode(ids))
        jsonschema.validate(json.loads(tokenizer.decode(ids[:-1])), SCHEMA)
    real.check_integrity()
