"""Build, offline, the tiny default artifacts for CPU training.

    python -m verl_traj.cpu.build_tiny [--home DIR] [--force]

Writes under ``--home`` (default ``$VERL_TRAJ_HOME/tiny``, and ``~/.cache/verl_traj/tiny`` without the variable;
``$VERL_TRAJ_HOME`` is the one parent folder of every prepared artifact: ``tiny/`` here, ``calc_agent/`` for the
calculator recipe):

* ``model/``: a random-weight Qwen2 (hidden 64, 2 layers, fp32) saved with ``save_pretrained``,
  and a byte-level BPE tokenizer trained here with ``tokenizers`` (PreTrainedTokenizerFast with a
  Qwen-style chat template: ``<|im_start|>``/``<|im_end|>``, tools via ``<tool_call>`` tags,
  ``<tool_response>`` for tool results; eos ``<|im_end|>``, pad ``<|endoftext|>``).
* ``data/train.parquet``, ``data/test.parquet``: verl's RL parquet format (``data_source``,
  ``prompt`` chat list, ``ability``, ``reward_model: {style, ground_truth}``, ``extra_info``).
  The task: "write digits"; reward ``verl_traj.cpu.reward.compute_score``.
* ``data/tool_train.parquet``: the same prompts routed to verl's ``tool_agent`` loop
  (``agent_name``), for multi-turn runs with ``tool_config.yaml`` (tool ``verl_traj.cpu.tools.DigitsTool``).
* ``model_tool/`` (``--tool-caller``): the tiny model after a few seconds of supervised fine-tuning
  to call that tool, so the ``tool_agent`` loop really runs several turns.

Nothing is downloaded. Building takes a few seconds; it is deterministic for a given seed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

import pandas as pd
import torch
import yaml
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast, Qwen2Config,
                          Qwen2ForCausalLM)

from verl_traj.cpu.warm_start import supervised_warm_start

DEFAULT_HOME = "~/.cache/verl_traj"  # $VERL_TRAJ_HOME's default; the tiny artifacts live in its tiny/
BUILD_VERSION = "2"

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]

# Qwen2.5-style template (system, user, assistant, tool calls, tool responses).
CHAT_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n"
    "Call a tool with <tool_call>\n{\"name\": <name>, \"arguments\": <json>}\n</tool_call><|im_end|>\n"
    "{% elif messages and messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' and loop.first %}"
    "{% elif message.role in ['user', 'system'] or (message.role == 'assistant' and not message.tool_calls) %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% elif message.role == 'assistant' %}"
    "<|im_start|>assistant\n{% if message.content %}{{ message.content }}{% endif %}"
    "{% for tool_call in message.tool_calls %}"
    "{% if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}"
    "{{ '\\n' }}<tool_call>\n{\"name\": \"{{ tool_call.name }}\", \"arguments\": "
    "{% if tool_call.arguments is string %}{{ tool_call.arguments }}{% else %}{{ tool_call.arguments | tojson }}{% endif %}"
    "}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ message.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

WORDS = (
    "the a one two three four five six seven eight nine zero number numbers digit digits write say "
    "please some many few more list count give me now then and or of to in is it this that with "
    "agent tool call answer result sum add value numbers quickly only just here"
).split()

PROMPT_TEMPLATES = [
    "Write digits, mostly {d}.",
    "Please give me some numbers with {d}.",
    "List many digits. Use {d}.",
    "Say a long number full of {d}.",
    "Count with digits like {d}.",
    "Only digits please, {d} is best.",
]


def home_dir(home: str | None = None) -> Path:
    """The tiny artifacts' folder: ``home`` itself when given, else ``$VERL_TRAJ_HOME/tiny`` (what the ``cpu_tiny``
    presets read: ``configs/task/tiny_digits.yaml``)."""
    if home:
        return Path(os.path.expanduser(home)).resolve()
    return (Path(os.path.expanduser(os.environ.get("VERL_TRAJ_HOME") or DEFAULT_HOME)) / "tiny").resolve()


def _corpus(rng: random.Random, n: int = 4000) -> list[str]:
    lines = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.35:
            lines.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))))
        elif kind < 0.6:
            lines.append("".join(rng.choice("0123456789") for _ in range(rng.randint(1, 12))))
        elif kind < 0.8:
            lines.append(rng.choice(PROMPT_TEMPLATES).format(d=rng.randint(0, 9)))
        else:
            args = json.dumps({"n": rng.randint(0, 99)})
            lines.append(f'<tool_call>\n{{"name": "digits", "arguments": {args}}}\n</tool_call>')
    lines += ["system user assistant tool", "You are a helpful assistant."] * 50
    tools_block = "# Tools\n<tools>\n" + json.dumps(TOOL_SCHEMA) + "\n</tools>\n"
    call_hint = 'Call a tool with <tool_call>\n{"name": <name>, "arguments": <json>}\n</tool_call>'
    lines += [tools_block, call_hint] * 300
    return lines


def build_tokenizer(out_dir: Path, vocab_size: int, seed: int, extra_corpus: list[str] | None = None):
    """Train the byte-level BPE tokenizer; ``extra_corpus`` adds a recipe's own text (shorter sequences)."""
    rng = random.Random(seed)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(rng) + list(extra_corpus or []), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        additional_special_tokens=SPECIAL_TOKENS[3:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 1024
    fast.padding_side = "left"
    fast.save_pretrained(out_dir)
    return fast


def build_model(out_dir: Path, tokenizer, seed: int, hidden: int, layers: int, kv_heads: int = 2):
    """A random-init Qwen2 causal LM (4 attention heads, ``kv_heads`` key/value heads) saved to ``out_dir``."""
    torch.manual_seed(seed)
    vocab = len(tokenizer)
    vocab = (vocab + 63) // 64 * 64  # verl/FSDP are happier with a rounded vocab
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        use_sliding_window=False,
        torch_dtype="float32",
    )
    model = Qwen2ForCausalLM(config)
    model.to(torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=True
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    return model


def build_data(data_dir: Path, seed: int, n_train: int, n_test: int) -> None:
    rng = random.Random(seed + 1)
    system = "You are a helpful assistant."

    def rows(n: int, split: str, agent_name: str | None = None):
        out = []
        for i in range(n):
            digit = rng.randint(0, 9)
            text = rng.choice(PROMPT_TEMPLATES).format(d=digit)
            row = {
                "data_source": "verl_traj/tiny_digits",
                "prompt": [{"role": "system", "content": system}, {"role": "user", "content": text}],
                "ability": "digits",
                "reward_model": {"style": "rule", "ground_truth": str(digit)},
                "extra_info": {"split": split, "index": i, "need_tools_kwargs": False,
                               "tools_kwargs": {"digits": {"create_kwargs": {"seed": i}}}},
            }
            if agent_name:
                row["agent_name"] = agent_name
            out.append(row)
        return out

    data_dir.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows(n_train, "train")).to_parquet(data_dir / "train.parquet")
    pd.DataFrame(rows(n_test, "test")).to_parquet(data_dir / "test.parquet")
    pd.DataFrame(rows(n_train, "train", agent_name="tool_agent")).to_parquet(data_dir / "tool_train.parquet")
    pd.DataFrame(rows(n_test, "test", agent_name="tool_agent")).to_parquet(data_dir / "tool_test.parquet")


