"""The README and the docs site say what runs: every Python block runs, every link resolves.

Every fenced ```python block of README.md and docs/**/*.md is run as a program of its own: in a
process of its own, from a fresh temporary directory outside the checkout (so the README's quick
start is tested the way a user who pastes it into a file runs it), with PYTHONPATH the repository
root, one intra-op thread and a timeout. It passes when the program exits 0; a block checks what
it claims with ``assert``.

A block is marked by an HTML comment on the line right before its opening fence (GitHub and
mkdocs show nothing of it):

    <!-- docs-test: skip, REASON -->   not run; REASON is the skip's reason (say what it needs)
    <!-- docs-test: gpu -->            run only where torch sees a CUDA device, else skipped
    <!-- docs-test: continue -->       appended to the previous python block of the same file;
                                       the chain runs as one program, under the first block's
                                       id, and its earlier blocks are not run on their own

An unmarked block must run on a CPU-only machine with the ``[test]`` extra installed. Keep blocks
tiny (a few layers, a few micro-batches): the whole file is meant to take about two minutes on a
2-core machine.

How a block's process starts: importing torch costs 3-5 s of CPU, more than most blocks run, so
each worker keeps a warm server that has imported torch only (no accumkernels, no framework) and
forks one child per block; the child changes into the block's directory and runs the block as
``__main__``, importing everything else itself (an environment variable a block sets before
``import accumkernels`` takes effect). The README's blocks, and every block when
ACCUMKERNELS_DOCS_FRESH=1, run in a fresh interpreter instead (``python block.py``). The blocks
run concurrently, ACCUMKERNELS_DOCS_JOBS at a time (default: the CPU count, at most 4), started
when the first of them is run, so that ``-k`` selects which ones run.

Also here: the README's length, relative links (and the README's own anchors), the repository
files the text cites (results files, tests, examples), the API reference covering every public
name, and ``mkdocs build --strict`` (when mkdocs is installed: the ``[docs]`` and ``[test]``
extras bring it).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import glob
import importlib.util
import json
import os
import queue
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
README_MAX_LINES = 260
BLOCK_TIMEOUT_S = 300  # far above a block's few seconds: only a hang should reach it

MARK = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<kind>[a-z]+)\s*(?:,\s*(?P<reason>.*?))?\s*-->\s*$")
FENCE_OPEN = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)\s*(?P<lang>[\w+-]*)")


def markdown_files() -> list[Path]:
    return [README] + sorted(DOCS.rglob("*.md"))


@dataclasses.dataclass
class Block:
    """One runnable program: a python block, with the blocks that continue it."""

    path: Path
    line: int  # 1-based line of the opening fence
    code: str
    mark: str | None = None  # "skip", "gpu" or None
    reason: str = ""
    continued_at: list[int] = dataclasses.field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def fenced_blocks(path: Path):
    """(line of the opening fence, language, dedented body, mark, reason) of every fence."""
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        opened = FENCE_OPEN.match(lines[i])
        if not opened:
            i += 1
            continue
        indent, fence = opened["indent"], opened["fence"]
        start, body = i, []
        i += 1
        while i < len(lines) and not (lines[i].startswith(indent)
                                      and lines[i].strip().startswith(fence)
                                      and lines[i].strip().strip(fence[0]) == ""):
            body.append(lines[i].removeprefix(indent))
            i += 1
        i += 1  # the closing fence
        marked = MARK.match(lines[start - 1]) if start > 0 else None
        if marked is None and start > 0 and "docs-test" in lines[start - 1]:
            raise ValueError(f"{path}:{start}: a docs-test mark this file cannot read: "
                             f"{lines[start - 1].strip()}")
        yield (start + 1, opened["lang"].lower(), textwrap.dedent("\n".join(body)) + "\n",
               marked["kind"] if marked else None, (marked["reason"] or "") if marked else "")


def collect_blocks() -> list[Block]:
    blocks: list[Block] = []
    for path in markdown_files():
        previous: Block | None = None
        for line, lang, code, mark, reason in fenced_blocks(path):
            if lang not in ("python", "py"):
                if mark is not None:
                    raise ValueError(f"{path}:{line}: a docs-test mark on a {lang or 'plain'} "
                                     "block (only python blocks run)")
                continue
            if mark not in (None, "skip", "gpu", "continue"):
                raise ValueError(f"{path}:{line}: unknown docs-test mark {mark!r}")
            if mark == "continue":
                if previous is None:
                    raise ValueError(f"{path}:{line}: 'continue' with no python block before it")
                previous.code += "\n" + code
                previous.continued_at.append(line)
                continue
            previous = Block(path, line, code, mark, reason)
            blocks.append(previous)
    return blocks


BLOCKS = collect_blocks()


def _has_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def skip_reason(block: Block) -> str | None:
    if block.mark == "skip":
        return block.reason or "marked skip"
    if block.mark == "gpu" and not _has_cuda():
        return "needs a CUDA device"
    return None


def block_env() -> dict:
    return os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                         "TOKENIZERS_PARALLELISM": "false"}


# The warm server: reads one request per line ({"script", "cwd", "timeout"}), forks a child that
# runs the script as __main__ with its output in cwd/stdout.txt and cwd/stderr.txt, and answers
# {"returncode"} (-9: killed at the timeout, with every process the child started).
SERVER = r"""
import json, os, runpy, signal, sys, time, traceback
import torch
try:
    import torch._dynamo  # noqa: F401  (accumkernels' import reaches it: the other big cost)
