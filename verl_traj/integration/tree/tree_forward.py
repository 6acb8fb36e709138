"""One micro-batch forwarded as a prefix tree through verl's FSDP engine (remove-padding path), exactly (issue 29).

Nothing changes until a worker process enters :func:`~verl_traj.integration.tree.tree_passes.tree_forward` on its
engine, and then only micro-batches whose batch carries the non-tensor key ``prefix_tree=True`` (:data:`TREE_KEY`) are
forwarded as a tree; every other micro-batch runs verl's code unchanged.

Hook points (each declared, with how it is undone):

1. process patch :func:`~verl_traj.integration.patches.process.prefix_tree_attention_patches`:
   ``verl.models.transformers.monkey_patch._flash_attention_forward`` <- :func:`tree_aware_attention` (the kernel
   verl's remove-padding path calls: the CPU platform's ``cpu_varlen`` attention on CPU, flash-attn on GPU). A call
   carrying the tree (model keyword :data:`TREE_KWARG`, which transformers hands down to every attention call, also
   when gradient checkpointing recomputes a layer) runs :func:`~verl_traj.core.tree_attention.tree_attention`; any
   other call runs the wrapped kernel after :func:`~verl_traj.core.tree_attention.refuse_tree_in_plain_attention`.
   Installed on the first :func:`~verl_traj.integration.tree.tree_passes.tree_forward`, never restored (idempotent; a
   non-tree call computes as before).
2. the engine *instance*'s ``prepare_model_inputs`` / ``prepare_model_outputs`` (:func:`tree_forward_patches`,
   installed by :func:`~verl_traj.integration.patches.scoped.patched`; on exit the instance attributes are removed and
   the class's methods show through again):

   * inputs: the micro-batch's tree is built on its device from its rows and the plan's facts
     (:func:`~verl_traj.core.tree_facts.tree_from_facts`: each row token's tree index, shipped by the trainer, and
     the tree's size, a host int the planned micro-batch carries;
     :mod:`verl_traj.integration.trainers.tree_plan_facts`), no host copy of token ids; verl's own
     ``prepare_model_inputs`` gets a one-row micro-batch holding the tree tokens and their depths, so verl packs,
     rolls the labels (the next serialised token is each tree token's child wherever it has one: branch copies),
     and pads exactly as for rows; the tree's ``subtree_end`` (verl's tail padding appended as one chain) rides
     along as the model keyword;
   * outputs: verl's own ``prepare_model_outputs`` over that one-row micro-batch gives per-tree-token log-probs /
     entropy; :func:`per_row_outputs` gathers them into the rows' packed order (``row_index``), so the loss and
     verl's un-packing see per-row outputs. The log-prob at each row's last token is set to 0: its rolled label
     crosses into the next packed row, and verl never reads it (``no_padding_2_padding`` drops it).

Exact because every row token's tree instance has exactly the row's tokens as ancestors (same ids, positions = depth
= the row's own position ids): logits, log-probs at the rolled label and entropy equal the per-row forward's, and the
backward through the gather sums each shared token's gradient over its rows. The facts are checked against the rows
on the device (:attr:`~verl_traj.core.tree_facts.DeviceTree.checks`, with the rows' temperatures); the counts are
read once when the pass ends (:meth:`~verl_traj.integration.tree.tree_passes.TreeForwardLog.settle`, the pass's one
device-to-host read), never per micro-batch, and a mismatch raises there.

Refused (a :class:`~verl_traj.core.tree_attention.TreeAttentionError` naming the fix): no remove-padding,
fused kernels, distillation, multi-modal inputs, 3-D position ids, an attention implementation other than the
flash-attention path, attention dropout / sliding window / soft-capping; a micro-batch without the plan's tree facts
(a :class:`~verl_traj.core.errors.TrajInputError`). Counted on the device and refused when the pass ends (a
``TrajInputError`` naming the field): facts that do not reproduce the rows, non-``arange`` position ids, per-row
temperatures that differ.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
from tensordict import NonTensorData, TensorDict
from torch.profiler import record_function
from transformers.integrations.flash_attention import flash_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from verl.utils import tensordict_utils as tu

from verl_traj.core.errors import TrajInputError
from verl_traj.core.keys import TREE_INDEX, TREE_KEY, TREE_SIZE_KEY
from verl_traj.core.tree_attention import (TreeAttentionError, refuse_tree_in_plain_attention, tree_attention,
                                           tree_attention_blocks)
from verl_traj.core.tree_facts import DeviceTree, tree_from_facts
from verl_traj.core.tree_flex import FlexTree, tree_attention_flex
from verl_traj.integration.patches.process import install, prefix_tree_attention_patches
from verl_traj.integration.patches.scoped import Patch

__all__ = ["TREE_KWARG", "TreeAttentionInput", "TreeRecorder", "tree_aware_attention", "install_tree_attention",
           "tree_forward_patches", "per_row_outputs", "micro_batch_tree"]

TREE_KWARG = "prefix_tree_attention"  # model keyword carrying the tree to the attention
LABELED_OUTPUTS = ("log_probs",)  # outputs that depend on the rolled label (the rest are per-token functions)
_STATE = "prefix_tree_state"  # output_args key: the tree of this forward
_ENGINE = "verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead"


class TreeRecorder(Protocol):
    """What a tree micro-batch is recorded into (:class:`~verl_traj.integration.tree.tree_passes.TreeForwardLog`)."""

    def add(self, tree: DeviceTree, forwarded: int, checks: dict) -> None: ...


class TreeAttentionInput:
    """One micro-batch's tree for the attention: ``subtree_end`` ``[S]`` global over the sequence the attention sees
    (``N`` tree tokens, then verl's tail padding as one chain), built once and shared by every layer: on CUDA the
    compiled flex kernel's tree (``flex``, :mod:`verl_traj.core.tree_flex`), elsewhere the blocked kernel's key sets
    per query block (``blocks``); ``calls`` (attention calls served). A plain class: FSDP passes it through
    unchanged."""

    __slots__ = ("subtree_end", "blocks", "flex", "calls")

    def __init__(self, subtree_end: torch.Tensor, block: int = 128) -> None:
        self.subtree_end = subtree_end
        self.flex = FlexTree(subtree_end, block) if subtree_end.is_cuda else None
        self.blocks = None if self.flex is not None else tree_attention_blocks(subtree_end, block)
        self.calls = 0


@dataclass(frozen=True)
class _TreeState:
    tree: DeviceTree
    batch: TensorDict  # the one-row micro-batch verl's code saw
    attention: TreeAttentionInput


def _refuse(what: str, fix: str) -> None:
    raise TreeAttentionError(f"prefix-tree forward: {what}. Fix: {fix}.", field=TREE_KEY)


def _tree_call(tree: TreeAttentionInput, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, kwargs: dict) -> torch.Tensor:
    """One attention call of a tree micro-batch: ``query`` ``[1, S, Hq, D]``, ``key`` / ``value`` ``[1, S, Hkv, D]``
    -> ``[1, S, Hq, D]`` (flash-attention's layout)."""
    extras = {k: kwargs.get(k) for k in ("sliding_window", "softcap", "s_aux") if kwargs.get(k) is not None}
    if kwargs.get("dropout") or attention_mask is not None or not kwargs.get("is_causal", True):
        extras.update(dropout=kwargs.get("dropout"), is_causal=kwargs.get("is_causal"),
                      attention_mask=None if attention_mask is None else tuple(attention_mask.shape))
    if extras:
        _refuse(f"the tree attention has no {sorted(extras)} ({extras})", "forward these micro-batches without the "
                "tree (attention dropout off, no sliding window / soft-capping)")
    if query.shape[0] != 1 or query.shape[1] != tree.subtree_end.numel():
        _refuse(f"the attention got query {tuple(query.shape)} for a tree of {tree.subtree_end.numel()} tokens (a "
                "sequence-parallel layout other than verl's Ulysses all-to-all?)", "forward the tree with Ulysses or "
                "without sequence parallelism")
    with record_function("verl_traj.tree.attention"):
        if tree.flex is not None:  # CUDA: compiled flex attention, one compile per tree-size bucket
            out = tree_attention_flex(query[0], key[0], value[0], tree.flex, scale=kwargs.get("softmax_scale"))
        else:
            out = tree_attention(query[0], key[0], value[0], tree.subtree_end, scale=kwargs.get("softmax_scale"),
                                 blocks=tree.blocks)
    tree.calls += 1
    return out.unsqueeze(0)


def tree_aware_attention(kernel: Callable) -> Callable:
    """``kernel`` (``_flash_attention_forward(query, key, value, attention_mask, query_length, ...)``) made
    tree-aware (module docstring, hook 1); ``kernel`` itself when it already is."""
    if getattr(kernel, "_prefix_tree_aware", False):
        return kernel

    checked: list = [None]  # a weak reference to the last position_ids checked (every layer gets the same tensor)

    @functools.wraps(kernel)
    def attention(query, key, value, attention_mask, query_length, *args, **kwargs):
        tree = kwargs.pop(TREE_KWARG, None)
        if tree is not None:
            return _tree_call(tree, query, key, value, attention_mask, kwargs)
        position_ids = kwargs.get("position_ids")
        if isinstance(position_ids, torch.Tensor) and position_ids.dim() == 2 and (
                checked[0] is None or checked[0]() is not position_ids):  # one check (one sync) a forward, not a layer
            refuse_tree_in_plain_attention(position_ids, where=f"the plain attention {kernel.__name__}")
            checked[0] = weakref.ref(position_ids)
        return kernel(query, key, value, attention_mask, query_length, *args, **kwargs)

    attention._prefix_tree_aware = True
    return attention


def _no_deferred_install(module_name: str, _callback: Callable) -> None:
    raise RuntimeError(f"the prefix-tree attention patch is installed now, not on import of {module_name}")


def install_tree_attention() -> None:
    """Hook 1 (module docstring), in this process, once."""
    install(prefix_tree_attention_patches(tree_aware_attention), _no_deferred_install)


def _check_micro_batch(engine: Any, micro_batch: TensorDict) -> None:
    """Refuse what the tree forward does not carry (module docstring)."""
    flags = {key: bool(tu.get_non_tensor_data(data=micro_batch, key=key, default=key == "use_remove_padding"))
             for key in ("use_remove_padding", "use_fused_kernels", "distillation_use_topk", "distillation_only")}
    wrong = {key: value for key, value in flags.items() if value != (key == "use_remove_padding")}
    if wrong:
        _refuse(f"{wrong}", "use remove-padding, no fused kernels and no distillation with a prefix tree")
    mm = micro_batch.get("multi_modal_inputs", None)
    if mm is not None and any(bool(getattr(x, "data", x)) for x in mm):
        _refuse("the micro-batch has multi-modal inputs", "forward multi-modal rows without the tree")
    impl = getattr(getattr(engine.module, "config", None), "_attn_implementation", None)
    if ALL_ATTENTION_FUNCTIONS.get(impl) is not flash_attention_forward:
        _refuse(f"the model's attention is {impl!r}, not the flash-attention path (sdpa / eager would read the tree "
                "as separate sequences)", "set override_config.attn_implementation=cpu_varlen (CPU) or "
                "flash_attention_2")


def micro_batch_tree(micro_batch: TensorDict) -> DeviceTree:
    """The micro-batch's tree on its device, from its rows and the plan's facts (:data:`TREE_INDEX` per row token,
    :data:`TREE_SIZE_KEY` the tree's size): tensor ops only, no host copy (the checks stay on the device)."""
    size = tu.get_non_tensor_data(data=micro_batch, key=TREE_SIZE_KEY, default=None)
    if size is None or TREE_INDEX not in micro_batch.keys():
        missing = TREE_INDEX if TREE_INDEX not in micro_batch.keys() else TREE_SIZE_KEY
        raise TrajInputError(f"prefix-tree forward: a micro-batch without the plan's {missing!r} (the workers build "
                             "each tree from the facts the trainer ships with the plan, on the plan's micro-batches). "
                             "Fix: run marked passes through verl_traj's workers on a batch its trainer planned with "
                             "traj.prefix_tree=true.", field=missing)
    ids, pos, index = micro_batch["input_ids"], micro_batch["position_ids"], micro_batch[TREE_INDEX]
    if pos.dim() != 2:
        _refuse(f"position_ids are {pos.dim()}-D (multi-dimensional rotary)", "forward these rows without the tree")
    return tree_from_facts(ids.values(), pos.values(), ids.offsets(), index.values() if index.is_nested else index,
                           int(size))


def _tree_batch(micro_batch: TensorDict, tree: DeviceTree) -> tuple[TensorDict, dict]:
    """The one-row micro-batch verl's code sees: the tree's tokens and depths, the scalar settings of
    ``micro_batch``; and the tree's checks, with the rows whose temperature differs from the first's counted (a
    per-row temperature must be one value: shared tokens serve several rows)."""
    device = micro_batch["input_ids"].values().device
    offsets = torch.arange(2, device=device) * tree.num_tree_tokens  # [0, N] made on the device (no host copy)
    tensors = {name: torch.nested.nested_tensor_from_jagged(t.to(device), offsets)
               for name, t in (("input_ids", tree.input_ids), ("position_ids", tree.position_ids))}
    settings = {k: v.data for k, v in micro_batch.items() if isinstance(v, NonTensorData)}
    checks = dict(tree.checks)
    temperature = micro_batch.get("temperature", None)
    if isinstance(temperature, torch.Tensor) and temperature.numel():
        checks["temperature"] = (temperature != temperature.reshape(-1)[0]).sum()
        tensors["temperature"] = temperature.reshape(-1)[:1]
    return tu.get_tensordict(tensors, settings), checks


def _padded_subtree_end(subtree_end: torch.Tensor, length: int) -> torch.Tensor:
    """``[N]`` -> ``[length]``: verl's tail padding (position ids restarting at 0) as one chain after the tree."""
    n = subtree_end.numel()
    return torch.cat([subtree_end, subtree_end.new_full((length - n,), length - 1)])


def _prepare_inputs(verl_prepare: Callable, engine: Any, log: TreeRecorder, micro_batch: TensorDict):
    """``engine.prepare_model_inputs`` (module docstring, hook 2)."""
    if not tu.get_non_tensor_data(data=micro_batch, key=TREE_KEY, default=False):
        return verl_prepare(micro_batch=micro_batch)
    _check_micro_batch(engine, micro_batch)
    with record_function("verl_traj.tree.build"):
        tree = micro_batch_tree(micro_batch)
    with record_function("verl_traj.tree.inputs"):
        batch, checks = _tree_batch(micro_batch, tree)
        model_inputs, output_args = verl_prepare(micro_batch=batch)
    # under Ulysses each rank holds a slice; the attention sees the whole (padded) sequence after verl's all-to-all
    sp = int(getattr(engine, "ulysses_sequence_parallel_size", 1)) if getattr(engine, "use_ulysses_sp", False) else 1
    device, length = model_inputs["input_ids"].device, model_inputs["input_ids"].shape[-1] * sp
    with record_function("verl_traj.tree.mask"):
        attention = TreeAttentionInput(_padded_subtree_end(tree.subtree_end, length).to(device))
    model_inputs[TREE_KWARG] = attention
    output_args[_STATE] = _TreeState(tree, batch, attention)
    log.add(tree, length, checks)
    return model_inputs, output_args


def per_row_outputs(model_output: dict, tree: DeviceTree, offsets: torch.Tensor) -> dict:
    """Nested ``[1, N]`` per-tree-token outputs -> nested ``[R, L_r]`` per row (``offsets`` ``[R + 1]``, the rows'
    packed order); :data:`LABELED_OUTPUTS` get 0 at each row's last token (see module docstring)."""
    out = dict(model_output)
    for key, value in model_output.items():
        if not (isinstance(value, torch.Tensor) and value.is_nested):
            continue
        values = value.values()
        flat = values[tree.row_index.to(values.device)]
        if key in LABELED_OUTPUTS:
            flat = flat.index_fill(0, (tree.row_offsets[1:] - 1).to(values.device), 0.0)
        out[key] = torch.nested.nested_tensor_from_jagged(flat, offsets)
    return out


def _prepare_outputs(verl_prepare: Callable, output: Any, output_args: dict, micro_batch: TensorDict,
                     logits_processor_func: Any) -> dict:
    """``engine.prepare_model_outputs`` (module docstring, hook 2)."""
    state = output_args.get(_STATE)
    if state is None:
        return verl_prepare(output=output, output_args=output_args, micro_batch=micro_batch,
                            logits_processor_func=logits_processor_func)
    if state.attention.calls == 0:
        _refuse("the forward never reached the tree attention (another attention read the tree as separate "
                "sequences)", "run the model's attention through the flash-attention path with tree_forward entered")
    model_output = verl_prepare(output=output, output_args=output_args, micro_batch=state.batch,
                                logits_processor_func=logits_processor_func)
    with record_function("verl_traj.tree.outputs"):
        return per_row_outputs(model_output, state.tree, micro_batch["input_ids"].offsets())


def tree_forward_patches(engine: Any, log: TreeRecorder) -> list[Patch]:
    """Hook 2 (module docstring): the engine instance's two methods, restored on exit of :func:`patched`."""
    return [
        Patch(_ENGINE, "prepare_model_inputs", lambda verl: functools.partial(_prepare_inputs, verl, engine, log),
              "forward micro-batches marked prefix_tree as one prefix tree", target=engine),
        Patch(_ENGINE, "prepare_model_outputs", lambda verl: functools.partial(_prepare_outputs, verl),
              "gather a tree micro-batch's per-token outputs back into its rows", target=engine),
    ]
