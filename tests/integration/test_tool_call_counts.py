"""Tool calls a policy writes malformed are counted per session (``traj_agent/malformed_tool_call_share``), through
verl's own hermes parser, instead of logged at ERROR; outside a training session verl's log line stays. A parsed call
no tool can run (unknown name, arguments the tool's schema refuses) is answered with what is wrong, counted malformed,
and neither run nor logged."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf
from verl.experimental.agent_loop import tool_parser
from verl.experimental.agent_loop.tool_parser import HermesToolParser

from verl_traj.core.rollout.session_ledger import TOOL_CALLS_TAG, session_ledger
from verl_traj.integration.agent_loops.stepwise_agent_loop import (CountingToolParser, StepwiseToolAgentLoop,
                                                                   add_malformed_counter)
from verl_traj.integration.agent_loops.tool_call_checks import strict_parameters, tool_call_problem
from verl_traj.integration.patches.process import install, tool_parser_log_patches
from verl_traj.integration.trainers.v1_metrics import tool_call_metrics

TEXT = ('<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>')


class _Tokenizer:
    def decode(self, ids):
        return TEXT


def _parse(parser) -> list:
    async def run():
        return (await parser.extract_tool_calls([1, 2, 3]))[1]
    return asyncio.run(run())


def test_a_sessions_malformed_tool_calls_are_counted_not_logged_and_logged_outside_one(caplog):
    install(tool_parser_log_patches(add_malformed_counter), on_import=None)
    install(tool_parser_log_patches(add_malformed_counter), on_import=None)  # idempotent: one filter
    assert sum(type(f).__name__ == "MalformedToolCallCounter" for f in tool_parser.logger.filters) == 1
    parser = CountingToolParser(HermesToolParser(_Tokenizer()))
    with caplog.at_level(logging.ERROR):
        with session_ledger() as ledger:
            calls = _parse(parser)
        assert len(calls) == 1 and not [r for r in caplog.records if "Failed to decode" in r.getMessage()]
        assert ledger.tags()[TOOL_CALLS_TAG] == [1, 1]
        _parse(parser)  # no session: verl's line as before
    assert [r for r in caplog.records if "Failed to decode tool call" in r.getMessage()]


def test_every_verl_parsers_decode_failure_is_counted_and_other_records_pass():
    from verl_traj.integration.agent_loops.stepwise_agent_loop import MalformedToolCallCounter

    counter = MalformedToolCallCounter()

    def record(msg):
        return logging.LogRecord("verl", logging.ERROR, __file__, 1, msg, None, None)

    with session_ledger() as ledger:
        assert not counter.filter(record("Failed to decode tool call: Expecting value"))  # hermes, gpt-oss
        assert not counter.filter(record("Failed to decode GLM tool call: bad json"))  # glm, seed, minimax, ...
        assert counter.filter(record("Failed to load tool config"))  # not a model's malformed call: logged
    assert ledger.malformed_tool_calls == 2


def test_tool_call_metrics_are_shares_of_the_calls_written():
    tags = [{TOOL_CALLS_TAG: [3, 1]}, {TOOL_CALLS_TAG: [2, 0]}, {}]
    out = tool_call_metrics(tags)
    assert out["traj_agent/malformed_tool_call_share"] == 1 / 6
    assert out["traj_agent/tool_calls_mean"] == 2.0
    assert tool_call_metrics([{}, {}]) == {}


# ---------------------------------------------------------------------------------------------------------------------
# calls no tool can run: answered with what is wrong, counted malformed, never run, never logged
# ---------------------------------------------------------------------------------------------------------------------
def probe(text: str, count: int = 1, scale: float = 1.0) -> str:
    """A probe tool.

    Args:
        text: any text.
        count: how many.
        scale: a factor.
    """
    return f"{text}:{count * scale}"


ARG_VALUES = st.one_of(st.text(max_size=5), st.integers(-5, 5), st.floats(allow_nan=False, width=16), st.booleans(),
                       st.none(), st.lists(st.integers(0, 3), max_size=2), st.just({"expression": "1 + 2"}))
PYTHON_TYPES = {"text": (str,), "count": (int,), "scale": (int, float)}


@given(args=st.dictionaries(st.sampled_from(["text", "count", "scale", "arguments", "expr"]), ARG_VALUES, max_size=4))
@settings(max_examples=300, deadline=None)
def test_a_function_tool_call_passes_the_check_exactly_when_its_signature_takes_it(args):
    """Refused iff ``fn(**args)`` could not bind (an argument it does not take, a required one missing): a call with
    values of other types than the hints is the function's to take (Python does not enforce hints), never refused."""
    from verl.tools.function_tool import function_tool, get_function_tool

    function_tool("traj_test_probe")(probe)  # verl's own schema inference from the signature (idempotent)
    tool = get_function_tool("traj_test_probe")
    problem = tool_call_problem("traj_test_probe", json.dumps(args), {"traj_test_probe": strict_parameters(tool)})
    try:
        inspect.signature(probe).bind(**args)
        binds = True
    except TypeError:
        binds = False
    assert (problem is None) == binds, (args, problem)
    typed = all(not isinstance(v, bool) and isinstance(v, PYTHON_TYPES[k]) for k, v in args.items() if k in PYTHON_TYPES)
    if problem is None and typed:
        assert asyncio.run(tool.call(args)).startswith(args["text"])  # the call runs
    elif problem is not None:
        assert problem.startswith("Invalid arguments for 'traj_test_probe': ")
        assert all(f"'{k}'" in problem for k in args if k not in PYTHON_TYPES)  # each unexpected argument named
        assert "traj_test_probe takes: text (string, required), count (integer), scale (number)" in problem


