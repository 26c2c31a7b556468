"""The documentation's code blocks run, so that they can never go stale.

For README.md and every page under docs/ (docs/*.md, docs/guide/*.md), in a fresh temporary
working folder per page:

- ```python blocks run in page order in ONE namespace (a later block uses earlier definitions);
- ```bash blocks run with `bash -eo pipefail` in the same folder, with the directory of this
  Python (the project's .venv/bin: `python`, `dynaprobe`, `torchrun`) first on PATH ($DYNAPROBE_CLI,
  when set, is the `dynaprobe` they run, as for the other tests);
- other fences (```text, ```console, ```cpp, no language, ...) are shown, not run;
- a block right after `<!-- not-executed: REASON -->` (blank lines allowed in between) is not run.
  Keep that for commands that cannot run inside the test suite (set-up scripts that run the suite
  itself, multi-process launches); the reason is required;
- a ```text block right after an executed ```bash block (only blank lines in between) is what that
  bash block prints (stdout and stderr together), and is compared with what it printed: line by
  line, trailing spaces ignored; a line `...` stands for any number of lines, and `...` inside a
  line for any text (a host name, a time, a path). So output shown in the docs is real output.

Relative links between the pages (and to files of the repository) must resolve, anchors included.

Python blocks are compiled with the page as file name and their real line numbers, so a failure's
traceback points at the line in the .md file. ```py, ```sh, ```shell and friends are refused:
spell them ```python or ```bash so they run, or pick a non-executed language on purpose.
"""

import dataclasses
import glob
import json
import os
import re
import subprocess
import sys
import textwrap
from typing import List, Optional

import pytest
from conftest import REPO

EXECUTED = {"python", "bash"}
# Languages that look runnable but would silently not run: refused, so a typo never hides a block.
AMBIGUOUS = {"py", "python3", "sh", "shell", "zsh", "ipython"}
_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*?)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*not-executed\s*(?::(?P<reason>.*?))?\s*-->\s*$")


class DocError(ValueError):
    """A page whose blocks cannot be run as written (malformed fence, marker, language)."""


@dataclasses.dataclass
class Block:
    lang: str  # the first word of the info string, "" when none
    code: str
    line: int  # 1-based line of the first code line in the page
    skip_reason: Optional[str] = None
    end: int = 0  # 1-based line of the closing fence
    output_of: Optional[int] = None  # a ```text block: the line of the bash block it shows the output of

    @property
    def executed(self) -> bool:
        return self.lang in EXECUTED and self.skip_reason is None


def parse_blocks(text: str, page: str = "<page>") -> List[Block]:
    """The fenced code blocks of a Markdown page, with their not-executed markers applied."""
    lines = text.splitlines()
    blocks: List[Block] = []
    marker: Optional[tuple] = None  # (line number, reason) of a marker awaiting its block
    i = 0
    while i < len(lines):
        line = lines[i]
        found = _MARKER.match(line)
        if found:
            reason = (found.group("reason") or "").strip()
            if not reason:
                raise DocError(f"{page}:{i + 1}: a not-executed marker needs a reason: "
                               "<!-- not-executed: WHY THIS CANNOT RUN IN THE TEST SUITE -->")
            marker = (i + 1, reason)
            i += 1
            continue
        fence = _FENCE.match(line)
        if not fence:
            if marker and line.strip():
                raise DocError(f"{page}:{marker[0]}: a not-executed marker must be followed by a "
                               f"code block, but line {i + 1} is text")
            i += 1
            continue
        indent, mark = len(fence.group("indent")), fence.group("fence")
        info = fence.group("info").split()
        lang = info[0].lower() if info else ""
        if lang in AMBIGUOUS:
            raise DocError(f"{page}:{i + 1}: fence language {lang!r} is not run by the docs test: "
                           "write ```python or ```bash so the block runs, or ```text/```console "
                           "for output")
        closing = re.compile(rf"^ {{0,3}}{re.escape(mark[0])}{{{len(mark)},}}\s*$")
        body = []
        j = i + 1
        while j < len(lines) and not closing.match(lines[j]):
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j].lstrip())
            j += 1
        if j == len(lines):
            raise DocError(f"{page}:{i + 1}: code block never closed")
        block = Block(lang, "\n".join(body) + "\n", i + 2, end=j + 1)
        previous = blocks[-1] if blocks else None
        if (lang == "text" and previous is not None and previous.lang == "bash"
                and previous.executed and not marker
                and all(not lines[k].strip() for k in range(previous.end, i))):
            block.output_of = previous.line
        if marker:
            if lang not in EXECUTED:
                raise DocError(f"{page}:{marker[0]}: not-executed marker on a ```{lang or '(none)'} "
                               "block, which does not run anyway: remove the marker")
            block.skip_reason = marker[1]
            marker = None
        blocks.append(block)
        i = j + 1
    if marker:
        raise DocError(f"{page}:{marker[0]}: a not-executed marker at the end of the page")
    return blocks


