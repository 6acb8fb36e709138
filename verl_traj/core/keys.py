"""Names of the per-row fields verl_traj adds to a batch, in one place.

Every per-row fact is computed once, where it is born, and carried forward in the batch under one of
these names (see docs/design.md, "Where each per-row fact is born"):

=====================  ======================  ==========================================================
key                    written by              read by
=====================  ======================  ==========================================================
``mini_batch_id``      :func:`apply_plan`      worker iterator (one optimizer step per id), loss weights
``micro_batch_id``     :func:`apply_plan`      worker micro-batch hook (the forward/backward passes)
``traj_index``         :func:`apply_plan`      loss weights (``traj-mean``), step-wise advantages
``is_padding``         :func:`apply_plan`      real-row views (metrics, advantages), loss weights
``is_last_step``       step-wise expansion     layout validation, step-wise advantages
``loss_weight``        trainer, per update     the loss functions (actor and critic)
``ratio_group``        trainer, per update     actor worker: trajectory-scoped GSPO (``traj.ratio_scope``)
``seq_ratio_shift``    actor worker, per step  the policy loss (GSPO's sequence ratio over the trajectory)
``prefix_tree_index``  trainer, per step       tree workers: each row token's index in its micro-batch's tree
``prefix_tree_size``   trainer, per step       tree workers: the tree tokens of the row's micro-batch
=====================  ======================  ==========================================================

A planned update is a contract: the trainer names the per-row fields it planned in the update's non-tensor
``traj_planned_fields`` (:data:`PLANNED_FIELDS`, :func:`planned_update_fields`); a worker that receives a planned
update missing any of them raises, naming the field (never verl's path in silence).

All of them but ``is_last_step`` (a ``non_tensor_batch`` field, as the expansion writes it) are
tensors: verl's ``DataProto.to_tensordict`` refuses a key that is both a tensor and a non-tensor.
"""

MINI_BATCH_ID = "mini_batch_id"
MICRO_BATCH_ID = "micro_batch_id"
TRAJ_INDEX = "traj_index"
IS_PADDING = "is_padding"
IS_LAST_STEP = "is_last_step"
LOSS_WEIGHT = "loss_weight"
RATIO_GROUP = "ratio_group"  # [B] the trajectory whose sequence ratio a row shares (GSPO at trajectory scope)
SEQ_RATIO_SHIFT = "seq_ratio_shift"  # [b] per-row shift of old log-probs that makes GSPO's row mean the trajectory's
TURN_REWARDS = "turn_rewards"  # [B, R] per-step (turn) rewards of step rows, each on its call's last response token
STEP_ANCHORS = "step_anchors"  # [B, R] int64: each LLM call's anchor key on its first response token (GiGPO), else 0
# [B, R] of a batch holding a branching session's rows (issue 56), on each call's first response token: the call's
# packed leaf span (int64, stepwise.call_tree.pack_leaf_span) and a leaf's own outcome (float), else 0
TREE_CALLS = "traj_tree_calls"
TREE_OUTCOMES = "traj_tree_outcomes"
# [B, R] float of an update whose batch has a call with leaves of both signs: that part of ``advantages``, which the
# policy loss evaluates on its own (loss(r, A - neg) + loss(r, neg): the call's root-to-leaf paths under clipping)
ADVANTAGES_NEGATIVE = "traj_advantages_negative"
# [B, R] float of an update under traj.branch_weighting=expanded: how many root-to-leaf paths each token trains for
# (its call's leaves below); the loss weighs each token by it and the normaliser counts it (docs/branching.md)
PATH_COPIES = "traj_path_copies"

TREE_SEGMENT = "prefix_tree_segment"  # [B, 3] per row: rank, start, first tree token of its segment (traj.prefix_tree)
TREE_SIZE = "prefix_tree_size"  # [B] per row: the tree tokens of its micro-batch's tree
TREE_KEY = "prefix_tree"  # non-tensor of a planned pass: forward each of its micro-batches as a prefix tree
PLAN_ATOMIC = "traj_plan_atomic"  # non-tensor of a v0 planned batch: every trajectory in one micro-batch
TREE_SIZE_KEY = "prefix_tree_tokens"  # non-tensor of one planned micro-batch: its tree tokens (a host int)

ADVANTAGE_METRICS = "traj_advantage_metrics"  # meta_info of a batch: the advantage step's metrics (traj_gigpo/*)
# non-tensor key the trainer sets when the critic steps on unions of the actor's mini-batches (read by the workers)
CRITIC_UNION_KEY = "traj_critic_union"
PLANNED_FIELDS = "traj_planned_fields"  # non-tensor of an update: the comma-separated fields the trainer planned
# non-tensor of an actor update: its old log-probs were computed by the parameters the update starts from (verl
# recomputes them right before every update; bypass_mode, which takes the rollout's, is refused), so the first
# optimizer step's log-ratios are rounding and GSPO's trajectory pre-pass may skip it where the forward is deterministic
OLD_LOG_PROBS_AT_START = "traj_old_log_probs_at_start"
# non-tensor of an actor update with ratio groups: every trajectory's rows share one micro-batch (a prefix-tree plan
# with all trajectories atomic), so the loss computes each trajectory's GSPO ratio from the live log-probs (no pre-pass)
RATIO_IN_LOSS = "traj_ratio_in_loss"
# non-tensor of a v1 call: the plan's per-row fields of each data-parallel rank (RowFieldRefs), shipped with the call
# instead of stored in TransferQueue; ROW_LENGTH, each row's attended tokens, lets the worker check they are its rows
ROW_FIELDS = "traj_row_fields"
ROW_LENGTH = "traj_row_length"


def planned_update_fields(ratio_groups: bool = False) -> tuple[str, ...]:
    """The per-row fields every planned update carries to the workers (``ratio_groups``: GSPO at trajectory
    scope, the actor's rows carry ``ratio_group`` too)."""
    return (MINI_BATCH_ID, MICRO_BATCH_ID, LOSS_WEIGHT) + ((RATIO_GROUP,) if ratio_groups else ())


# Tensor fields apply_plan adds (replaced if the input already carries them).
PLAN_KEYS = (MINI_BATCH_ID, MICRO_BATCH_ID, TRAJ_INDEX, IS_PADDING)

__all__ = ["ADVANTAGE_METRICS", "ADVANTAGES_NEGATIVE", "PATH_COPIES", "CRITIC_UNION_KEY", "MINI_BATCH_ID", "MICRO_BATCH_ID", "TRAJ_INDEX", "IS_PADDING", "IS_LAST_STEP", "LOSS_WEIGHT", "PLAN_KEYS",
           "OLD_LOG_PROBS_AT_START", "PLANNED_FIELDS", "RATIO_IN_LOSS", "RATIO_GROUP", "planned_update_fields", "SEQ_RATIO_SHIFT", "STEP_ANCHORS",
           "ROW_FIELDS", "ROW_LENGTH", "TREE_CALLS", "TREE_OUTCOMES", "TREE_SEGMENT", "TREE_SIZE", "TREE_SIZE_KEY", "TURN_REWARDS", "PLAN_ATOMIC", "TREE_KEY"]
