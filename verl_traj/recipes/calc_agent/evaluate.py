"""Offline evaluation of a calculator agent with Hugging Face ``generate`` (no Ray, no trainer).

    python -m verl_traj.recipes.calc_agent.evaluate --model ~/.cache/verl_traj/calc_agent/model [--samples 64] [--temperature 1.0]

Plays each episode the way verl_traj's step-wise ``tool_agent`` loop does, with verl's own pieces: its hermes
``ToolParser``, the calculator loaded by ``load_function_tools_from_path`` and run with the loop's
error texts, the result fed back as a tool message, at most ``--max-turns`` assistant turns; and scores it with the
recipe's ``compute_score``. Tool calls the model wrote malformed (the parser cannot decode them, or the calculator
cannot take their arguments) are counted as in training
(:func:`~verl_traj.integration.agent_loops.stepwise_agent_loop.counting_tool_parser`,
:func:`~verl_traj.integration.agent_loops.tool_call_checks.check_tool_call`), not logged. Prints one JSON line: accuracy, mean reward, mean tool calls per episode, the malformed calls, and the start of one response.
Used to size the warm start (greedy and temperature-1 accuracy of the prepared model) and to
check a trained model outside the trainer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from verl.experimental.agent_loop.tool_parser import ToolParser
from verl.tools.function_tool import normalize_function_tool_return
from verl.tools.schemas import OpenAIFunctionCallSchema, OpenAIFunctionParsedSchema

from verl_traj.core.rollout.session_ledger import session_ledger
from verl_traj.integration.agent_loops.stepwise_agent_loop import counting_tool_parser
from verl_traj.integration.agent_loops.tool_call_checks import check_tool_call
from verl_traj.recipes.calc_agent import task

HERE = Path(__file__).resolve().parent


async def call_tool(tools: dict, call) -> str:
    """One parsed call run as the step-wise loop runs a function tool: a call no tool can run (unknown name, arguments
    the tool's schema refuses) answered with what is wrong and counted malformed in the session
    (:func:`~verl_traj.integration.agent_loops.tool_call_checks.check_tool_call`), the others by verl's ``_call_tool``,
    with its error text for a tool that raises."""
    problem = check_tool_call(call, tools)
    if problem is not None:
        return problem
    arguments = json.loads(call.arguments)
    try:
        response, _, _ = normalize_function_tool_return(await tools[call.name].call(arguments))
    except Exception as exc:  # noqa: BLE001 - the loop turns any tool failure into a tool message
        return f"Error executing tool '{call.name}': {exc}"
    return response.text or ""


def _assistant_message(content: str, call) -> dict:
    """The assistant message verl's loop appends for a turn with one tool call."""
    parsed, decode_error = OpenAIFunctionCallSchema.from_openai_function_parsed_schema(
        OpenAIFunctionParsedSchema(name=call.name, arguments=call.arguments))
    function = {"name": call.name, "arguments": call.arguments} if decode_error else parsed.model_dump()
    return {"role": "assistant", "content": content, "tool_calls": [{"type": "function", "function": function}]}


def _generate_turn(model, tokenizer, texts: list[str], sampling: dict, max_new_tokens: int) -> list[list[int]]:
    """One assistant turn for each chat text: the new ids up to (not including) the first end-of-turn token."""
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id, **sampling)
    new = out[:, enc["input_ids"].shape[1]:]
    ended = (new == tokenizer.eos_token_id) | (new == tokenizer.pad_token_id)
    full = torch.full_like(ended[:, 0], new.shape[1], dtype=torch.long)
    lengths = torch.where(ended.any(1), ended.int().argmax(1), full)
    return [new[r, :n].tolist() for r, n in enumerate(lengths.tolist())]


async def _turn(parser, tools: dict, rows: list[list[int]]) -> list[tuple]:
    """Each row's assistant turn parsed and its first call run, in a session of its own (the tool calls counted
    there, as in training): ``(content, call or None, tool result or None, [parsed, malformed])`` per row."""

    async def one(ids):
        with session_ledger("calc_agent_evaluate") as ledger:
            content, calls = await parser.extract_tool_calls(ids)
            result = await call_tool(tools, calls[0]) if calls else None
        return content, (calls[0] if calls else None), result, [ledger.tool_calls, ledger.malformed_tool_calls]

    return await asyncio.gather(*(one(ids) for ids in rows))


