"""The catalogue of every change verl_traj makes inside verl's modules, each with its why and how it is restored:
:mod:`.scoped` (swapped for one call, restored on exit) and :mod:`.process` (the plugin's, for a process's life).
The adapters pass their replacements in; ``docs/design.md`` tables every entry.

May import: rows (v0's fit patches name their replacements there), engines (the engines' patch targets).
"""
