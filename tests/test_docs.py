"""The documentation cannot rot: the site builds with `mkdocs build --strict`, and every shell and
Python block of docs/*.md and README.md runs.

Why a test and not a review: the docs quote commands and figures; a renamed key or a removed option
breaks a page silently unless the page is executed. Shell blocks run as written, except that each
command that replays a trace is held to TRACE_CAP requests (an existing `trace.max_requests` above it
is lowered, else one is appended), so the whole page set runs in minutes. A block that cannot run
here says so in the markdown, on the line before it: `<!-- docs-test: skip (why) -->`; those are
counted and listed, never silently dropped. ```text blocks are outputs and are not run. Python
blocks of one page run in order in one namespace (one fresh interpreter per page).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").glob("**/*.md")) + [ROOT / "README.md"]
TRACE_CAP = 200
BLOCK_TIMEOUT_S = 600
SHELL = {"bash", "sh", "console", "shell"}
SKIP = re.compile(r"^<!--\s*docs-test:\s*skip\s*\((?P<why>.+)\)\s*-->\s*$")
FENCE = re.compile(r"^```(?P<lang>[\w-]*)\s*$")
# commands that replay a trace and so take the request cap
CAPPED = re.compile(r"^(?:\S+=\S+\s+)*(?:testbed-(?:sim|capacity|disagg-search|fidelity|referee|traces)\b"
                    r"|\S*python3?\s+-m\s+testbed(?:\s|$)|\S*python3?\s+-m\s+testbed\.app\.analysis\.(?:fidelity|referee|traces)\b)")


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    skip: str | None  # why it does not run here, as the markdown says

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of a page (fences at the start of a line), each with its skip reason."""
    out, lines = [], page.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m["lang"].lower()
        j = i + 1
        while j < len(lines) and lines[j].rstrip() != "```":
            j += 1
        prev = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        skip = SKIP.match(prev.strip())
        out.append(Block(page, start + 1, lang, "\n".join(lines[start + 1:j]) + "\n", skip["why"] if skip else None))
        i = j + 1
    return out


ALL = [b for page in PAGES for b in blocks(page)]
RUNNABLE = [b for b in ALL if b.lang in SHELL | {"python"}]


def _split_comment(line: str) -> tuple[str, str]:
    """(command, trailing comment): a `#` after whitespace, outside quotes, starts a comment."""
    quote = None
    for k, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (k == 0 or line[k - 1].isspace()):
            return line[:k].rstrip(), line[k:]
    return line, ""


def capped(command: str) -> str:
    """A command that replays a trace, held to TRACE_CAP requests; any other command unchanged."""
    cmd, comment = _split_comment(command)
    if not CAPPED.match(cmd.strip()):
        return command
    if "trace.max_requests=" in cmd:
        cmd = re.sub(r"trace\.max_requests=([\d,]+)",
                     lambda m: "trace.max_requests=" + ",".join(str(min(int(v), TRACE_CAP)) for v in m[1].split(",")), cmd)
    else:
        cmd = f"{cmd} trace.max_requests={TRACE_CAP}"
    return f"{cmd}  {comment}" if comment else cmd


def shell_script(code: str, lang: str) -> str:
    """The block's commands, continuation lines joined, each trace replay capped; `set -e` so that
    any failing command fails the block. A console block's commands are its `$ ` lines."""
    lines = code.splitlines()
    if lang == "console":
        lines = [ln[2:] for ln in lines if ln.startswith("$ ")]
    logical, buf = [], ""
    for ln in lines:
        if ln.rstrip().endswith("\\"):
            buf += ln.rstrip()[:-1] + " "
            continue
        logical.append(buf + ln)
        buf = ""
    if buf:
        logical.append(buf)
    return "set -euo pipefail\n" + "\n".join(capped(ln) for ln in logical) + "\n"


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="offline", WANDB_SILENT="true",
               MPLBACKEND="Agg", PYTHONUNBUFFERED="1", NO_MKDOCS_2_WARNING="1")
    env.pop("WANDB_API_KEY", None)
    return env


def _run(args: list[str], cwd: Path, what: str) -> None:
    try:
        done = subprocess.run(args, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what}: still running after {BLOCK_TIMEOUT_S} s")
    if done.returncode != 0:
        pytest.fail(f"{what} failed with exit {done.returncode}\n--- stdout (tail)\n{done.stdout[-3000:]}"
                    f"\n--- stderr (tail)\n{done.stderr[-3000:]}", pytrace=False)


