"""The documentation runs: every snippet marked runnable in README.md and docs/*.md, and the strict site build.

A fenced block runs when the line right before it is an HTML comment (invisible on the site and on GitHub):

- ``<!-- run -->`` before a ``python`` block: a program. It is saved as ``snippet.py`` after the *glue* below
  and run with ``python snippet.py`` (so the names the glue defines are there unless the block defines its own).
- ``<!-- run: call=train -->``: the same, then ``train(cfg)`` is called (for a block that only defines it).
- ``<!-- run: fragment -->``: lines from the body of a decorated function (they use ``ctx``). They are
  indented into ``@distributed(mode="ddp", nprocs=2, seed=0) def snippet(cfg, ctx)`` whose first lines build
  ``model`` (wrapped), ``opt``, ``sched``, a batch ``x, y`` on ``ctx.device``, ``logits``, ``loss``,
  ``test_loader`` and ``state``.
- ``<!-- run -->`` before a ``bash`` block: run with ``bash -euo pipefail``.
- ``stdin`` on a program: fed to ``python -`` on standard input, as a notebook cell or an interactive session
  runs it (no ``if __name__ == "__main__":`` guard needed there).
- ``as=NAME`` on a program: saved as ``NAME`` (``train.py``) instead of ``snippet.py``; ``uses=NAME`` on a later
  ``bash`` block of the same page: that program is saved as ``NAME`` first, so the commands can run it.
- ``needs=NAME`` (a module or a command, e.g. ``<!-- run: fragment needs=tensorboard -->``): skipped, with a
  reason, where it is missing.

Markers and fences may be indented (inside a tab or an admonition); the block is dedented.

Every block runs in a fresh temporary directory holding a copy of ``examples/``, with ``DISTFN_NPROCS=2``
(2 ranks everywhere), ``EPOCHS=1`` (examples/quickstart.py's epoch count) and the venv's ``bin`` first on
``PATH``. The glue (``GLUE`` below) defines ``Net`` (a small classifier of 8 features into 4 classes),
``train_set``/``test_set``/``dataset`` (built lazily, so the launching process runs no torch operation and
distfn can fork), ``loss_fn``, ``cfg`` (``epochs``, ``lr``, ``batch_size``, ``data_dir``), ``epochs``,
``path``, ``step``, ``step_time``, ``Block``/``Model``/``build_model`` (two blocks and a head), and
stand-ins ``prepare_dataset``/``load_dataset``/``train_one_step``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import clean_env, requires

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

GLUE = '''\
import os
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset
import distfn
from distfn import distributed


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x):
        return self.layers(x)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.linear(x))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.blocks(x))


build_model = Model


class ToySet(Dataset):
    """n samples of 8 features and a class in 0..3, made on demand (no torch operation at import)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x = torch.randn(8, generator=torch.Generator().manual_seed(i))
        return x, int(x[:4].sum() > 0) + 2 * int(x[4:].sum() > 0)


train_set, test_set = ToySet(256), ToySet(101)
dataset = train_set
loss_fn = F.cross_entropy
cfg = {"epochs": 2, "lr": 0.05, "batch_size": 32, "data_dir": "data", "ckpt_dir": "ckpt", "steps": 3}
epochs = cfg["epochs"]
path = "snippet.safetensors"
step, step_time = 0, 0.25
train_dataset = train_set
prepare_dataset = load_dataset = lambda data_dir: train_set


def train_one_step(model, opt):
    x = torch.randn(8, 8, device=next(model.parameters()).device)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
'''

FRAGMENT = '''
@distributed(mode="ddp", nprocs=2, seed=0)
def snippet(cfg, ctx):
    model = ctx.wrap(Net())
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    step = 0
    state = {"model": model, "optimizer": opt, "scheduler": sched, "step": step}
    x, y = next(iter(DataLoader(train_set, batch_size=8)))
    x, y = x.to(ctx.device), y.to(ctx.device)
    logits = model(x)
    loss = loss_fn(logits, y)
    test_loader = ctx.dataloader(test_set, batch_size=16, shuffle=False)
{body}
    return "snippet done"


