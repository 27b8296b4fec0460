#!/usr/bin/env python
"""Print one of the README's quick-start commands: `main` (set up + demo training) or `test` (set up + tests).
The commands are the fenced ```bash blocks right after the `<!-- cmd:NAME -->` markers, so CI runs exactly
what the README tells a new user to run."""
import re, sys
from pathlib import Path

def command(name: str, readme=Path(__file__).resolve().parents[1] / "README.md") -> str:
    m = re.search(rf"<!-- cmd:{name} -->\s*```bash\n(.*?)```", readme.read_text(), re.S)
    if not m: sys.exit(f"README.md has no '<!-- cmd:{name} -->' block")
    return " ".join(l.strip() for l in m.group(1).splitlines() if l.strip() and not l.strip().startswith("#"))

if __name__ == "__main__": print(command(sys.argv[1]))
