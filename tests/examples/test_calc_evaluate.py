"""The recipe's offline evaluator (``verl_traj.recipes.calc_agent.evaluate``): tool calls run as verl's loop
runs them, and the episode loop on verl's hermes parser and the real calculator tool. ``play`` is
driven by an oracle model that answers each turn with the correct next message of the episode (read off the prompt it is given), and by the tiny random model through real
Hugging Face ``generate``."""

import asyncio
import json
import logging
import random

import pytest
import torch

from verl_traj.recipes.calc_agent import evaluate
from verl_traj.recipes.calc_agent import task

CALL = '<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{}"}}}}\n</tool_call>'


@pytest.fixture(scope="module")
def tools():
    from verl_traj.recipes.calc_agent.task import calc_tools

    return {tool.name: tool for tool in calc_tools()}


def _call(name, arguments):
    from verl.experimental.agent_loop.tool_parser import FunctionCall

    return FunctionCall(name=name, arguments=arguments)


def test_call_tool_runs_the_real_tool_and_reports_errors_as_verl_does(tools):
    run = lambda name, arguments: asyncio.run(evaluate.call_tool(tools, _call(name, arguments)))  # noqa: E731
    assert run("calculator", '{"expression": "(12 + 7) * 3"}') == "57"
    assert run("calculator", '{"expression": "2 / 3"}').startswith("error: unsupported element")  # the tool's own error
    assert run("search", '{"q": "x"}') == "Unknown function 'search'. Available tools: ['calculator']"
    assert run("calculator", "{not json").startswith("Invalid JSON in arguments for 'calculator'")
    # arguments the calculator cannot take: answered with what is wrong, never run (verl would raise inside it)
    assert run("calculator", '{"expr": "1 + 1"}') == (
        "Invalid arguments for 'calculator': unexpected argument 'expr'; missing required argument 'expression'. "
        "calculator takes: expression (string, required).")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from verl_traj.cpu.build_tiny import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=600, seed=0)


class OracleModel:
    """``generate`` that emits the correct next assistant turn of each problem in the batch (the
    problem is found by its question, the turn by the number of tool results already in the prompt);
    with ``wrong_answer`` the final answer is off by one."""

    def __init__(self, tokenizer, problems, wrong_answer=False, first_turn=None):
        self.tokenizer, self.wrong_answer, self.first_turn = tokenizer, wrong_answer, first_turn
        self.by_question = {p.question: p for p in problems}

    def _next_turn(self, prompt: str) -> str:
        problem = next(p for q, p in self.by_question.items() if q in prompt)
        done = prompt.count("<tool_response>")
        if self.first_turn is not None and done == 0:
            return self.first_turn
        if done < len(problem.steps):
            return "\n" + CALL.format(problem.steps[done][0])  # as the chat template renders a call turn
        return f"<answer>{problem.answer + int(self.wrong_answer)}</answer>"

    def generate(self, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id, **sampling):
        tok = self.tokenizer
        new = [tok(self._next_turn(tok.decode(row[mask.bool()])), add_special_tokens=False)["input_ids"] + [eos_token_id]
               for row, mask in zip(input_ids, attention_mask)]
        width = max(map(len, new))
        assert width <= max_new_tokens
        tail = torch.tensor([ids + [pad_token_id] * (width - len(ids)) for ids in new])
        return torch.cat([input_ids, tail], dim=1)


@pytest.mark.parametrize("wrong_answer", [False, True])
def test_play_runs_the_tool_loop(tokenizer, tools, wrong_answer):
    rng = random.Random(3)
    problems = [task.make_problem(rng, n, 9) for n in (1, 2, 3, 3)]
    results = evaluate.play(OracleModel(tokenizer, problems, wrong_answer), tokenizer, problems, tools,
                            temperature=0.0, max_turns=5)
    assert [r["calls"] for r in results] == [len(p.steps) for p in problems]
    for r, p in zip(results, problems):
        # the calculator really ran: each call's result is in the transcript as a tool response
        for _, value in p.steps:
            assert f"<tool_response>\n{value}\n</tool_response>" in r["response"]
        # all intermediates reached: full credit, or 0.1 + 0.5 for a well-formed wrong answer
        assert r["score"] == (pytest.approx(0.6) if wrong_answer else 1.0)
        assert r["correct"] is (not wrong_answer)
        # a call turn re-renders as the template renders it (content "" around the call), not with "\n" added
        assert all(m["content"] == "" for m in r["messages"] if m.get("tool_calls")), r["messages"]


