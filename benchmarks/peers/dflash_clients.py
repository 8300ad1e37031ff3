"""DFlash exports read by implementations we did not write: the numbers behind docs/benchmarks.md,
"Exports served", DFlash. The comparisons themselves live in tests/test_dflash_export.py (same functions).

Run from a throwaway environment that has the clients (never the project's .venv):
    python3 -m venv /tmp/venv-dflash && . /tmp/venv-dflash/bin/activate
    echo /work/main/.venv/lib/python3.11/site-packages > /tmp/venv-dflash/lib/python3.11/site-packages/zz_main.pth
    pip install --no-deps dflash==0.1.0 speculators==0.9.0 loguru openai sniffio hs-connectors==0.9.0
    cd /work/main && python benchmarks/peers/dflash_clients.py
(the .pth line reuses the project's torch 2.13 CPU and transformers 5.24, so pip never pulls another torch).

A random Qwen3 target (no download) and a DFlash drafter over it, exported in both layouts. For each layout and
reader: max |logit difference| against our drafter on the same inputs (fp32, every block of a 40-token sequence),
and, for readers that run speculative decoding, greedy decoding compared with our engine round by round (fp64, so
that no near-tie of the target separates the engines): same output tokens, same drafts in every full-size round,
same acceptance. For the decoding the drafter is briefly trained on the target's own continuations, so that rounds
accept anything from 0 to block_size - 1 drafts.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import test_dflash_export as parity  # noqa: E402
from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from inference.engine.target import TargetModel  # noqa: E402

VOCAB = 1024
MASK = VOCAB - 1
LAYER_IDS = (2, 4, 6, 7)  # ours (vLLM): z-lab writes (1, 3, 5, 6)


def build_target(dtype, directory: str) -> TargetModel:
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=1024,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6}, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(config).to(dtype).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # sharper logits: repetitive, partly predictable text
    model.save_pretrained(directory)  # speculators reloads the verifier's embedding and lm_head from here
    return TargetModel(model, name_or_path=directory)


def build_drafter(target, draft_vocab_size=None, seed=1):
    return parity.make_drafter(target, draft_vocab_size, seed=seed, layer_ids=LAYER_IDS, block_size=8, num_layers=3,
                               mask_token_id=MASK)


def available(module: str) -> bool:
    try:
        __import__(module)
        return True
    except ImportError:
        return False


def logits_rows(work: str, seq_len: int) -> list[tuple]:
    target = build_target(torch.float32, os.path.join(work, "verifier32"))
    rows = []
    for vocab_name, draft_vocab in (("full", None), ("draft 384", 384)):
        drafter = build_drafter(target, draft_vocab)
        batch = parity.make_batch(target, drafter, seq_len=seq_len)
        anchors = list(range(seq_len - 8))
        ours = parity.our_logits(drafter, batch, anchors)
        for fmt in ("dflash", "speculators"):
            directory = os.path.join(work, f"{fmt}-{draft_vocab}")
            drafter.save(directory, fmt)
            loaded = type(drafter).load(directory, target.target_info()).eval()
            rows.append((fmt, vocab_name, "draftsmith (read back)", parity.max_diff(parity.our_logits(loaded, batch,
                                                                                                       anchors), ours)))
            convention = "zlab" if fmt == "dflash" else "speculators"
            reference = parity.reference_block_logits(directory, convention, target, batch["input_ids"], anchors)
            rows.append((fmt, vocab_name, f"re-implemented {convention} conventions (test)",
                         parity.max_diff(reference, ours)))
            if fmt == "dflash" and draft_vocab is None:
                for name, ok, fn in (("dflash 0.1.0 DFlashDraftModel", available("dflash.model"),
                                      parity.dflash_package_logits),
                                     ("transformers 5.24 MuseGlimmerAssistantModel", parity.transformers_has_dflash(),
                                      parity.transformers_logits)):
                    value = parity.max_diff(fn(directory, target, batch["input_ids"], anchors), ours) if ok else None
                    rows.append((fmt, vocab_name, name, value))
            if fmt == "speculators":
                if available("speculators.models.dflash"):
                    spec_anchors, logits = parity.speculators_logits(directory, target, batch["input_ids"])
                    value = parity.max_diff(logits, parity.our_logits(drafter, batch, spec_anchors))
                else:
                    value = None
                rows.append((fmt, vocab_name, "speculators 0.9.0 DFlashDraftModel", value))
    return rows


def decoding_rows(work: str, num_prompts: int, max_new_tokens: int, train_steps: int) -> list[tuple]:
    target = build_target(torch.float64, os.path.join(work, "verifier64"))
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, MASK, (12,), generator=generator).tolist() for _ in range(num_prompts)]
    drafter = parity.train_briefly(target, build_drafter(target), prompts, steps=train_steps, new_tokens=max_new_tokens)
    directory = os.path.join(work, "dflash-trained")
    drafter.save(directory, "dflash")
    ours = [parity.engine_rounds(target, drafter, p, max_new_tokens) for p in prompts]
    accepted = [a for _, _, acc in ours for a in acc]
    histogram = " ".join(f"{k}:{accepted.count(k)}" for k in range(drafter.max_draft_tokens() + 1))
    rows = [("draftsmith engine", f"{sum(len(t) for t, _, _ in ours)} tokens, {len(accepted)} rounds, "
             f"accepted per round {histogram}", "-", "-", "-")]
    clients = [("dflash 0.1.0 dflash_generate", available("dflash.model"), parity.dflash_package_rounds),
               ("transformers 5.24 generate(speculation_type='dflash')", parity.transformers_has_dflash(),
                parity.transformers_rounds)]
    for name, ok, fn in clients:
        if not ok:
            rows.append((name, "not installed", "-", "-", "-"))
            continue
        same_tokens, compared, same_drafts, same_accepted, accepted_compared = 0, 0, 0, 0, 0
        for prompt, (tokens, drafts, accepted) in zip(prompts, ours):
            peer = fn(directory, target, prompt, max_new_tokens)
            same_tokens += peer[0] == tokens
            rounds = min(len(drafts), len(peer[1]))  # full-size blocks (dflash_generate shrinks its last ones)
            compared += rounds
            same_drafts += sum(a == b for a, b in zip(drafts[:rounds], peer[1][:rounds]))
            if len(peer) > 2:  # dflash_generate reports acceptance; its last round is clipped to max_new_tokens
                full = min(rounds, len(peer[2]) - 1)
                accepted_compared += full
                same_accepted += sum(a == b for a, b in zip(accepted[:full], peer[2][:full]))
        rows.append((name, f"{len(prompts)} prompts", f"{same_tokens}/{len(prompts)}",
                     f"{same_drafts}/{compared}",
                     f"{same_accepted}/{accepted_compared}" if accepted_compared else "not reported"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=40)
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--train-steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as work:
        print("| layout | vocabulary | reader | max abs logit diff vs ours (fp32) |")
        print("|---|---|---|---|")
        for fmt, vocab, reader, value in logits_rows(work, args.seq_len):
            print(f"| {fmt} | {vocab} | {reader} | {'not installed' if value is None else f'{value:.2e}'} |")
        print()
        print("| decoder (greedy, fp64) | run | outputs equal to ours | rounds with the same drafts | "
              "rounds with the same acceptance |")
        print("|---|---|---|---|---|")
        for row in decoding_rows(work, args.num_prompts, args.max_new_tokens, args.train_steps):
            print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
