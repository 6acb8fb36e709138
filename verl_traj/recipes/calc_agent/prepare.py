"""Prepare the calculator-agent recipe offline: data, tiny model, supervised warm start.

    python -m verl_traj.recipes.calc_agent.prepare [--home DIR] [--sft-steps 300]

Writes under ``$VERL_TRAJ_HOME/calc_agent`` (default ``~/.cache/verl_traj/calc_agent``):
* ``data/{train,test}.parquet``: verl's RL format (``prompt`` chat, ``agent_name: tool_agent``,
  ``reward_model.ground_truth``), 2-3 operations per problem, so 2-3 tool calls per episode.
* ``model/``: the tiny Qwen2-style model and tokenizer of ``verl_traj.cpu.build_tiny`` (built here,
  offline), warm-started with a short supervised run on correct transcripts rendered by the SAME
  chat template and tool schema that verl's ``tool_agent`` loop uses, so it knows the tool-call
  format; GRPO then has to make it right. A random tiny model would never emit a parseable tool
  call, and nothing can be downloaded here. The warm start is stopped early on purpose (300 steps:
  it has just learned to copy operands and tool results; about 75% greedy but only about 30%
  accurate when sampled at temperature 1), so GRPO has a visible way to go. Its figures, including
  that accuracy and the tool calls it writes malformed, measured by ``verl_traj.recipes.calc_agent.evaluate``, land
  in ``model/WARM_START.json``.
Pass ``--data-only`` on a GPU machine: a real instruct model needs no tiny model and no warm start.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

import pandas as pd
import torch
from tokenizers import Tokenizer, models
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from verl_traj.cpu.build_tiny import CHAT_TEMPLATE, build_model, build_tokenizer
from verl_traj.cpu.warm_start import supervised_warm_start
from verl_traj.recipes.calc_agent import task
from verl_traj.recipes.calc_agent.evaluate import evaluate_model

HERE = Path(__file__).resolve().parent


def tool_schemas() -> list[dict]:
    """The tool schema exactly as verl's agent loop renders it (FunctionTool -> model_dump)."""
    return [tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True) for tool in task.calc_tools()]


def write_data(data_dir: Path, n_train: int, n_test: int, seed: int, max_operand: int) -> None:
    rng = random.Random(seed)

    def rows(n: int, split: str) -> list[dict]:
        out = []
        for i in range(n):
            p = task.make_problem(rng, rng.choice((2, 3)), max_operand)
            out.append(
                {
                    "data_source": "calc_agent",
                    "agent_name": "tool_agent",
                    "prompt": [{"role": "system", "content": task.SYSTEM_PROMPT}, {"role": "user", "content": p.question}],
                    "ability": "arithmetic",
                    "reward_model": {"style": "rule", "ground_truth": str(p.answer)},
                    "extra_info": {"split": split, "index": i, "expression": p.expression, "num_calls": len(p.steps),
                                   "intermediates": [value for _, value in p.steps]},
                }
            )
        return out

    data_dir.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows(n_train, "train")).to_parquet(data_dir / "train.parquet")
    pd.DataFrame(rows(n_test, "test")).to_parquet(data_dir / "test.parquet")


def encode_transcript(tokenizer, messages: list[dict], tools: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids and a 0/1 loss mask that is 1 on the assistant's own tokens (incl. its <|im_end|>)."""
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    opener, closer = "<|im_start|>assistant\n", "<|im_end|>"
    spans, start = [], text.find(opener)
    while start != -1:
        begin = start + len(opener)
        end = text.find(closer, begin) + len(closer)
        spans.append((begin, end))
        start = text.find(opener, end)
    mask = [int(any(b <= s < e for b, e in spans)) for s, _ in enc["offset_mapping"]]
    return enc["input_ids"], mask


def warm_start(model_dir: Path, steps: int, seed: int, max_operand: int, batch_size: int = 16, lr: float = 1e-3) -> dict:
    """Supervised warm start on correct transcripts (assistant tokens only); returns loss figures."""
    torch.manual_seed(seed)
    rng = random.Random(seed + 7)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tools = tool_schemas()

    def example():
        problem = task.make_problem(rng, rng.choice((2, 3)), max_operand)
        ids, mask = encode_transcript(tokenizer, task.transcript(problem), tools)
        return ids, [t if m else -100 for t, m in zip(ids, mask)]

    t0 = time.time()
    losses = supervised_warm_start(model, example, steps=steps, lr=lr, pad_id=tokenizer.pad_token_id,
                                   batch_size=batch_size, warmup_steps=50, decay=False, clip_grad=1.0, log_every=50)
    model.save_pretrained(model_dir, safe_serialization=True)
    return {"first_loss": losses[0], "last_loss": sum(losses[-10:]) / min(10, len(losses)), "seconds": time.time() - t0}


def _bootstrap_tokenizer():
    """A throwaway character-level tokenizer, only to render chat-template text for the corpus."""
    return Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))


