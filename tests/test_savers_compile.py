"""nbkit.savers.apply(compile="regional"): torch.compile of each decoder layer and vision block, on the CPU.

Inductor generates C++ here, so a C compiler is needed (the tests skip without one). What a user
relies on: the compiled model's loss and LoRA gradients equal the eager model's, with every other
saver on (offloaded checkpointing recomputes the compiled layers), in one process and under 2-rank
gloo DDP and FSDP2; the layers stay the same objects (peft and the other savers find them); remove() makes
the model eager again.
"""

from __future__ import annotations

import functools
import math
import shutil

import pytest
import torch
from test_fsdp import FSDP_ENV, _check_against_reference, _sharded_step
from test_savers import TOLERANCE, assert_grads_match, loss_and_grads, make_batch, relative_error, tiny_model
from test_savers_ddp import SAVERS, _reference, _run_matrix, check_matrix

import nbkit
from nbkit.training import savers
from nbkit.training.savers import compiling
from nbkit.training.savers._model import decoder_layers

pytestmark = pytest.mark.skipif(
    not any(shutil.which(cc) for cc in ("cc", "gcc", "clang")), reason="inductor on the CPU needs a C compiler"
)

EVERY_SAVER = dict(checkpointing="offload", tiled_mlp=3, chunked_loss=True)


@pytest.mark.slow  # inductor generates and compiles C++ for each model: 40-90 s on 2 shared cores
@pytest.mark.parametrize("kind", ["qwen3", "qwen3-vl"])
def test_regional_compile_with_every_saver_matches_the_eager_model(kind):
    model = tiny_model(kind)
    layers = list(decoder_layers(model))
    batch = make_batch(model, [24, 17], seed=3)
    reference_loss, reference = loss_and_grads(model, batch)

    savers.apply(model, **EVERY_SAVER, compile="regional")
    regions = compiling.regions(model)
    vision_blocks = len(savers._model.base_model(model).model.visual.blocks) if kind == "qwen3-vl" else 0
    assert len(regions) == len(layers) + vision_blocks  # whole layers, the tiled MLP inside
    assert list(decoder_layers(model)) == layers  # compiled in place: the same modules, peft's LoRA inside
    assert all(r._compiled_call_impl is not None for r in regions)
    for _ in range(2):  # the second step runs the compiled code without tracing again
        loss, grads = loss_and_grads(model, batch)
        assert relative_error(loss, reference_loss) < TOLERANCE
        assert_grads_match(grads, reference)

    savers.apply(model, **EVERY_SAVER, compile="regional")  # the same options again: nothing changes
    assert all(r._compiled_call_impl is not None for r in regions)
    savers.remove(model)
    assert not compiling.is_enabled(model)
    assert all(r._compiled_call_impl is None for r in regions)
    loss, grads = loss_and_grads(model, batch)
    assert torch.equal(loss, reference_loss)
    assert all(torch.equal(grads[n], reference[n]) for n in reference)


def test_the_tiled_mlp_joins_its_layers_graph_until_it_splits():
    # Below the length where the automatic tiled MLP splits, a compiled layer is one graph (its MLP traced
    # inside, no break: what keeps a short-sequence step fast); where it splits, the graph breaks around
    # the tiled call and the gradients still equal the eager model's. aot_eager: dynamo's graphs without
    # code generation.
    from torch._dynamo.utils import counters

    model = tiny_model("qwen3")
    hidden = savers._model.base_model(model).config.hidden_size
    short, long = make_batch(model, [2 * hidden - 8], seed=1), make_batch(model, [5 * hidden], seed=2)
    references = [loss_and_grads(model, batch) for batch in (short, long)]
    savers.apply(model, checkpointing="offload", tiled_mlp=True, chunked_loss=True)
    compiling.enable(model, backend="aot_eager")
    torch._dynamo.reset()
    counters.clear()
    breaks = []
    for batch, (reference_loss, reference) in zip((short, long), references, strict=True):
        before = sum(counters["graph_break"].values())
        loss, grads = loss_and_grads(model, batch)
        breaks.append(sum(counters["graph_break"].values()) - before)
        assert relative_error(loss, reference_loss) < TOLERANCE
        assert_grads_match(grads, reference)
    assert breaks[0] == 0, dict(counters["graph_break"])
    assert breaks[1] > 0  # the split: the tiled call runs eagerly between two graphs of the layer
    savers.remove(model)
    torch._dynamo.reset()


