"""nbkit.notebook.notebook_names: the one rule for which notebook names travel, for spawn mode and live sets."""

from __future__ import annotations

import pickle

import pytest

from nbkit.notebook import notebook_names
from nbkit.platform.errors import CellSyntaxError


@pytest.mark.version_independent
def test_the_names_a_cell_reads_travel_private_ones_too_but_not_ipythons():
    namespace = {n: 1 for n in ("_cfg", "lr", "_", "__", "_i3", "_5", "In", "Out", "open", "get_ipython", "unused")}
    code = "print(_cfg, lr, _, __, _i3, _5, In, Out, get_ipython)\nwith open('f') as f: pass"
    assert notebook_names.needed(code, namespace) == ["_cfg", "lr"]
    # a live set's own names stay the ranks'
    assert notebook_names.needed(code, namespace, kept={"lr"}) == ["_cfg"]
    with pytest.raises(CellSyntaxError):
        notebook_names.needed("x = (1,", {"x": 1})


@pytest.mark.version_independent
def test_a_builtin_the_notebook_rebinds_travels_and_the_kernels_own_builtins_do_not():
    import builtins

    namespace = {"dir": "outputs", "input": "a prompt", "len": len, "print": builtins.print, "open": open}
    code = "print(len(dir), input)\nopen(dir)\ndef f():\n    return sorted(dir)"
    # `len` and `print` bound to the builtins themselves (ipykernel's `input` lives in builtins) stay the rank's
    assert notebook_names.needed(code, namespace) == ["dir", "input"]
    assert notebook_names.needed("dir = 'x'\nprint(dir)", namespace) == []  # the cell binds it first


@pytest.mark.version_independent
def test_spawn_and_a_live_set_pickle_a_notebook_function_with_the_values_it_reads():
    namespace: dict = {"scale": 3}
    exec("def times(x):\n    return x * scale", namespace)
    namespace["times"].__module__ = "__main__"  # as a function defined in a notebook cell is
    # a live set: the function alone, with what it reads now, its own globals
    rebuilt = pickle.loads(notebook_names.pickle_value(namespace["times"]))
    assert rebuilt(2) == 6
    # spawn mode: the rank's namespace becomes its globals, the values it reads come along
    brought = notebook_names.bring_along("times(2)", namespace)
    assert brought.names == ("times",) and brought.reached == ("times", "scale")
    rank: dict = {}
    brought.load_into(rank)
    assert rank["times"](2) == 6 and rank["times"].__globals__ is rank
