"""docs/design.md's patch table lists exactly what the patch catalogues declare (``integration/patches/scoped.py`` and
``integration/patches/process.py``): every ``module.name`` in the table's name column is one declared patch,
and every declared patch is in the table. Names may be written with a module suffix (``ray_trainer.x`` for
``verl.trainer.ppo.ray_trainer.x``) and with braces (``compute_{data,timing}_metrics``, ``f{,_ray}``)."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

from tests.patch_catalogue import declared_patches

DESIGN = Path(__file__).resolve().parents[1] / "docs" / "design.md"
SECTION = "## What verl_traj replaces inside verl"


def expand(text: str) -> list[str]:
    """``a{b,c}d{,e}`` -> ``abd``, ``abde``, ``acd``, ``acde``."""
    parts = re.split(r"\{([^{}]*)\}", text)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def table_names(markdown: str) -> list[str]:
    """The backticked names in the second column of every table row of the patch section."""
    section = markdown.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|") and not re.match(r"\|[-| ]+\|$", line)]
    cells = [row.strip("|").split("|")[1] for row in rows]
    return [name for cell in cells for span in re.findall(r"`([^`]+)`", cell) for name in expand(span)
            if "(" not in name and "." in name]  # "name (module global)" header has no backticks


def _matches(entry: str, full: str) -> bool:
    return full == entry or full.endswith("." + entry)


def test_expand():
    assert expand("compute_{data,timing}_metrics") == ["compute_data_metrics", "compute_timing_metrics"]
    assert expand("{a,b.c}.f{,_ray}") == ["a.f", "a.f_ray", "b.c.f", "b.c.f_ray"]


def test_design_patch_table_lists_every_declared_patch_and_nothing_else():
    declared = sorted(f"{module}.{name}" for module, name in declared_patches())
    entries = table_names(DESIGN.read_text())
    assert entries, f"no table rows under {SECTION!r}"
    unknown_or_ambiguous = {e: [d for d in declared if _matches(e, d)] for e in entries}
    unknown_or_ambiguous = {e: m for e, m in unknown_or_ambiguous.items() if len(m) != 1}
    assert not unknown_or_ambiguous, f"table names that are not exactly one declared patch: {unknown_or_ambiguous}"
    missing = [d for d in declared if not any(_matches(e, d) for e in entries)]
    assert not missing, f"declared patches missing from docs/design.md's patch table: {missing}"


def test_every_declared_patch_names_the_verl_extension_point_that_would_replace_it():
    """Issue 42, item 4: each catalogue's ``UPSTREAM`` says, for each entry, what verl (or transformers) would need
    so that the patch could go, or which registry a registration uses; no entry for a patch that is gone."""
    from verl_traj.integration.patches import process, scoped

    upstream = {**scoped.UPSTREAM, **process.UPSTREAM}
    declared = set(declared_patches())
    assert sorted(declared - set(upstream)) == [], "patches without their extension point in UPSTREAM"
    assert sorted(set(upstream) - declared) == [], "UPSTREAM entries of patches no catalogue declares"
    assert all(len(text) > 20 for text in upstream.values())
