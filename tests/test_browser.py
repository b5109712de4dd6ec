"""The dashboard as a person sees it: a real browser on a real Jupyter server.

JupyterLab 4.6 and Notebook 7.6 run headless on 127.0.0.1 with a token; headless Chromium
(Debian's `chromium`, driven by Playwright through `executable_path`) opens a flagship-style
notebook (`%load_ext nbkit`, then a `%%ddp --gpus 2` cell training tiny:qwen3 with TRL's SFTTrainer
for 40 steps on 2 gloo CPU ranks, logging_steps=1) and runs it. Everything checked is read from the
page: while it trains the panel shows progress, loss and a row per rank (both rows from the first
frame on, no broken image, no Trainer log lines piling up under it, nothing hidden in a scroll
box); after it, the static summary with the last step; after save + reload, the same summary.

Screenshots are kept: under $NBKIT_BROWSER_ARTIFACTS when set (CI uploads that directory), else in
pytest's tmp directory; the path is printed (`pytest -s` shows it).

Needs chromium and the Python packages playwright, jupyterlab and notebook (the `browser` extra);
a machine without them fails with what to install, so CI cannot skip this silently.
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
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

STEPS = 40

TRAIN_CELL = f"""%%ddp --gpus 2 --out train_result
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
    args=SFTConfig(output_dir="out", max_steps={STEPS}, per_device_train_batch_size=2, learning_rate=5e-3,
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

CELLS = [
    # transformers imported in the notebook before training, as the flagship's `%nbkit plan` does
    "%load_ext nbkit\nimport nbkit\nimport transformers\n\nmodel_name = 'tiny:qwen3'",
    TRAIN_CELL,
    "print('peak memory (GiB):', train_result['peak_memory_gib'])",
]


# --------------------------------------------------------------------------------------------
# The tools: chromium, a Jupyter server, a page
# --------------------------------------------------------------------------------------------


def _chromium() -> str:
    path = os.environ.get("NBKIT_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail("No chromium found: install it (Debian: apt-get install -y chromium) or set NBKIT_CHROMIUM.")
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


@contextlib.contextmanager
def _jupyter(app: str, root: Path, kernel_name: str) -> Iterator[tuple[str, str]]:
    """A Jupyter server (app "lab" or "notebook") on 127.0.0.1 serving `root`; yields (base URL, token)."""
    port, token = _free_port(), secrets.token_hex(16)
    home = root.parent / f"{app}-home"
    env = {
        **os.environ,
        # its own settings, workspaces and runtime files: nothing read from or left in the user's
        "JUPYTER_CONFIG_DIR": str(home / "config"),
        "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH")])),
        "NBKIT_DASHBOARD_INTERVAL": "10",
    }
    env.pop("NBKIT_DASHBOARD", None)  # the default choice is what is tested
    # no "Would you like to get notified about official Jupyter news?" toast over the page
    settings = home / "config" / "lab" / "user-settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True, exist_ok=True)
    (settings / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false"}))
    log = (home / "server.log").open("w")
    server = subprocess.Popen(
        [
            # the console scripts a person runs (`jupyter lab` execs jupyter-lab)
            str(Path(sys.executable).parent / ("jupyter-lab" if app == "lab" else "jupyter-notebook")),
            "--no-browser",
            "--allow-root",  # CI containers run as root
            "--ip=127.0.0.1",
            f"--port={port}",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={root}",
            f"--MultiKernelManager.default_kernel_name={kernel_name}",
        ],
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
                    raise RuntimeError(f"jupyter {app} did not start: {(home / 'server.log').read_text()}") from None
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
    """The page as it stands, and the training cell's output (scrolled into view) on its own."""
    page.screenshot(path=str(artifacts / f"{name}.png"))
    if output is not None and output.count():
        output.screenshot(path=str(artifacts / f"{name}-output.png"))


def _run_all(page) -> None:
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name=re.compile(r"^Run All Cells")).click()


def _train_output(page):
    return page.locator(".jp-Cell").nth(1).locator(".jp-OutputArea")


def _frame(output) -> dict:
    """What the training cell's output shows right now, read from the page."""
    return output.evaluate(
        """area => {
          const panel = area.querySelector('.nbkit-panel');
          const summary = area.querySelector('.nbkit-summary');
          const shown = panel || summary;
          const rows = shown ? [...shown.querySelectorAll('table.nbkit-ranks tr')].slice(1)
                                 .map(tr => [...tr.cells].map(td => td.innerText.trim())) : [];
          const progress = shown ? shown.querySelector('progress') : null;
          const images = shown ? [...shown.querySelectorAll('img')] : [];
          const streams = [...area.querySelectorAll('.jp-RenderedText')].map(e => e.innerText).join('\\n');
          const box = shown ? shown.getBoundingClientRect() : null;
          return {
            kind: panel ? 'panel' : (summary ? 'summary' : 'none'),
            text: shown ? shown.innerText : '',
            rows: rows,
            progress: progress ? [progress.value, progress.max] : null,
            images: images.map(i => [i.complete, i.naturalWidth]),
            streams: streams,
            scrolled: !!area.closest('.jp-mod-outputsScrolled, .jp-OutputArea-scrolled'),
            loadingWidget: area.innerText.includes('Loading widget'),
            failed: [...area.querySelectorAll('[data-mime-type="application/vnd.jupyter.stderr"]')]
                      .some(e => e.innerText.includes('Traceback')),
            height: box ? box.height : 0,
          };
        }"""
    )


# --------------------------------------------------------------------------------------------
# The test: one run per frontend
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("app", ["lab", "notebook"])
def test_the_dashboard_in_a_real_browser(app, browser, artifacts, kernel_name, nbkit_cache, tmp_path, tiny_text_path):
    root = tmp_path / "root"
    root.mkdir()
    _write_notebook(root / "flagship.ipynb", kernel_name)
    shots = artifacts / app
    shots.mkdir(exist_ok=True)
    with _jupyter(app, root, kernel_name) as (base, token):
        page = browser.new_page(viewport={"width": 1280, "height": 1400})
        url = f"{base}/lab/tree/flagship.ipynb" if app == "lab" else f"{base}/notebooks/flagship.ipynb"
        page.goto(f"{url}?token={token}")
        page.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=120_000)
        # the kernel is idle once its status says so (Lab: the toolbar indicator; both: no busy cell)
        page.wait_for_function(
            "() => document.querySelector('.jp-Notebook') && "
            "!document.querySelector('.jp-Notebook-ExecutionIndicator[data-status=\"busy\"]')",
            timeout=120_000,
        )
        time.sleep(2)  # the kernel connection settles (Notebook 7 starts the kernel on open)
        _shot(page, shots, "0-opened")
        _run_all(page)

        output = _train_output(page)
        live: list[dict] = []
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            frame = _frame(output)
            if frame["kind"] == "panel":
                live.append(frame)
                if len(live) in (1, 5) or len(live) % 20 == 0:
                    _shot(page, shots, f"1-live-{len(live):03d}", output)
            if frame["kind"] == "summary" or frame["failed"]:
                break
            time.sleep(0.2)
        final = _frame(output)
        _shot(page, shots, "2-summary", output)
        assert final["kind"] == "summary", f"no summary (within 10 minutes); last frame: {final}"

        # While it trained: progress, loss and a row per rank, from the first frame on.
        assert len(live) >= 5, f"the live panel was seen in only {len(live)} frames"
        assert all(len(f["rows"]) == 2 and [r[0] for r in f["rows"]] == ["0", "1"] for f in live), live[0]["rows"]
        steps = [f["progress"][0] for f in live if f["progress"]]
        assert steps and steps[-1] > steps[0] and all(f["progress"][1] == STEPS for f in live if f["progress"])
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
        assert final["progress"] == [STEPS, STEPS]
        assert f"steps\t{STEPS} / {STEPS}" in final["text"] and "final loss" in final["text"]
        assert "peak memory, rank 1" in final["text"]
        assert [r[0] for r in final["rows"]] == ["0", "1"] and all(r[1] == str(STEPS) for r in final["rows"])
        assert final["images"] and all(complete and width > 0 for complete, width in final["images"])
        assert "{'loss'" not in final["streams"]
        page.locator(".jp-Cell").nth(2).locator(".jp-OutputArea").get_by_text("peak memory (GiB):").wait_for(
            timeout=60_000
        )
        peak = float(page.locator(".jp-Cell").nth(2).locator(".jp-OutputArea").inner_text().split(":")[1])
        assert peak > 0  # the same measure the panel shows (process RSS on a CPU), not None

        # Save, reload: the summary is still there, readable, without a kernel or widget state.
        page.keyboard.press("Control+s")
        page.wait_for_function(
            "() => !document.title.startsWith('*') && !document.querySelector('.jp-mod-dirty')", timeout=30_000
        )
        time.sleep(1)
        saved = json.loads((root / "flagship.ipynb").read_text())
        outputs = saved["cells"][1]["outputs"]
        assert any("nbkit-summary" in "".join(o.get("data", {}).get("text/html", "")) for o in outputs)
        page.reload()
        page.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=120_000)
        output = _train_output(page)
        output.locator(".nbkit-summary").wait_for(timeout=60_000)
        reloaded = _frame(output)
        _shot(page, shots, "3-reloaded", output)
        assert reloaded["kind"] == "summary" and "final loss" in reloaded["text"]
        assert not reloaded["loadingWidget"]  # no widget from the ranks left behind in the saved notebook
        assert f"steps\t{STEPS} / {STEPS}" in reloaded["text"]
        assert reloaded["images"] and all(complete and width > 0 for complete, width in reloaded["images"])
        page.close()
