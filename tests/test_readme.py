"""The code blocks of README.md and docs/*.md run as written.

Every ```bash and ```python block in README.md and docs/*.md has a marker on the line before it (blank lines allowed):
    <!-- readme-test: run -->                bash: the block in one `bash -e` shell; python: `python block.py`
    <!-- readme-test: run torchrun=2 -->     python: `torchrun --standalone --nproc-per-node 2 block.py`
    <!-- readme-test: run independent -->    as `run`, for a block that uses nothing an earlier block made
    <!-- readme-test: skip: <why> -->        not run (GPU only, a long run, ...): the reason is required
A block without a marker fails the test, so a new section is either covered or deliberately excluded.

README.md's blocks run in the default suite, every page's in the slow tier (`-m slow`). The blocks run in one scratch
copy of the repository, two at a time on two cores: the `run` blocks in page order
(README.md, then docs/*.md by file name; later ones use earlier ones' runs, e.g. the quick start's runs/tiny_cpu) on
one worker, and the `independent` ones beside them on both (so each independent block writes runs of its own). They
run with OMP_NUM_THREADS=1 and these rewrites, so that the pages take a few minutes and test what they say:
  - `pip install ...` commands are dropped: the environment under test is the installed one;
  - `python -m pytest ...` commands are dropped: the suite is what runs this test;
  - every `train.py` training command gets SHORT appended, replacing the command's own values of those keys (train.py
    refuses a key given twice): one step;
  - the files a user would bring are made first: USER_FILES (text, a JSONL corpus, a `tokenizers` JSON).
A block passes when it exits 0 and prints no `...Warning` line to stderr (a console people can read).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DESIGN = ROOT / "DESIGN.md"
# removed options: no command may name them; prose names them only where it says they were removed
REMOVED = (
    "comm.overlap_backward",
    "parallel.dp_comm",
    "parallel.dp_high_priority",
    "async_tp=symm_mem",
    "async_tp=ring",
    "comm.overlap_sm_margin",
    "train.fp8_small_layers",
    "parallel.overlap_param_gather",
)
REMOVED_NOTED_IN = ("docs/performance.md", "docs/design-notes.md")
SHORT = ["train.steps=1", "train.eval_interval=0", "data.synthetic_tokens=50000", "logging.progress=false"]
SHORT_KEYS = re.compile(r"(?<=\s)(?:" + "|".join(re.escape(a.split("=")[0]) for a in SHORT) + r")=\S*")
MARKER = re.compile(r"^<!-- readme-test: (run(?: torchrun=(\d+))?( independent)?|skip: (.+)) -->$")
FENCE = re.compile(r"^```(bash|python)\s*$")
TEXT = "The cat sat on the mat. The dog sat on the log. A bird sang in the tree by the house.\n"
USER_FILES = {
    "notes/a.txt": TEXT * 20,
    "notes/b.txt": TEXT.upper() * 20,
    "corpus.jsonl": "".join(f'{{"text": "{TEXT.strip()} Line {i}."}}\n' for i in range(40)),
}


def pages() -> list[Path]:
    """README.md, then docs/*.md by file name: the order the dependent blocks run in."""
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def page_name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@dataclass
class Block:
    page: str  # README.md, docs/data.md, ...
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    action: str  # "run" or "skip"
    nproc: int | None = None  # python under torchrun
    reason: str = ""
    independent: bool = False  # uses nothing an earlier block made


def readme_blocks(text: str, page: str = "README.md") -> list[Block]:
    """Every bash/python block of one page with its marker; ValueError naming the first block without one."""
    lines, blocks, i = text.splitlines(), [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        prev = i - 1
        while prev >= 0 and not lines[prev].strip():
            prev -= 1
        marker = MARKER.match(lines[prev].strip()) if prev >= 0 else None
        if marker is None:
            raise ValueError(
                f"{page}:{i + 1}: a ```{fence.group(1)} block without a marker; put "
                "'<!-- readme-test: run -->' or '<!-- readme-test: skip: <why> -->' on the line before it"
            )
        run = marker.group(1).startswith("run")
        blocks.append(
            Block(
                page,
                i + 1,
                fence.group(1),
                "\n".join(lines[i + 1 : end]) + "\n",
                "run" if run else "skip",
                int(marker.group(2)) if marker.group(2) else None,
                marker.group(4) or "",
                bool(marker.group(3)),
            )
        )
        i = end + 1
    return blocks


def all_blocks() -> list[Block]:
    """Every page's blocks, in page order."""
    return [b for path in pages() for b in readme_blocks(path.read_text(), page_name(path))]


def _shorten(command: str) -> str:
    """A train.py training command with SHORT's keys instead of its own; what follows `||` or `|` is kept as is."""
    if not re.search(r"\btrain\.py\b", command) or "--help" in command:
        return command
    run, sep, rest = (re.split(r"(\s\|\|?\s)", command, maxsplit=1) + ["", ""])[:3]
    return f"{SHORT_KEYS.sub('', run).rstrip()} {' '.join(SHORT)}{sep}{rest}"


def rewrite_bash(code: str) -> str:
    """Join continuation lines; drop pip install and pytest commands; shorten train.py runs."""
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        command, _, comment = line.partition(" #") if not line.lstrip().startswith("#") else ("", "", line)
        parts = [p.strip() for p in command.split("&&") if p.strip()]
        parts = [p for p in parts if not p.startswith("pip install") and not p.startswith("python -m pytest")]
        parts = [_shorten(p) for p in parts]
        if parts:
            out.append(" && ".join(parts))
    return "\n".join(out) + "\n"


def _user_files(work: Path) -> None:
    for name, content in USER_FILES.items():
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_text(content)
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted({w for w in re.findall(r"\w+|[^\w\s]", TEXT + TEXT.upper() + " Line 0123456789")})
    vocab = {"<unk>": 0, "<|endoftext|>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(work / "tokenizer.json"))


def test_every_readme_block_is_marked():
    blocks = all_blocks()
    assert all(b.action == "run" or b.reason for b in blocks)
    assert sum(b.action == "run" for b in blocks if b.page == "README.md") >= 3
    assert sum(b.action == "run" for b in blocks) >= 12


def test_train_help_single_process_command_is_in_readme():
    """`train.py --help` shows a one-process command; the README runs the same command."""
    doc = (ROOT / "train.py").read_text().split('"""')[1]
    command = next(
        line.split("#")[0].strip() for line in doc.splitlines() if line.strip().startswith("python train.py")
    )
    runs = "".join(b.code for b in readme_blocks(README.read_text()) if b.action == "run")
    assert command in runs, f"train.py's docstring shows {command!r}, which no README run block has"


def _config_class():
    try:  # issue 45's layout: the run's Config in tpframe/run/
        from tpframe.run.config import Config
    except ImportError:
        from tpframe.training.config import Config
    return Config


def test_every_config_key_the_readme_names_exists():
    """A `section.key` in backticks anywhere in README.md or docs/ (the Megatron-LM table, the prose) is a real config
    key, or a removed one (REMOVED), named where the pages say so."""
    import dataclasses

    Config = _config_class()

    sections = {
        f.name: {g.name for g in dataclasses.fields(f.type if isinstance(f.type, type) else f.default_factory())}
        for f in dataclasses.fields(Config)
    }
    key = r"`(?:[a-z_]+\.)?\b(" + "|".join(sections) + r")\.([a-z_0-9]+)(?:[=:][^`]*)?`"  # `k`, `k=v`, `a.k: v`
    named = {
        (s, k)
        for path in pages()
        for s, k in re.findall(key, path.read_text())
        if k not in ("py", "safetensors", "main") and f"{s}.{k}" not in REMOVED
    }
    unknown = sorted(f"{s}.{k}" for s, k in named if k not in sections[s])
    assert len(named) > 60 and not unknown, unknown


def test_no_page_offers_a_removed_option():
    """Removed options appear in no command, and in prose only where the pages say they were removed."""
    commands = [f"{b.page}:{b.line}" for b in all_blocks() for name in REMOVED if name in b.code]
    assert not commands, f"blocks naming a removed option: {commands}"
    prose = [
        f"{page_name(path)}: {name}"
        for path in [*pages(), DESIGN]
        for name in REMOVED
        if name in path.read_text() and page_name(path) not in REMOVED_NOTED_IN
    ]
    assert not prose, f"removed options named outside {REMOVED_NOTED_IN}: {prose}"


def _prose_lines(text: str):
    """(line number, line) of every line outside code fences and tables."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if not fenced and not line.lstrip().startswith("|"):
            yield number, line


def test_prose_lines_fit_the_page():
    """README.md, DESIGN.md and docs/ read at 120 columns: prose is wrapped (tables and code excepted)."""
    long = [
        f"{page_name(path)}:{n} ({len(line)} characters)"
        for path in [*pages(), DESIGN]
        for n, line in _prose_lines(path.read_text())
        if len(line) > 120
    ]
    assert not long, long


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose_lines(text):
        if not line.startswith("#"):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return out


def test_links_between_the_pages_resolve():
    """Every relative link of README.md, DESIGN.md and docs/ names a file that exists (and a heading of it, when the
    link has an anchor and the file is Markdown)."""
    broken = []
    for path in [*pages(), DESIGN]:
        text = path.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{page_name(path)}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text()):
                broken.append(f"{page_name(path)}: {target} (no such heading)")
    assert not broken, broken


def _run_block(b: Block, work: Path, env: dict) -> str | None:
    """None if the block ran cleanly, else what went wrong."""
    if b.lang == "bash":
        cmd = ["bash", "-e", "-o", "pipefail", "-c", rewrite_bash(b.code)]
    else:
        script = work / f"readme_block_{Path(b.page).stem}_{b.line}.py"
        script.write_text(b.code)
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={b.nproc}"]
        cmd = [*(launcher if b.nproc else [sys.executable]), str(script)]
    result = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        return (
            f"{b.page}:{b.line} ({b.lang}) failed with exit code {result.returncode}:\n{cmd[-1]}\n"
            f"--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}"
        )
    warned = [line for line in result.stderr.splitlines() if "Warning" in line]
    if warned:
        return f"{b.page}:{b.line} ({b.lang}) printed warnings a user would see: {warned[:3]}"
    return None


def _run_chain(blocks: list[Block], shared: deque, lock: threading.Lock, work: Path, env: dict) -> str | None:
    """`blocks` in order, then independent blocks taken from `shared` until none is left (or one fails)."""
    for b in blocks:
        failure = _run_block(b, work, env)
        if failure:
            return failure
    while True:
        with lock:
            if not shared:
                return None
            b = shared.popleft()
        failure = _run_block(b, work, env)
        if failure:
            return failure


def _run_pages(tmp_path: Path, pages: tuple[str, ...] | None) -> list[str]:
    """Run the `run` blocks of `pages` (page names; None: every page) in a scratch copy; the failures."""
    work = tmp_path / "repo"
    shutil.copytree(ROOT, work, ignore=shutil.ignore_patterns(".git", "runs", "__pycache__", ".wt", "*.egg-info"))
    _user_files(work)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(work), PYTHONUNBUFFERED="1")
    runs = [b for b in all_blocks() if b.action == "run" and (pages is None or b.page in pages)]
    # one worker runs the dependent blocks in order, then helps the other with the independent ones
    shared, lock = deque(b for b in runs if b.independent), threading.Lock()
    chains = [[b for b in runs if not b.independent], []]
    with ThreadPoolExecutor(2) as pool:
        return [f for f in pool.map(lambda chain: _run_chain(chain, shared, lock, work, env), chains) if f]


def test_readme_blocks_run_as_written(tmp_path):
    """README.md's own blocks (the quick start, the launch lines): the default suite."""
    failures = _run_pages(tmp_path, ("README.md",))
    assert not failures, "\n\n".join(failures)
    assert (tmp_path / "repo/runs/tiny_cpu/loss.png").is_file()


@pytest.mark.slow
def test_every_page_s_blocks_run_as_written(tmp_path):
    """README.md's and every docs/ page's blocks (a few minutes: the slow tier)."""
    pytest.importorskip("transformers", reason="docs/huggingface.md's example needs transformers (dev extras)")
    failures = _run_pages(tmp_path, None)
    assert not failures, "\n\n".join(failures)
    work = tmp_path / "repo"
    assert (work / "runs/tiny_cpu/loss.png").is_file() and (work / "hf_model/config.json").is_file()