def build_tool_config(path: Path) -> None:
    cfg = {
        "tools": [
            {
                "class_name": "verl_traj.cpu.tools.DigitsTool",
                "config": {"type": "native"},
                "tool_schema": TOOL_SCHEMA,
            }
        ]
    }
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))


TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": "digits",
        "description": "Return a string of digits.",
        "parameters": {
            "type": "object",
            "properties": {"n": {"type": "integer", "description": "how many digits"}},
            "required": ["n"],
        },
    },
}


def build_tool_caller(home: str | None = None, steps: int = 150, lr: float = 3e-3, seed: int = 0,
                      force: bool = False) -> Path:
    """A copy of the tiny model taught (a few seconds of supervised fine-tuning) to answer the first
    user turn with ``<tool_call>{"name": "digits", ...}</tool_call>`` and a tool response with digits,
    so verl's ``tool_agent`` loop really runs several turns (``model_tool/``)."""
    root = home_dir(home)
    out_dir = root / "model_tool"
    if not force and (out_dir / "model.safetensors").exists():
        return out_dir
    tok = AutoTokenizer.from_pretrained(root / "model")
    model = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32, attn_implementation="sdpa")
    rng = random.Random(seed + 2)
    torch.manual_seed(seed)

    def example():
        digit = rng.randint(0, 9)
        n = rng.randint(2, 6)
        user = rng.choice(PROMPT_TEMPLATES).format(d=digit)
        result = "".join(rng.choice("0123456789") for _ in range(n))
        msgs = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": user}]
        call = {"role": "assistant", "content": "",
                "tool_calls": [{"type": "function", "function": {"name": "digits", "arguments": {"n": n}}}]}
        answer = {"role": "assistant", "content": result + str(digit) * 4}
        full = msgs + [call, {"role": "tool", "content": result}, answer]
        ids, labels = [], []
        # assistant segments = diff between consecutive renderings
        text_prompt = tok.apply_chat_template(msgs, tools=[TOOL_SCHEMA], tokenize=False, add_generation_prompt=True)
        text_call = tok.apply_chat_template(msgs + [call], tools=[TOOL_SCHEMA], tokenize=False)
        text_tool = tok.apply_chat_template(msgs + [call, full[3]], tools=[TOOL_SCHEMA], tokenize=False,
                                            add_generation_prompt=True)
        text_full = tok.apply_chat_template(full, tools=[TOOL_SCHEMA], tokenize=False)
        for seg_text, train in ((text_prompt, False), (text_call[len(text_prompt):], True),
                                (text_tool[len(text_call):], False), (text_full[len(text_tool):], True)):
            seg = tok.encode(seg_text, add_special_tokens=False)
            if train:
                seg = seg[: len(seg) - (1 if seg_text.endswith("\n") else 0)]  # train up to <|im_end|>
            ids += seg
            labels += seg if train else [-100] * len(seg)
        return ids, labels

    losses = supervised_warm_start(model, example, steps=steps, lr=lr, pad_id=tok.pad_token_id, batch_size=8)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    (out_dir / "sft_loss.txt").write_text(f"{losses[-1]:.4f}\n")
    return out_dir


