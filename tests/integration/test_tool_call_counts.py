"""Tool calls a policy writes malformed are counted per session (``traj_agent/malformed_tool_call_share``), through
verl's own hermes parser, instead of logged at ERROR; outside a training session verl's log line stays."""

from __future__ import annotations

import asyncio
import logging

from verl.experimental.agent_loop import tool_parser
from verl.experimental.agent_loop.tool_parser import HermesToolParser

from verl_traj.integration.process_patches import install, tool_parser_log_patches
from verl_traj.integration.session_ledger import TOOL_CALLS_TAG, session_ledger
from verl_traj.integration.stepwise_agent_loop import CountingToolParser, add_malformed_counter
from verl_traj.integration.v1_metrics import tool_call_metrics

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
    from verl_traj.integration.stepwise_agent_loop import MalformedToolCallCounter

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
