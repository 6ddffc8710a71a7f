#!/usr/bin/python3
"""Checks that the repository's files only point inside the repository.

Usage:
    /usr/bin/python3 tests/docs/check_links.py [REPO_ROOT]    check the tracked files (exit 1 on a problem)
    /usr/bin/python3 tests/docs/check_links.py --self-test    check the checker on a small made-up tree

For every tracked text file (git ls-files: Markdown, C++ sources and headers, Python, shell,
CMake, plain text, and scripts with a #! line) it reports:
  - a Markdown link or image whose target escapes the repository root or is not a tracked file
    or folder (links to http(s)/mailto addresses and to anchors of the same page are not checked
    for existence; anchors into another Markdown file must name one of its headings);
  - a relative path ("../x") in any file that, resolved from the file's folder, leaves the root;
  - an absolute path into the development machine (/work/..., /home/...) or the words
    "shared/reference";
  - a path into one of the source folders (docs/, include/, tests/, ...) that is not a tracked
    file or folder (wildcards and name prefixes such as tests/test_ are not paths);
  - a mention of algorithm.md other than docs/algorithm.md (outside docs/), and a cited
    section (docs/algorithm.md, "Section") that is not a heading of docs/algorithm.md;
  - a reference to a tracker issue number, which readers of the repository cannot see.
Only tracked files count as existing, so the result is the same in a fresh clone.
"""
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path, PurePosixPath

TEXT_SUFFIXES = {".md", ".hpp", ".h", ".cpp", ".cc", ".py", ".pyi", ".sh", ".txt", ".cmake", ".in", ".yml",
                 ".yaml", ".toml", ".cfg"}
TEXT_NAMES = {"CMakeLists.txt", "Makefile", "Dockerfile"}

# Written in pieces so that this file does not match its own patterns.
ISSUE_RE = re.compile(r"\b[Ii]ssues?\s+#?\d+\b|\(#\d+\)")
ABSOLUTE_RE = re.compile(r"(?<![\w.~-])/(?:work|home)/[\w.-]+")
SHARED_RE = re.compile(r"shared" + r"/reference")
RELATIVE_RE = re.compile(r"(?<![\w.~/-])((?:\.\./)+[\w.\-/]*)")
MD_LINK_RE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
MD_REF_DEF_RE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
ALGO_RE = re.compile(r"([\w./-]*)algorithm\.md")
SECTION_REF_RE = re.compile(r"docs/algorithm\.md,((?:\s*(?:,|and)?\s*\"[^\"\n]+\")+)")
COMMENT_JOIN_RE = re.compile(r"\n[ \t]*(?:///?|#+(?!#)|\*)?[ \t]*")
SCHEME_RE = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
# A path into one of the repository's source folders, named in prose or a comment.
REPO_PATH_RE = re.compile(r"(?<![\w./$-])((?:docs|include|tests|scripts|examples|programs|bench|cmake|python)"
                          r"/[\w./-]*[A-Za-z0-9/])")


def tracked_files(root):
    """The repository's tracked files (posix paths relative to root)."""
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], check=True, capture_output=True).stdout
        return sorted(p for p in out.decode("utf-8").split("\0") if p)
    except (OSError, subprocess.CalledProcessError):
        # Not a git checkout (an unpacked archive): every file outside build folders.
        files = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if not d.startswith((".", "build"))]
            for f in filenames:
                files.append(Path(dirpath, f).relative_to(root).as_posix())
        return sorted(files)


def is_text(root, rel):
    p = PurePosixPath(rel)
    if p.name in TEXT_NAMES or p.suffix in TEXT_SUFFIXES:
        return True
    try:
        with open(Path(root, rel), "rb") as f:
            return f.read(2) == b"#!"
    except OSError:
        return False


