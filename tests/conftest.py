"""Fixtures every test folder shares: the one tiny model.

* ``tiny_home``: the tiny Qwen2, tokenizer and data of :mod:`verl_traj.cpu.build_tiny`, built once per session
  (offline) into ``<tmp>/tiny``: a training process finds it with ``VERL_TRAJ_HOME=<tmp>`` (``tiny_home.parent``;
  the presets read ``$VERL_TRAJ_HOME/tiny``).
* ``tool_home``: the same folder with ``model_tool/`` added (the tiny model taught to call the digits tool, for
  multi-turn runs), built on first use.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_home(tmp_path_factory) -> Path:
    from verl_traj.cpu.build_tiny import build

    return build(str(tmp_path_factory.mktemp("verl_traj_home") / "tiny"))


@pytest.fixture(scope="session")
def tool_home(tiny_home) -> Path:
    from verl_traj.cpu.build_tiny import build_tool_caller

    build_tool_caller(str(tiny_home), steps=80)
    return tiny_home