def test_a_checkpointed_layer_compiles_with_its_checkpoint_inside():
    # Where the tiled MLP does not split (a GPU's automatic count at common lengths), each checkpointed layer
    # runs one compiled call with the checkpoint inside: the forward saves the layer's inputs and weights,
    # no activation (the compiled backward recomputes the layer), and the gradients are the eager model's,
    # LoRA dropout included (the recompute replays the forward's masks).
    from nbkit.training.savers import checkpointing

    model = tiny_model("qwen3", dropout=0.2).train()
    batch = make_batch(model, [24, 17], seed=5)
    reference_loss, reference = loss_and_grads(model, batch)  # seeded: the same dropout masks each time
    assert relative_error(loss_and_grads(model.eval(), batch)[0], reference_loss) > 1e-3  # dropout is active
    model.train()
    savers.apply(model, checkpointing="recompute", tiled_mlp=False, chunked_loss=True)
    compiling.enable(model, backend="aot_eager")
    layers = list(decoder_layers(model))
    calls = []
    for index, layer in enumerate(layers):
        compiled = layer._nbkit_compiled_checkpoint

        def counted(*args, _compiled=compiled, _index=index, **kwargs):
            calls.append(_index)
            return _compiled(*args, **kwargs)

        layer._nbkit_compiled_checkpoint = counted
    saved = []

    def pack(tensor):
        saved.append(tuple(tensor.shape))
        return tensor

    width = savers._model.base_model(model).config.intermediate_size
    activation = batch["input_ids"].numel() * width  # one MLP projection's output: (batch, seq, width)
    for _ in range(2):
        calls.clear(), saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss, grads = loss_and_grads(model, batch)
        assert calls == list(range(len(layers)))
        # (the loss saves 0-dim scalars too: a shape without dimensions is no MLP activation)
        assert saved and not [s for s in saved if s and s[-1] == width and math.prod(s) == activation], saved
        assert relative_error(loss, reference_loss) < TOLERANCE
        assert_grads_match(grads, reference)
    savers.remove(model)
    assert not any(hasattr(layer, "_nbkit_compiled_checkpoint") for layer in layers)
    assert not any(checkpointing.is_checkpointed(layer) for layer in layers)
    torch._dynamo.reset()


def test_generation_runs_eagerly_and_leaves_dynamos_budget_to_training():
    # A notebook generates an answer before it trains. Generation compiles nothing (a prefill, then token by token,
    # without autograd): its graphs would count against dynamo's limit on compilations per function, which the
    # layers' training calls share, and once it is reached every later length trains eagerly. Training after it
    # compiles each region once, at its first length, with the length dynamic (compiling._mark_sequence_dynamic),
    # and the later lengths run that graph, with the eager model's values.
    from torch._dynamo.utils import counters

    model = tiny_model("qwen3").train()
    batches = [make_batch(model, [length], seed=length) for length in (16, 24, 32)]
    references = [loss_and_grads(model, batch) for batch in batches]
    prompt = batches[0]["input_ids"][:, :8]
    with torch.no_grad():
        expected = model.eval().generate(input_ids=prompt, max_new_tokens=10, do_sample=False)
    savers.apply(model, checkpointing=None, tiled_mlp=False, chunked_loss=True)
    compiling.enable(model, backend="aot_eager")
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        answer = model.generate(input_ids=prompt, max_new_tokens=10, do_sample=False)
    assert torch.equal(answer, expected) and counters["frames"]["total"] == 0, dict(counters["frames"])
    model.train()
    compiled = []
    for batch, (reference_loss, reference) in zip(batches, references, strict=True):
        loss, grads = loss_and_grads(model, batch)
        compiled.append(counters["frames"]["ok"])
        assert relative_error(loss, reference_loss) < TOLERANCE
        assert_grads_match(grads, reference)
    # 16: a dynamic graph (two: the first layer's input needs no grad, the later layers' do); 24 and 32: served by it.
    # Left to dynamo, 24 compiled again (the length then dynamic): 4 in all.
    assert compiled[0] == 2 and compiled[2] == compiled[1] == compiled[0], compiled
    savers.remove(model)
    torch._dynamo.reset()


