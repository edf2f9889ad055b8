"""Routing: a validated configuration, contexts around the compiled router, usage statistics.

``Config`` holds every routing option; ``init`` builds a ``Context`` whose ``route`` (or the
function ``route_from_dlpack``) picks each token's experts and weights from ``[T, E]`` logits
of any framework; ``route`` is the one-shot form. ``UsageStats`` are the expert counts and
co-activations a context collects, the input of ``Partition.from_usage``.
"""

from colibri._usage import UsageStats  # a leaf, so that partition needs no routing for it
from colibri.routing._config import Config
from colibri.routing._context import Context, init, route, route_from_dlpack

__all__ = ["Config", "Context", "UsageStats", "init", "route", "route_from_dlpack"]
