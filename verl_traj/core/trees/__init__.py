"""Prefix trees as data: rows of token ids, the trie of every micro-batch, the facts a tree carries.

Runs on: the driver (built once when it plans) and the workers (the same facts rebuilt on the device in each pass).
May import: nothing in the core but its root (errors, keys, sorting).

Pure: torch and numpy.
"""