# Runs one page's blocks in order; python in this process's namespace, bash as child processes.
_RUNNER = textwrap.dedent("""
    import json, os, subprocess, sys, traceback
    page, blocks = json.load(open(sys.argv[1]))
    namespace = {"__name__": "__main__"}
    outputs = {}  # line of each bash block -> what it printed
    for block in blocks:
        where = f"{page}:{block['line']}"
        print(f"----- {where} ({block['lang']})", flush=True)
        if block["lang"] == "python":
            try:
                # Padded so tracebacks give the line numbers of the page itself.
                code = compile("\\n" * (block["line"] - 1) + block["code"], block["path"], "exec")
                exec(code, namespace)
            except BaseException:
                traceback.print_exc()
                print(f"\\nFAILED: the python block at {where}", file=sys.stderr, flush=True)
                sys.exit(1)
        else:
            sys.stdout.flush()
            proc = subprocess.run(["bash", "-eo", "pipefail", "-c", block["code"]],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            text = proc.stdout.decode("utf-8", errors="replace")
            sys.stdout.write(text)
            outputs[str(block["line"])] = text
            with open(sys.argv[2], "w") as f:
                json.dump(outputs, f)
            rc = proc.returncode
            if rc != 0:
                print(f"\\nFAILED: the bash block at {where} exited with {rc}", file=sys.stderr,
                      flush=True)
                sys.exit(1)
        sys.stdout.flush()
""")


def pages():
    """README.md and every page under docs/, sub-folders (docs/guide/) included."""
    found = [os.path.join(REPO, "README.md")] + sorted(
        glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True))
    return [os.path.relpath(p, REPO) for p in found if os.path.isfile(p)]


def run_page(page: str, workdir) -> subprocess.CompletedProcess:
    """Runs the page's blocks in `workdir`; what each bash block printed is in
    `outputs_file(workdir)` (a JSON object: the block's first line -> its output)."""
    path = os.path.join(REPO, page)
    with open(path, encoding="utf-8") as f:
        blocks = [b for b in parse_blocks(f.read(), page) if b.executed]
    spec = workdir.parent / f"{workdir.name}-blocks.json"
    spec.write_text(json.dumps([page, [dict(dataclasses.asdict(b), path=path) for b in blocks]]))
    runner = workdir.parent / f"{workdir.name}-runner.py"
    runner.write_text(_RUNNER)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    if os.environ.get("DYNAPROBE_CLI"):  # the CLI the other tests run, e.g. a build folder's
        cli_dir = workdir.parent / f"{workdir.name}-cli"
        cli_dir.mkdir(exist_ok=True)
        link = cli_dir / "dynaprobe"
        if not link.exists():
            link.symlink_to(os.path.abspath(os.environ["DYNAPROBE_CLI"]))
        env["PATH"] = str(cli_dir) + os.pathsep + env["PATH"]
    env.pop("PYTHONPATH", None)
    return subprocess.run([sys.executable, str(runner), str(spec), str(outputs_file(workdir))],
                          cwd=workdir, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1800)


def outputs_file(workdir):
    return workdir.parent / f"{workdir.name}-outputs.json"


