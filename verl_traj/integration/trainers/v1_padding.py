"""Padding rows of a planned v1 batch, written to TransferQueue.

The plan adds at most ``dp - 1`` padding rows per mini-batch so every rank holds the same number of rows of it.
On v1 a row lives in TransferQueue and the workers pull only the fields common to every row dispatched to them,
so a padding row is stored with the schema of a real row of the batch (verl's own
``construct_minimal_padding_template``, shortened to ``pad_row_tokens``), tagged ``is_padding`` as verl tags its
own, and with a uid of its own: a group of one, which no group statistic sees.
"""

from __future__ import annotations

import copy
import uuid
from typing import Any

import torch
import transfer_queue as tq

from verl.trainer.ppo.padding_utils import (build_padding_position_ids, build_padding_routed_experts,
                                            construct_minimal_padding_template)
from verl.utils.tensordict_utils import list_of_dict_to_tensordict

from verl_traj.core.rollout.row_key import row_key

__all__ = ["padding_ids", "padding_row", "write_padding_rows"]


def padding_ids(eos_token_id: int, length: int) -> torch.Tensor:
    """``[length]`` int64: a padding row's attended ids (``length - 1`` prompt EOS, one response EOS); the tree
    planner builds the padding rows' trees from these without reading them back."""
    return torch.full((length,), eos_token_id, dtype=torch.int64)


def padding_row(source: dict, tag: dict, eos_token_id: int, length: int) -> tuple[dict, dict]:
    """One padding row of ``length`` attended tokens (``length - 1`` prompt EOS + one response EOS, masks and
    rewards 0) with ``source``'s schema: verl's ``construct_minimal_padding_template`` (128 tokens), shortened; its
    tag verl's copy of ``tag`` without verl_traj's ``traj_*`` entries. Returns ``(fields, tag)``; ``source`` and
    ``tag`` are not changed."""
    sample, pad_tag = construct_minimal_padding_template(source, tag, eos_token_id)
    input_ids = padding_ids(eos_token_id, length)
    prompts, responses = input_ids[:-1], input_ids[-1:]
    attention_mask = torch.ones_like(input_ids)
    sample.update(prompts=prompts, responses=responses, input_ids=input_ids, attention_mask=attention_mask,
                  position_ids=build_padding_position_ids(source.get("position_ids"), attention_mask))
    if "routed_experts" in sample:
        sample["routed_experts"] = build_padding_routed_experts(source.get("routed_experts"), length)
    # verl copies the source row's whole tag: drop verl_traj's ("traj_*": the source session's turn rewards, GiGPO
    # anchors, row facts, versions), which a padding row must not carry into plans, credit or metrics
    pad_tag = {k: v for k, v in pad_tag.items() if not str(k).startswith("traj_")}
    pad_tag.update(is_padding=True, prompt_len=length - 1, response_len=1, seq_len=length)
    return sample, pad_tag


def write_padding_rows(batch: Any, count: int, eos_token_id: int, length: int) -> tuple[list[str], list[dict]]:
    """Store ``count`` padding rows in ``batch``'s partition, each its own uid (key ``pad<hex>_0_0``), with the
    schema of the batch's first row. Returns their keys and tags (``[count]`` each, empty for 0)."""
    if count == 0:
        return [], []
    source = tq.kv_batch_get(keys=[batch.keys[0]], partition_id=batch.partition_id)[0]
    template, tag = padding_row(source, batch.tags[0], eos_token_id, length)
    if "session_id" in template:
        template["session_id"] = 0
    keys, fields = [], []
    for _ in range(count):  # the rows share the template's values (the put copies them): no deep copy a row
        uid = f"pad{uuid.uuid4().hex}"
        keys.append(row_key(uid, 0, 0))
        fields.append({**template, "uid": uid})
    tags = [copy.deepcopy(tag) for _ in range(count)]
    tq.kv_batch_put(keys=keys, partition_id=batch.partition_id, fields=list_of_dict_to_tensordict(fields), tags=tags)
    return keys, tags
