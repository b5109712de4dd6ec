"""A pytest plugin: a failure whose report pytest cannot render is reported with a plain traceback.

tests/conftest.py uses it for the suite; tests/test_plain_failures.py runs it on a failure of its own making.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failure whose report pytest cannot render is reported with a plain traceback, not an INTERNALERROR.

    pytest reads each frame's source with ast.parse to show the failing statement. On CPython 3.11 an exception
    raised inside a parse (a SIGINT's KeyboardInterrupt) leaves the AST constructor's recursion count off, and the
    parse raises SystemError ("AST constructor recursion depth mismatch"). pytest then stopped the whole suite there
    without saying what had failed: in CI, when a test's late SIGINT landed while pytest rendered that test's
    failure (benchmarks/RESULTS.md, "An interrupt while a live set starts"). Reported this way, such a failure says
    what it was, and the suite's other tests still run.
    """
    try:
        return (yield)
    except SystemError as exc:
        if call.excinfo is None:
            raise
        lines = [f"(pytest could not render this failure: {exc}; the traceback without source follows)"]
        error: BaseException | None = call.excinfo.value
        while error is not None:
            lines.append(f"{type(error).__name__}: {error}")
            frame = error.__traceback__
            while frame is not None:
                code = frame.tb_frame.f_code
                lines.append(f"  {code.co_filename}:{frame.tb_lineno} in {code.co_name}")
                frame = frame.tb_next
            error = error.__cause__ or error.__context__
        return pytest.TestReport(
            item.nodeid, item.location, dict.fromkeys(item.keywords, 1), "failed", "\n".join(lines), call.when
        )