except ImportError:
    pass

def child(req):
    os.setpgid(0, 0)  # a group of its own: a timeout kills what it spawned too
    os.chdir(req["cwd"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, name in ((1, "stdout.txt"), (2, "stderr.txt")):
        os.dup2(os.open(os.path.join(req["cwd"], name), os.O_WRONLY | os.O_CREAT, 0o644), fd)
    sys.stdin, sys.argv, sys.path[0] = open(os.devnull), [req["script"]], req["cwd"]
    code = 0
    try:
        runpy.run_path(req["script"], run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        child(req)
    deadline = time.monotonic() + req["timeout"]
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            break
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            code = -9
            break
        time.sleep(0.02)
    print(json.dumps({"returncode": code}), flush=True)
"""


class WarmServer:
    """One worker's server process (see SERVER); used by one thread at a time."""

    def __init__(self):
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (lives as long as the server)
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=block_env())

    def run(self, script: Path, cwd: str) -> int:
        request = {"script": str(script), "cwd": cwd, "timeout": BLOCK_TIMEOUT_S}
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            return json.loads(self.proc.stdout.readline())["returncode"]
        except (BrokenPipeError, json.JSONDecodeError):
            self.log.seek(0)
            raise RuntimeError("the docs-block server died:\n" +
                               self.log.read().decode(errors="replace")[-4000:]) from None

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self.log.close()


def fresh_interpreter(block: Block) -> bool:
    return (block.path == README or os.environ.get("ACCUMKERNELS_DOCS_FRESH") == "1"
            or not sys.platform.startswith("linux"))  # fork after importing torch: Linux only


def read_output(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""


def run_block(block: Block, servers: queue.Queue | None = None) -> subprocess.CompletedProcess:
    """The block as a script in a temporary directory outside the checkout."""
    with tempfile.TemporaryDirectory(prefix="docs-block-") as cwd:
        script = Path(cwd) / "block.py"
        script.write_text(block.code, encoding="utf-8")
        if servers is None or fresh_interpreter(block):
            try:
                return subprocess.run([sys.executable, str(script)], cwd=cwd, env=block_env(),
                                      text=True, capture_output=True, timeout=BLOCK_TIMEOUT_S,
                                      check=False)
            except subprocess.TimeoutExpired as exc:
                return subprocess.CompletedProcess(exc.cmd, -9, str(exc.stdout or ""),
                                                   f"timed out after {BLOCK_TIMEOUT_S} s")
        server = servers.get()
        try:
            code = server.run(script, cwd)
        finally:
            servers.put(server)
        return subprocess.CompletedProcess([str(script)], code,
                                           read_output(Path(cwd) / "stdout.txt"),
                                           read_output(Path(cwd) / "stderr.txt"))


@pytest.fixture(scope="module")
def block_runs(request):
    """Every selected, runnable block started at once on a pool: block id -> future."""
    jobs = max(1, int(os.environ.get("ACCUMKERNELS_DOCS_JOBS", min(4, os.cpu_count() or 1))))
    selected = [item.callspec.params["block"] for item in request.session.items
                if getattr(item, "obj", None) is test_block_runs and hasattr(item, "callspec")
                and "block" in item.callspec.params]
    runnable = [b for b in selected if skip_reason(b) is None]
    warm = [b for b in runnable if not fresh_interpreter(b)]
    servers: queue.Queue = queue.Queue()
    for _ in range(min(jobs, len(warm))):
        servers.put(WarmServer())
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=jobs)
    futures = {b.id: pool.submit(run_block, b, servers) for b in runnable}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)
    while not servers.empty():
        servers.get().close()


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_block_runs(block: Block, block_runs):
    reason = skip_reason(block)
    if reason is not None:
        pytest.skip(reason)
    done = block_runs[block.id].result()
    where = block.id + (f" (continued at lines {block.continued_at})" if block.continued_at else "")
    assert done.returncode == 0, (f"{where} exited {done.returncode}\n--- stdout\n"
                                  f"{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-6000:]}")


def test_blocks_are_found():
    """The collector sees the README's quick start first and a block on most pages."""
    assert BLOCKS and BLOCKS[0].path == README and BLOCKS[0].mark is None
    pages_with_blocks = {b.path for b in BLOCKS}
    assert len(pages_with_blocks) >= 8, sorted(str(p) for p in pages_with_blocks)


def test_few_blocks_are_skipped():
    """A skipped block is an untested one: at most one in ten."""
    skipped = [b.id for b in BLOCKS if b.mark in ("skip", "gpu")]
    assert len(skipped) * 10 <= len(BLOCKS), skipped


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; the front door ends at " \
                                      f"{README_MAX_LINES}: move detail into docs/"


# -- links and citations ---------------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\((?P<target><[^>]+>|[^)\s]+)(?:\s+\"[^\"]*\")?\)")
REF_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*(?P<target>\S+)", re.MULTILINE)
HEADING = re.compile(r"^#{1,6}\s+(?P<title>.+?)\s*#*\s*$", re.MULTILINE)


def without_code(text: str) -> str:
    """The text with fenced blocks and inline code spans blanked (links there are examples)."""
    text = re.sub(r"^(\s*)(```+|~~~+).*?^\1\2\s*$", "", text, flags=re.DOTALL | re.MULTILINE)
    return re.sub(r"(`+)(?:(?!\1).)+?\1", "", text)


def github_slug(title: str) -> str:
    title = re.sub(r"`|\*|_(?=\w)|(?<=\w)_", "", title).strip().lower()
    return re.sub(r"[^\w\- ]", "", title).replace(" ", "-")


def links(path: Path) -> list[str]:
    text = without_code(path.read_text(encoding="utf-8"))
    return [m["target"].strip("<>") for m in LINK.finditer(text)] + \
        [m["target"] for m in REF_LINK.finditer(text)]


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path):
    broken = []
    for target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        file_part, _, anchor = target.partition("#")
        if not file_part:  # an anchor on this page: GitHub's heading ids for the README
            headings = HEADING.finditer(without_code(README.read_text(encoding="utf-8")))
            if path == README and anchor not in {github_slug(m["title"]) for m in headings}:
                broken.append(target)
            continue
        if not (path.parent / file_part).exists():
            broken.append(target)
    assert not broken, f"{path.relative_to(ROOT)}: links to nothing: {broken}"