def build(home: str | None = None, force: bool = False, seed: int = 0, vocab_size: int = 512,
          hidden: int = 64, layers: int = 2, n_train: int = 256, n_test: int = 32) -> Path:
    root = home_dir(home)
    stamp = root / "BUILD"
    meta = json.dumps({"version": BUILD_VERSION, "seed": seed, "vocab": vocab_size, "hidden": hidden,
                       "layers": layers, "n_train": n_train, "n_test": n_test}, sort_keys=True)
    if not force and stamp.exists() and stamp.read_text() == meta:
        return root
    (root / "model").mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(root / "model", vocab_size, seed)
    build_model(root / "model", tokenizer, seed, hidden, layers)
    build_data(root / "data", seed, n_train, n_test)
    build_tool_config(root / "tool_config.yaml")
    stamp.write_text(meta)
    return root


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--home", default=None, help=f"output dir (default $VERL_TRAJ_HOME/tiny, or {DEFAULT_HOME}/tiny)")
    p.add_argument("--force", action="store_true", help="rebuild even if present")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tool-caller", action="store_true",
                   help="also build model_tool/: the tiny model fine-tuned to call the digits tool (multi-turn runs)")
    args = p.parse_args(argv)
    root = build(args.home, args.force, args.seed, args.vocab_size, args.hidden, args.layers)
    if args.tool_caller:
        print(build_tool_caller(args.home, force=args.force, seed=args.seed))
    print(root)


if __name__ == "__main__":
    main()
