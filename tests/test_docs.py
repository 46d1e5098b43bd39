"""The documentation a newcomer reads first stays whole: the README's first screen,
its list of every docs page, the site's home page, and the package map."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def test_the_readme_first_screen_fits_a_screen() -> None:
    """The two commands, what maxkv is, the feature table and set-up: 40 lines at most."""
    lines = README.read_text().splitlines()
    first_section = next(i for i, line in enumerate(lines) if line.startswith("## "))
    assert first_section <= 40, f"the first screen is {first_section} lines"


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = set(re.findall(r"\]\(docs/([\w./-]+\.md)", README.read_text()))
    pages = {p.name for p in DOCS.glob("*.md")} - {"index.md"}
    assert pages <= linked, f"not linked from the README: {sorted(pages - linked)}"


def test_the_site_home_page_is_the_readme() -> None:
    """``docs/index.md`` is the README with its links made relative to ``docs/``."""
    expected = README.read_text().replace("](docs/", "](")
    assert (DOCS / "index.md").read_text() == expected, "copy README.md to docs/index.md"


def test_the_package_map_names_every_module() -> None:
    layout = (DOCS / "layout.md").read_text()
    files = [*(ROOT / "python" / "maxkv").rglob("*.py"), *(ROOT / "mojo_ops").rglob("*.mojo")]
    missing = [
        str(path.relative_to(ROOT))
        for path in files
        if path.name != "__init__.py" and path.name not in layout
    ]
    assert not missing, f"docs/layout.md does not name: {missing}"
