"""The driver's training loop: v0's ``TrajRayPPOTrainer`` (:mod:`.v0`) and v1's ``TrajV1Mixin`` (:mod:`.v1`, one module
per concern: ``v1_planning``, ``v1_padding``, ``v1_plan_facts``, ``v1_advantage``, ``v1_updates``, ``v1_metrics``), and
what both share: the update contract they hand the workers (:mod:`.update_contract`), the planner call
(:mod:`.step_plan`), the prefix trees' facts shipped with the plan (:mod:`.tree_plan_facts`) and complete checkpoints
(:mod:`.checkpoints`).

May import: config, rows, patches, tree, async_modes, startup.
"""
