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

README.md's numbers, paragraph by paragraph (a list item is a paragraph; code blocks are left out):

4. A paragraph that reports a measurement (a percentage, a ratio such as 2.5x, tok/s, or the word
   "measured") links where it comes from: an existing file in `benchmarks/results/` or `docs/`.
5. A figure (a plot, or a table of percentages or ratios) has a caption, the paragraph before it, that
   names the machine (AMD EPYC, Intel Xeon, NVIDIA H100, ...) and the date, and links the result file
   it comes from; every decimal and percentage of a table is in that file, a plot is of the same run.
6. Every date and machine a paragraph names is in a result file it links; the GPU paragraph names a GPU
   and a date.
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



# -- README.md's numbers ------------------------------------------------------------------------------

README = REPO / "README.md"
MEASURED = re.compile(r"\bmeasured\b|tok/s|\d(?:\.\d+)?(?:%|x)(?!\w)")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
MACHINE = re.compile(r"\b(?:AMD EPYC|Intel Xeon|NVIDIA [A-Z]+\d+|Apple M\d)")
GPU = re.compile(r"\bNVIDIA [A-Z]+\d+")
TABLE_NUMBER = re.compile(r"\d+\.\d+|\d+%")  # the decimals and percentages of a figure's table
IMAGE = re.compile(r"^!\[[^\]]*\]\(([^)\s]+)\)$")


def paragraphs(text: str) -> list[str]:
    """The paragraphs of a markdown text: runs of lines between blank lines, each list item and each
    heading alone, fenced code left out."""
    out: list[str] = []
    current: list[str] = []
    fenced = False

    def flush() -> None:
        if current:
            out.append("\n".join(current))
            current.clear()

    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            flush()
        elif fenced:
            continue
        elif not line.strip():
            flush()
        else:
            if line.startswith(("- ", "#")):
                flush()
            current.append(line)
            if line.startswith("#"):
                flush()
    flush()
    return out


def _is_table(p: str) -> bool:
    return all(line.startswith("|") for line in p.splitlines())


def _is_prose(p: str) -> bool:
    return not (_is_table(p) or IMAGE.match(p) or p.startswith("#"))


def _results(p: str) -> list[Path]:
    """The existing files in `benchmarks/results/` a README paragraph links (paths in the repo)."""
    return [path for _, path in links(README, p)
            if path.is_relative_to("benchmarks/results") and (REPO / path).is_file()]  # fmt: skip


def _dated(p: str) -> list[str]:
    """What is wrong with a paragraph's dates and machines: each must be in a result file it links."""
    texts = [(REPO / path).read_text(errors="replace") for path in _results(p)]
    return [f"{what} is in no result file it links" for what in {*DATE.findall(p), *MACHINE.findall(p)}
            if not any(what in t for t in texts)]  # fmt: skip


def readme_problems(text: str) -> list[str]:
    """Rules 4-6 on a README text."""
    problems = []
    paras = paragraphs(text)
    for i, p in enumerate(paras):
        head = p.splitlines()[0][:70]
        if _is_prose(p):
            if MEASURED.search(p) and not any(path.is_relative_to(folder) and (REPO / path).is_file()
                                              for _, path in links(README, p)
                                              for folder in ("benchmarks/results", "docs")):  # fmt: skip
                problems.append(f"{head!r}: reports a measurement without linking a result file or docs page")
            problems += [f"{head!r}: {why}" for why in _dated(p)]
            if p.startswith("- **GPU**") and not (GPU.search(p) and DATE.search(p)):
                problems.append(f"{head!r}: the GPU paragraph names no GPU (NVIDIA ...) or no date")
        figure = IMAGE.match(p) or (_is_table(p) and MEASURED.search(p))
        if not figure:
            continue
        caption = next((q for q in reversed(paras[:i]) if _is_prose(q)), "")
        head = p.splitlines()[0][:70]
        results = _results(caption)
        if not (DATE.search(caption) and MACHINE.search(caption) and results):
            problems.append(f"{head!r}: its caption names no machine or no date, or links no result file")
            continue
        if IMAGE.match(p):
            image = Path(IMAGE.match(p).group(1))
            if _run_name(image) not in {_run_name(r) for r in results}:
                problems.append(f"{head!r}: not the run of its caption's result file {results}")
        else:
            source = " ".join((REPO / r).read_text(errors="replace") for r in results)
            missing = [n for n in TABLE_NUMBER.findall(p) if n not in source]
            if missing:
                problems.append(f"{head!r}: numbers not in {[str(r) for r in results]}: {missing}")
    return problems


def test_readme_numbers_link_their_results() -> None:
    text = README.read_text()
    assert any(p.startswith("- **GPU**") for p in paragraphs(text)), "README.md has no GPU paragraph (- **GPU**: ...)"
    problems = readme_problems(text)
    assert not problems, "README.md:\n" + "\n".join(problems)


def test_the_readme_rules_can_fail() -> None:
    ok = ("Throughput on AMD EPYC, 2 cores; 2026-11-22 ([x](benchmarks/results/eviction.md)).\n\n"
          "| config | tok/s |\n| --- | ---: |\n| rkv | 2.48x (2.41-2.54) |\n\n"
          "![t](benchmarks/results/eviction.png)\n\n- **GPU**: served on an NVIDIA H100 on 2026-11-27 "
          "([r](benchmarks/results/gpu-serve-tests-h100.txt)).\n")  # fmt: skip
    assert readme_problems(ok) == []
    for wrong in (
        ok.replace("2026-11-22", "2026-11-21"),  # a date the result file does not have
        ok.replace("AMD EPYC, 2 cores; ", ""),  # a figure without a machine
        ok.replace("2.48x", "2.49x"),  # a number that is not the result file's
        ok.replace("eviction.png", "quality.png"),  # a plot of another run
        ok.replace("NVIDIA H100 on 2026-11-27", "GPU"),  # the GPU paragraph without its GPU and date
        "R-KV keeps 90% of the answers.\n",  # a measurement without a source
    ):
        assert readme_problems(wrong), wrong
    assert readme_problems("R-KV keeps 90% ([measured](docs/quality.md)).\n") == []
    assert paragraphs("a\nb\n\n```\nc\n\nd\n```\n- e\n- f\n# g\nh") == ["a\nb", "- e", "- f", "# g", "h"]


def test_readme_is_short() -> None:
    """README.md is the front page: what sgl-kvc is, its two commands, what is supported, a figure or
    two; the details live in docs/."""
    n = len(README.read_text().splitlines())
    assert n < 250, f"README.md has {n} lines: move details to docs/"


WORK_WORDS = re.compile(r"\b(?:sessions?|issues?|pull requests?|PR)\b|(?<![\w/&])#\d+\b", re.IGNORECASE)


def test_no_work_process_words_in_the_docs() -> None:
    """The docs describe the software, not the work that made it: no sessions, issues, issue numbers."""
    assert WORK_WORDS.search("as this session found") and WORK_WORDS.search("fixed in #12")
    assert not WORK_WORDS.search("[a](#section), &#8212;, pass@1, 30 issued requests")
    found = [f"{doc.relative_to(REPO)}:{n}: {line.strip()[:100]}"
             for doc in DOCS if doc.exists()
             for n, line in enumerate(doc.read_text().splitlines(), 1) if WORK_WORDS.search(line)]  # fmt: skip
    assert not found, "work-process words in the docs:\n" + "\n".join(found)
