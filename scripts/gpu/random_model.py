"""A random-weight model folder of a given shape (for speed measurements only), with the
embedded model's tokenizer."""
import json
import shutil
import sys
from pathlib import Path

import torch
import transformers as tf

out, shape = Path(sys.argv[1]), sys.argv[2]
src = Path(__file__).parent / "smol"  # the embedded model's config.json and tokenizer files
cfg = json.loads((src / "config.json").read_text())
if shape == "llama1b":  # Llama-3.2-1B's shape, vocabulary of the embedded tokenizer
    cfg.update(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
               rope_parameters={"rope_theta": 500000.0, "rope_type": "default"})
config = tf.LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
torch.manual_seed(0)
with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
    model = tf.LlamaForCausalLM(config).to(torch.bfloat16)
model.save_pretrained(out)
for f in src.iterdir():
    if f.name != "config.json":
        shutil.copy(f, out / f.name)
print("made", out, shape, sum(p.numel() for p in model.parameters()) / 1e6, "M params")
