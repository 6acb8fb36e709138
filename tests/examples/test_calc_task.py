"""The calculator-agent recipe's task: safe evaluation, problem generation, reward."""

import gc
import random
import sys
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_traj.recipes.calc_agent import task


@given(seed=st.integers(0, 10_000), num_ops=st.integers(1, 4))
@settings(max_examples=200, deadline=None)
def test_problem_steps_chain_to_answer(seed, num_ops):
    problem = task.make_problem(random.Random(seed), num_ops)
    assert task.evaluate(problem.expression) == problem.answer
    assert len(problem.steps) == num_ops
    value = None
    for call, result in problem.steps:
        if value is not None:
            assert call.startswith(f"{value} ")  # each call uses the previous tool result
        assert task.evaluate(call) == result
        value = result
    assert value == problem.answer


@pytest.mark.parametrize("bad", ["__import__('os')", "2 ** 100", "1 / 0", "x + 1", "", "1e3 + 1", "True + 1"])
def test_calculator_rejects_anything_but_integer_arithmetic(bad):
    with pytest.raises(task.CalculatorError):
        task.evaluate(bad)


def test_reward_levels():
    info = {"intermediates": [19, 57]}
    call = '<tool_call>{{"name": "calculator", "arguments": {{"expression": "{}"}}}}</tool_call>'
    assert task.compute_score("calc_agent", call.format("12 + 7") + " <answer>57</answer>", "57", info) == 1.0
    assert task.compute_score("calc_agent", "<answer>56</answer>", "57", info) == 0.1
    assert task.compute_score("calc_agent", "the answer is 57", "57", info) == 0.0
    # the LAST answer counts
    assert task.compute_score("calc_agent", "<answer>57</answer> <answer>1</answer>", "57", info) == 0.1
    # partial credit: intermediate values reached by the agent's own calls, in order, re-evaluated here
    assert task.compute_score("calc_agent", call.format("12 + 7") + " <answer>5</answer>", "57", info) == 0.1 + 0.25
    assert task.compute_score("calc_agent", call.format("19 * 3") + call.format("12 + 7"), "57", info) == 0.25
    assert task.compute_score("calc_agent", call.format("12+7") + call.format("19*3"), "57", info) == 0.5
    assert task.compute_score("calc_agent", call.format("import os") + call.format("2 ** 9"), "57", info) == 0.0
    assert task.compute_score("calc_agent", call.format("12 + 7"), "57", None) == 0.0  # no intermediates given


def test_transcript_is_a_correct_episode():
    problem = task.make_problem(random.Random(1), 3)
    messages = task.transcript(problem)
    calls = [m["tool_calls"][0]["function"]["arguments"]["expression"] for m in messages if m.get("tool_calls")]
    results = [int(m["content"]) for m in messages if m["role"] == "tool"]
    assert calls == [c for c, _ in problem.steps] and results == [r for _, r in problem.steps]
    assert task.compute_score("calc_agent", messages[-1]["content"], str(problem.answer)) == 1.0


def test_turn_rewards_reward_calls_the_calculator_can_compute():
    from verl_traj.recipes.calc_agent.agent_loop import TURN_REWARD, turn_rewards

    good = '<tool_call>{"name": "calculator", "arguments": {"expression": "3 + 4 * 2"}}</tool_call>'
    bad = '<tool_call>{"name": "calculator", "arguments": {"expression": "3 +"}}</tool_call>'
    assert turn_rewards([good, bad, "<answer>11</answer>", ""]) == [TURN_REWARD, 0.0, 0.0, 0.0]


class _Finalized:
    """Garbage whose finalizer runs Python code: a collection inside ast.parse lets another thread run there."""

    def __init__(self):
        self.cycle = self

    def __del__(self):
        sum(range(50))


def test_the_calculator_evaluates_from_many_threads_at_once():
    """verl runs the (sync) calculator tool with asyncio.to_thread and reward functions in an executor. CPython 3.11's
    ast.parse keeps its recursion depth per interpreter: concurrent parses fail with "SystemError: AST constructor
    recursion depth mismatch" (seen in the quick start as "Error executing tool 'calculator': AST constructor ...")
    unless they take turns. Garbage collections with finalizers switch threads inside ast.parse, as in a busy worker."""
    errors: list[str] = []

    def work():
        for k in range(3000):
            _Finalized(), _Finalized()
            try:
                assert task.evaluate(f"(((1 + {k}) * 3) - 4) * (5 + (6 - 7))") == ((1 + k) * 3 - 4) * 4
            except SystemError as exc:
                errors.append(str(exc))

    thresholds, interval = gc.get_threshold(), sys.getswitchinterval()
    gc.set_threshold(5, 1, 1)
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=work) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        gc.set_threshold(*thresholds)
        sys.setswitchinterval(interval)
    assert not errors, f"{len(errors)} of 12000 parses failed, e.g. {errors[0]}"
