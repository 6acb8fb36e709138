"""The engine seam: what verl_traj needs of one of verl's training engines, in one value per engine
(:class:`EngineSeam`), looked up by the config's ``strategy``. Everything engine-specific that the worker adapters,
the patch catalogue and the start-up checks use is read from here; a second engine (verl's Megatron engine) is one
new module of this folder that registers its seam (docs/architecture.md, "A second engine").

Built in: :data:`~verl_traj.integration.engines.fsdp.FSDP` (``strategy=fsdp`` / ``fsdp2``), the engine verl_traj
plans micro-batches for and forwards prefix trees through. A strategy with no seam trains with verl's own
micro-batches (start-up says so: ``traj_plan/planned_micro_batches`` is 0) and never takes trees.

May import: nothing else in verl_traj.integration.
"""

from verl_traj.integration.engines.fsdp import FSDP
from verl_traj.integration.engines.seam import (ENGINES, EngineSeam, engine_of, micro_batch_modules,
                                                planned_strategies, register_engine, tree_engines, tree_strategies)

__all__ = ["ENGINES", "FSDP", "EngineSeam", "engine_of", "micro_batch_modules", "planned_strategies",
           "register_engine", "tree_engines", "tree_strategies"]
