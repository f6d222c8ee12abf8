"""The README's Python example, run as written against the real dpcoord.

The only change made to the code is the endpoints: the example uses dpcoord's
default tcp ports, the test the daemon's private ipc:// ones. Its output must be
exactly the output the README shows under it.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[3] / "README.md"


def example() -> tuple[str, str]:
    text = README.read_text()
    m = re.search(r"```python\n(.*?)```\n.*?```text\n(.*?)```", text, re.S)
    assert m, "README.md has no ```python block followed by a ```text block"
    return m.group(1), m.group(2)


def test_readme_python_example_prints_what_the_readme_shows(start_daemon):
    code, shown = example()
    d = start_daemon("--policy", "least_load")
    for default, ours in (("tcp://127.0.0.1:5570", d.route), ("tcp://127.0.0.1:5571", d.health), ("tcp://127.0.0.1:5572", d.stats)):
        assert default in code, f"the README example no longer uses {default}"
        code = code.replace(default, ours)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {"__name__": "readme_example"})
    assert out.getvalue() == shown


def test_every_relative_link_in_the_readme_and_docs_resolves():
    repo = README.parent
    pages = [README, repo / "clients/python/README.md", *sorted((repo / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for link in re.findall(r"\]\(([^)\s]+)\)", text):
            if link.startswith(("http://", "https://")):
                continue
            path, _, fragment = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                broken.append(f"{page.relative_to(repo)}: {link} (no such file)")
            elif fragment and target.suffix == ".md" and fragment not in anchors(target):
                broken.append(f"{page.relative_to(repo)}: {link} (no such heading)")
    assert broken == []


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes."""
    headings = re.findall(r"(?m)^#+ (.*)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.S))
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}