def github_slug(heading):
    """The anchor GitHub gives a Markdown heading."""
    s = heading.strip().lower()
    s = re.sub(r"[`*_~]", "", s) if not re.search(r"\w_\w", s) else re.sub(r"[`*~]", "", s)
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def headings(text):
    """Markdown headings outside fenced code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m and not fenced:
            out.append(m.group(1))
    return out


def without_code(md):
    """Markdown text with fenced code blocks and inline code blanked (line numbers kept)."""
    lines, fenced = [], False
    for line in md.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            lines.append("")
            continue
        lines.append("" if fenced else re.sub(r"`[^`]*`", "``", line))
    return "\n".join(lines)


def normalise(rel_dir, target):
    """target resolved against rel_dir as a posix path relative to the root, or None if it escapes."""
    parts = []
    for part in PurePosixPath(rel_dir, target).parts if not target.startswith("/") else ["/"]:
        if part in ("", "."):
            continue
        if part == "/":
            return None
        if part == "..":
            if not parts:
                return None
            parts.pop()
        else:
            parts.append(part)
    return "/".join(parts)


def line_of(text, pos):
    return text.count("\n", 0, pos) + 1


def check(root, files):
    """Problems ("path:line: message") in the given tracked files of the tree at root."""
    root = Path(root)
    tracked = set(files)
    folders = {str(PurePosixPath(f).parent) for f in files}
    for f in list(folders):
        p = PurePosixPath(f)
        folders.update(str(q) for q in p.parents)
    anchors_cache = {}

    def anchors(rel):
        if rel not in anchors_cache:
            try:
                anchors_cache[rel] = {github_slug(h) for h in headings(Path(root, rel).read_text("utf-8"))}
            except (OSError, UnicodeDecodeError):
                anchors_cache[rel] = set()
        return anchors_cache[rel]

    algo_sections = set()
    if "docs/algorithm.md" in tracked:
        algo_sections = set(headings(Path(root, "docs/algorithm.md").read_text("utf-8")))

    problems = []
    reported = set()  # (file, line, path) already reported, so one missing path is one problem
    for rel in files:
        if not is_text(root, rel):
            continue
        try:
            text = Path(root, rel).read_text("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        rel_dir = str(PurePosixPath(rel).parent)
        is_md = rel.endswith(".md")
        self_file = rel == "tests/docs/check_links.py"

        if is_md:
            body = without_code(text)
            targets = [(m.group(1), m.start()) for m in MD_LINK_RE.finditer(body)]
            targets += [(m.group(1), m.start()) for m in MD_REF_DEF_RE.finditer(body)]
            for target, pos in targets:
                if SCHEME_RE.match(target):
                    continue
                path, _, anchor = target.partition("#")
                where = f"{rel}:{line_of(body, pos)}"
                if not path:
                    if anchor and anchor not in anchors(rel):
                        problems.append(f"{where}: link to #{anchor}, which is not a heading of this page")
                    continue
                resolved = normalise(rel_dir, path)
                if resolved is None:
                    problems.append(f"{where}: link to '{target}' leaves the repository")
                elif resolved not in tracked and resolved not in folders:
                    reported.add((rel, line_of(body, pos), resolved))
                    problems.append(f"{where}: link to '{target}': {resolved} is not a tracked file of the repository (new? git add it)")
                elif anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
                    problems.append(f"{where}: link to '{target}': no heading of {resolved} has the anchor #{anchor}")

        if not self_file:
            # In Markdown, paths in code are relative to the reader's shell, not to the page.
            for m in RELATIVE_RE.finditer(without_code(text) if is_md else text):
                token = m.group(1).rstrip(".")
                if normalise(rel_dir, token) is None:
                    problems.append(f"{rel}:{line_of(text, m.start())}: '{token}' points outside the repository")
            for m in ABSOLUTE_RE.finditer(text):
                problems.append(f"{rel}:{line_of(text, m.start())}: '{m.group(0)}' is a path on one machine, "
                                f"not in the repository")
            for m in SHARED_RE.finditer(text):
                problems.append(f"{rel}:{line_of(text, m.start())}: refers to a reference folder outside the "
                                f"repository")
            for m in ISSUE_RE.finditer(text):
                problems.append(f"{rel}:{line_of(text, m.start())}: '{m.group(0)}' cites a tracker issue readers "
                                f"cannot see; say what it means instead")
            for m in ALGO_RE.finditer(text):
                prefix = m.group(1)
                inside_docs = rel.startswith("docs/") and prefix == ""
                if not (prefix.endswith("docs/") or inside_docs):
                    problems.append(f"{rel}:{line_of(text, m.start())}: '{prefix}algorithm.md': write "
                                    f"docs/algorithm.md (the repository's copy)")
            for m in REPO_PATH_RE.finditer(text):
                path = m.group(1).rstrip("/.")
                if text[m.end():m.end() + 1] in ("*", "_", "-", "<", "$", "{"):
                    continue  # a pattern or a prefix, not a path
                key = (rel, line_of(text, m.start()), path)
                if path not in tracked and path not in folders and key not in reported:
                    reported.add(key)
                    problems.append(f"{rel}:{line_of(text, m.start())}: names '{path}', which is not a tracked "
                                    f"file or folder of the repository")
            joined = COMMENT_JOIN_RE.sub(" ", text)
            for m in SECTION_REF_RE.finditer(joined):
                for name in re.findall(r"\"([^\"]+)\"", m.group(1)):
                    name = re.sub(r"\s+", " ", name).strip()
                    if name not in algo_sections:
                        problems.append(f"{rel}: cites docs/algorithm.md, \"{name}\", which is not a section "
                                        f"of docs/algorithm.md")
    return problems


def self_test():
    """The checker finds each kind of problem in a made-up tree, and none in a clean one."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        files = {
            "docs/algorithm.md": "# Title\n\n## Outer optimizer\n\ntext\n",
            "docs/ok.md": "See [alg](algorithm.md#outer-optimizer), [readme](../README.md), [top](#ok),\n"
                          "[site](https://example.org/x) and `[code](../../nowhere.md)`.\n\n# Ok\n",
            "README.md": "[docs](docs/ok.md) and docs/algorithm.md, \"Outer optimizer\".\n",
            "include/a.hpp": "// (docs/algorithm.md, \"Outer\n// optimizer\")\n#include \"../include/a.hpp\"\n",
        }
        bad = {
            "docs/bad.md": "[out](../../outside.md) [missing](nothere.md) [anchor](algorithm.md#nope)\n",
            "include/c.hpp": "// see docs/" + "gone.md and tests/test_*.cpp, tests/test_ and docs/ok.md\n",
            "include/b.hpp": "// see " + "iss" + "ue 7 and (docs/algorithm.md, \"Nope\") and " + "../" * 3 + "x\n"
                             "// algorithm.md 4.2 and /wo" + "rk/shared/x and shared" + "/reference/y\n",
        }
        for rel, text in {**files, **bad}.items():
            Path(root, rel).parent.mkdir(parents=True, exist_ok=True)
            Path(root, rel).write_text(text, "utf-8")
        clean = check(root, sorted(files))
        if clean:
            print("self-test: a clean tree was reported:\n  " + "\n  ".join(clean))
            return 1
        found = check(root, sorted({**files, **bad}))
        expected = ["leaves the repository", "nothere.md is not a tracked file", "anchor #nope", "cites a tracker issue",
                    "\"Nope\", which is not a section", "points outside the repository", "write docs/algorithm.md",
                    "a path on one machine", "a reference folder outside", "names 'docs/gone.md'"]
        missing = [e for e in expected if not any(e in p for p in found)]
        if missing:
            print("self-test: not detected: " + ", ".join(missing) + "\nfound:\n  " + "\n  ".join(found))
            return 1
        print(f"self-test: {len(found)} problems found in the bad files, none in the clean ones")
        return 0


def main(argv):
    if len(argv) > 1 and argv[1] == "--self-test":
        return self_test()
    root = Path(argv[1] if len(argv) > 1 else Path(__file__).resolve().parents[2])
    files = tracked_files(root)
    problems = check(root, files)
    for p in problems:
        print(p)
    print(f"check_links: {len(files)} files, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
