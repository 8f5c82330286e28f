"""Check every relative link in README.md and docs/*.md: the file exists in the repo (git ls-files or on disk),
and a #anchor matches a heading of the target, slugged as GitHub does."""
import re, sys, subprocess
from pathlib import Path

root = Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
pages = [root / "README.md"] + sorted((root / "docs").glob("*.md"))
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")

def slug(heading: str) -> str:
    s = re.sub(r"[`*_]", "", heading.strip().lower())
    s = re.sub(r"[^\w\- ]", "", s)  # GitHub keeps letters, digits, '-', '_' and spaces
    return s.replace(" ", "-")

def anchors(path: Path) -> set:
    out, fence = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and line.startswith("#"):
            out.add(slug(line.lstrip("#")))
    return out

bad = checked = 0
for page in pages:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not relative
        checked += 1
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        problem = None
        if not dest.exists():
            problem = "no such file"
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problem = f"no heading #{anchor}"
        if problem:
            bad += 1
            print(f"{page.relative_to(root)}: {target}: {problem}")
print(f"{checked} relative links in {len(pages)} pages, {bad} broken")
sys.exit(1 if bad else 0)
