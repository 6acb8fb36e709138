"""The calculator agent: a multi-turn tool-calling task (2-3 calculator calls per episode) that trains on a
machine without a GPU. ``task`` (problems, reward), ``tool`` (the calculator, loaded by verl's agent loop),
``prepare`` (offline data + tiny model + warm start), ``evaluate`` (offline accuracy)."""