def output_mismatch(expected: str, actual: str) -> Optional[str]:
    """None when `actual` is what `expected` shows (see the module docstring for `...`), else a
    message that shows both."""
    pattern = ""
    for line in expected.rstrip("\n").splitlines():
        if line.strip() == "...":
            pattern += r"(?:[^\n]*\n)*?"
        else:
            pattern += "[^\n]*?".join(re.escape(part) for part in line.rstrip().split("...")) + r"\n"
    normal = "".join(line.rstrip() + "\n" for line in actual.splitlines())
    if re.fullmatch(pattern, normal):
        return None
    return f"expected (as the page shows it):\n{expected}\nbut the block printed:\n{actual}"


@pytest.mark.parametrize("page", pages())
def test_code_blocks_of_the_page_run(page, tmp_path):
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    proc = run_page(page, workdir)
    if proc.returncode != 0:
        pytest.fail(f"{page}: a code block failed (working folder {workdir}):\n"
                    f"{proc.stdout[-12000:]}", pytrace=False)
    with open(os.path.join(REPO, page), encoding="utf-8") as f:
        blocks = parse_blocks(f.read(), page)
    outputs = json.loads(outputs_file(workdir).read_text()) if outputs_file(workdir).exists() else {}
    wrong = []
    for block in blocks:
        if block.output_of is not None:
            mismatch = output_mismatch(block.code, outputs[str(block.output_of)])
            if mismatch:
                wrong.append(f"{page}:{block.line}: the output of the bash block at line "
                             f"{block.output_of}: {mismatch}")
    assert not wrong, "\n\n".join(wrong)


# --------------------------------------------------------------------------- links
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def _prose_lines(text: str) -> List[str]:
    """The page's lines outside fenced code blocks, with inline code spans blanked."""
    out, fence = [], None
    for line in text.splitlines():
        found = _FENCE.match(line)
        if fence is None and found:
            fence = found.group("fence")
            continue
        if fence is not None:
            if re.match(rf"^ {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}\s*$", line):
                fence = None
            continue
        out.append(line)
    return out