CITED = re.compile(r"`(?P<path>(?:benchmarks/results|tests|examples|benchmarks|csrc|accumkernels)"
                   r"/[\w./*+-]+)(?:::[\w\[\]-]+)?`")


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_cited_files_exist(path: Path):
    """A results file, test or example named in backticks exists (a number cites its record)."""
    missing = []
    for m in CITED.finditer(path.read_text(encoding="utf-8")):
        cited = m["path"].rstrip(".")
        if not glob.glob(str(ROOT / cited)):
            missing.append(cited)
    assert not missing, f"{path.relative_to(ROOT)} cites files that do not exist: {missing}"


# -- the site --------------------------------------------------------------------------------------

def reference_text() -> str:
    pages = sorted((DOCS / "reference").glob("*.md"))
    return "\n".join(p.read_text(encoding="utf-8") for p in pages)


def test_api_reference_covers_every_public_name():
    """Each name of ``accumkernels.__all__`` and each module the manual promises is rendered."""
    sys.path.insert(0, str(ROOT))
    import accumkernels
    text = reference_text()
    rendered = set(re.findall(r"^:::\s*(\S+)", text, re.MULTILINE))
    missing = [f"accumkernels.{name}" for name in accumkernels.__all__
               if f"accumkernels.{name}" not in rendered]
    modules = ["accumkernels.integrations." + m for m in
               ("transformers", "accelerate", "lightning", "fabric", "pipelining")]
    modules += ["accumkernels.optimizers", "accumkernels.optim.fsdp2.wire"]
    missing += [m for m in modules if m not in rendered]
    assert not missing, f"not in docs/reference/: {missing}"


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="mkdocs is not installed "
                    "(pip install -e '.[docs]')")
def test_mkdocs_build_strict(tmp_path):
    """``make docs``'s build: every warning (a broken link or anchor, a docstring griffe cannot
    read, a page left out of the nav) fails it."""
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                           "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
                          env=os.environ | {"PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    assert (tmp_path / "site" / "index.html").exists()
