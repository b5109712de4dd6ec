"""What splits the suite between the two sets CI tests on: the libraries pinned to different versions there, and
the record of their imports that tests/conftest.py checks `version_independent` tests against (see the marker in
pyproject.toml)."""

from __future__ import annotations

from importlib.metadata import packages_distributions
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECORDER = Path(__file__).resolve().parent / "versioned_imports"  # its sitecustomize.py, first on PYTHONPATH


def _pins(path: Path) -> dict[str, str]:
    """{normalized distribution name: version} of a constraints file's `name==version` lines."""
    pins = {}
    for line in path.read_text().splitlines():
        name, sep, version = line.split("#", 1)[0].partition("==")
        if sep:
            pins[name.strip().lower().replace("-", "_")] = version.strip()
    return pins


def versioned_modules() -> frozenset[str]:
    """The top-level modules of the libraries pinned to different versions in the newest and the oldest set:
    what a test must not import to run on one set only (the two sets share the rest: torch, the notebook stack)."""
    newest, oldest = _pins(REPO / "constraints.txt"), _pins(REPO / "constraints-oldest.txt")
    differ = {name for name in newest.keys() & oldest.keys() if newest[name] != oldest[name]}
    modules = {
        module
        for module, dists in packages_distributions().items()
        if any(d.lower().replace("-", "_") in differ for d in dists)
    }
    return frozenset(modules | differ)


# What every rank of a live set imports at its start, whichever test it runs: the hub's switch for its progress
# bars (huggingface_hub.utils.disable_progress_bars, nothing else of the library). The live-set tests that run on
# both sets (test_live_notebook.py, test_fsdp_live.py, faults/test_live_stop.py) run it on the oldest set too.
START_UP_IMPORTERS = frozenset({"nbkit.rank_side.reporting._progress_bars_off"})


class Record:
    """The file the processes of a module's tests note their imports of versioned modules in, read test by test."""

    def __init__(self, path: Path, names: frozenset[str]):
        self.path, self.names, self.read = path, names, 0

    def since_last(self) -> list[str]:
        with open(self.path) as f:
            f.seek(self.read)
            text = f.read()
            self.read = f.tell()
        return sorted({line for line in text.splitlines() if not self._expected(line)})

    def _expected(self, line: str) -> bool:
        """An import by nbkit's start-up of a rank, or by a versioned library (following one already judged)."""
        importer = line.split()[1]
        return importer in START_UP_IMPORTERS or importer.split(".", 1)[0] in self.names
