"""What a round that proposes nothing costs beside a plain decoding step: seconds per round of plain decoding and of
decoding with a drafter attached (EAGLE-3, random weights) under a width policy that never proposes, interleaved.

    HF_HUB_OFFLINE=1 python benchmarks/engine/k0_round_cost.py THREADS

SmolLM2-135M-Instruct on its fast path, 4 MT-Bench first turns x 48 tokens, 3 repeats after a warm-up pass; medians.
"""
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from drafters import DRAFTERS
from inference.engine.cpu import CpuBackend
from inference.engine.generate import decode
from inference.engine.policy import FixedWidth, WidthPolicy
from inference.engine.rounds import ChainRounds
from inference.engine.target import TargetModel
from inference.evaluation.eval import render_prompt
from inference.evaluation.prompts import load_questions
torch.set_num_threads(int(sys.argv[1]))
target = TargetModel.from_pretrained("smollm2-135m-instruct", backend=CpuBackend())
info = target.target_info()
cls = DRAFTERS["eagle3"]
torch.manual_seed(0)
drafter = cls(cls.Config(layer_ids=(2, 15, 27), draft_vocab_size=8192, init_head_from_target=False), info)
drafter.init_from_data(torch.randint(0, 100, (info.vocab_size,)))
drafter.eval()

class Never(WidthPolicy):
    max_width = 3
    def choose(self, active):
        return 0

_, qs = load_questions("mt_bench", num_prompts=4)
prompts = [render_prompt(target.tokenizer, q.turns[:1], [], True) for q in qs]
times = {"plain": [], "drafter attached, k=0": []}
for attempt in range(4):
    for name in times:
        for p in prompts:
            start = time.perf_counter()
            out = decode(target, drafter if name != "plain" else None, [p], ChainRounds(), Never() if name != "plain" else FixedWidth(0), max_new_tokens=48, eos_token_ids=[])
            if attempt:
                times[name].append((time.perf_counter() - start - out.time_prefill) / out.verify_forwards)
base = statistics.median(times["plain"])
for name, t in times.items():
    print(f"threads {sys.argv[1]} {name}: {1e3 * statistics.median(t):.2f} ms per round, {statistics.median(t) / base:.3f}x plain")
