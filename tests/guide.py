"""deploy/README.md's shell, read the way bash reads it: its ```bash blocks, the simple commands
in them (continuation lines joined, comments dropped, split at `&&`, `||`, `;`, `|`, `&`) and
the OVERRIDES array that every step-4 command takes."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "deploy" / "README.md"
SEPARATORS = {"&&", "||", ";", "|", "&"}


def blocks(text: str | None = None) -> list[str]:
    """The body of every ```bash block."""
    text = GUIDE.read_text() if text is None else text
    return re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M)


def commands(text: str | None = None) -> list[list[str]]:
    """Every simple command in the bash blocks, as bash's words (quotes removed, variables not
    expanded); commented-out lines are no commands."""
    out: list[list[str]] = []
    for block in blocks(text):
        for line in re.sub(r"\\\n", " ", block).splitlines():
            words: list[str] = []
            for word in shlex.split(line, comments=True):
                if word in SEPARATORS:
                    out.append(words)
                    words = []
                else:
                    words.append(word)
            out.append(words)
    return [words for words in out if words]


def assignments(name: str, text: str | None = None) -> list[str]:
    """Every value the guide's shell gives `name`, in commented-out alternatives too
    (`# export PIPELINE_VERSION=2.16.1`)."""
    text = GUIDE.read_text() if text is None else text
    return [m for block in blocks(text) for m in re.findall(rf"(?<![\w$]){name}=(\S+)", block)]


def overrides(text: str | None = None) -> list[str]:
    """The words of the guide's `OVERRIDES=( ... )` array."""
    (body,) = [m for block in blocks(text) for m in re.findall(r"^OVERRIDES=\((.*?)^\)", block, re.S | re.M)]
    return shlex.split(body, comments=True)
