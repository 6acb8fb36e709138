"""verl's FSDP engine (``strategy=fsdp`` / ``fsdp2``, ``verl.workers.engine.fsdp.transformer_impl``): its
``forward_backward_batch`` cuts micro-batches with the module-level ``prepare_micro_batches`` and runs them as a plain
loop, so the plan's micro-batches replace that one function; ``FSDPEngineWithLMHead``'s ``prepare_model_inputs`` /
``prepare_model_outputs`` are the input-transform hooks a prefix-tree pass wraps; ``engine.module`` is the wrapped
Hugging Face model (the seam's default ``model_attribute``)."""

from __future__ import annotations

from verl_traj.integration.engines.seam import EngineSeam, register_engine

__all__ = ["FSDP"]


FSDP = register_engine(EngineSeam(
    name="fsdp", strategies=("fsdp", "fsdp2"), micro_batch_modules=("verl.workers.engine.fsdp.transformer_impl",),
    tree_engine="verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead"))
