"""Bridges between colibri and model frameworks.

Each integration lives in its own module and imports its framework lazily, so
``import colibri`` never needs it:

- :mod:`colibri.integrations.transformers`: route the MoE blocks of a loaded
  Hugging Face transformers model with colibri (``patch`` / ``unpatch``), and load a
  checkpoint bigger than memory with its routed experts paged by colibri
  (``from_pretrained(path, budget=...)``).
"""
