"""mkdocs hooks of the distfn site (mkdocs.yml: ``hooks``): turn the plain references of the docs into links.

Docstrings are read in a terminal too (``help(distfn.distributed)``), so they name a guide as a path,
``docs/modes.md``, and an API object as code, ``distfn.WorkerError``; the guides name the examples as paths,
``examples/resume.py``. On the site each of those becomes a link, here, in one place, instead of markup in every
docstring and page:

- ``docs/NAME.md`` (plain text or code, with an optional ``#anchor``) links to that page of the site;
- on the API page, ``distfn.X`` / ``ctx.X`` in code links to the page's entry for it, when there is one
  (``ctx.save`` is ``distfn.Context.save``);
- ``examples/...`` in code links to the file in the repository (``repo_url``).

Code blocks, text already inside a link, and the attributes of tags are left alone.
"""

from __future__ import annotations

import re
from typing import Any

# A code block or a link (left as they are), one of the references to link (a guide path as text or code, code
# naming an API object, code naming an example), or any other tag (left as it is, attributes included). The
# order matters: at one position the first alternative that matches wins.
_TOKEN = re.compile(
    r"(?P<keep><pre\b.*?</pre>|<a\b[^>]*>.*?</a>)"
    r"|(?P<guide>(?:<code>)?(?<![\w/.-])docs/(?P<page>[a-z_]+)\.md(?P<anchor>#[\w-]+)?(?:</code>)?)"
    r"|<code>(?P<api>(?:distfn|ctx)\.[\w.]+)(?:\(\))?</code>"
    r"|<code>(?P<example>examples/[\w/.-]+)</code>"
    r"|(?P<tag><[^>]+>)",
    re.S,
)


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    """Link the references in ``html`` (one page's body, after Markdown and mkdocstrings)."""
    here = page.file
    entries = set(re.findall(r'id="(distfn\.[\w.]+)"', html))  # the API page's headings (none elsewhere)
    repo = str(config.get("repo_url") or "").rstrip("/")

    def link(m: re.Match[str]) -> str:
        if m.group("keep") or m.group("tag"):
            return m.group(0)
        if m.group("guide"):
            target = files.get_file_from_path(f"{m.group('page')}.md")
            if target is None:
                return m.group(0)
            return f'<a href="{target.url_relative_to(here)}{m.group("anchor") or ""}">{m.group(0)}</a>'
        if m.group("api"):
            name = re.sub(r"^ctx\.", "distfn.Context.", m.group("api"))
            return f'<a href="#{name}">{m.group(0)}</a>' if name in entries else m.group(0)
        if repo:
            kind = "tree" if m.group("example").endswith("/") else "blob"
            return f'<a href="{repo}/{kind}/main/{m.group("example")}">{m.group(0)}</a>'
        return m.group(0)

    return _TOKEN.sub(link, html)