# one interpreter per page runs its Python blocks in order, in one module namespace (dataclasses and
# pickling look a class's module up in sys.modules), and names the block that failed
_PY_RUNNER = textwrap.dedent('''
    import json, sys, traceback, types
    blocks = json.load(open(sys.argv[1]))
    module = types.ModuleType("docs_page")
    sys.modules["docs_page"] = module
    for where, code in blocks:
        try:
            exec(compile(code, where, "exec"), module.__dict__)
        except BaseException:
            traceback.print_exc()
            print(f"docs block {where} failed", file=sys.stderr)
            sys.exit(1)
''')


def test_every_fence_is_closed_and_every_skip_says_why():
    """A skip marker with no reason, or before a block that is not run anyway, is a mistake."""
    for page in PAGES:
        text = page.read_text()
        assert len(re.findall(r"^```", text, re.M)) % 2 == 0, f"{page}: an unclosed code fence"
        for n, line in enumerate(text.splitlines(), 1):
            if "docs-test:" in line:
                assert SKIP.match(line.strip()), f"{page}:{n}: write it as <!-- docs-test: skip (why) -->"
    for b in ALL:
        if b.skip is not None:
            assert b.lang in SHELL | {"python"}, f"{b.where}: a skip marker before a ```{b.lang} block, which never runs"


def test_skipped_blocks_are_listed(capsys):
    """The blocks that do not run here, with why: visible in the test's output, never silent."""
    skipped = [b for b in RUNNABLE if b.skip]
    with capsys.disabled():
        print(f"\ndocs: {len(RUNNABLE)} shell/Python blocks, {len(skipped)} not run here:")
        for b in skipped:
            print(f"  {b.where}: {b.skip}")
    assert len(skipped) < len(RUNNABLE)


def test_capping():
    assert capped("testbed-sim policy=static   # another") == f"testbed-sim policy=static trace.max_requests={TRACE_CAP}  # another"
    assert capped("testbed-sim trace.max_requests=2000") == f"testbed-sim trace.max_requests={TRACE_CAP}"
    assert capped("testbed-sim trace.max_requests=100") == "testbed-sim trace.max_requests=100"
    assert capped("testbed-report multirun/demo") == "testbed-report multirun/demo"
    assert capped("python -m testbed.app.profiling.bench --out x.md") == "python -m testbed.app.profiling.bench --out x.md"
    assert capped("HF_HUB_OFFLINE=1 python -m testbed backend=vllm").endswith(f"trace.max_requests={TRACE_CAP}")
    assert capped("python -m testbed.app.analysis.fidelity cost_model=profile").endswith(f"trace.max_requests={TRACE_CAP}")
    assert "echo '# x'" in shell_script("echo '# x'\n", "bash")


def test_the_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'")
    mkdocs = shutil.which("mkdocs")
    args = [mkdocs] if mkdocs else [sys.executable, "-m", "mkdocs"]
    _run(args + ["build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
         tmp_path, "mkdocs build --strict")
    assert (tmp_path / "site" / "index.html").exists()
    assert (tmp_path / "site" / "api" / "index.html").exists()


PY_PAGES = sorted({b.page for b in RUNNABLE if b.lang == "python" and not b.skip})
SHELL_BLOCKS = [b for b in RUNNABLE if b.lang in SHELL and not b.skip]


@pytest.mark.parametrize("page", PY_PAGES, ids=[str(p.relative_to(ROOT)) for p in PY_PAGES])
def test_python_blocks_run(page, tmp_path):
    import json

    code = [(b.where, b.code) for b in RUNNABLE if b.page == page and b.lang == "python" and not b.skip]
    (tmp_path / "blocks.json").write_text(json.dumps(code))
    (tmp_path / "runner.py").write_text(_PY_RUNNER)
    _run([sys.executable, str(tmp_path / "runner.py"), str(tmp_path / "blocks.json")], tmp_path,
         f"the Python blocks of {page.relative_to(ROOT)}")


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=[b.where for b in SHELL_BLOCKS])
def test_shell_block_runs(block, tmp_path):
    (tmp_path / "block.sh").write_text(shell_script(block.code, block.lang))
    _run(["bash", str(tmp_path / "block.sh")], tmp_path, f"the shell block at {block.where}")