def test_an_answer_names_at_most_five_wrong_arguments_each_cut_to_40_characters():
    parameters = {"properties": {"x": {"type": "integer"}}, "required": ["x"]}
    args = {("k" * 100) + str(i): i for i in range(20)}
    problem = tool_call_problem("f", json.dumps(args), {"f": parameters})
    assert problem.count("unexpected argument") == 5 and "and 16 more" in problem and "k" * 41 not in problem
    assert tool_call_problem("f", '{"x": null}', {"f": parameters}) is None  # types are the function's to check


def test_unknown_tools_and_non_object_arguments_are_refused_for_every_tool_kind():
    tools = {"calculator": None}  # a BaseTool: any JSON object, the tool decides
    assert tool_call_problem("calculator", '{"anything": 1}', tools) is None
    assert tool_call_problem("-calculator", "{}", tools) == "Unknown function '-calculator'. Available tools: ['calculator']"
    assert tool_call_problem("calculator", "{x", tools).startswith("Invalid JSON in arguments for 'calculator': ")
    assert tool_call_problem("calculator", '"1 + 2"', tools) == (
        "Invalid arguments for 'calculator': expected a JSON object of named arguments, got str \"1 + 2\".")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from verl_traj.cpu.build_tiny import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tok"), 512, 0)


class _Out:
    def __init__(self, ids):
        self.token_ids, self.log_probs = ids, [-0.1] * len(ids)
        self.num_preempted, self.extra_fields, self.routed_experts = None, {}, None


class _ScriptedServer:
    """Answers turn k with ``turns[k]``."""

    def __init__(self, tok, turns):
        self.tok, self.turns, self.calls = tok, turns, 0

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kw):
        self.calls += 1
        return _Out(self.tok.encode(self.turns[self.calls - 1], add_special_tokens=False))


def _call(arguments: str) -> str:
    return f'<tool_call>\n{{"name": "calculator", "arguments": {arguments}}}\n</tool_call><|im_end|>'


def test_the_training_loop_answers_a_call_the_calculator_cannot_take_and_counts_it(tokenizer, caplog):
    """verl's real ToolAgentLoop machinery (as the quick start builds it: hermes, the recipe's calculator loaded by
    path) on a scripted server whose first call nests its arguments, as the warm-started model does."""
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from verl_traj.recipes.calc_agent.task import calc_tools

    cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": {
        "prompt_length": 512, "response_length": 512, "full_determinism": False,
        "multi_turn": {"max_user_turns": 8, "max_assistant_turns": 8, "max_parallel_calls": 1,
                       "max_tool_response_length": 256, "tool_response_truncate_side": "middle", "format": "hermes"}}},
        "data": {"apply_chat_template_kwargs": {}}})
    turns = [_call('{"arguments": {"expression": "2 + 3"}}'), _call('{"expression": "2 + 3"}'), "<answer>5</answer><|im_end|>"]

    async def main():
        loop = StepwiseToolAgentLoop(trainer_config=DictConfigWrap(cfg), server_manager=_ScriptedServer(tokenizer, turns),
                                     tokenizer=tokenizer, processor=None, dataset_cls=RLHFDataset,
                                     data_config=DictConfigWrap(cfg.data), tools=ToolListWrap(calc_tools()))
        with session_ledger() as ledger:
            out = await loop.run({"temperature": 1.0}, raw_prompt=[{"role": "user", "content": "What is 2 + 3?"}])
        return out, ledger

    with caplog.at_level(logging.WARNING):
        out, ledger = asyncio.run(main())
    text = tokenizer.decode(out.response_ids)
    assert ("Invalid arguments for 'calculator': unexpected argument 'arguments'; missing required argument "
            "'expression'. calculator takes: expression (string, required).") in text, text
    assert "<tool_response>\n5\n</tool_response>" in text  # the well-formed call after it ran
    assert ledger.tags()[TOOL_CALLS_TAG] == [1, 1]  # one parsed, one malformed: traj_agent/malformed_tool_call_share
    logged = [r.getMessage() for r in caplog.records if "agent_loop" in r.name or "tools" in r.name]  # verl's loggers
    assert not logged, logged  # verl logs "Error executing tool 'calculator': calculator() got an unexpected ..."
