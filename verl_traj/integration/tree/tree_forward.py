"""A worker's passes on prefix trees through verl's FSDP engine (remove-padding path), exactly (issue 29): the one
step of the worker-side path that differs for trees.

The trainer marks each pass of a planned batch (the non-tensor :data:`~verl_traj.core.keys.TREE_KEY`: v1 puts it in the
call's ``extra_info``, since verl rebuilds the meta between passes; v0 in the batch's ``meta_info``). A verl_traj
worker runs a marked pass inside :func:`tree_pass` on the plan's micro-batches -- an update's (``train_mini_batch``,
actor and critic) and the old-log-prob, reference and value passes' (``infer_batch``), so both log-probs of the PPO
ratio take one numeric path -- and every micro-batch is forwarded as one tree; nothing else changes. What a pass checks
and records is the pure :mod:`verl_traj.core.kernels.tree_pass`; the attention's side of a tree is
:mod:`verl_traj.core.kernels.tree_kernel`.

Hook points (each declared, with how it is undone):

1. process patch :func:`~verl_traj.integration.patches.process.prefix_tree_attention_patches`:
   ``verl.models.transformers.monkey_patch._flash_attention_forward`` <-
   :func:`~verl_traj.core.kernels.tree_kernel.tree_aware_attention` (the kernel verl's remove-padding path calls: the CPU
   platform's ``cpu_varlen`` attention on CPU, flash-attn on GPU). Installed by a process's first tree pass, never
   restored (a non-tree call computes as before).
2. scoped patch :func:`~verl_traj.integration.patches.scoped.tree_forward_patches`: the engine *instance*'s
   ``prepare_model_inputs`` / ``prepare_model_outputs`` for the pass (on exit the instance attributes are removed and
   the class's methods show through again):

   * inputs: the micro-batch's tree is built on its device from its rows and the plan's facts
     (:func:`~verl_traj.core.trees.tree_facts.tree_from_facts`; the facts are planned on the driver,
     :mod:`verl_traj.integration.trainers.tree_plan_facts`), no host copy of token ids; verl's own
     ``prepare_model_inputs`` gets a one-row micro-batch holding the tree tokens and their depths, so verl packs,
     rolls the labels (the next serialised token is each tree token's child wherever it has one: branch copies),
     and pads exactly as for rows; the tree rides along as the model keyword
     :data:`~verl_traj.core.kernels.tree_kernel.TREE_KWARG`;
   * outputs: verl's own ``prepare_model_outputs`` over that one-row micro-batch gives per-tree-token log-probs /
     entropy; :func:`~verl_traj.core.kernels.tree_kernel.per_row_outputs` gathers them into the rows' packed order.

Exact because every row token's tree instance has exactly the row's tokens as ancestors (same ids, positions = depth
= the row's own position ids): logits, log-probs at the rolled label and entropy equal the per-row forward's, and the
backward through the gather sums each shared token's gradient over its rows. The facts are checked against the rows
on the device; the counts are read once when the pass ends (:meth:`~verl_traj.core.kernels.tree_pass.TreeForwardLog.settle`),
and a mismatch raises there, as does a pass in which some micro-batch ran without its tree.

Refused (a :class:`~verl_traj.core.kernels.tree_attention.TreeAttentionError` naming the fix): no remove-padding,
fused kernels, distillation, multi-modal inputs, 3-D position ids, an attention implementation other than the
flash-attention path, attention dropout / sliding window / soft-capping; a batch or micro-batch without the plan's ids
or tree facts (a :class:`~verl_traj.core.errors.TrajInputError`). Counted on the device and refused when the pass ends:
facts that do not reproduce the rows, non-``arange`` position ids, per-row temperatures that differ.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from tensordict import NonTensorData, TensorDict
from torch.profiler import record_function
from transformers.integrations.flash_attention import flash_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_id

from verl_traj.core.errors import TrajInputError
from verl_traj.core.keys import TREE_SEGMENT, TREE_KEY, TREE_SIZE_KEY
from verl_traj.core.trees.tree_facts import segment_tree_index, DeviceTree, tree_from_facts
from verl_traj.core.kernels.tree_kernel import (TREE_KWARG, TreeAttentionInput, padded_subtree_end, per_row_outputs,
                                        refuse_tree, tree_aware_attention)
from verl_traj.core.kernels.tree_pass import (TreeForwardLog, TreeTotals, check_all_tree, check_marked, tree_metric_totals,
                                      tree_metrics_of)
from verl_traj.integration.engines import EngineSeam, tree_strategies
from verl_traj.integration.patches.process import install, prefix_tree_attention_patches
from verl_traj.integration.patches.scoped import patched, tree_forward_patches

__all__ = ["install_tree_attention", "micro_batch_tree", "tree_forward", "tree_metrics", "tree_pass"]

_STATE = "prefix_tree_state"  # output_args key: the tree of this forward


@dataclass(frozen=True)
class _TreeState:
    tree: DeviceTree
    batch: TensorDict  # the one-row micro-batch verl's code saw
    attention: TreeAttentionInput


def _no_deferred_install(module_name: str, _callback: Callable) -> None:
    raise RuntimeError(f"the prefix-tree attention patch is installed now, not on import of {module_name}")


@functools.cache
def install_tree_attention() -> None:
    """Hook 1 (module docstring), in this process, once (a process's first tree pass installs it)."""
    install(prefix_tree_attention_patches(tree_aware_attention), _no_deferred_install)


def _check_micro_batch(engine: Any, seam: Optional[EngineSeam], micro_batch: TensorDict) -> None:
    """Refuse what the tree forward does not carry (module docstring)."""
    flags = {key: bool(tu.get_non_tensor_data(data=micro_batch, key=key, default=key == "use_remove_padding"))
             for key in ("use_remove_padding", "use_fused_kernels", "distillation_use_topk", "distillation_only")}
    wrong = {key: value for key, value in flags.items() if value != (key == "use_remove_padding")}
    if wrong:
        refuse_tree(f"{wrong}", "use remove-padding, no fused kernels and no distillation with a prefix tree")
    mm = micro_batch.get("multi_modal_inputs", None)
    if mm is not None and any(bool(getattr(x, "data", x)) for x in mm):
        refuse_tree("the micro-batch has multi-modal inputs", "forward multi-modal rows without the tree")
    if seam is None or seam.tree_engine is None:
        refuse_tree(f"the engine is a {type(engine).__qualname__}, which no engine seam serves with trees",
                    "set the role's strategy to one of " + ", ".join(tree_strategies()))
    model = getattr(engine, seam.model_attribute, None)
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if ALL_ATTENTION_FUNCTIONS.get(impl) is not flash_attention_forward:
        refuse_tree(f"the model's attention is {impl!r}, not the flash-attention path (sdpa / eager would read the tree "
                "as separate sequences)", "set override_config.attn_implementation=cpu_varlen (CPU) or "
                "flash_attention_2")


def micro_batch_tree(micro_batch: TensorDict) -> DeviceTree:
    """The micro-batch's tree on its device, from its rows and the plan's facts (:data:`TREE_SEGMENT` per row,
    :data:`TREE_SIZE_KEY` the tree's size): tensor ops only, no host copy (the checks stay on the device)."""
    size = tu.get_non_tensor_data(data=micro_batch, key=TREE_SIZE_KEY, default=None)
    if size is None or TREE_SEGMENT not in micro_batch.keys():
        missing = TREE_SEGMENT if TREE_SEGMENT not in micro_batch.keys() else TREE_SIZE_KEY
        raise TrajInputError(f"prefix-tree forward: a micro-batch without the plan's {missing!r} (the workers build "
                             "each tree from the facts the trainer ships with the plan, on the plan's micro-batches). "
                             "Fix: run marked passes through verl_traj's workers on a batch its trainer planned with "
                             "traj.prefix_tree=true.", field=missing)
    ids, pos = micro_batch["input_ids"], micro_batch["position_ids"]
    if pos.dim() != 2:
        refuse_tree(f"position_ids are {pos.dim()}-D (multi-dimensional rotary)", "forward these rows without the tree")
    index = segment_tree_index(ids.offsets(), micro_batch[TREE_SEGMENT], ids.values().shape[0])
    return tree_from_facts(ids.values(), pos.values(), ids.offsets(), index, int(size))


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


def _prepare_inputs(verl_prepare: Callable, engine: Any, seam: Optional[EngineSeam], log: TreeForwardLog,
                    micro_batch: TensorDict):
    """``engine.prepare_model_inputs`` (module docstring, hook 2)."""
    if not tu.get_non_tensor_data(data=micro_batch, key=TREE_KEY, default=False):
        return verl_prepare(micro_batch=micro_batch)
    if tu.get_non_tensor_data(data=micro_batch, key=TREE_SIZE_KEY, default=None) == 0:  # the plan chose rows
        log.row_micro_batches += 1
        return verl_prepare(micro_batch=micro_batch)
    _check_micro_batch(engine, seam, micro_batch)
    with record_function("verl_traj.tree.build"):
        tree = micro_batch_tree(micro_batch)
    with record_function("verl_traj.tree.inputs"):
        batch, checks = _tree_batch(micro_batch, tree)
        model_inputs, output_args = verl_prepare(micro_batch=batch)
    # under Ulysses each rank holds a slice; the attention sees the whole (padded) sequence after verl's all-to-all
    sp = int(getattr(engine, "ulysses_sequence_parallel_size", 1)) if getattr(engine, "use_ulysses_sp", False) else 1
    device, length = model_inputs["input_ids"].device, model_inputs["input_ids"].shape[-1] * sp
    with record_function("verl_traj.tree.mask"):
        attention = TreeAttentionInput(padded_subtree_end(tree.subtree_end, length).to(device))
    model_inputs[TREE_KWARG] = attention
    output_args[_STATE] = _TreeState(tree, batch, attention)
    log.add(tree, length, checks)
    return model_inputs, output_args


def _prepare_outputs(verl_prepare: Callable, log: TreeForwardLog, output: Any, output_args: dict, micro_batch: TensorDict,
                     logits_processor_func: Any) -> dict:
    """``engine.prepare_model_outputs`` (module docstring, hook 2)."""
    state = output_args.get(_STATE)
    if state is None:
        return verl_prepare(output=output, output_args=output_args, micro_batch=micro_batch,
                            logits_processor_func=logits_processor_func)
    if state.attention.calls == 0:
        refuse_tree("the forward never reached the tree attention (another attention read the tree as separate "
                    "sequences)", "run the model's attention through the flash-attention path with tree_forward entered")
    log.fallback_micro_batches += int(state.attention.fallbacks > 0)  # flex past its limit: the blocked kernel
    model_output = verl_prepare(output=output, output_args=output_args, micro_batch=state.batch,
                                logits_processor_func=logits_processor_func)
    with record_function("verl_traj.tree.outputs"):
        return per_row_outputs(model_output, state.tree, micro_batch["input_ids"].offsets())


@contextlib.contextmanager
def tree_forward(engine: Any, seam: Optional[EngineSeam]) -> Iterator[TreeForwardLog]:
    """Within: ``engine`` (of the engine seam ``seam``, which the worker resolved when it was built) forwards
    micro-batches marked ``prefix_tree=True`` as prefix trees (hooks 1 and 2); an engine no seam serves with trees is
    refused. Yields the log of the tree micro-batches run, settled on exit (its one device read; a mismatch raises)."""
    if seam is None or seam.tree_engine is None:
        refuse_tree(f"the engine is a {type(engine).__qualname__}, which no engine seam serves with trees",
                    "set the role's strategy to one of " + ", ".join(tree_strategies()))
    install_tree_attention()
    log = TreeForwardLog()
    hooks = (lambda verl: functools.partial(_prepare_inputs, verl, engine, seam, log),
             lambda verl: functools.partial(_prepare_outputs, verl, log))
    with patched(tree_forward_patches(engine, seam.tree_engine, *hooks)):
        yield log
    log.settle()


@contextlib.contextmanager
def tree_pass(engine: Any, seam: Optional[EngineSeam], data: TensorDict, counts: Callable[[], int], what: str,
              into: Optional[TreeTotals] = None) -> Iterator[TreeForwardLog]:
    """Within: ``engine`` (its ``seam``) forwards every micro-batch of the marked ``data`` (its ids and facts checked:
    :func:`~verl_traj.core.kernels.tree_pass.check_marked`) as a tree; on exit (no error) the pass's log is settled and
    ``counts()`` micro-batches (the planned ones the pass ran) must all have been trees
    (:func:`~verl_traj.core.kernels.tree_pass.check_all_tree`). ``into``: totals the pass is added to (a worker's log-prob /
    value passes, which its next update reports)."""
    check_marked(data.keys())
    with tree_forward(engine, seam) as log:
        yield log
    check_all_tree(log, counts(), what)
    if into is not None:
        into.add(log)


def tree_metrics(log: TreeForwardLog, infer: Optional[TreeTotals], dp_group: Any = None) -> dict[str, list]:
    """The update's tree metrics (:func:`~verl_traj.core.kernels.tree_pass.tree_metrics_of`), summed over the data-parallel
    ranks of ``dp_group`` (one all-reduce) and all epochs; ``infer``: this worker's inference passes since its last
    update (``None``: none ran)."""
    totals = torch.tensor(tree_metric_totals(log, infer), dtype=torch.float64, device=get_device_id())
    ranks = 1
    if dp_group is not None and torch.distributed.is_initialized():
        torch.distributed.all_reduce(totals, group=dp_group)
        ranks = torch.distributed.get_world_size(dp_group)
    return tree_metrics_of(totals.tolist(), ranks)
