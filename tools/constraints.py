"""Rewrite the constraints files with the versions pip resolves today for nbkit and its extras.

    python tools/constraints.py            # `make constraints` runs this; docs/versions.md says when

1. constraints.txt, CI's newest set: pip resolves `-e ".[test,browser,liger]"` as a fresh install would
   (`pip install --dry-run --ignore-installed --report`), with the file's held pins as requirements so that the rest
   resolves around them; every other `name==version` line takes the version pip chose.
2. The sets defined against it (constraints-oldest.txt, constraints-kaggle.txt): their held pins define them, every
   other pin takes constraints.txt's new version; then pip must resolve each set with constraints.txt's pins for
   the names it does not pin, or the script fails with pip's reason.

A held line is "name==version  # held: why"; it stays as written. Comments and the order of lines stay: a comment's
reason may name an old version, so reread those next to the pins that changed (the script lists them). A pinned name
that pip no longer installs is an error: delete its line or say why it stays. Run it with the Python CI uses (3.11),
where pip reaches the package index; CI itself only installs the pins.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NEWEST = ROOT / "constraints.txt"
# The sets whose held pins differ from the newest set and which take its versions for everything else.
FOLLOWERS = (ROOT / "constraints-oldest.txt", ROOT / "constraints-kaggle.txt")
# nbkit's extras whose packages CI or the GPU hosts install with constraints.txt (unsloth needs a GPU to install or
# import; the GPU image's wheelhouse pins it and bitsandbytes). bitsandbytes has a CPU backend, but peft imports it
# wherever it is installed, which made every process that imports peft 1.3 s slower (4.2 -> 5.5 s on CI's 2 cores):
# the suite took 1,148 s instead of 1,023, and CI 29.9 of its 30 minutes. Its CPU tests run where it is installed.
# The other sets install the test extras only.
EXTRAS = "test,browser,liger"
FOLLOWER_EXTRAS = "test"
PIN = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[^\s#]+)(?P<rest>.*)$")
HELD = re.compile(r"#\s*held\b")


def normal(name: str) -> str:
    """The comparable form of a distribution name (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(text: str, held: bool | None = None) -> dict[str, str]:
    """{normalized name: "name==version"} of a constraints file's pins: all, or only the held (True) or others."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        match = PIN.match(line.strip())
        if match and (held is None or held == bool(HELD.search(match["rest"]))):
            found.setdefault(normal(match["name"]), f"{match['name']}=={match['version']}")
    return found


def rewrite(text: str, versions: Mapping[str, str]) -> tuple[str, list[str]]:
    """The file with each pin that is not held set to `versions` (normalized name -> version), and the changes.

    Returns the new text and one line per change ("name: old -> new", "name: repeated line removed").

    Raises:
        ValueError: a pin that is not held names a package `versions` lacks.
    """
    lines: list[str] = []
    changes: list[str] = []
    seen: set[str] = set()
    missing: list[str] = []
    for line in text.splitlines():
        match = PIN.match(line.strip())
        if not match:
            lines.append(line)
            continue
        name, version = match["name"], match["version"]
        if normal(name) in seen:
            changes.append(f"{name}: repeated line removed")
            continue
        seen.add(normal(name))
        new = version if HELD.search(match["rest"]) else versions.get(normal(name))
        if new is None:
            missing.append(name)
            continue
        if new != version:
            changes.append(f"{name}: {version} -> {new}")
        lines.append(f"{name}=={new}{match['rest']}")
    if missing:
        raise ValueError(f"{', '.join(missing)}: not resolved; delete the pin or mark it held with a reason")
    return "\n".join(lines) + "\n", changes


def resolve(extras: str, requirements: Sequence[str], constraints: Sequence[str] = ()) -> dict[str, str]:
    """What `pip install -e ".[extras]" REQUIREMENTS` under CONSTRAINTS (pins) would install today, as a fresh
    environment: normalized name -> version.

    Raises:
        subprocess.CalledProcessError: pip finds no solution (it prints why).
    """
    with tempfile.TemporaryDirectory() as tmp:
        report, pinned = Path(tmp) / "report.json", Path(tmp) / "constraints.txt"
        pinned.write_text("".join(f"{pin}\n" for pin in constraints))
        command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
        command += ["--report", str(report), "-c", str(pinned), *requirements, "-e", f"{ROOT}[{extras}]"]
        subprocess.run(command, check=True)
        installs = json.loads(report.read_text())["install"]
    return {normal(item["metadata"]["name"]): item["metadata"]["version"] for item in installs}


def refresh(path: Path, versions: Mapping[str, str]) -> bool:
    """Rewrite `path` with `versions` (see rewrite()), say what changed, and return whether anything did."""
    new, changes = rewrite(path.read_text(), versions)
    path.write_text(new)
    print(f"{path.name}: " + ("; ".join(changes) if changes else "unchanged"))
    return bool(changes)


def main() -> int:
    """Rewrite constraints.txt from pip, then the sets that follow it, and check that pip resolves each."""
    try:
        changed = refresh(NEWEST, _resolved(NEWEST.name, EXTRAS, list(pins(NEWEST.read_text(), held=True).values())))
        newest = pins(NEWEST.read_text())
        for path in FOLLOWERS:
            changed |= refresh(path, {name: pin.partition("==")[2] for name, pin in newest.items()})
            own = pins(path.read_text())
            merged = [*own.values(), *(pin for name, pin in newest.items() if name not in own)]
            _resolved(f"{path.name} with {NEWEST.name}", FOLLOWER_EXTRAS, [], merged)
            print(f"{path.name}: pip resolves it with {NEWEST.name}")
    except ValueError as error:
        print(f"tools/constraints.py: {error}", file=sys.stderr)
        return 1
    if changed:
        print("Reread the comments next to changed pins; TESTED_VERSIONS (nbkit/notebook/diagnostics.py) follows them.")
    return 0


def _resolved(what: str, extras: str, requirements: Sequence[str], constraints: Sequence[str] = ()) -> dict[str, str]:
    """resolve(), with pip's failure said as which set it could not resolve (pip has printed why)."""
    try:
        return resolve(extras, requirements, constraints)
    except subprocess.CalledProcessError:
        raise ValueError(f"pip finds no versions for {what} (its reason is above)") from None


if __name__ == "__main__":
    sys.exit(main())
