"""verl_traj's patch surface, read from the two catalogues: every verl (or transformers) name they change, whether it
is replaced or only gets an entry added (a registry: the extension point itself), the factories that declare it, and
the extension point that would make it unnecessary (``UPSTREAM``). Issue 42, item 4.

    python scripts/patch_surface.py           # the table and the counts
    python scripts/patch_surface.py --json    # the same as JSON

Counted: entries of ``verl_traj/integration/patches/scoped.py`` (swapped for one call, restored) and ``process.py``
(for a process's life); every change verl_traj makes to verl is in one of them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.patch_catalogue import declared_patches  # noqa: E402
from verl_traj.integration.patches import process, scoped  # noqa: E402

REGISTRATION = "an entry added, nothing replaced"


def surface() -> list[dict]:
    upstream = {**scoped.UPSTREAM, **process.UPSTREAM}
    rows = []
    for (module, name), factories in sorted(declared_patches().items()):
        text = upstream.get((module, name), "")
        rows.append({"name": f"{module}.{name}", "kind": "register" if REGISTRATION in text else "replace",
                     "catalogue": "scoped" if (module, name) in scoped.UPSTREAM else "process",
                     "factories": factories, "upstream": text})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = surface()
    counts = {kind: sum(r["kind"] == kind for r in rows) for kind in ("replace", "register")}
    counts.update({f"{c}_replace": sum(r["kind"] == "replace" and r["catalogue"] == c for r in rows)
                   for c in ("scoped", "process")})
    if args.json:
        print(json.dumps({"counts": counts, "patches": rows}, indent=1))
        return
    for r in rows:
        print(f"{r['kind']:<8} {r['catalogue']:<7} {r['name']}\n{'':17}would go with: {r['upstream']}")
    print(f"\n{len(rows)} names: {counts['replace']} replaced ({counts['scoped_replace']} for one call, "
          f"{counts['process_replace']} for a process's life), {counts['register']} registry entries")


if __name__ == "__main__":
    main()
