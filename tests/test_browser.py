"""The dashboard as a person sees it: a real browser on a real Jupyter server.

Three front ends run headless on 127.0.0.1 with a token: JupyterLab 4.6 and Notebook 7.6, and the
classic Notebook 6.5 with ipywidgets 7.7 in the kernel (what Colab ships; Colab's own front end cannot
run here). Headless Chromium (Debian's `chromium`, driven by Playwright through `executable_path`)
opens a flagship-style notebook and runs it all: `%load_ext nbkit`, a one-shot `%%ddp --gpus 2`
cell training tiny:qwen3 with TRL's SFTTrainer for 20 steps on 2 gloo CPU ranks (logging_steps=1),
then the same training on a live set (`%ddp start --gpus 2`, a `%%ddp` cell, `%ddp stop`) in the
same kernel, and a few nbkit.report() calls with NBKIT_DASHBOARD=widget. Everything checked is read
from the page, for each training cell: while it trains the panel shows progress, loss and a row per
rank (both rows from the first frame on, no broken image, no Trainer log lines piling up under it,
nothing hidden in a scroll box); after it, the static summary with the last step; after save +
reload, the same summary. One server, one kernel and one run of the notebook per front end.

Screenshots are kept: under $NBKIT_BROWSER_ARTIFACTS when set (CI uploads that directory), else in
pytest's tmp directory; the path is printed (`pytest -s` shows it).

Needs chromium and the Python packages playwright, jupyterlab and notebook (the `browser` extra),
and for the classic front end the environment `make browser-setup` makes in .venv-classic
(NBKIT_CLASSIC_ENV names another); a machine without them fails with what to install, so CI cannot
skip this silently.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

STEPS = 20  # each training cell's


def _train_cell(magic: str, steps: int) -> str:
    """A flagship-style training cell: TRL's SFTTrainer on tiny:qwen3 with LoRA, logging every step."""
    return f"""{magic}
import time

from datasets import Dataset
from peft import LoraConfig
from transformers import AutoTokenizer, TrainerCallback
from trl import SFTConfig, SFTTrainer


class PacedSteps(TrainerCallback):
    # tiny:qwen3 takes a few ms per step on a CPU; a GPU step of a real model takes ~0.3-1 s.
    # Pacing the steps keeps the panel live long enough to be watched, as on a GPU.
    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(0.25)


path = nbkit.resolve_model(model_name)
trainer = SFTTrainer(
    model=path,
    args=SFTConfig(output_dir="out", max_steps={steps}, per_device_train_batch_size=2, learning_rate=5e-3,
                   logging_steps=1, save_strategy="no", report_to=[], max_length=64, seed=0,
                   bf16=False),
    processing_class=AutoTokenizer.from_pretrained(path),
    train_dataset=Dataset.from_list(nbkit.text_dataset(256)),
    peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
    callbacks=[PacedSteps()],
)
result = trainer.train()
{{"global_step": trainer.state.global_step, "training_loss": result.training_loss,
  "peak_memory_gib": nbkit.peak_memory_gib()}}"""


# The cells' indexes, in the order Run All runs them.
ONE_SHOT, PEAK, LIVE, WIDGETS = 1, 2, 4, 6
WIDGET_STEPS = 3
CELLS = [
    # transformers imported in the notebook before training, as the flagship's `%nbkit plan` does
    "%load_ext nbkit\nimport nbkit\nimport transformers\n\nmodel_name = 'tiny:qwen3'",
    _train_cell("%%ddp --gpus 2 --out train_result", STEPS),
    "print('peak memory (GiB):', train_result['peak_memory_gib'])",
    # the same training on a live set, in the same kernel: gloo CPU ranks in ipyparallel engines
    "%ddp start --gpus 2",
    _train_cell("%%ddp --out live_result", STEPS),
    "%ddp stop",
    # NBKIT_DASHBOARD=widget: ipywidgets 8's panel (Lab, Notebook 7); with ipywidgets 7, a notice and the HTML panel
    f"%env NBKIT_DASHBOARD=widget\nimport time\n\nfor step in range(1, {WIDGET_STEPS + 1}):\n"
    f"    nbkit.report(step=step, loss=1.0 / step, total_steps={WIDGET_STEPS})\n    time.sleep(0.3)",
]


