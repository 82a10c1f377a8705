"""Documentation references: every cited docs/ section exists, and nothing points outside the repository.

Citations follow one convention: ``docs/<page>.md#<anchor>``, where several anchors of one page may follow as
``docs/algorithm.md#2-jrsc, #4-srgo and #7-record``. Anchors are GitHub's heading slugs.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
TEXT_SUFFIXES = (".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".txt", ".cfg", ".ini", ".json")
_CITATION = re.compile(r"docs/([\w-]+\.md)((?:#[\w-]+)(?:(?:, and |, | and )#[\w-]+)*)?")
_MD_LINK = re.compile(r"\]\(([^)\s]+)\)")


def repository_files() -> list[Path]:
    """Text files of the repository: tracked plus untracked-but-not-ignored (a checkout without git: all files)."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout.split()
        paths = [REPO / p for p in out]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "__pycache__", ".pytest_cache", "runs"}
        paths = [p for p in REPO.rglob("*") if not skip & set(p.relative_to(REPO).parts)]
    return sorted(p for p in paths if p.suffix in TEXT_SUFFIXES and p.is_file())


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading text."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    out, fenced = set(), False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.+)", line)):
            out.add(slug(m.group(1)))
    return out


def citations() -> list[tuple[str, int, str, str | None]]:
    """Every ``docs/...`` citation outside docs/ and every relative link inside docs/: (file, line, page, anchor)."""
    found = []
    for path in repository_files():
        rel = str(path.relative_to(REPO))
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for m in _CITATION.finditer(line):
                names = re.findall(r"#([\w-]+)", m.group(2) or "")
                found += [(rel, number, m.group(1), a) for a in names] or [(rel, number, m.group(1), None)]
            if path.parent == DOCS:
                for target in _MD_LINK.findall(line):
                    if target.startswith(("http://", "https://", "mailto:")):
                        continue
                    page, _, anchor = target.partition("#")
                    found.append((rel, number, page or path.name, anchor or None))
    return found


def test_docs_pages_exist():
    assert {p.name for p in DOCS.glob("*.md")} >= {"algorithm.md", "sketch.md", "verl_integration.md", "record.md"}
    assert {"0-notation", "3-ggsr", "31-safe-anchor", "7-record"} <= anchors(DOCS / "algorithm.md")


def test_every_cited_docs_section_exists():
    cited = citations()
    assert len(cited) > 40  # the code and the docs cite sections throughout (155 when written)
    pages = {p.name: anchors(p) for p in DOCS.glob("*.md")}
    # a page of docs/ may link a page next to the data it describes (../validation/<folder>/README.md)
    pages.update({page: anchors(DOCS / page) for _, _, page, _ in cited
                  if "/" in page and page.endswith(".md") and (DOCS / page).is_file()})
    # a figure or other file linked from a page must exist; a page must also hold the cited section
    broken = [f"{f}:{n}: docs/{page}{'#' + a if a else ''}" for f, n, page, a in cited
              if (page not in pages and (page.endswith(".md") or not (DOCS / page).is_file()))
              or (a is not None and a not in pages.get(page, ()))]
    assert not broken, "citations of missing docs pages or sections:\n" + "\n".join(broken)


def test_slug_follows_github():
    assert slug("3.1 Safe anchor") == "31-safe-anchor"
    assert slug("Worker sketch RPC") == "worker-sketch-rpc"
    assert slug("0. Notation") == "0-notation"


# Paths of material that lives outside this repository (design notes, the paper's text, a work directory).
_OUTSIDE = [re.compile(p) for p in (
    r"shared/(design|seeds)", r"\.\./shared\b", r"/work/", r"\bSETGRPO\.md\b", r"\bVERL_INTEGRATION\.md\b",
    r"\bLAYOUT\.md\b",
)]


def test_no_file_refers_to_a_path_outside_the_repository():
    me = Path(__file__).resolve()
    hits = []
    for path in repository_files():
        if path.resolve() == me:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if any(p.search(line) for p in _OUTSIDE):
                hits.append(f"{path.relative_to(REPO)}:{number}: {line.strip()[:120]}")
            if path.suffix == ".md":
                for target in _MD_LINK.findall(line):
                    if target.startswith(("http://", "https://", "mailto:", "#")):
                        continue
                    resolved = (path.parent / target.partition("#")[0]).resolve()
                    if REPO not in resolved.parents and resolved != REPO:
                        hits.append(f"{path.relative_to(REPO)}:{number}: link {target} leaves the repository")
    assert not hits, "references to paths outside the repository:\n" + "\n".join(hits)


#: The usual forms of an outside reference, joined from parts so that this file itself names no such path.
_OUTSIDE_EXAMPLES = ["see " + "/".join(("..", "shared", "design", "SETGRPO.md")),
                     "(" + "/".join(("shared", "seeds", "paper.txt")) + ")", "/".join(("", "work", "x"))]


@pytest.mark.parametrize("line", _OUTSIDE_EXAMPLES)
def test_outside_patterns_catch_the_usual_forms(line):
    assert any(p.search(line) for p in _OUTSIDE)


def test_repository_scripts_in_docs_say_where_to_run_them():
    """The compose command of docs/validation.md runs a repository script: the page says to run it from the root."""
    text = (DOCS / "validation.md").read_text()
    block = text[text.index("python scripts/make_validation_rubrics.py compose") - 400:]
    assert "from the repository root" in block[:400] or "repository root" in block[:400]


@pytest.mark.parametrize("page", ["README.md", "docs/verl_integration.md"])
def test_the_first_verl_command_shown_is_the_plain_estimator_override(page):
    """Users are promised verl's own entry point with one override; the pages lead with it, not the long form."""
    text = (REPO / page).read_text()
    first = re.search(r"^\s*(?:\$ )?python -m verl\.trainer\.main_ppo\b.*$", text, re.MULTILINE)
    assert first is not None, f"{page} shows no main_ppo command"
    assert first.group(0).split()[-2:] in (["algorithm.adv_estimator=setgrpo", "\\"],
                                           ["main_ppo", "algorithm.adv_estimator=setgrpo"]), first.group(0)
    long_form = text.find("--config-name setgrpo_trainer")
    assert long_form == -1 or first.start() < long_form, f"{page} names the long form before the plain command"


def test_the_readme_describes_the_quickstart_the_cli_runs():
    """The README's calibration size, levels and certification figure are the default profile's and the benchmark's."""
    from setgrpo_verl.runner.cli import PROFILES

    default, text = PROFILES["default"], " ".join((REPO / "README.md").read_text().split())
    groups = default["algorithm.setgrpo.calibration.num_prompts"]
    levels = (default["algorithm.setgrpo.alpha"], default["algorithm.setgrpo.beta"], default["algorithm.setgrpo.delta"])
    assert f"risk test: {groups} groups" in text
    assert "The quickstart's levels (alpha {}, beta {}, delta {})".format(*levels) in text
    # the fresh-run certify probability is quoted with its interval and how it was made
    quoted = re.findall(r"(0\.\d\d) \((?:90% interval )?(0\.\d\d)-(\d\.\d\d)\)", text)
    assert len(quoted) >= 1 and all(float(lo) <= float(p) <= float(hi) for p, lo, hi in quoted)
    assert "posterior-predictive" in text and "python benchmarks/bench_quickstart_certifies.py --run-dir RUN" in text
    assert "resamples" not in text
    bench = (REPO / "benchmarks" / "bench_quickstart_certifies.py").read_text()
    assert 'print(f"fresh runs certify with probability {probs.mean():.2f} (90% interval {lo:.2f}-{hi:.2f})")' in bench
