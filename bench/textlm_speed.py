"""text-lm training speed and bits per byte on this CPU (one torch thread, as the trainer runs).

python textlm_speed.py [STEPS] [N_LAYER] [N_EMBD] [BLOCK] [BATCH]; prints CPU seconds per step
(process time: what an idle core would take) and held-out bits per byte every 200 steps.
"""

import math
import sys
import tempfile
import time
from pathlib import Path

import torch

from pipeline.determinism import use_deterministic_kernels
from pipeline.textlm.data import training_windows
from pipeline.textlm.eval_set import TextEvalSet
from pipeline.textlm.evaluators import GenerationJudged, HeldoutBitsPerByte
from pipeline.textlm.landing import read_text_frame, write_text_landing
from pipeline.textlm.model import TextLM, TextLMConfig

DEFAULTS = ["800", "2", "128", "64", "32"]
args = sys.argv[1:] + DEFAULTS[len(sys.argv) - 1 :]
steps, n_layer, n_embd, block, batch = (int(a) for a in args)
torch.set_num_threads(1)
use_deterministic_kernels()
torch.manual_seed(0)
frame = read_text_frame(write_text_landing(Path(tempfile.mkdtemp())))
eval_set = TextEvalSet.from_frame(frame, snapshot_id="bench")
config = TextLMConfig(n_layer=n_layer, n_embd=n_embd, n_head=4, block_size=block)
model = TextLM(config)
windows = training_windows(frame, block_size=block)
params = sum(p.numel() for p in model.parameters())
eval_bytes = sum(len(t.encode()) for t in eval_set.eval_documents.texts)
print(f"config {config.to_dict()} batch {batch} params {params}")
print(f"train windows {tuple(windows.shape)}, eval bytes {eval_bytes}")
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
generator = torch.Generator().manual_seed(0)
train_cpu, wall0 = 0.0, time.time()
for step in range(1, steps + 1):
    started = time.process_time()
    model.train()
    for group in optimizer.param_groups:
        group["lr"] = 3e-3 * min(1.0, step / 50)
    loss = model.loss(windows[torch.randint(len(windows), (batch,), generator=generator)])
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    train_cpu += time.process_time() - started
    if step % 200 == 0 or step == steps:
        bpb = HeldoutBitsPerByte().evaluate(model, eval_set).metrics["bits_per_byte"]
        print(
            f"step {step} train_loss_bits {float(loss.detach()) / math.log(2):.3f} "
            f"eval_bits_per_byte {bpb:.3f} train_cpu_s {train_cpu:.1f} "
            f"cpu_s_per_step {train_cpu / step:.3f} wall_s {time.time() - wall0:.0f}",
            flush=True,
        )

# The generation evaluator on the trained model, with its defaults.
started = time.process_time()
result = GenerationJudged(judge=eval_set.judge).evaluate(model, eval_set)
print(f"generation_judged cpu_s {time.process_time() - started:.1f}")
print({k: round(v, 3) for k, v in result.metrics.items()})
for row in result.raw_outputs.head(3).itertuples():
    print(repr(row.prompt[-40:]), "->", repr(row.output), f"score {row.score:.2f}")
