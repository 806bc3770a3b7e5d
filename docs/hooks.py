"""MkDocs hook: fill the generated parts of the reference pages (``docs/gen_reference.py``) at build time."""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gen_reference  # noqa: E402

MARKER = re.compile(r"<!-- gen:(cli|config|method|api) ?([\w-]*) -->")


def on_page_markdown(markdown: str, page, config, files) -> str:
    def fill(match: re.Match) -> str:
        kind, arg = match.groups()
        if kind == "cli":
            return gen_reference.cli_markdown()
        if kind == "config":
            return gen_reference.config_markdown()
        if kind == "api":
            return gen_reference.api_markdown()
        return gen_reference.method_markdown(arg)

    return MARKER.sub(fill, markdown)