if __name__ == "__main__":
    print(snippet(cfg))
'''

_BLOCK = re.compile(r"^(?P<indent>[ ]*)<!-- run(?::(?P<opts>[^>]*))? -->\n(?P=indent)```(?P<lang>\w+)\n"
                    r"(?P<code>.*?)^(?P=indent)```", re.M | re.S)


def _blocks() -> list:
    params = []
    for page in PAGES:
        text = page.read_text()
        saved: dict[str, tuple[str, dict[str, str]]] = {}  # as=NAME programs of this page so far
        for m in _BLOCK.finditer(text):
            line = text.count("\n", 0, m.start()) + 2
            opts = dict(o.partition("=")[::2] for o in (m.group("opts") or "").split())
            code = textwrap.dedent(m.group("code"))
            files = {}
            if "as" in opts:
                saved[opts["as"]] = (code, opts)
            if "uses" in opts:
                assert opts["uses"] in saved, f"{page.name}:{line}: uses={opts['uses']} before any as={opts['uses']}"
                files[opts["uses"]] = program("python", *saved[opts["uses"]])
            params.append(pytest.param(m.group("lang"), code, opts, files, id=f"{page.relative_to(REPO)}:{line}"))
    return params


def _missing(name: str) -> bool:
    return shutil.which(name) is None and importlib.util.find_spec(name) is None


def program(lang: str, code: str, opts: dict[str, str]) -> str:
    """The file a marked block becomes (Python: glue + block; a fragment: glue + decorated body)."""
    if lang != "python":
        return code
    if "fragment" in opts:
        return GLUE + FRAGMENT.replace("{body}", textwrap.indent(code, "    "))
    call = f'\n\nif __name__ == "__main__":\n    print({opts["call"]}(cfg))\n' if "call" in opts else ""
    return GLUE + "\n" + code + call


@pytest.mark.slow
@pytest.mark.parametrize(("lang", "code", "opts", "files"), _blocks())
def test_snippet_runs(lang: str, code: str, opts: dict[str, str], files: dict[str, str], tmp_path: Path) -> None:
    if opts.get("needs") and _missing(opts["needs"]):
        pytest.skip(f"needs {opts['needs']}")
    assert lang in ("python", "bash"), f"only python and bash blocks can be marked runnable, not {lang}"
    shutil.copytree(REPO / "examples", tmp_path / "examples")
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    script = tmp_path / (opts.get("as", "snippet.py") if lang == "python" else "snippet.sh")
    script.write_text(program(lang, code, opts))
    command = [sys.executable, str(script)] if lang == "python" else ["bash", "-euo", "pipefail", str(script)]
    if "stdin" in opts:
        command = [sys.executable, "-"]
    env = clean_env(DISTFN_NPROCS="2", EPOCHS="1",
                    PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280,
                          input=script.read_text() if "stdin" in opts else None)
    assert done.returncode == 0, f"{script.read_text()}\n--- output:\n{done.stdout[-3000:]}{done.stderr[-5000:]}"
    assert "Failed to initialize NumPy" not in done.stderr  # a bare install warns about nothing


def test_every_page_has_runnable_snippets_and_markers_are_well_formed() -> None:
    """A marker must sit right before a fence (a blank line in between would silently disable it)."""
    for page in PAGES:
        text = page.read_text()
        markers = re.findall(r"^[ ]*<!-- run", text, re.M)
        assert len(markers) == len(_BLOCK.findall(text)), f"a stray run marker in {page.name}"
    assert len(_blocks()) >= 20


@requires("mkdocs", "docs")
@requires("mkdocstrings", "docs")
def test_docs_build_strict(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "a distributed job" in api and "WorkerError" in api  # rendered from the docstrings
    assert (tmp_path / "site" / "benchmarks" / "index.html").exists()
    # No Sphinx role leaks into the rendered page as literal text (":func:`x`" shows as ":func: x").
    assert not re.search(r":(?:func|class|meth|attr|mod|exc|data):", api), "a Sphinx role in a docstring"
    for page in ("install", "notebooks"):
        assert (tmp_path / "site" / page / "index.html").exists()