def recipe_tokenizer(model_dir: Path, seed: int, max_operand: int = 9):
    """The recipe's byte-level BPE tokenizer (1,024 ids) saved in ``model_dir``: trained on the tiny corpus and on the
    recipe's own rendered episodes, so they stay short (also the tokenizer of ``scripts/gpu_e2e.py``'s random model)."""
    render = PreTrainedTokenizerFast(tokenizer_object=_bootstrap_tokenizer())
    render.chat_template = CHAT_TEMPLATE
    rng = random.Random(seed + 1)
    corpus = [render.apply_chat_template(task.transcript(task.make_problem(rng, rng.choice((2, 3)), max_operand)),
                                         tools=tool_schemas(), tokenize=False) for _ in range(300)]
    return build_tokenizer(model_dir, vocab_size=1024, seed=seed, extra_corpus=corpus)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_home = Path(os.path.expanduser(os.environ.get("VERL_TRAJ_HOME", "~/.cache/verl_traj"))) / "calc_agent"
    parser.add_argument("--home", type=Path, default=default_home)
    parser.add_argument("--data-only", action="store_true",
                        help="write the data only (GPU runs bring their own model via actor_rollout_ref.model.path)")
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--n-train", type=int, default=2048)
    parser.add_argument("--n-test", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-operand", type=int, default=9,
                        help="operands in [2, N]; 9 keeps copying easy enough for the tiny CPU model")
    parser.add_argument("--eval-samples", type=int, default=64,
                        help="episodes for the warm start's greedy and sampled accuracy (0: skip the evaluation)")
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    if args.sft_steps < 1:
        parser.error(f"--sft-steps {args.sft_steps}: must be >= 1 (the tiny model cannot call the tool without a warm start)")
    if args.eval_samples < 0:
        parser.error(f"--eval-samples {args.eval_samples}: must be >= 0 (0 skips the evaluation)")

    home: Path = args.home
    write_data(home / "data", args.n_train, args.n_test, args.seed, args.max_operand)
    stamp = home / "model" / "WARM_START.json"
    if not args.data_only and (args.force or not stamp.exists()):
        (home / "model").mkdir(parents=True, exist_ok=True)
        tokenizer = recipe_tokenizer(home / "model", args.seed, args.max_operand)
        build_model(home / "model", tokenizer, seed=args.seed, hidden=args.hidden, layers=args.layers, kv_heads=4)
        figures = warm_start(home / "model", args.sft_steps, args.seed, args.max_operand)
        for name, temperature in (("greedy", 0.0), ("sampled", 1.0)) if args.eval_samples > 0 else ():
            result = evaluate_model(home / "model", samples=args.eval_samples, temperature=temperature, seed=args.seed,
                                    max_operand=args.max_operand)
            figures[f"{name}_accuracy"], figures[f"{name}_reward"] = result["accuracy"], result["mean_reward"]
            # tool calls it wrote that no tool could run: counted as training counts them, not logged
            figures[f"{name}_malformed_calls"] = result["malformed_calls"]
            figures[f"{name}_malformed_call_share"] = result["malformed_call_share"]
        stamp.write_text(json.dumps(figures, indent=1))
    print(json.dumps({"home": str(home), "model": None if args.data_only else str(home / "model"), "data": str(home / "data")}))


if __name__ == "__main__":
    main()
