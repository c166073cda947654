"""Committed results and the docs that cite them, checked both ways.

The docs are README.md, docs/*.md and research/README.md. A link is the target of a markdown link or
image, `[text](target)` / `![alt](target)`, that is relative (no scheme), read from the folder of the doc
that holds it, its `#anchor` dropped.

1. Every link from a doc into `benchmarks/results/` or `research/results/` names a file that exists.
2. Every file in `benchmarks/results/` is cited by README.md or docs/*.md: linked itself, or a sibling of
   a linked file. Siblings are the files of one run, which share a name up to the extension (a
   benchmark writes `NAME.json`, `NAME.md` and `NAME.png` together): linking `eviction.md` covers
   `eviction.json` and `eviction.png`. A file only research/README.md cites belongs in
   `research/results/`.
3. Every file in `research/results/` is cited by some doc (research/README.md, usually), by the same
   rule.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRODUCT_DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
DOCS = [*PRODUCT_DOCS, REPO / "research" / "README.md"]
RESULTS = {"benchmarks/results": PRODUCT_DOCS, "research/results": DOCS}

_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def links(doc: Path, text: str | None = None) -> list[tuple[str, Path]]:
    """(target as written, resolved path relative to the repo) of every relative link in `doc`
    (in `text` instead of the file's, when given)."""
    out = []
    for m in _LINK.finditer(doc.read_text() if text is None else text):
        target = m.group(1).split("#", 1)[0]
        if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue  # an anchor in the same page, or an URL
        path = (doc.parent / target).resolve()
        if path.is_relative_to(REPO):
            out.append((target, path.relative_to(REPO)))
    return out


def _run_name(path: Path) -> Path:
    """A result file's run: its path without the extension (`eviction.md` -> `eviction`)."""
    return path.with_suffix("")


def test_every_link_into_results_exists() -> None:
    missing = [f"{doc.relative_to(REPO)}: ({target})"
               for doc in DOCS if doc.exists()
               for target, path in links(doc)
               if any(path.is_relative_to(folder) for folder in RESULTS) and not (REPO / path).is_file()]  # fmt: skip
    assert not missing, "links to result files that do not exist:\n" + "\n".join(missing)


def test_every_result_file_is_cited_by_a_doc() -> None:
    unlinked = []
    for folder, docs in RESULTS.items():
        cited = {path for doc in docs if doc.exists() for _, path in links(doc) if path.is_relative_to(folder)}
        runs = {_run_name(p) for p in cited}
        for f in sorted((REPO / folder).rglob("*")):
            rel = f.relative_to(REPO)
            if f.is_file() and rel not in cited and _run_name(rel) not in runs:
                unlinked.append(str(rel))
    assert not unlinked, (
        "result files no doc links to (link them from the doc whose numbers they are, or git rm them; "
        "a file only research/README.md cites goes to research/results/):\n" + "\n".join(unlinked)
    )


def test_the_link_reader() -> None:
    doc = REPO / "docs" / "x.md"
    text = ("[a](../benchmarks/results/eviction.md#top) ![p](../benchmarks/results/eviction.png) "
            "[u](https://example.com/x.md) [s](#section) [r](quality.md)")  # fmt: skip
    got = links(doc, text)
    assert got == [("../benchmarks/results/eviction.md", Path("benchmarks/results/eviction.md")),
                   ("../benchmarks/results/eviction.png", Path("benchmarks/results/eviction.png")),
                   ("quality.md", Path("docs/quality.md"))]  # fmt: skip
    assert _run_name(Path("benchmarks/results/eviction-long-output-1024.json")) == Path(
        "benchmarks/results/eviction-long-output-1024"
    )

