"""How good is a truncated / layer-skipping copy of SmolLM2 as a draft model? (docs/benchmarks.md, "Engine")

    python benchmarks/engine/draft_model_agreement.py

Generates 96 greedy tokens for 4 MT-Bench first turns with the target, then, for each kept-layer set, the share of
those tokens the truncated model predicts (teacher-forced next-token argmax agreement, an upper bound on greedy
draft acceptance at position 1).
"""

import copy

import torch

from inference.engine.api import speculative_generate
from inference.engine.target import TargetModel
from inference.evaluation.eval import render_prompt
from inference.evaluation.prompts import load_questions

KEPT_LAYERS = [list(range(2)), list(range(6)), list(range(12)), [0, 1, 28, 29], [0, 1, 2, 3, 27, 28, 29],
               list(range(6)) + [26, 27, 28, 29], list(range(10)) + [27, 28, 29]]


def agreement(model, keep, sequences) -> float:
    draft = copy.deepcopy(model)
    draft.model.layers = torch.nn.ModuleList([model.model.layers[i] for i in keep])
    draft.config.num_hidden_layers = len(keep)
    for index, layer in enumerate(draft.model.layers):
        layer.self_attn.layer_idx = index
    hits = total = 0
    for prompt, generated in sequences:
        with torch.no_grad():
            predicted = draft(input_ids=torch.tensor([prompt + generated])).logits[0].argmax(-1)
        predicted = predicted[len(prompt) - 1: len(prompt) + len(generated) - 1]
        hits += int((predicted == torch.tensor(generated)).sum())
        total += len(generated)
    return hits / total


def main() -> None:
    torch.set_num_threads(1)
    target = TargetModel.from_pretrained("smollm2-135m-instruct")
    _, questions = load_questions("mt_bench", 4)
    sequences = []
    for question in questions:
        prompt = render_prompt(target.tokenizer, question.turns[:1], [], use_chat_template=True)
        out = speculative_generate(target, None, [prompt], num_draft_tokens=0, max_new_tokens=96)
        sequences.append((prompt, out.tokens[0]))
    for keep in KEPT_LAYERS:
        print(f"{len(keep):2d} layers {keep}: agreement {agreement(target.model, keep, sequences):.3f}", flush=True)


if __name__ == "__main__":
    main()
