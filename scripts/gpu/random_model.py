"""A random-weight model folder of a given shape (for speed and memory measurements only), with
the embedded model's tokenizer. Shapes: ``smol`` (the embedded model's), ``llama1b``
(Llama-3.2-1B's), ``llama8b`` (Llama-3.1-8B's: 32 layers, 32 query and 8 KV heads of 128, its
128256-token vocabulary and untied head, llama3 RoPE) and ``llama8b-tiny`` (the same
configuration with 4 narrow layers, to rehearse the 8B run on a CPU).

The weights are made on the GPU where there is one, in bfloat16 (an 8B model's float32 copy
would take 32 GB), and written as safetensors."""
import json
import shutil
import sys
from pathlib import Path

import torch
import transformers as tf

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
SHAPES = {
    "smol": {},
    "llama1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                    rope_parameters={"rope_theta": 500000.0, "rope_type": "default"}),
    "llama8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
                    max_position_embeddings=131072, rope_parameters=LLAMA3_ROPE),
}
SHAPES["llama8b-tiny"] = dict(SHAPES["llama8b"], hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=64)

out, shape = Path(sys.argv[1]), sys.argv[2]
src = Path(__file__).parent / "smol"  # the embedded model's config.json and tokenizer files
cfg = json.loads((src / "config.json").read_text())
cfg.update(SHAPES[shape])
config = tf.LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "dtype")})
torch.manual_seed(0)
torch.set_default_dtype(torch.bfloat16)
with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
    model = tf.LlamaForCausalLM(config)
model.save_pretrained(out)
for f in src.iterdir():
    if f.name != "config.json":
        shutil.copy(f, out / f.name)
print("made", out, shape, f"{sum(p.numel() for p in model.parameters()) / 1e9:.3f}", "B params")