# --------------------------------------------------------------------------------------------
# The tools: chromium, the front ends, a Jupyter server, a page
# --------------------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Frontend:
    """How to start one front end's server and read its page (CSS selectors of its DOM)."""

    server: str  # the console script a person runs (`jupyter lab` execs jupyter-lab)
    url: str  # a notebook's page, {} for its name
    options: tuple[str, ...]  # the server's token and root folder options, {token} and {root} filled in
    cell: str
    prompt: str  # a cell's execution count, [*] while it runs
    output: str  # one cell's outputs
    text: str  # a stream output's text
    stderr: str
    scrolled: str  # an output area cut to a scroll box
    ready: str  # JS: the notebook is open and its kernel idle
    saved: str  # JS: no unsaved changes
    classic: bool = False


_JUPYTERLAB_DOM = dict(
    options=("--IdentityProvider.token={token}", "--ServerApp.root_dir={root}"),
    cell=".jp-Notebook .jp-Cell",
    prompt=".jp-InputPrompt",
    output=".jp-OutputArea",
    text=".jp-RenderedText",
    stderr='[data-mime-type="application/vnd.jupyter.stderr"]',
    scrolled=".jp-mod-outputsScrolled, .jp-OutputArea-scrolled",
    # the kernel is idle once its status says so (Lab: the toolbar indicator; both: no busy cell)
    ready="() => document.querySelector('.jp-Notebook') && "
    "!document.querySelector('.jp-Notebook-ExecutionIndicator[data-status=\"busy\"]')",
    saved="() => !document.title.startsWith('*') && !document.querySelector('.jp-mod-dirty')",
)

FRONTENDS = {
    "lab": Frontend(server="jupyter-lab", url="/lab/tree/{}", **_JUPYTERLAB_DOM),
    "notebook": Frontend(server="jupyter-notebook", url="/notebooks/{}", **_JUPYTERLAB_DOM),
    "classic": Frontend(
        server="jupyter-notebook",
        url="/notebooks/{}",
        options=("--NotebookApp.token={token}", "--notebook-dir={root}"),
        cell="#notebook-container .cell",
        prompt=".input_prompt",
        output=".output_wrapper",
        text=".output_text",
        stderr=".output_stderr",
        scrolled=".output_scroll",
        ready="() => window.Jupyter && Jupyter.notebook && Jupyter.notebook.kernel && "
        "Jupyter.notebook.kernel.is_connected() && !document.querySelector('.cell.running')",
        saved="() => window.Jupyter && !Jupyter.notebook.dirty",
        classic=True,
    ),
}


def _chromium() -> str:
    path = os.environ.get("NBKIT_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail("No chromium found: install it (Debian: apt-get install -y chromium) or set NBKIT_CHROMIUM.")
    return path


def _classic_env() -> Path:
    """The environment of the classic Notebook 6.5 and its kernel with ipywidgets 7.7 (Makefile: browser-setup)."""
    path = Path(os.environ.get("NBKIT_CLASSIC_ENV") or REPO / ".venv-classic")
    if not (path / "bin" / "jupyter-notebook").is_file():
        pytest.fail(
            f"No classic Notebook environment at {path}: `make browser-setup` makes it (or set NBKIT_CLASSIC_ENV)."
        )
    return path


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail('The browser test needs playwright: pip install -c constraints.txt -e ".[browser]"')
    with sync_playwright() as pw:
        # --no-sandbox: CI containers run as root, where Chromium's sandbox refuses to start.
        chromium = pw.chromium.launch(executable_path=_chromium(), headless=True, args=["--no-sandbox"])
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = os.environ.get("NBKIT_BROWSER_ARTIFACTS")
    path = Path(root) if root else tmp_path_factory.mktemp("browser-screenshots")
    path.mkdir(parents=True, exist_ok=True)
    print(f"\nbrowser test screenshots: {path}")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _classic_kernel(env: Path, home: Path) -> str:
    """A kernel on the classic environment's interpreter (its ipywidgets 7.7 and ipykernel 6), in `home`'s
    kernels folder; returns its name."""
    name = "nbkit-classic-python"
    spec = home / "kernels" / name
    spec.mkdir(parents=True, exist_ok=True)
    argv = [str(env / "bin" / "python"), "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": name, "language": "python"}))
    return name


