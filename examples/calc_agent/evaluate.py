"""Offline evaluation of a calculator agent with Hugging Face ``generate`` (no Ray, no verl).

    python examples/calc_agent/evaluate.py --model ~/.cache/verl_traj/calc_agent/model [--samples 64] [--temperature 1.0]

Plays each episode the way verl's ``tool_agent`` loop does (hermes ``<tool_call>`` parsing, the
calculator run on each call, its result fed back as a tool message, at most ``--max-turns``
assistant turns) and scores it with the recipe's ``compute_score``. Prints one JSON line:
accuracy, mean reward, mean tool calls per episode, and the start of one response.
Used to size the warm start (greedy and temperature-1 accuracy of the prepared model) and to
check a trained model outside the trainer.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import task  # noqa: E402

TOOL_CALL_RE = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def parse_call(text: str) -> str | None:
    """The ``expression`` argument of the first hermes tool call in ``text``, or None."""
    match = TOOL_CALL_RE.search(text)
    if not match:
        return None
    try:
        call = json.loads(match.group(1))
        return str(call["arguments"]["expression"])
    except (ValueError, KeyError, TypeError):
        return None


def play(model, tokenizer, problems: list[task.Problem], tools: list[dict], *, temperature: float,
         max_turns: int, max_new_tokens: int = 64, seed: int = 0) -> list[dict]:
    """Play ``problems`` as a batch, one assistant turn per ``generate`` call; one result dict per problem."""
    import torch

    torch.manual_seed(seed)
    chats = [[{"role": "system", "content": task.SYSTEM_PROMPT}, {"role": "user", "content": p.question}] for p in problems]
    responses = [""] * len(problems)
    calls = [0] * len(problems)
    live = list(range(len(problems)))
    tokenizer.padding_side = "left"
    for _ in range(max_turns):
        if not live:
            break
        texts = [tokenizer.apply_chat_template(chats[i], tools=tools, add_generation_prompt=True, tokenize=False) for i in live]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else dict(do_sample=False)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id, **sampling)
        still = []
        for row, i in enumerate(live):
            # keep <tool_call> (a special token of the tiny tokenizer); cut at the end of the turn
            text = tokenizer.decode(out[row, enc["input_ids"].shape[1]:], skip_special_tokens=False)
            text = text.split(tokenizer.eos_token)[0].replace(tokenizer.pad_token, "")
            responses[i] += text
            expression = parse_call(text)
            if expression is None:
                chats[i].append({"role": "assistant", "content": text})
                continue  # a final answer (or garbage): the episode ends, as in verl's loop
            calls[i] += 1
            try:
                result = str(task.evaluate(expression))
            except task.CalculatorError as exc:
                result = f"error: {exc}"
            chats[i].append({"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}]})
            chats[i].append({"role": "tool", "content": result})
            responses[i] += f"\n<tool_response>\n{result}\n</tool_response>\n"
            still.append(i)
        live = still
    results = []
    for i, p in enumerate(problems):
        score = task.compute_score("calc_agent", responses[i], str(p.answer), {"intermediates": [v for _, v in p.steps]})
        results.append({"score": score, "correct": score == 1.0, "calls": calls[i], "response": responses[i],
                        "messages": chats[i]})
    return results


def evaluate_model(model_dir: Path, *, samples: int, temperature: float, seed: int, max_operand: int = 9,
                   max_turns: int = 5, batch: int = 64) -> dict:
    """Accuracy and mean reward of the model at ``model_dir`` on ``samples`` fresh problems."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from prepare import tool_schemas

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rng = random.Random(seed + 12345)
    problems = [task.make_problem(rng, rng.choice((2, 3)), max_operand) for _ in range(samples)]
    results = []
    for start in range(0, samples, batch):
        results += play(model, tokenizer, problems[start:start + batch], tool_schemas(), temperature=temperature,
                        max_turns=max_turns, seed=seed + start)
    n = len(results)
    return {
        "model": str(model_dir), "samples": n, "temperature": temperature,
        "accuracy": sum(r["correct"] for r in results) / n,
        "mean_reward": sum(r["score"] for r in results) / n,
        "mean_calls": sum(r["calls"] for r in results) / n,
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
