"""Hugging Face: StepprofCallback profiles Trainer.train, and the knee-aware sweep sets the batch size.

    python examples/hf_trainer.py [LOG]     # needs: pip install 'stepprof[transformers]'
"""

import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is built from a config: nothing to download

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

from stepprof.integrations.transformers import StepprofCallback, sweep

log = sys.argv[1] if len(sys.argv) > 1 else "hf.jsonl"
torch.manual_seed(0)
config = BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=128, num_labels=2)
model = BertForSequenceClassification(config)
# Token sequences labelled by whether token 7 appears: real data with a signal, not zeros.
dataset = []
for _ in range(512):
    ids = torch.randint(0, config.vocab_size, (64,))
    dataset.append({"input_ids": ids, "attention_mask": torch.ones(64, dtype=torch.long),
                    "labels": int((ids == 7).any())})

args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=60, per_device_train_batch_size=16,
                         logging_steps=20, report_to=[], save_strategy="no", disable_tqdm=True,
                         use_cpu=not torch.cuda.is_available())
callback = StepprofCallback(log=log, warmup=5)
trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=[callback])

# 1. The batch size: the knee of samples/s, outside the allocator's thrash zone (weights restored).
result = sweep(trainer, max_batch=256, time_budget_s=30, apply=True, progress=False)
print(f"sweep: recommended batch {result.recommended} ({result.reason})")

# 2. Training under the callback: one step record per optimizer step; the Trainer's logs get stepprof/...
trainer.train()
print({k: round(v, 3) for k, v in trainer.state.log_history[0].items() if k.startswith("stepprof/")})
print(callback.summary)
print(f"next: stepprof report {log}; stepprof plot {log}")
