"""What a frequency-ranked 8k head (`draftsmith export --draft-vocab-size 8192`) saves DFlash and DSpark a round:
d(k) and v(k) in decode steps (over v(0)) of each long recipe's drafter, full head and reduced, measured by the engine's
cost profile on SmolLM2 through the fast path, the four interleaved, twice. A round's cost depends on the shapes, not
on the weights, so untrained drafters serve (the vocabulary's choice does not matter either); tau is measured on
trained ones (`levers.sh fr KIND 8192`).

    OMP_NUM_THREADS=2 python benchmarks/training/fr_cost.py docs/results/fr_cost.json   # ~5 min on 2 quiet cores
"""
import copy
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from drafters import DRAFTERS  # noqa: E402
from inference.engine.cpu import CpuBackend, cpu_model  # noqa: E402
from inference.engine.target import TargetModel  # noqa: E402
from inference.evaluation.profile import profile_costs  # noqa: E402
from train.config import load_recipe  # noqa: E402

torch.manual_seed(0)
target = TargetModel.from_pretrained("smollm2-135m-instruct", dtype=torch.float32, backend=CpuBackend())
info = target.target_info()
prompt = target.tokenizer.apply_chat_template([{"role": "user", "content": "Explain how a bicycle stays upright."}],
                                              add_generation_prompt=True, tokenize=True, return_dict=False)
counts = torch.randint(0, 1000, (info.vocab_size,))
out = {"cpu": cpu_model(), "threads": torch.get_num_threads()}
drafters = {}
for kind in ("dflash", "dspark"):
    recipe = load_recipe(f"recipes/smollm2/{kind}_long.yaml")
    full = DRAFTERS[kind](recipe.drafter, info)
    fr = copy.deepcopy(full)
    fr.reduce_draft_vocab(counts, 8192)
    drafters[f"{kind}_full"], drafters[f"{kind}_fr8k"] = target.serve(full), target.serve(fr)
for repeat in range(2):  # interleaved
    for name, drafter in drafters.items():
        costs = profile_costs(target, drafter, [prompt], 7, max_new_tokens=16, repeats=3)
        v0 = costs.v(0)
        row = {"d": [round(costs.d(w) / v0, 4) for w in range(8)], "v": [round(costs.v(w) / v0, 4) for w in range(8)]}
        out.setdefault(name, []).append(row)
        print(name, repeat, row, flush=True)
with open(sys.argv[1] if len(sys.argv) > 1 else "runs/fr_cost.json", "w") as f:
    json.dump(out, f, indent=1)
