"""The documentation stands on the repository alone: no file points outside
it (to a design document or a folder the user does not have, to a section
number of one, to an issue tracker), every relative link of README.md and
docs/*.md reaches a file and heading that exist, and the README fits on a few
screens."""

from __future__ import annotations

import re
import subprocess

import pytest
from doc_tables import DOC_FILES, README, ROOT

OUTSIDE = re.compile("|".join([
    r"DESIGN\.md",            # the design is docs/design.md
    r"\bDESIGN\b",
    r"(?i:shared folder)",
    r"\.\./shared",
    r"/work/",                # a path of one machine
    "\N{SECTION SIGN}",       # a section number of a document not in the repository
    r"(?i:\bissue \d+)",      # a tracker the user does not see
]))
"""What a reference outside the repository looks like."""

def repository_files() -> list[str]:
    """Tracked and untracked files git does not ignore (text files only)."""
    try:
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                                capture_output=True, text=True, check=True).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = []
    for name in filter(None, listed):
        path = ROOT / name
        if path.is_file() and path.suffix in (".py", ".md", ".toml", ".sh", ".json", ".txt", ".cfg", ".yml", "") \
                and path.resolve() != ROOT / "tests" / "test_docs.py":
            files.append(name)
    return files


def outside_references(name: str) -> list[str]:
    try:
        text = (ROOT / name).read_text()
    except UnicodeDecodeError:
        return []
    return [f"{name}:{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1) if OUTSIDE.search(line)]


def test_no_reference_outside_the_repository():
    found = [hit for name in repository_files() for hit in outside_references(name)]
    assert not found, "\n".join(found)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but - and _ dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings(text: str) -> set[str]:
    """The anchors of the headings outside code fences."""
    found, fenced = set(), False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (match := re.match(r"^#{1,6} (.+)$", line)):
            found.add(slug(match[1]))
    return found


def test_every_relative_link_reaches_its_file_and_heading():
    broken = []
    for path in DOC_FILES:
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # an address outside the repository: none is expected, but they are not files
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            if not linked.exists():
                broken.append(f"{path.name}: {target} (no file)")
            elif anchor and anchor not in headings(linked.read_text()):
                broken.append(f"{path.name}: {target} (no heading)")
    assert not broken, broken


def test_readme_fits_on_a_few_screens():
    assert len(README.read_text().splitlines()) <= 250
