"""Why offloaded checkpointing keeps layer inputs on one GPU (probe, not committed)."""
import sys, torch
sys.path.insert(0, "tests")
from transformers import Qwen3Config, Qwen3ForCausalLM
from peft import LoraConfig, get_peft_model
from nbkit import savers
from nbkit.savers import checkpointing as ck

print("torch", torch.__version__)
config = Qwen3Config(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
                     num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096)
torch.manual_seed(0)
model = get_peft_model(Qwen3ForCausalLM(config).to("cuda"), LoraConfig(r=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
batch = {"input_ids": torch.randint(0, 1024, (2, 2048), device="cuda")}
batch["labels"] = batch["input_ids"]
packed = []
orig_pack = ck.HostOffloader._pack
def pack(self, t):
    packed.append((tuple(t.shape), t.dtype, t.device.type, t.untyped_storage().nbytes(), t.data_ptr()))
    return orig_pack(self, t)
ck.HostOffloader._pack = pack

def measure(label):
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    import gc
    collected = gc.collect()
    print(f"{label}: before forward {base:,}, after gc.collect() ({collected} objects) {torch.cuda.memory_allocated():,}")
    base = torch.cuda.memory_allocated()
    packed.clear()
    loss = model(**batch).loss
    torch.cuda.synchronize()
    a1 = torch.cuda.memory_allocated()
    torch.empty(1, device="cuda")
    a2 = torch.cuda.memory_allocated()
    torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    a3 = torch.cuda.memory_allocated()
    torch.cuda.empty_cache()
    a4 = torch.cuda.memory_allocated()
    stats = torch.cuda.memory_stats()
    cuda_packed = [p for p in packed if p[2] == "cuda"]
    print(f"{label}: base {base:,} after-fwd {a1:,} after-empty1 {a2:,} after-64MiB {a3:,} after-empty_cache {a4:,} "
          f"active {stats['active_bytes.all.current']:,} packs {len(packed)} cuda-packs {len(cuda_packed)} "
          f"cuda-packed-bytes {sum(p[3] for p in cuda_packed):,}")
    big = {}
    for p in cuda_packed:
        big[(p[0], str(p[1]))] = big.get((p[0], str(p[1])), 0) + 1
    print("   packed shapes:", sorted(big.items(), key=lambda kv: -kv[1])[:8])
    loss.backward()

savers.apply(model, checkpointing="recompute", tiled_mlp=False, chunked_loss=False)
measure("recompute")
savers.apply(model, checkpointing="offload", tiled_mlp=False, chunked_loss=False)
measure("offload-1")
measure("offload-2")
