"""What transformers does with a model split over the visible GPUs, as notebooks/model_parallel.ipynb loads one.

For each way of loading (16-bit or 4-bit, device_map="balanced" or an explicit map): which devices hold
parameters, whether the model carries `hf_device_map` (Trainer reads it to decide that the model is split and
to count one GPU), what Trainer then decides (is_model_parallel, n_gpu, DataParallel) and the first logged loss
against the same batch's loss from one forward before training (equal unless Trainer scales it).

    python3 benchmarks/split_probe.py --model random:qwen3-1.7b
"""

from __future__ import annotations

import argparse
import json

import torch


def probe(model_path: str, four_bit: bool, device_map: str) -> dict[str, object]:
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig, Trainer, TrainingArguments

    gpus = torch.cuda.device_count()
    placement: object = device_map
    if device_map == "explicit":
        n = AutoConfig.from_pretrained(model_path).num_hidden_layers
        # the output layer beside the embeddings: small Qwen3 models tie them, and a tied pair split over two GPUs
        # fails at the embedding lookup (its index on one GPU, the shared weight on the other)
        placement = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": gpus - 1, "lm_head": 0}
        placement.update({f"model.layers.{i}": i * gpus // n for i in range(n)})
    quantization = None
    if four_bit:
        quantization = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float16
        )
    model = AutoModelForCausalLM.from_pretrained(
        model_path,
        dtype=torch.float16,
        quantization_config=quantization,
        device_map=placement,
        max_memory={i: "15GiB" for i in range(gpus)},
    )
    row: dict[str, object] = {
        "four_bit": four_bit,
        "device_map": device_map,
        "parameter_devices": sorted({str(p.device) for p in model.parameters()}),
        "has_hf_device_map": hasattr(model, "hf_device_map"),
        "hf_device_map_values": sorted({str(v) for v in getattr(model, "hf_device_map", {}).values()}),
    }
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    ids = torch.randint(8, 1000, (64,), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids[None].to(model.get_input_embeddings().weight.device)}
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
        row["forward_loss"] = float(model(**batch, labels=batch["input_ids"]).loss)
    args = TrainingArguments(
        output_dir="/tmp/split_probe",
        max_steps=1,
        per_device_train_batch_size=1,
        learning_rate=0.0,
        fp16=True,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": ids, "labels": ids}])
    row["trainer_is_model_parallel"] = trainer.is_model_parallel
    row["trainer_n_gpu"] = trainer.args.n_gpu
    trainer.train()
    row["wrapped_in"] = type(trainer.model_wrapped).__name__
    row["first_logged_loss"] = next(e["loss"] for e in trainer.state.log_history if "loss" in e)
    del trainer, model
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:qwen3-1.7b")
    parser.add_argument("--out")
    a = parser.parse_args()
    import nbkit

    path = str(nbkit.resolve_model(a.model))
    rows = []
    for four_bit in (False, True):
        for device_map in ("balanced", "explicit"):
            try:
                rows.append(probe(path, four_bit, device_map))
            except Exception as error:  # a probe reports every case, failed ones included
                rows.append(
                    {"four_bit": four_bit, "device_map": device_map, "error": f"{type(error).__name__}: {error}"}
                )
            print(json.dumps(rows[-1]), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