def test_batches_of_many_image_sizes_stay_compiled_and_exact(monkeypatch):
    # Every decoder layer and vision block runs one compiled function, whose inputs come in many variants with
    # images of several sizes and batches of one and two; past dynamo's default of 8 compilations per function
    # each new one would run eagerly (it did by the third batch here). The regions allow more, for their calls alone.
    # And no region breaks in a batch of two images: the vision blocks' attention splits by image at sizes given to it
    # (nbkit.savers.vision_attention), where transformers' reads them from the tensor and broke each block's graph
    # there (a batch of one image keeps transformers' split).
    # As a notebook trains by default: nbkit's offloaded checkpoint on the decoder layers and the Trainer's
    # checkpointing on (transformers' checkpoint around the frozen vision blocks, which compile under no_grad).
    import logging

    import test_savers
    from torch._dynamo.utils import counters

    limits = []

    class Warnings(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "recompile_limit" in record.getMessage():
                limits.append(record.getMessage())

    handler = Warnings()
    logging.getLogger("torch._dynamo").addHandler(handler)
    model = tiny_model("qwen3-vl").train()
    batches = []
    for index, grid in enumerate([(1, 2, 2), (1, 4, 4), (1, 2, 4), (1, 6, 6), (1, 4, 2), (1, 8, 4)]):
        monkeypatch.setattr(test_savers, "IMAGE_GRID", grid)
        tokens = math.prod(grid) // 4  # after the 2x2 merge
        batches.append(make_batch(model, [tokens + 9 + index, tokens + 5][: 1 + index % 2], seed=index))
    references = [loss_and_grads(model, batch) for batch in batches]
    model.gradient_checkpointing_enable()
    savers.apply(model, checkpointing="offload", tiled_mlp=False, chunked_loss=True, compile=None)
    compiling.enable(model, backend="aot_eager")
    torch._dynamo.reset()
    try:
        for batch, (reference_loss, reference) in zip(batches, references, strict=True):
            counters.clear()
            loss, grads = loss_and_grads(model, batch)
            assert relative_error(loss, reference_loss) < TOLERANCE
            assert_grads_match(grads, reference)
            if len(batch["image_grid_thw"]) > 1:
                assert not counters["graph_break"], dict(counters["graph_break"])
    finally:
        logging.getLogger("torch._dynamo").removeHandler(handler)
        savers.remove(model)
        torch._dynamo.reset()
    assert not limits, limits
    assert torch._dynamo.config.recompile_limit == 8  # raised for the regions' calls, not for the process


def test_a_compile_the_user_made_is_left_alone_and_bad_values_are_refused():
    model = tiny_model("qwen3")
    head = savers._model.base_model(model).lm_head
    head.compile(backend="eager")  # the user's own
    savers.apply(model, compile="regional")
    savers.remove(model)
    assert head._compiled_call_impl is not None
    with pytest.raises(ValueError, match="compile='full' is not valid; use 'regional', 'auto' or None"):
        savers.apply(model, compile="full")
    assert not compiling.is_enabled(model)
    savers.apply(model, compile="auto")  # on the CPU: the savers without compilation
    assert not compiling.is_enabled(model) and savers._model.base_model(model)._nbkit_savers.compile is None


def test_the_wait_at_the_first_step_is_announced_once(capsys):
    model = tiny_model("qwen3")
    savers.apply(model, compile="auto")  # on the CPU: nothing compiles, nothing to say
    assert "compile" not in capsys.readouterr().out
    savers.apply(model, compile="regional")
    said = capsys.readouterr().out
    blocks = len(compiling.regions(model))
    assert f"nbkit: {blocks} blocks of the model compile at its first training step" in said, said
    assert "compile=None leaves them uncompiled" in said
    savers.apply(model, compile="regional")  # the same options again: nothing changes, nothing is said
    assert capsys.readouterr().out == ""


@pytest.mark.slow
def test_ddp_with_regional_compile_matches_single_process(monkeypatch):
    # test_savers_ddp's matrix (gradient accumulation 2 with no_sync, other lengths on each rank):
    # the compiled layers under DDP, find_unused_parameters True and False. Traced by Dynamo and
    # AOTAutograd as with inductor, without its code generation: two ranks generating C++ on CI's 2
    # shared cores took over 500 s; the tests above cover inductor's code.
    monkeypatch.setattr(compiling, "enable", functools.partial(compiling.enable, backend="aot_eager"))
    # The ranks fork from here and see both: the tiled MLP split (the checkpoint wraps each compiled layer) and
    # whole (each layer compiled with its checkpoint inside).
    SAVERS["compiled"] = dict(EVERY_SAVER, compile="regional")
    SAVERS["compiled_whole"] = dict(EVERY_SAVER, tiled_mlp=False, compile="regional")
    cases = [
        (saver, {"find_unused_parameters": unused})
        for saver in ("compiled", "compiled_whole")
        for unused in (True, False)
    ]
    try:
        results = nbkit.launch(_run_matrix, "qwen3-vl", "cpu", cases, gpus=2, timeout=300, dashboard=False)
    finally:
        del SAVERS["compiled"], SAVERS["compiled_whole"]
    check_matrix(results, *_reference("qwen3-vl"), cases)


def _fsdp_step(savers: dict) -> tuple[dict, int]:
    """test_fsdp's sharded step in a rank, and how many graphs Dynamo compiled there."""
    from torch._dynamo.utils import counters

    counters.clear()  # a forked rank starts with the counts of the tests run before it
    result = _sharded_step(None, savers)
    return result, counters["stats"]["unique_graphs"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("savers", "accelerate_checkpointing"),
    [
        # nbkit's offloaded checkpointing; each layer compiled around its split tiled MLP, inside FSDP's unit
        (dict(checkpointing="offload", tiled_mlp=3, chunked_loss=True), "false"),
        # the same with the MLP whole: FSDP2's hooks on each layer keep the checkpoint outside the compiled layer
        (dict(checkpointing="offload", tiled_mlp=False, chunked_loss=True), "false"),
        # accelerate's checkpointing (nbkit's fsdp set-up); whole layers compiled, each inside its checkpoint
        # wrapper, the FSDP unit that carries FSDP's hooks
        (dict(checkpointing=None, tiled_mlp=False, chunked_loss=True), "true"),
    ],
    ids=["offload-tiled", "offload-whole-mlp", "fsdp-checkpointing-whole-layers"],
)
def test_fsdp_with_regional_compile_gives_the_reference_gradients(monkeypatch, savers, accelerate_checkpointing):
    # test_fsdp's check: each rank holds half of the base weights, the loss and every LoRA gradient equal
    # one process's over the whole batch. aot_eager, as in the DDP case above.
    monkeypatch.setattr(compiling, "enable", functools.partial(compiling.enable, backend="aot_eager"))
    env = {**FSDP_ENV, "FSDP_ACTIVATION_CHECKPOINTING": accelerate_checkpointing}
    result, graphs = nbkit.launch(_fsdp_step, dict(savers, compile="regional"), gpus=2, env=env, timeout=300)
    assert graphs >= 1  # the regions ran compiled
    _check_against_reference(result, 2)
