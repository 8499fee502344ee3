"""Write and compare the constraints file that CI and the README's test command install from.

``python .ci/lockfile.py freeze PYTHON`` prints the exact versions installed in PYTHON's
environment (the project itself left out, torch at its plain pin); ``python .ci/lockfile.py
diff OLD NEW`` prints the packages whose versions differ. ``.ci/newest`` uses both.
"""

from __future__ import annotations

import re
import subprocess
import sys

HEADER = """\
# Exact versions CI and the README's test command install (pip install -c constraints.txt).
# The package's own extras keep version ranges; this file only makes the test environment
# reproducible. Refresh: `bash .ci/newest --write` (fresh venv, newest releases, full suite),
# review the printed version changes, commit.
"""


def freeze(python: str) -> str:
    out = subprocess.run(
        [python, "-m", "pip", "freeze", "--exclude-editable", "--disable-pip-version-check"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    pins = []
    for line in out.splitlines():
        if not line or line.startswith("#") or "@" in line or "==" not in line:
            continue
        name, version = line.split("==", 1)
        if name.lower().replace("_", "-") == "functional-fsdp":
            continue
        pins.append(f"{name}=={version.split('+')[0] if name == 'torch' else version}")
    return HEADER + "\n".join(sorted(pins, key=str.lower)) + "\n"


def read(path: str) -> dict[str, str]:
    pins = {}
    with open(path) as f:
        for line in f:
            m = re.match(r"^([A-Za-z0-9_.\-\[\]]+)==(\S+)", line.strip())
            if m:
                pins[m.group(1).lower().replace("_", "-")] = m.group(2)
    return pins


def diff(old_path: str, new_path: str) -> str:
    old, new = read(old_path), read(new_path)
    lines = []
    for name in sorted(old.keys() | new.keys()):
        a, b = old.get(name, "-"), new.get(name, "-")
        if a != b:
            lines.append(f"  {name}: {a} -> {b}")
    return "\n".join(lines) if lines else "  (no version changed)"


def main(argv: list[str]) -> None:
    if len(argv) == 2 and argv[0] == "freeze":
        sys.stdout.write(freeze(argv[1]))
    elif len(argv) == 3 and argv[0] == "diff":
        print(diff(argv[1], argv[2]))
    else:
        sys.exit("usage: lockfile.py freeze PYTHON | lockfile.py diff OLD NEW")


if __name__ == "__main__":
    main(sys.argv[1:])
