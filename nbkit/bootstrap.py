"""Make a Python environment ready for nbkit's notebooks, run from nbkit's own wheel before anything is installed.

A notebook's first cell puts the wheel on sys.path and calls `install()`:

    import glob, sys
    sys.path[:0] = sorted(glob.glob("/kaggle/input/*/nbkit_ddp-*.whl") + glob.glob("nbkit_ddp-*.whl"))[-1:]
    from nbkit import bootstrap
    bootstrap.install()

A wheel is a zip archive and Python imports pure-Python packages from one (zipimport), so this module runs from
the attached wheel itself (Kaggle mounts it under /kaggle/input/<dataset>/; on Colab an upload lands in /content,
the working folder). It uses only the standard library and nbkit's standard-library modules (platform,
distributed), and `import nbkit` imports nothing else, so it runs before nbkit's dependencies are there.
From a shell: `PYTHONPATH=nbkit_ddp-0.2.0-py3-none-any.whl python -m nbkit.bootstrap [--dry-run]`.

What it installs (`steps`): nothing when nbkit-ddp of this version is installed and no foreign `nbkit` is (a second
run of the cell, or a machine where nbkit runs from a checkout). Otherwise, on a GPU machine without unsloth,
unsloth's own recipe for Kaggle comes first (UNSLOTH_RECIPE); a distribution named `nbkit` (the package index's
unrelated project, or nbkit before 0.2.0: it owns the same folder) is named and removed; then nbkit-ddp with its
`unsloth` extra on a GPU machine, `peft` elsewhere, with every version in HELD that is installed by then held (pip
constraints), so that it adds only what is missing and replaces nothing the platform or unsloth installed.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import subprocess
import sys
import tempfile
import zipimport
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from nbkit import __version__
from nbkit.platform import distributed
from nbkit.platform import host as platform
from nbkit.platform.errors import InstallError

__all__ = ["DISTRIBUTION", "HELD", "UNSLOTH_RECIPE", "Machine", "Step", "install", "main", "steps", "survey"]

# The distribution's name; the import name is `nbkit`, which on the package index belongs to an unrelated project.
DISTRIBUTION = "nbkit-ddp"
FOREIGN = "nbkit"

# unsloth's install on Kaggle, as its Kaggle Qwen3-VL notebook has it: unsloth with transformers pinned, then trl
# pinned without its dependencies (trl's own would move transformers again). Each entry: pip's arguments.
UNSLOTH_RECIPE = (("install", "unsloth", "transformers==4.57.1"), ("install", "--no-deps", "trl==0.22.2"))

# What nbkit-ddp's install must not move: the platform's CUDA build of torch, and the training stack as the platform
# or unsloth's recipe left it.
HELD = ("torch", "transformers", "trl", "peft", "datasets", "unsloth", "unsloth_zoo", "bitsandbytes")


@dataclass(frozen=True)
class Machine:
    """What the install depends on. host: "kaggle", "colab" or "local"; gpus: NVIDIA GPUs visible; versions: the
    installed version of each distribution in HELD, nbkit-ddp and `nbkit`, where installed; foreign: the summary of
    the installed distribution named `nbkit` ("" where it has none), None where there is none.
    """

    host: str
    gpus: int
    versions: Mapping[str, str]
    foreign: str | None = None


@dataclass(frozen=True)
class Step:
    """One pip command: its arguments (after `pip`), whether the versions of HELD installed when it runs go with it
    as constraints, and the line printed before it runs ("" for none).
    """

    args: tuple[str, ...]
    hold: bool = False
    says: str = ""

    def __str__(self) -> str:
        held = " -c <the installed versions of " + ", ".join(HELD) + ">" if self.hold else ""
        return f"pip {' '.join(self.args[:1])}{held} {' '.join(self.args[1:])}"


def survey() -> Machine:
    """This machine, read without importing anything beyond the standard library (installed metadata, nvidia-smi)."""
    found = {name: _installed(name) for name in (*HELD, DISTRIBUTION, FOREIGN)}
    versions = {name: dist.version for name, dist in found.items() if dist is not None}
    foreign = found[FOREIGN]
    host = platform.detect(os.environ, None).host
    summary = None if foreign is None else str(foreign.metadata.json.get("summary", ""))
    return Machine(host=host, gpus=len(distributed.machine_gpus()), versions=versions, foreign=summary)


def steps(machine: Machine, source: str | None, version: str = __version__) -> list[Step]:
    """The pip commands that make `machine` ready to run nbkit `version` from `source` (a wheel's path or a pip
    requirement), in order; [] where there is nothing to do or no source to install from.
    """
    if source is None or (machine.versions.get(DISTRIBUTION) == version and machine.foreign is None):
        return []
    planned = []
    if machine.gpus and "unsloth" not in machine.versions:
        planned += [Step(args) for args in UNSLOTH_RECIPE]
    if machine.foreign is not None:
        what = f"{FOREIGN} {machine.versions[FOREIGN]}" + (f" ({machine.foreign})" if machine.foreign else "")
        says = f"Found {what}, not {DISTRIBUTION} {version}: replacing it."
        planned.append(Step(("uninstall", "-y", FOREIGN), says=says))
    extra = ("[unsloth]" if machine.gpus else "[peft]") if source.endswith(".whl") else ""
    planned.append(Step(("install", source + extra), hold=True))
    return planned


def install(source: str | None = None, *, dry_run: bool = False) -> list[Step]:
    """Install what `steps` lists for this machine, from `source` (default: the wheel this module runs from; none
    where it runs from an installed nbkit or a checkout). Prints a line for each change ("installed nbkit-ddp 0.2.0
    from ..."), nothing where nothing was to do. Run from a wheel, it then forgets the wheel, so that the next
    `import nbkit` in this process finds the installed copy. dry_run: print the pip commands instead of running them.

    Returns the steps. Raises InstallError when pip fails (with pip's output and, on Kaggle, the Internet setting).
    """
    archive = _running_archive()
    source = source or (archive and os.path.abspath(archive))
    machine = survey()
    planned = steps(machine, source)
    for step in planned:
        if dry_run:
            print(step)
            continue
        if step.says:
            print(step.says)
        _pip(step, machine.host)
    if planned and not dry_run:
        print(f"installed {DISTRIBUTION} {_version(DISTRIBUTION)} from {source}")
    if archive is not None:
        _forget(archive)
    return planned


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m nbkit.bootstrap [--source WHEEL_OR_REQUIREMENT] [--dry-run]`: install() from a shell."""
    parser = argparse.ArgumentParser(prog="python -m nbkit.bootstrap", description=install.__doc__)
    parser.add_argument("--source", help="a wheel's path or a pip requirement (default: the wheel this runs from)")
    parser.add_argument("--dry-run", action="store_true", help="print the pip commands instead of running them")
    args = parser.parse_args(argv)
    try:
        install(args.source, dry_run=args.dry_run)
    except InstallError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


def _installed(name: str) -> importlib.metadata.Distribution | None:
    """The installed distribution `name`, or None. The wheel this runs from is on sys.path with its own metadata,
    which importlib.metadata would find too: it is not installed, so it is left out.
    """
    archive = _running_archive()
    path = [entry for entry in sys.path if entry != archive]
    return next(iter(importlib.metadata.distributions(name=name, path=path)), None)


def _version(name: str) -> str | None:
    installed = _installed(name)
    return None if installed is None else installed.version


def _running_archive() -> str | None:
    """The wheel (zip archive) this module was imported from, or None."""
    loader = globals().get("__loader__")
    return loader.archive if isinstance(loader, zipimport.zipimporter) else None


def _pip(step: Step, host: str) -> None:
    """Run `step` with this interpreter's pip (unlike %pip, a failure stops here, with pip's own words)."""
    with tempfile.TemporaryDirectory(prefix="nbkit-bootstrap-") as folder:
        args = list(step.args)
        if step.hold:
            held = os.path.join(folder, "held.txt")
            with open(held, "w") as pins:
                pins.writelines(f"{name}=={version}\n" for name in HELD if (version := _version(name)))
            args[1:1] = ["-c", held]
        done = subprocess.run([sys.executable, "-m", "pip", *args, "-q"], capture_output=True, text=True)
    if done.returncode:
        hint = " On Kaggle, pip needs Settings > Internet on (a phone-verified account)." if host == "kaggle" else ""
        raise InstallError(
            f"pip {' '.join(step.args)} failed (exit {done.returncode}).{hint}\n{done.stdout}{done.stderr}".rstrip()
        )
    importlib.invalidate_caches()  # the next import looks at site-packages again


def _forget(archive: str) -> None:
    """Take the wheel off sys.path and nbkit's modules (all loaded from it) out of this process, so that the next
    `import nbkit` finds the installed copy.
    """
    sys.path[:] = [entry for entry in sys.path if entry != archive]
    sys.path_importer_cache.pop(archive, None)
    for name in [name for name in sys.modules if name == "nbkit" or name.startswith("nbkit.")]:
        del sys.modules[name]


if __name__ == "__main__":
    sys.exit(main())
