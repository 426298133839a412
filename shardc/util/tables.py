"""A report as text, rich tables or HTML: lines of text and :class:`Table`\\ s, built once
and rendered three ways.

``str(report)`` is plain text (what ``plan.explain()`` returns and a pipe gets); a
:class:`Report` is a rich renderable (``rich.print(plan.report())``; ``shardc explain`` in a
terminal) when ``rich`` is installed, and ``_repr_html_`` gives notebooks plain HTML tables
(no dependency). Nothing here imports rich until a console renders a report.
"""

from __future__ import annotations

import html
import textwrap
from dataclasses import dataclass

__all__ = ["Report", "Table"]


def clip(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters, the cut marked with ``...`` (0: no limit)."""
    return text if not width or len(text) <= width else text[:width - 3] + "..."


@dataclass(frozen=True)
class Table:
    """A titled table. ``rows`` hold one string per column, or a single string: a note
    spanning the table (``-- x12: ops 5-90 ...`` before a folded layer's rows).
    ``align`` has one character per column, ``<`` or ``>``; ``widths`` caps a column's
    width in text (0: none); ``header`` prints the column names in text (rich and HTML
    always show them); ``indent`` prefixes each text row."""

    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...] | str, ...]
    align: str = ""
    widths: tuple[int, ...] = ()
    header: bool = True
    indent: int = 0
    caption: str = ""

    def _align(self, k: int) -> str:
        return self.align[k] if k < len(self.align) else "<"

    def _cap(self, k: int) -> int:
        return self.widths[k] if k < len(self.widths) else 0

    def text(self) -> list[str]:
        cells = [tuple(clip(c, self._cap(k)) for k, c in enumerate(row))
                 for row in self.rows if not isinstance(row, str)]
        width = [max([len(c[k]) for c in cells] + [len(name) if self.header else 0])
                 for k, name in enumerate(self.columns)]
        pad = " " * self.indent

        def line(row) -> str:
            return (pad + "  ".join(f"{c:{self._align(k)}{width[k]}}"
                                    for k, c in enumerate(row))).rstrip()

        out = [self.title] if self.title else []
        if self.header:
            head = line(self.columns)
            out += [head, "-" * len(head)]
        it = iter(cells)
        out += [pad + row if isinstance(row, str) else line(next(it)) for row in self.rows]
        if self.caption:
            out += textwrap.wrap(self.caption, 100, initial_indent=pad, subsequent_indent=pad)
        return out

    def html(self) -> str:
        n = len(self.columns)
        caption = self.title + (f" ({self.caption})" if self.caption else "")
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.columns)
        body = []
        for row in self.rows:
            if isinstance(row, str):
                body.append(f'<tr><td colspan="{n}"><em>{html.escape(row)}</em></td></tr>')
            else:
                body.append("<tr>" + "".join(
                    f'<td style="text-align:{"right" if self._align(k) == ">" else "left"}">'
                    f"{html.escape(c)}</td>" for k, c in enumerate(row)) + "</tr>")
        return (f"<table><caption>{html.escape(caption)}</caption><thead><tr>{head}</tr>"
                f"</thead><tbody>{''.join(body)}</tbody></table>")

    def rich(self):
        from rich.console import Group
        from rich.table import Table as RichTable
        from rich.text import Text

        t = RichTable(caption=self.caption or None, caption_justify="left")
        for k, name in enumerate(self.columns):
            t.add_column(name, justify="right" if self._align(k) == ">" else "left",
                         max_width=self._cap(k) or None, overflow="ellipsis")
        last = len(self.columns) - 1
        for row in self.rows:
            if isinstance(row, str):  # a note: its own section, in the widest column
                t.add_section()
                t.add_row(*([""] * last), f"[dim]{_markup_escape(row)}[/dim]")
            else:
                t.add_row(*map(_markup_escape, row))
        return Group(Text(self.title, style="bold"), t) if self.title else t


def _markup_escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


@dataclass(frozen=True)
class Report:
    """Lines of text and tables, in order."""

    blocks: tuple[str | Table, ...]

    def __str__(self) -> str:
        lines: list[str] = []
        for b in self.blocks:
            lines += [b] if isinstance(b, str) else b.text()
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        parts = [b.html() if isinstance(b, Table) else
                 f"<pre style=\"margin:0\">{html.escape(b)}</pre>" for b in self.blocks]
        return "<div>" + "\n".join(parts) + "</div>"

    def __rich_console__(self, console, options):
        for b in self.blocks:
            yield b.rich() if isinstance(b, Table) else _rich_text(b)


def _rich_text(line: str):
    from rich.text import Text

    return Text(line)
