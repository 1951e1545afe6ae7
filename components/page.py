"""One look for every HTML page liftoff writes (the eval report, training curves, profiles, run
comparisons): self-contained, inline CSS, headed by what the page is about."""

from __future__ import annotations

import html

STYLE = """
body{font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1d2330;background:#f4f6fa;margin:0}
main{max-width:1180px;margin:0 auto;padding:24px}
header#identity{background:#1d2b4f;color:#fff;border-radius:10px;padding:18px 24px;margin-bottom:20px}
header#identity h1{margin:0 0 12px;font-size:22px}
header#identity dl{display:grid;grid-template-columns:max-content 1fr max-content 1fr;gap:4px 16px;margin:0}
header#identity dt{color:#a9b8de}
header#identity dd{margin:0;font-family:ui-monospace,Menlo,monospace;word-break:break-all}
section{background:#fff;border-radius:10px;padding:16px 24px;margin-bottom:20px;box-shadow:0 1px 3px #0002}
h2{font-size:18px;margin:4px 0 12px}
.cards{display:flex;gap:12px;flex-wrap:wrap}
.card{background:#eef2fb;border-radius:8px;padding:10px 16px;min-width:150px}
.card b{display:block;font-size:22px}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(420px,1fr));gap:12px}
figure{margin:0;text-align:center}
figure img{max-width:100%;border:1px solid #dde2ec;border-radius:6px}
figcaption{color:#56607a;font-size:13px}
table{border-collapse:collapse;width:100%}
th,td{text-align:left;padding:5px 10px;border-bottom:1px solid #e3e7ef}
th{background:#eef2fb}
#metrics th:not(:first-child){text-align:right}
td.num{text-align:right;font-family:ui-monospace,Menlo,monospace}
.better{color:#107a3a}.worse{color:#b3261e}
.sample{white-space:pre-wrap;font-family:ui-monospace,Menlo,monospace}
.note{color:#56607a}
.event{font-family:ui-monospace,Menlo,monospace;font-size:13px}
"""


def header(title: str, rows: dict[str, str]) -> str:
    """The page's identity block: a title over `name: value` pairs."""
    cells = "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(str(v))}</dd>" for k, v in rows.items())
    return f"<header id='identity'><h1>{html.escape(title)}</h1><dl>{cells}</dl></header>"


def section(ident: str, title: str, body: str) -> str:
    return f"<section id='{ident}'><h2>{html.escape(title)}</h2>{body}</section>"


def table(head: list[str], rows: list[list], numeric_from: int = 1) -> str:
    """A table of escaped cells; columns from `numeric_from` on are right-aligned numbers."""

    def cell(i: int, v, tag: str = "td") -> str:
        text = f"{v:.4g}" if isinstance(v, float) else str(v)
        cls = " class='num'" if tag == "td" and i >= numeric_from else ""
        return f"<{tag}{cls}>{html.escape(text)}</{tag}>"

    top = "".join(cell(i, h, "th") for i, h in enumerate(head))
    body = "".join("<tr>" + "".join(cell(i, v) for i, v in enumerate(r)) + "</tr>" for r in rows)
    return f"<table><tr>{top}</tr>{body}</table>"


def figures(plots: list[tuple[str, str]]) -> str:
    """(base64 PNG, caption) pairs in a grid."""
    items = "".join(
        f"<figure><img alt='{html.escape(c)}' src='data:image/png;base64,{png}'/><figcaption>{html.escape(c)}"
        "</figcaption></figure>"
        for png, c in plots
    )
    return f"<div class='grid'>{items}</div>"


def page(title: str, body: list[str], data: str = "") -> str:
    """The whole document; `data`: a JSON script element for machines (already serialised)."""
    safe = data.replace("</", "<\\/")
    script = f"<script type='application/json' id='data'>{safe}</script>" if data else ""
    return (
        f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{STYLE}</style></head><body><main>{''.join(body)}</main>{script}</body></html>"
    )