def anchors(text: str) -> set:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to '-'."""
    seen, result = {}, set()
    for line in _prose_lines(text):
        found = _HEADING.match(line)
        if not found:
            continue
        slug = re.sub(r"[^\w\- ]", "", found.group(1).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return result


@pytest.mark.parametrize("page", pages())
def test_relative_links_and_anchors_resolve(page):
    path = os.path.join(REPO, page)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    broken = []
    for line in _prose_lines(text):
        for target in _LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"^[a-z]+:", target):
                continue  # https:, mailto:
            file_part, _, anchor = target.partition("#")
            linked = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part \
                else path
            if not os.path.exists(linked):
                broken.append(f"{target}: {os.path.relpath(linked, REPO)} does not exist")
            elif anchor and linked.endswith(".md"):
                with open(linked, encoding="utf-8") as f:
                    if anchor not in anchors(f.read()):
                        broken.append(f"{target}: no heading with anchor #{anchor}")
    assert not broken, f"{page}: broken links:\n  " + "\n  ".join(broken)


def test_anchors_follow_github():
    page = "# Title\n## 1. Choosing a mode\n### Why is `loss_eager` NaN?\n## Graph dumps (`dump_graphs`)\n" \
           "## Title\n```text\n# not a heading\n```\n"
    assert anchors(page) == {"title", "1-choosing-a-mode", "why-is-loss_eager-nan",
                             "graph-dumps-dump_graphs", "title-1"}


# --------------------------------------------------------------------------- the parser itself
def test_parser_finds_blocks_languages_lines_and_markers():
    page = textwrap.dedent("""\
        # Title

        ```python
        x = 1
        ```

        <!-- not-executed: launches 2 processes -->

        ```bash
        torchrun --nproc-per-node 2 train.py
        ```

        1. In a list:

           ```bash
           echo indented
           ```

        ````text
        ```python
        not a block of its own
        ```
        ````

        ```
        no language
        ```
        """)
    blocks = parse_blocks(page)
    assert [(b.lang, b.line, b.executed) for b in blocks] == [
        ("python", 4, True), ("bash", 10, False), ("bash", 16, True), ("text", 20, False),
        ("", 26, False)]
    assert blocks[0].code == "x = 1\n"
    assert blocks[1].skip_reason == "launches 2 processes"
    assert blocks[2].code == "echo indented\n"
    assert blocks[3].code == "```python\nnot a block of its own\n```\n"


@pytest.mark.parametrize("page, message", [
    ("<!-- not-executed -->\n```bash\nls\n```\n", "needs a reason"),
    ("<!-- not-executed:   -->\n```bash\nls\n```\n", "needs a reason"),
    ("<!-- not-executed: why -->\nsome text\n```bash\nls\n```\n", "must be followed by a code block"),
    ("<!-- not-executed: why -->\n```text\nout\n```\n", "does not run anyway"),
    ("text\n<!-- not-executed: why -->\n", "at the end of the page"),
    ("```sh\nls\n```\n", "is not run by the docs test"),
    ("```py\nx = 1\n```\n", "is not run by the docs test"),
    ("```python\nx = 1\n", "never closed"),
])
def test_parser_refuses_blocks_that_would_silently_not_run(page, message):
    with pytest.raises(DocError, match=message):
        parse_blocks(page)


def test_text_block_right_after_a_bash_block_is_its_output():
    page = textwrap.dedent("""\
        ```bash
        echo hi
        ```

        ```text
        hi
        ```

        Prose in between: an illustration, not an output.

        ```text
        not compared
        ```

        <!-- not-executed: cannot run here -->
        ```bash
        torchrun train.py
        ```
        ```text
        not compared either
        ```
        """)
    blocks = parse_blocks(page)
    assert [(b.lang, b.output_of) for b in blocks] == [
        ("bash", None), ("text", 2), ("text", None), ("bash", None), ("text", None)]


@pytest.mark.parametrize("expected, actual, matches", [
    ("a\nb\n", "a\nb\n", True),
    ("a\nb\n", "a  \nb", True),  # trailing spaces and the last newline do not matter
    ("a\nb\n", "a\nc\n", False),
    ("a\n", "a\nb\n", False),  # every printed line is shown, or stood for by ...
    ("a\n...\nd\n", "a\nb\nc\nd\n", True),
    ("a\n...\nd\n", "a\nd\n", True),
    ("a\n...\nd\n", "a\nb\n", False),
    ("host=... mode=x\n", "host=build-7 mode=x\n", True),
    ("host=... mode=x\n", "host=build-7 mode=y\n", False),
    ("x (1+1)\n", "x (1+1)\n", True),  # regular-expression characters are literal
])
def test_output_comparison(expected, actual, matches):
    assert (output_mismatch(expected, actual) is None) == matches


def test_a_wrong_output_fails_the_page(tmp_path, monkeypatch):
    docs = tmp_path / "repo"
    (docs / "docs").mkdir(parents=True)
    (docs / "docs" / "x.md").write_text("```bash\necho 41\n```\n\n```text\n42\n```\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", str(docs))
    with pytest.raises(AssertionError, match="docs/x.md:6: the output of the bash block at line 2"):
        test_code_blocks_of_the_page_run("docs/x.md", tmp_path)


def test_a_failing_block_fails_the_page_and_names_its_line(tmp_path, monkeypatch):
    docs = tmp_path / "repo"
    (docs / "docs").mkdir(parents=True)
    (docs / "docs" / "x.md").write_text(
        "```python\nvalue = 41\n```\n\n```bash\necho from-bash\n```\n\n"
        "```python\nassert value == 42, 'off by one'\n```\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", str(docs))
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    proc = run_page("docs/x.md", workdir)
    assert proc.returncode == 1
    assert "from-bash" in proc.stdout  # the bash block ran between the python blocks
    assert "AssertionError: off by one" in proc.stdout
    assert "FAILED: the python block at docs/x.md:10" in proc.stdout
    assert 'docs/x.md", line 10' in proc.stdout  # the traceback points into the page


# --------------------------------------------------------------------------- design.md's tables
# docs/design.md says where things live; its tables must name files that exist. A row may
# shorten a path: `src/record.cpp` after `formats/include/...` (the row's top folder),
# `render_csv.cpp` after `analyze/src/render_text.cpp` (the folder of a path named before it, or a
# parent of that folder), or a file name found once in the sources (`checker.py`). `{a,b}`
# expands; `*` must match something.
_SOURCE_FOLDERS = ("formats", "analyze", "capture", "tests", "bench", "examples", "scripts", "docs")
_FILE_SUFFIXES = (".h", ".cpp", ".py", ".pyi", ".cmake", ".html", ".txt", ".md", ".sh", ".toml")
_BUILD_OUTPUTS = {"build/", "build-fuzz/"}  # folders the build makes, not the repository's


def _path_tokens(cell: str) -> List[str]:
    """The backticked tokens of a table cell that name a file or folder of the repository."""
    found = []
    for token in re.findall(r"`([^`]+)`", cell):
        token = token.strip()
        if (" " in token or "<" in token or token.startswith(("/", ".", "-"))
                or token in _BUILD_OUTPUTS):
            continue  # prose in code font, a placeholder, an HDF5 path, a flag
        if token.endswith("/") or token.endswith(_FILE_SUFFIXES):
            found.append(token)
    return found


def _expand(token: str) -> List[str]:
    braces = re.search(r"\{([^}]*)\}", token)
    if not braces:
        return [token]
    return [expanded for choice in braces.group(1).split(",")
            for expanded in _expand(token[:braces.start()] + choice + token[braces.end():])]


def _source_files_by_name() -> dict:
    names: dict = {}
    for folder in _SOURCE_FOLDERS:
        for root, dirs, files in os.walk(os.path.join(REPO, folder)):
            dirs[:] = [d for d in dirs if not d.startswith((".", "__pycache__"))]
            for name in files:
                names.setdefault(name, []).append(os.path.join(root, name))
    return names


def _named_paths_missing(text: str) -> List[str]:
    """The paths that the tables of a design page name and the repository lacks."""
    by_name = _source_files_by_name()
    missing = []
    for line in _prose_lines(text):
        if not line.startswith("|") or re.match(r"^\|[\s\-:|]+\|$", line):
            continue
        row_top = None  # the top folder of the row's first full path
        earlier: List[str] = []  # folders of the paths the row named before, most recent first
        for cell in line.strip("|").split("|"):
            for token in _path_tokens(cell):
                hits = []
                for path in _expand(token):
                    bases = [REPO]
                    for folder in earlier:  # a folder named before, or one of its parents
                        while folder.startswith(REPO + os.sep) and folder not in bases:
                            bases.append(folder)
                            folder = os.path.dirname(folder)
                    if row_top:
                        bases.append(os.path.join(REPO, row_top))
                    for base in bases:
                        hits = glob.glob(os.path.join(base, path))
                        if hits:
                            break
                    if not hits and "/" not in path.rstrip("/") and len(by_name.get(path, [])) == 1:
                        hits = by_name[path]
                    if not hits:
                        missing.append(f"{path} (in the row: {line[:80]}...)")
                        continue
                    first = hits[0].rstrip("/")
                    folder = first if os.path.isdir(first) else os.path.dirname(first)
                    earlier.insert(0, folder)
                    if row_top is None:
                        row_top = os.path.relpath(first, REPO).split(os.sep)[0]
    return missing


def test_design_tables_name_files_that_exist():
    with open(os.path.join(REPO, "docs", "design.md"), encoding="utf-8") as f:
        missing = _named_paths_missing(f.read())
    assert not missing, ("docs/design.md's tables name files the repository does not have (rename "
                         "or remove them in the table):\n  " + "\n  ".join(missing))


def test_design_table_check_finds_a_missing_file_and_resolves_short_forms():
    page = textwrap.dedent("""\
        | path | what |
        | --- | --- |
        | `formats/include/dynaprobe/formats/record.h`, `src/record.cpp` | records |
        | `analyze/src/render_text.cpp`, `render_csv.cpp`, `analyze/cli/{compare,ls}.cpp` | ok |
        | `capture/bindings/*.cpp` | globs; `checker.py`, by its unique name; `/index` is HDF5's |
        | `analyze/src/render_<name>.cpp`, `formats/src/no_such_file.cpp` | the second is missing |
        """)
    assert [m.split(" ")[0] for m in _named_paths_missing(page)] == ["formats/src/no_such_file.cpp"]