@contextlib.contextmanager
def _jupyter(front: Frontend, root: Path, kernel_name: str, bin_dir: Path) -> Iterator[tuple[str, str]]:
    """A Jupyter server of `front` (its console script in `bin_dir`) on 127.0.0.1 serving `root`; yields
    (base URL, token)."""
    port, token = _free_port(), secrets.token_hex(16)
    home = root.parent / "jupyter-home"
    env = {
        **os.environ,
        # its own settings, workspaces and runtime files: nothing read from or left in the user's
        "JUPYTER_CONFIG_DIR": str(home / "config"),
        "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
        "JUPYTER_PATH": os.pathsep.join(filter(None, [str(home), os.environ.get("JUPYTER_PATH")])),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "NBKIT_DASHBOARD_INTERVAL": "10",
    }
    env.pop("NBKIT_DASHBOARD", None)  # the default choice is what is tested
    # no "Would you like to get notified about official Jupyter news?" toast over the page
    settings = home / "config" / "lab" / "user-settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True, exist_ok=True)
    (settings / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false"}))
    log = (home / "server.log").open("w")
    options = [option.format(token=token, root=root) for option in front.options]
    server = subprocess.Popen(
        [str(bin_dir / front.server), "--no-browser", "--allow-root", "--ip=127.0.0.1", f"--port={port}", *options]
        # --allow-root: CI containers run as root
        + [f"--MultiKernelManager.default_kernel_name={kernel_name}"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5):
                    break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{front.server} did not start: {(home / 'server.log').read_text()}") from None
                time.sleep(0.5)
        yield base, token
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


def _write_notebook(path: Path, kernel_name: str) -> None:
    nb = {
        "cells": [
            {
                "cell_type": "code",
                "execution_count": None,
                "id": f"cell-{i}",
                "metadata": {},
                "outputs": [],
                "source": c,
            }
            for i, c in enumerate(CELLS)
        ],
        "metadata": {
            "kernelspec": {"display_name": "nbkit test", "language": "python", "name": kernel_name},
            "language_info": {"name": "python"},
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    path.write_text(json.dumps(nb, indent=1))


def _shot(page, artifacts: Path, name: str, output=None) -> None:
    """The page as it stands, and a cell's output (scrolled into view) on its own."""
    page.screenshot(path=str(artifacts / f"{name}.png"))
    if output is not None and output.count():
        output.screenshot(path=str(artifacts / f"{name}-output.png"))


def _open(page, front: Frontend, url: str) -> None:
    page.goto(url)
    page.locator(front.cell).first.wait_for(timeout=120_000)
    page.wait_for_function(front.ready, timeout=120_000)
    time.sleep(2)  # the kernel connection settles (Notebook 7 starts the kernel on open)


def _run_all(page, front: Frontend) -> None:
    if front.classic:
        page.locator("#celllink").click()
        page.locator("#run_all_cells").click()
        return
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name=re.compile(r"^Run All Cells")).click()


def _output(page, front: Frontend, cell: int):
    return page.locator(front.cell).nth(cell).locator(front.output)


def _frame(output, front: Frontend) -> dict:
    """What a training cell's output shows right now, read from the page."""
    return output.evaluate(
        """(area, dom) => {
          const panel = area.querySelector('.nbkit-panel');
          const summary = area.querySelector('.nbkit-summary');
          const shown = panel || summary;
          const rows = shown ? [...shown.querySelectorAll('table.nbkit-ranks tr')].slice(1)
                                 .map(tr => [...tr.cells].map(td => td.innerText.trim())) : [];
          const progress = shown ? shown.querySelector('progress') : null;
          const images = shown ? [...shown.querySelectorAll('img')] : [];
          const streams = [...area.querySelectorAll(dom.text)].map(e => e.innerText).join('\\n');
          const box = shown ? shown.getBoundingClientRect() : null;
          return {
            kind: panel ? 'panel' : (summary ? 'summary' : 'none'),
            text: shown ? shown.innerText : '',
            rows: rows,
            progress: progress ? [progress.value, progress.max] : null,
            images: images.map(i => [i.complete, i.naturalWidth]),
            streams: streams,
            scrolled: !!(area.closest(dom.scrolled) || area.querySelector(dom.scrolled)),
            loadingWidget: area.innerText.includes('Loading widget'),
            failed: [...area.querySelectorAll(dom.stderr)].some(e => e.innerText.includes('Traceback')),
            height: box ? box.height : 0,
          };
        }""",
        {"text": front.text, "scrolled": front.scrolled, "stderr": front.stderr},
    )


def _watch(page, front: Frontend, cell: int, shots: Path, name: str) -> tuple[list[dict], dict]:
    """The frames a training cell showed while its panel was live, and the one it ended with."""
    output = _output(page, front, cell)
    live: list[dict] = []
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        frame = _frame(output, front)
        if frame["kind"] == "panel":
            live.append(frame)
            if len(live) in (1, 5) or len(live) % 20 == 0:
                _shot(page, shots, f"{name}-1-live-{len(live):03d}", output)
        if frame["kind"] == "summary" or frame["failed"]:
            break
        if frame["kind"] == "none" and re.search(
            r"\[\d+\]", page.locator(front.cell).nth(cell).locator(front.prompt).inner_text()
        ):
            break  # the cell ran without a panel
        time.sleep(0.2)
    final = _frame(output, front)
    _shot(page, shots, f"{name}-2-summary", output)
    assert final["kind"] == "summary", f"{name}: no summary; last frame: {final}"
    return live, final


def _check_run(live: list[dict], final: dict, steps: int) -> None:
    """What a person relies on in a training cell of 2 ranks: the live panel, then the summary."""
    # While it trained: progress, loss and a row per rank, from the first frame on.
    assert len(live) >= 5, f"the live panel was seen in only {len(live)} frames"
    assert all(len(f["rows"]) == 2 and [r[0] for r in f["rows"]] == ["0", "1"] for f in live), live[0]["rows"]
    progress = [f["progress"][0] for f in live if f["progress"]]
    assert progress and progress[-1] > progress[0] and all(f["progress"][1] == steps for f in live if f["progress"])
    assert any(re.search(r"loss \d+\.\d{4}", f["text"]) for f in live)
    assert any(re.search(r"[\d,]+ tokens/s", f["text"]) for f in live)
    assert any(all(re.fullmatch(r"\d+\.\d\d GiB \(cpu RSS\)", r[4]) for r in f["rows"]) for f in live)
    for f in live:  # an image is there only once it has a curve: never a broken one
        assert all(complete and width > 0 for complete, width in f["images"]), f["images"]
        assert not f["loadingWidget"] and not f["scrolled"]
        assert "{'loss'" not in f["streams"]  # no Trainer log lines under the panel
        assert f["streams"].count("PAD/BOS/EOS") <= 1  # transformers' notice from rank 0 only

    # After: the static summary, with the last step.
    assert not final["scrolled"] and not final["loadingWidget"]
    assert final["progress"] == [steps, steps]
    assert f"steps\t{steps} / {steps}" in final["text"] and "final loss" in final["text"]
    assert "peak memory, rank 1" in final["text"]
    assert [r[0] for r in final["rows"]] == ["0", "1"] and all(r[1] == str(steps) for r in final["rows"])
    assert final["images"] and all(complete and width > 0 for complete, width in final["images"])
    assert "{'loss'" not in final["streams"]


def _check_widget_mode(page, front: Frontend) -> None:
    """The cell run with NBKIT_DASHBOARD=widget ends as the summary; with ipywidgets 7 nbkit said why it showed HTML."""
    output = _output(page, front, WIDGETS)
    output.locator(".nbkit-summary").wait_for(timeout=60_000)
    frame = _frame(output, front)
    assert f"steps\t{WIDGET_STEPS} / {WIDGET_STEPS}" in frame["text"] and not frame["loadingWidget"]
    notice = "NBKIT_DASHBOARD=widget needs ipywidgets 8 or later (this kernel has 7.7.1)"
    assert (notice in frame["streams"]) == front.classic, frame["streams"]


def _check_saved_and_reloaded(page, front: Frontend, notebook: Path, shots: Path) -> None:
    """Save, reload: each summary is still there, readable, without a kernel or widget state."""
    page.keyboard.press("Control+s")
    page.wait_for_function(front.saved, timeout=30_000)
    time.sleep(1)
    saved = json.loads(notebook.read_text())
    steps_of = {ONE_SHOT: STEPS, LIVE: STEPS, WIDGETS: WIDGET_STEPS}
    for cell in steps_of:
        outputs = saved["cells"][cell]["outputs"]
        assert any("nbkit-summary" in "".join(o.get("data", {}).get("text/html", "")) for o in outputs), cell
    page.reload()
    page.locator(front.cell).first.wait_for(timeout=120_000)
    for cell, steps in steps_of.items():
        output = _output(page, front, cell)
        output.locator(".nbkit-summary").wait_for(timeout=60_000)
        reloaded = _frame(output, front)
        _shot(page, shots, f"3-reloaded-{cell}", output)
        assert reloaded["kind"] == "summary" and "final loss" in reloaded["text"]
        assert not reloaded["loadingWidget"]  # no widget from the ranks left behind in the saved notebook
        assert f"steps\t{steps} / {steps}" in reloaded["text"]
        assert reloaded["images"] and all(complete and width > 0 for complete, width in reloaded["images"])


# --------------------------------------------------------------------------------------------
# The test: one server, one kernel and one run of the notebook per front end
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("app", ["lab", "notebook", "classic"])
def test_the_dashboard_in_a_real_browser(app, browser, artifacts, kernel_name, nbkit_cache, tmp_path, tiny_text_path):
    front = FRONTENDS[app]
    root = tmp_path / "root"
    root.mkdir()
    bin_dir = Path(sys.executable).parent
    if front.classic:
        env = _classic_env()
        kernel_name, bin_dir = _classic_kernel(env, tmp_path / "jupyter-home"), env / "bin"
    _write_notebook(root / "flagship.ipynb", kernel_name)
    shots = artifacts / app
    shots.mkdir(exist_ok=True)
    with _jupyter(front, root, kernel_name, bin_dir) as (base, token):
        page = browser.new_page(viewport={"width": 1280, "height": 1400})
        _open(page, front, f"{base}{front.url.format('flagship.ipynb')}?token={token}")
        _shot(page, shots, "0-opened")
        _run_all(page, front)

        _check_run(*_watch(page, front, ONE_SHOT, shots, "one-shot"), steps=STEPS)
        peak = _output(page, front, PEAK)
        peak.get_by_text("peak memory (GiB):").wait_for(timeout=60_000)
        assert float(peak.inner_text().split(":")[1]) > 0  # the same measure the panel shows (process RSS on a CPU)

        _check_run(*_watch(page, front, LIVE, shots, "live"), steps=STEPS)
        _output(page, front, LIVE + 1).get_by_text("stopped the live set").wait_for(timeout=60_000)
        _check_widget_mode(page, front)

        _check_saved_and_reloaded(page, front, root / "flagship.ipynb", shots)
        page.close()
