"""The batches, the initial weights and the one evaluator of benchmarks/peers/peer_train_parity.py (draftsmith's venv)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import time

import torch

from benchmarks.peers.parity_common import write_json

HPARAM_KEYS = ("lr", "betas", "grad_clip")


def dump_batches(args, work: str) -> tuple[str, str]:
    """Write work/dump.pt (batches, anchors per step, frozen target tensors) and work/init/{native,dflash|deepspec}
    once; a later run with the same work directory reuses them."""
    dump_path, init = os.path.join(work, "dump.pt"), os.path.join(work, "init")
    if os.path.exists(dump_path) and os.path.exists(os.path.join(init, "native")):
        made_with = torch.load(dump_path, weights_only=False)["meta"]["recipe_override"]
        if list(made_with) != list(args.recipe_override):
            raise SystemExit(f"peer_train_parity: --recipe-override: {work} was dumped with {made_with}, not "
                             f"{list(args.recipe_override)}; pass the same overrides or remove that directory")
        return dump_path, init
    from accelerate import PartialState

    from drafters.dflash.anchors import sample_anchors
    from train.build import build_drafter, load_data, load_target
    from train.config import load_recipe
    from train.data.vocab import count_tokens

    torch.set_num_threads(1)
    recipe = load_recipe(os.path.join("recipes", "smollm2", f"{args.drafter}.yaml"), args.recipe_override)
    state = PartialState(cpu=True)
    target = load_target(recipe, "cpu")
    data = load_data(recipe, target, state)
    if len(data.train) < 2 * args.num_batches:
        raise SystemExit(f"peer_train_parity: --num-batches: the recipe's data has {len(data.train)} training "
                         f"conversations, fewer than 2 x {args.num_batches}; lower --num-batches")
    torch.manual_seed(0)
    drafter = build_drafter(recipe, target)
    info = target.target_info()
    drafter.init_from_data(count_tokens(data.train, info.vocab_size))
    layer_ids = list(drafter.target_layer_ids())
    batches = target_batches(args, recipe, target, data, drafter, layer_ids)
    config = drafter.config
    anchors = []
    for step in range(args.steps):
        batch = batches[step % len(batches)]
        anchors.append(sample_anchors(batch["attention_mask"], batch["loss_mask"], config.num_anchors,
                                      seed=recipe.train.seed, epoch=step // len(batches),
                                      sample_index=batch["sample_index"]))
    if args.drafter == "dflash":
        from drafters.dflash.layers import decay_gamma

        gamma = decay_gamma(config)
    else:
        gamma = config.loss_decay_gamma
    meta = {"kind": args.drafter, "target": recipe.target.name_or_path, "block_size": config.block_size,
            "num_anchors": config.num_anchors, "mask_token_id": int(drafter.mask_token_id), "layer_ids": layer_ids,
            "gamma": float(gamma), "num_depths": config.block_size - 1 if args.drafter == "dflash"
            else config.block_size,
            "hparams": {"lr": recipe.optim.lr, "betas": list(recipe.optim.betas), "grad_clip": recipe.optim.grad_clip,
                        "warmup_steps": recipe.schedule.warmup_steps, "min_lr_ratio": recipe.schedule.min_lr_ratio},
            "recipe_override": list(args.recipe_override)}
    os.makedirs(work, exist_ok=True)
    torch.save({"meta": meta, "embed": info.embed_weight.detach().clone(),
                "lm_head": info.lm_head_weight.detach().clone(), "batches": batches, "anchors": anchors}, dump_path)
    drafter.save(os.path.join(init, "native"), "native")
    drafter.save(os.path.join(init, "dflash" if args.drafter == "dflash" else "deepspec"),
                 "dflash" if args.drafter == "dflash" else "deepspec")
    return dump_path, init


def target_batches(args, recipe, target, data, drafter, layer_ids) -> list[dict]:
    """The first 2 x num_batches training conversations with the target's features, computed once per (data section,
    layer ids, num_batches) and shared by the DFlash and DSpark runs (the target forward is the costly part here)."""
    from train.features.cache import FeatureProvider, make_batch

    key = json.dumps({"data": dataclasses.asdict(recipe.data), "layers": layer_ids, "n": args.num_batches},
                     sort_keys=True, default=str)
    path = os.path.join(args.envs, "work", f"batches_{hashlib.sha1(key.encode()).hexdigest()[:12]}.pt")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:  # one run computes them; a concurrent run waits for its file
        os.close(os.open(path + ".lock", os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        while not os.path.exists(path):
            time.sleep(10)
    if os.path.exists(path):
        return torch.load(path, weights_only=False)
    provider = FeatureProvider("online", target, drafter.feature_request())
    pad = target.target_info().pad_token_id or 0
    batches = []
    for start in range(0, 2 * args.num_batches, 2):
        batch = make_batch(data.train, [start, start + 1], pad)
        features = provider.online(batch)
        batches.append({
            "input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
            "loss_mask": batch["loss_mask"], "sample_index": batch["sample_index"],
            "features": torch.cat([features["hidden"][i] for i in layer_ids], dim=-1).to(torch.bfloat16),
            "last_hidden": features["final_hidden"].to(torch.bfloat16),
            "target_argmax": features["target_argmax"]})
    torch.save(batches, path + ".tmp")
    os.replace(path + ".tmp", path)
    os.remove(path + ".lock")
    return batches


def evaluate(args, work: str, trainers: list[str]) -> list[dict]:
    """Each trained drafter read back through our readers at one step for all (--eval-step, else the last step every
    trainer saved), then greedy speculative decoding of the held-out prompts with our engine: heldout_tau = 1 +
    accepted / rounds over all prompts."""
    from benchmarks.training.heldout_tau import decode, first_turns
    from drafters import load_drafter
    from inference.engine.target import TargetModel

    torch.set_num_threads(1)
    dump_meta = torch.load(os.path.join(work, "dump.pt"), weights_only=False)["meta"]
    target = TargetModel.from_pretrained(dump_meta["target"])
    prompts = first_turns(target, args.prompts, args.num_prompts)
    curves = {}
    for name in trainers:
        path = os.path.join(work, name, "curve.json")
        if os.path.exists(path):
            with open(path) as f:
                curves[name] = json.load(f)
    saved = [set(c.get("weights_steps") or []) for c in curves.values()]
    common = sorted(set.intersection(*saved)) if saved else []
    step = args.eval_step or (common[-1] if common else None)
    rows = []
    for name in trainers:
        if name not in curves:
            rows.append({"trainer": name, "error": _tail(os.path.join(work, name, "log.txt"))})
            continue
        row = dict(curves[name], steps_reached=(curves[name]["steps"] or [0])[-1])
        weights = os.path.join(work, name, "weights", f"step_{step}")
        if step is None or not os.path.exists(os.path.join(weights, "config.json")):
            row["error"] = f"no weights saved at step {step}"
            rows.append(row)
            continue
        drafter = load_drafter(weights, target.target_info()).eval()
        k = args.eval_k or drafter.max_draft_tokens() or dump_meta["num_depths"]  # EAGLE-3: the blocks' length
        done = os.path.join(work, name, f"heldout_{step}_{args.prompts}_{len(prompts)}_{args.max_new_tokens}_{k}.json")
        if os.path.exists(done):  # the same weights on the same prompts: decoded by an earlier run
            with open(done) as f:
                heldout = json.load(f)
        else:
            heldout = {**decode(target, target.serve(drafter), prompts, k, args.max_new_tokens), "heldout_step": step,
                       "heldout_prompts": f"{args.prompts} x {len(prompts)}, {args.max_new_tokens} new tokens"}
            write_json(done, heldout)
        row.update(heldout, read_as=_format_of(weights))
        rows.append(row)
        write_json(os.path.join(work, "rows.json"), {"rows": rows})
    return rows


def _format_of(directory: str) -> str:
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    return "native" if "draftsmith_kind" in config else ",".join(config.get("architectures") or ["?"])


def _tail(path: str, lines: int = 5) -> str:
    if not os.path.exists(path):
        return "no log"
    with open(path) as f:
        return " | ".join(f.read().strip().splitlines()[-lines:])


def plot(args, rows: list[dict], png: str) -> None:
    """Loss and accuracy against steps, one line per trainer, drawn in the `plot` venv (matplotlib)."""
    python = os.path.join(args.envs, "plot", "bin", "python")
    if not os.path.exists(python):
        print(f"no plot venv under {args.envs}: {png} not drawn")
        return
    data = json.dumps([{k: r.get(k) for k in ("trainer", "steps", "loss", "accuracy", "heldout_tau")} for r in rows])
    script = (
        "import json, sys, matplotlib; matplotlib.use('Agg'); import matplotlib.pyplot as plt\n"
        "rows, title, png = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]\n"
        "fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))\n"
        "for r in rows:\n"
        "    if not r.get('steps'): continue\n"
        "    label = r['trainer'] + (f\" (tau {r['heldout_tau']:.3f})\" if r.get('heldout_tau') else '')\n"
        "    a.plot(r['steps'], r['loss'], label=label); b.plot(r['steps'], r['accuracy'], label=label)\n"
        "a.set_xlabel('step'); a.set_ylabel('training loss (own objective)'); a.set_yscale('log')\n"
        "b.set_xlabel('step'); b.set_ylabel('training accuracy (top-1 vs data token)'); b.legend(fontsize=8)\n"
        "fig.suptitle(title); fig.tight_layout(); fig.savefig(png, dpi=90)\n")
    title = f"{args.drafter}: equal batches, same initial weights ({' '.join(args.recipe_override) or 'recipe'})"
    subprocess.run([python, "-c", script, data, title, png], check=False)