def play(model, tokenizer, problems: list[task.Problem], tools: dict, *, temperature: float,
         max_turns: int, max_new_tokens: int = 64, seed: int = 0) -> list[dict]:
    """Play ``problems`` as a batch, one assistant turn per ``generate`` call; one result dict per problem.

    ``tools``: name -> verl ``FunctionTool`` (``task.calc_tools()``). Each turn is parsed by verl's
    hermes ``ToolParser`` (counting, :func:`_turn`) and its first call (verl's default ``max_parallel_calls: 1``)
    executed by ``call_tool``; a turn without a call ends the episode, as in verl's ``tool_agent`` loop.
    """
    parser = counting_tool_parser(ToolParser.get_tool_parser("hermes", tokenizer))
    schemas = [tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True) for tool in tools.values()]
    torch.manual_seed(seed)
    chats = [[{"role": "system", "content": task.SYSTEM_PROMPT}, {"role": "user", "content": p.question}] for p in problems]
    responses, calls, live = [""] * len(problems), [0] * len(problems), list(range(len(problems)))
    written = [[0, 0] for _ in problems]  # [parsed, malformed] tool calls per episode
    tokenizer.padding_side = "left"
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else dict(do_sample=False)
    for _ in range(max_turns):
        if not live:
            break
        texts = [tokenizer.apply_chat_template(chats[i], tools=schemas, add_generation_prompt=True, tokenize=False)
                 for i in live]
        rows = _generate_turn(model, tokenizer, texts, sampling, max_new_tokens)
        still = []
        for i, ids, (content, call, result, counts) in zip(live, rows, asyncio.run(_turn(parser, tools, rows))):
            responses[i] += tokenizer.decode(ids)
            written[i] = [a + b for a, b in zip(written[i], counts)]
            # The chat is re-rendered by the template every turn (verl's loop appends token ids instead):
            # strip the whitespace the template itself puts around a tool call, so that a well-formed turn
            # re-renders to exactly the tokens the model produced.
            if call is None:
                chats[i].append({"role": "assistant", "content": content.strip()})
                continue
            calls[i] += 1
            chats[i] += [_assistant_message(content.strip(), call), {"role": "tool", "content": result}]
            responses[i] += f"\n<tool_response>\n{result}\n</tool_response>\n"
            still.append(i)
        live = still
    return [_result(p, responses[i], calls[i], chats[i], written[i]) for i, p in enumerate(problems)]


def _result(problem: task.Problem, response: str, calls: int, messages: list[dict], written: list[int]) -> dict:
    """``calls``: the calls run (a malformed call the calculator could not take included, answered with what was
    wrong); ``tool_calls``: ``[parsed, malformed]`` as training counts them (``traj_agent/*``)."""
    score = task.compute_score("calc_agent", response, str(problem.answer),
                               {"intermediates": [v for _, v in problem.steps]})
    return {"score": score, "correct": score == 1.0, "calls": calls, "response": response, "messages": messages,
            "tool_calls": written}


def evaluate_model(model_dir: Path, *, samples: int, temperature: float, seed: int, max_operand: int = 9,
                   max_turns: int = 5, batch: int = 64) -> dict:
    """Accuracy and mean reward of the model at ``model_dir`` on ``samples`` fresh problems."""

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tools = {tool.name: tool for tool in task.calc_tools()}
    rng = random.Random(seed + 12345)
    problems = [task.make_problem(rng, rng.choice((2, 3)), max_operand) for _ in range(samples)]
    results = []
    for start in range(0, samples, batch):
        results += play(model, tokenizer, problems[start:start + batch], tools, temperature=temperature,
                        max_turns=max_turns, seed=seed + start)
    n = len(results)
    parsed, malformed = (sum(r["tool_calls"][k] for r in results) for k in (0, 1))
    return {
        "model": str(model_dir), "samples": n, "temperature": temperature,
        "accuracy": sum(r["correct"] for r in results) / n,
        "mean_reward": sum(r["score"] for r in results) / n,
        "mean_calls": sum(r["calls"] for r in results) / n,
        # as traj_agent/malformed_tool_call_share: of the tool calls the model wrote, those no tool could run
        "malformed_calls": malformed, "malformed_call_share": malformed / (parsed + malformed) if malformed else 0.0,
        "example": results[0]["response"][:400],
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--max-operand", type=int, default=9)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not (args.model / "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json there; pass a Hugging Face model directory "
                     "(the prepared one is $VERL_TRAJ_HOME/calc_agent/model, made by prepare.py)")
    if args.samples < 1:
        parser.error(f"--samples {args.samples}: must be >= 1")
    print(json.dumps(evaluate_model(args.model, samples=args.samples, temperature=args.temperature, seed=args.seed,
                                    max_operand=args.max_operand)))


if __name__ == "__main__":
    main()
