"""Make `pystdlib.jsonl`, the second shipped source: whole modules of CPython's standard library,
one document per file, from the interpreter that runs this script (its `Lib/` on disk).

    python corpus/make_pystdlib.py            # writes corpus/pystdlib.jsonl

The shipped file was made with CPython 3.11.7; another version makes other bytes, hence
another dataset version (the store keys datasets by content).
"""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

# Pure-Python packages and modules, about 800 KB in all: a source of a different kind from the
# KJV's prose (code: indentation, identifiers, operators), small enough for the tiny run.
MODULES = ["json", "email", "http", "collections", "csv.py", "textwrap.py", "string.py", "fractions.py"]


def documents(lib: Path):
    for name in MODULES:
        root = lib / name
        files = sorted(root.rglob("*.py")) if root.is_dir() else [root]
        for f in files:
            text = f.read_text(encoding="utf-8")
            if text.strip():
                yield {"text": text, "source": f"CPython {sys.version.split()[0]} Lib/{f.relative_to(lib).as_posix()}"}


def main() -> None:
    lib = Path(sysconfig.get_paths()["stdlib"])
    out = Path(__file__).with_name("pystdlib.jsonl")
    with open(out, "w", encoding="utf-8") as f:
        for doc in documents(lib):
            f.write(json.dumps(doc, ensure_ascii=False) + "\n")
    print(f"{out}: {out.stat().st_size} bytes")


if __name__ == "__main__":
    main()
