"""nbkit.platform.host: each host and frontend recognised from the marks it leaves (environment
variables, the execution request's cell id, the parent processes, Kaggle's input folder), and the
same answer from inside a real Jupyter kernel."""

from __future__ import annotations

import pytest
from kernel_cells import run_cells

from nbkit.platform import host
from nbkit.platform.host import Platform, detect

_PLATFORM_VARIABLES = (
    "KAGGLE_KERNEL_RUN_TYPE",
    "KAGGLE_URL_BASE",
    "COLAB_RELEASE_TAG",
    "COLAB_GPU",
    "JPY_SESSION_NAME",
    "VSCODE_PID",
)


class _Kernel:
    """What nbkit reads of ipykernel's kernel: the request being executed."""

    def __init__(self, metadata: dict) -> None:
        self.request = {"header": {"msg_type": "execute_request"}, "metadata": metadata}

    def get_parent(self) -> dict:
        return self.request


class _KernelShell:
    """The part of ipykernel's ZMQInteractiveShell that nbkit reads: its kernel."""

    def __init__(self, metadata: dict | None = None) -> None:
        self.kernel = _Kernel(metadata or {})


@pytest.mark.version_independent
@pytest.mark.parametrize(
    ("environ", "expected", "description"),
    [
        ({"KAGGLE_KERNEL_RUN_TYPE": "Interactive"}, Platform("kaggle", "kaggle"), "Kaggle (interactive session)"),
        (
            {"KAGGLE_KERNEL_RUN_TYPE": "Batch"},
            Platform("kaggle", "kaggle", batch=True),
            "Kaggle (batch run: Save & Run All)",
        ),
        ({"KAGGLE_URL_BASE": "https://www.kaggle.com"}, Platform("kaggle", "kaggle"), "Kaggle (interactive session)"),
        ({"COLAB_RELEASE_TAG": "release-colab_20261120"}, Platform("colab", "colab"), "Colab"),
        ({"COLAB_GPU": "1"}, Platform("colab", "colab"), "Colab"),
        ({"VSCODE_PID": "4242"}, Platform("local", "vscode"), "local (Jupyter kernel), shown in VS Code"),
        (
            {"JPY_SESSION_NAME": "/home/me/train.ipynb"},
            Platform("local", "jupyter"),
            "local (Jupyter kernel), shown in JupyterLab/Notebook",
        ),
        # A Jupyter server started from VS Code's terminal: the kernel is the server's, not VS Code's.
        ({"JPY_SESSION_NAME": "train.ipynb", "VSCODE_PID": "4242"}, Platform("local", "jupyter"), None),
        ({}, Platform("local", "kernel"), "local (Jupyter kernel)"),
    ],
)
def test_each_platform_is_recognised_from_its_environment(environ, expected, description):
    found = detect(environ, _KernelShell(), ancestors=["/usr/bin/python -m ipykernel_launcher -f k.json"])
    assert found == expected
    if description is not None:
        assert found.description == description
    assert found.watched == (expected.frontend != "kernel" and not expected.batch)


@pytest.mark.version_independent
def test_the_frontend_is_recognised_from_the_cell_id_it_sends():
    vscode = _KernelShell({"cellId": "vscode-notebook-cell:/home/me/train.ipynb#W1sZmlsZQ%3D%3D"})
    assert detect({}, vscode, ancestors=[]) == Platform("local", "vscode")
    lab = _KernelShell({"cellId": "0b8a6f0e-3c2d-4e55-9d0a-2f6c1d7e9a10"})
    assert detect({}, lab, ancestors=[]) == Platform("local", "jupyter")


@pytest.mark.version_independent
def test_a_kernel_a_jupyter_server_started_is_watched_whatever_started_the_server():
    # The classic Notebook 6.5 (Colab's notebook package) sets no JPY_SESSION_NAME and sends no cell id: its
    # server, the kernel's parent, is the mark. What started the server (here a test) is not looked at.
    server = "/env/bin/python /env/bin/jupyter-notebook --no-browser --notebook-dir=/tmp/pytest-of-me/root"
    assert detect({}, _KernelShell(), ancestors=[server]) == Platform("local", "jupyter")
    assert detect({"VSCODE_PID": "4242"}, _KernelShell(), ancestors=[server]) == Platform("local", "jupyter")
    assert detect({}, _KernelShell(), ancestors=["bash", "papermill nb.ipynb out.ipynb"]).frontend == "headless"


@pytest.mark.version_independent
def test_headless_runners_are_never_watched_even_with_a_cell_id():
    shell = _KernelShell({"cellId": "0b8a6f0e"})
    for runner in ("papermill nb.ipynb out.ipynb", "/usr/bin/python -m pytest -q", "jupyter-nbconvert --execute x"):
        found = detect({"JPY_SESSION_NAME": "x.ipynb"}, shell, ancestors=["bash", runner])
        assert found == Platform("local", "headless") and not found.watched


@pytest.mark.version_independent
def test_no_kernel_means_a_script_or_terminal_ipython_whatever_the_host():
    from IPython.core.interactiveshell import InteractiveShell

    assert detect({}, None) == Platform("local", "script")
    assert detect({"KAGGLE_KERNEL_RUN_TYPE": "Interactive"}, None) == Platform("kaggle", "script")
    assert detect({"COLAB_GPU": "0"}, None).description == "Colab"
    shell = InteractiveShell.instance()
    try:
        assert detect({}, shell) == Platform("local", "ipython")
        assert detect({}, shell).description == "local (IPython)"
    finally:
        InteractiveShell.clear_instance()
    assert not any(detect(env, None).watched for env in ({}, {"COLAB_GPU": "0"}, {"KAGGLE_URL_BASE": "x"}))


@pytest.mark.version_independent
def test_kaggle_input_only_on_kaggle_and_only_where_the_folder_exists(tmp_path, monkeypatch):
    for name in _PLATFORM_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(host, "KAGGLE_INPUT", tmp_path / "input")
    assert host.current() == Platform("local", "script")  # pytest: no IPython shell
    assert host.kaggle_input() is None
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")
    assert host.kaggle_input() is None  # no input attached: no folder
    (tmp_path / "input").mkdir()
    assert host.kaggle_input() == tmp_path / "input"


@pytest.mark.version_independent
def test_in_a_real_kernel_under_a_headless_runner_and_on_kaggle(kernel_name, tmp_path, monkeypatch):
    for name in _PLATFORM_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    outputs = run_cells(
        {
            "here": "import nbkit.platform.host, nbkit.dashboard\n"
            "print(nbkit.platform.host.current(), nbkit.dashboard.display_mode())",
            "kaggle": "%env KAGGLE_KERNEL_RUN_TYPE=Interactive\n"
            "print(nbkit.platform.host.current(), nbkit.dashboard.display_mode())",
        },
        tmp_path,
        kernel_name,
        timeout=120,
    )
    # nbclient, run by pytest, is among the kernel's parents: nobody watches, the dashboard prints lines.
    assert outputs["here"]["stdout"].strip() == "Platform(host='local', frontend='headless', batch=False) text"
    assert outputs["kaggle"]["stdout"].strip().endswith("Platform(host='kaggle', frontend='kaggle', batch=False) html")