BROKEN = '\n<tool_call>\n{"name": "calculator", "arguments": {"expression": </tool_call>'  # not JSON
NESTED = '\n<tool_call>\n{"name": "calculator", "arguments": {"arguments": {"expression": "2 + 3"}}}\n</tool_call>'


@pytest.mark.parametrize("first_turn, answered", [
    (BROKEN, None),  # the parser cannot decode it: the turn has no call and ends the episode
    (NESTED, "Invalid arguments for 'calculator': unexpected argument 'arguments'; missing required argument "
             "'expression'. calculator takes: expression (string, required)."),  # the calculator cannot take it
])
def test_play_counts_malformed_calls_as_training_does_and_logs_none(tokenizer, tools, caplog, first_turn, answered):
    problems = [task.make_problem(random.Random(7), 1, 9), task.make_problem(random.Random(8), 2, 9)]
    model = OracleModel(tokenizer, problems, first_turn=first_turn)
    with caplog.at_level(logging.DEBUG):
        results = evaluate.play(model, tokenizer, problems, tools, temperature=0.0, max_turns=5)
    logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not logged, logged  # verl's hermes parser logs "Failed to decode tool call: ..." at ERROR outside a session
    assert [r["tool_calls"][1] for r in results] == [1, 1]  # [parsed, malformed] per episode, as traj_agent/* counts
    for r in results:
        if answered is None:
            assert r["calls"] == 0 and r["tool_calls"] == [0, 1]
        else:  # answered as a tool would answer, and the episode goes on
            assert f"<tool_response>\n{answered}\n</tool_response>" in r["response"] and r["calls"] >= 1


def test_play_stops_at_max_turns(tokenizer, tools):
    problems = [task.make_problem(random.Random(5), 3, 9)]
    results = evaluate.play(OracleModel(tokenizer, problems), tokenizer, problems, tools, temperature=0.0,
                            max_turns=2)
    assert results[0]["calls"] == 2 and not results[0]["correct"]


def test_evaluate_model_on_the_tiny_model(tmp_path, capsys):
    """Real ``generate`` on a random tiny model: the loop and the JSON report hold together."""
    from verl_traj.cpu.build_tiny import build_model, build_tokenizer

    tok = build_tokenizer(tmp_path, vocab_size=600, seed=0)
    build_model(tmp_path, tok, seed=0, hidden=32, layers=1)
    evaluate.main(["--model", str(tmp_path), "--samples", "3", "--temperature", "1.0"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["samples"] == 3 and 0.0 <= report["accuracy"] <= report["mean_reward"] + 1e-9 <= 1.0 + 1e-9
    assert 0.0 <= report["mean_calls"] <= 5


@pytest.mark.parametrize("args, named", [(["--model", "/nonexistent/model"], "--model /nonexistent/model"),
                                         (["--samples", "0"], "--samples 0")])
def test_evaluate_cli_rejects_bad_input_by_name(tmp_path, capsys, args, named):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as exc:
        evaluate.main(["--model", str(tmp_path), *args])
    assert exc.value.code == 2
    assert named in capsys.readouterr().err


@pytest.mark.parametrize("args, named", [(["--sft-steps", "0"], "--sft-steps 0"), (["--eval-samples", "-1"], "--eval-samples -1")])
def test_prepare_cli_rejects_bad_input_by_name(tmp_path, capsys, args, named):
    from verl_traj.recipes.calc_agent import prepare

    with pytest.raises(SystemExit) as exc:
        prepare.main(["--home", str(tmp_path), *args])
    assert exc.value.code == 2
    assert named in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # refused before writing anything
