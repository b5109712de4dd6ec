"""Which import creates a CUDA context in a notebook-like process? (Such a process cannot fork ranks.)

    python benchmarks/fork_probe.py [MODEL] [--unsloth]

Imports what a training notebook imports before launching, in order, and after each step prints
whether CUDA is initialised and whether bitsandbytes / torchao are loaded; at the first step that
initialises CUDA it prints the stack of that initialisation and stops. With --unsloth it also
imports unsloth last (which notebooks must otherwise import inside the launched function).
"""

from __future__ import annotations

import importlib
import sys
import traceback

import torch

_first: list[str] = []
_lazy_init = torch.cuda._lazy_init


def _traced_lazy_init() -> None:
    if not torch.cuda.is_initialized() and not _first:
        _first.append("".join(traceback.format_stack(limit=40)))
    _lazy_init()


torch.cuda._lazy_init = _traced_lazy_init


def step(label: str, action) -> None:
    action()
    print(
        f"{label:<14} cuda_initialized={torch.cuda.is_initialized()} "
        f"bitsandbytes={'bitsandbytes' in sys.modules} torchao={'torchao' in sys.modules}",
        flush=True,
    )
    if _first:
        print(_first[0])
        raise SystemExit(1)


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    model = args[0] if args else "random:qwen3-vl-2b"
    step("import nbkit", lambda: importlib.import_module("nbkit"))
    import nbkit

    path = nbkit.resolve_model(model)
    step("resolve_model", lambda: None)
    step("transformers", lambda: importlib.import_module("transformers"))
    from transformers import AutoConfig, AutoModelForImageTextToText  # noqa: F401

    step("auto classes", lambda: AutoConfig.from_pretrained(path))
    step("nbkit.savers", lambda: importlib.import_module("nbkit.savers"))
    step("trl", lambda: importlib.import_module("trl"))
    step("peft", lambda: importlib.import_module("peft"))
    if "--unsloth" in sys.argv:
        step("unsloth", lambda: importlib.import_module("unsloth"))
    print("no step initialised CUDA")


if __name__ == "__main__":
    main()
