"""colibri's own Sphinx glue: the transformers catalogue, and links for top-level names.

``.. colibri-routers::`` is a table of the routing implementations colibri reproduces and the
transformers router classes that use each; ``.. colibri-differences::`` lists
``colibri.integrations.transformers.DIFFERENCES``. Both are read from the installed package at
build time, so the pages never disagree with the code.

A reference to a top-level name (``colibri.Pager``, ``colibri.init``, ``colibri.Pager.load``)
links to where the API pages document it, the subpackage that defines it
(``colibri.pager.Pager``).
"""

from __future__ import annotations

import importlib

from docutils import nodes
from sphinx.util.docutils import SphinxDirective


def _table(header: list[str], rows: list[list[str]], widths: list[int]) -> nodes.table:
    table = nodes.table()
    group = nodes.tgroup(cols=len(header))
    table += group
    for width in widths:
        group += nodes.colspec(colwidth=width)
    head, body = nodes.thead(), nodes.tbody()
    group += head
    group += body
    for target, cells, code in ((head, [header], False), (body, rows, True)):
        for cells_row in cells:
            row = nodes.row()
            for i, text in enumerate(cells_row):
                entry = nodes.entry()
                child = nodes.literal(text, text) if code and i == 0 else nodes.Text(text)
                entry += nodes.paragraph("", "", child)
                row += entry
            target += row
    return table


class Routers(SphinxDirective):
    """The routing implementations and the router classes that share each."""

    def run(self) -> list[nodes.Node]:
        from colibri.integrations.transformers import supported_routers

        rows = [[kind, ", ".join(classes.split())] for kind, classes in supported_routers().items()]
        return [_table(["routing implementation", "transformers router classes"], rows, [30, 70])]


class Differences(SphinxDirective):
    """``DIFFERENCES``: where colibri's routing is not bit-identical to transformers'."""

    def run(self) -> list[nodes.Node]:
        from colibri.integrations.transformers import DIFFERENCES

        items = nodes.definition_list()
        for key, text in DIFFERENCES.items():
            item = nodes.definition_list_item()
            item += nodes.term(text=key)
            definition = nodes.definition()
            definition += nodes.paragraph(text=text)
            item += definition
            items += item
        return [items]


# The subpackages whose API pages document the names ``colibri`` re-exports.
_HOMES = ("routing", "partition", "pager", "layer", "formats")


def _resolve_reexport(app, env, node, contnode):
    """Resolve ``colibri.X[.member]`` to ``colibri.<home>.X[.member]``."""
    target = node.get("reftarget", "")
    if node.get("refdomain") != "py" or not target.startswith("colibri."):
        return None
    name, dot, member = target.removeprefix("colibri.").partition(".")
    for home in _HOMES:
        if name in getattr(importlib.import_module(f"colibri.{home}"), "__all__", ()):
            return env.get_domain("py").resolve_xref(
                env,
                node["refdoc"],
                app.builder,
                node["reftype"],
                f"colibri.{home}.{name}{dot}{member}",
                node,
                contnode,
            )
    return None


def setup(app):
    app.add_directive("colibri-routers", Routers)
    app.add_directive("colibri-differences", Differences)
    app.connect("missing-reference", _resolve_reexport)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
