"""Step-wise multi-turn helpers (pure: torch, numpy, stdlib; no verl / ray imports).

- ``advantages``: outcome estimators run once per trajectory, broadcast to each step row on its own
  ``response_mask`` (fixes the SkyRL 1492 class of bugs).
- ``prefix_merge``: merge consecutive steps whose context is a token prefix of the next step's.
- ``credit_rules``: the registry of per-call credit rules; ``step_groups`` registers GiGPO on it (imported here,
  so a process that loads any step-wise module knows every built-in rule).
- ``expand``: expand a rollout batch carrying per-step records into padded step rows (optionally
  prefix-merged), for the trainer's ``_balance_batch`` hook.
"""

from verl_traj.stepwise.advantages import (  # noqa: F401
    StepwiseAdvantageError,
    broadcast_step_advantages,
    check_stepwise_estimator,
    compute_trajectory_advantages,
    last_step_rows,
)
from verl_traj.stepwise.expand import (  # noqa: F401
    DEFAULT_STEPS_KEY,
    ExpandedBatch,
    StepExpansionError,
    decode_step_records,
    encode_step_records,
    expand_step_rows,
    steps_from_row,
)
from verl_traj.stepwise.prefix_merge import (  # noqa: F401
    MergedRow,
    MergeStats,
    PrefixMergeError,
    can_merge_boundaries,
    merge_trajectory_steps,
)
from verl_traj.stepwise import step_groups  # noqa: F401,E402  (registers the built-in rule gigpo)
from verl_traj.stepwise import tree_credit  # noqa: F401,E402  (registers the built-in rule tree_grpo)
