"""verl_traj inside verl: the adapters, one folder per place the code runs.

The pure core (:mod:`verl_traj.core`, :mod:`verl_traj.stepwise`) decides; the folders here move its decisions into
verl's trainers, workers and agent loops. Each folder's docstring says what runs there and, on its ``May import:``
line, which other folders it may import (``tests/test_code_shape.py`` reads those lines and checks every import,
at module level and inside functions). The order, bottom to top::

    engines                                    each training engine's seam (verl's FSDP engine)
    config   rows                              verl's config read once; verl's batch functions on planned rows
    patches                                    the catalogue of every change to verl's modules
    tree     async_modes                       the prefix tree's engine path; staleness and failed groups
    workers  agent_loops  startup              worker processes; agent-loop processes; the driver's checks
    trainers                                   the driver's training loop (v0 and v1)

``verl_traj.main_ppo`` sits above them all: it runs start-up, then verl's task runner with the trainers, and wires
the worker classes of every role (driver code imports no worker or agent-loop module).
"""
