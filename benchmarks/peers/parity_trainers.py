"""One trainer of benchmarks/peers/peer_train_parity.py on the dumped batches, in whichever venv holds it:

    python benchmarks/peers/parity_trainers.py TRAINER --dump DUMP.pt --init INIT_DIR --steps N --out OUT_DIR

TRAINER: ours | specforge | modelopt | speculators. Each builds its own model class from the same initial weights
(INIT_DIR: our initial drafter in native format and in the layout the peer loads), runs ITS training forward and loss
on each dumped batch with the dumped anchors (the peer's anchor sampler is replaced by a function returning them),
and the shared loop of parity_common.train steps it. OUT_DIR gets curve.json and the trained weights in a layout our
readers load (drafters/dflash/export.py, drafters/dspark/export.py). The peers run on CPU with sdpa attention and
their torch losses (SpecForge's flex-attention and Triton paths are CUDA-only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.peers.parity_common import Capture, frozen_modules, train  # noqa: E402


def _features(batch):
    return batch["features"].float()


def _loss_mask(batch):
    return (batch["loss_mask"] * batch["attention_mask"]).float()


def _zlab_config(init_dir: str, sub: str):
    from transformers import Qwen3Config

    with open(os.path.join(init_dir, sub, "config.json")) as f:
        raw = json.load(f)
    config = Qwen3Config(**raw)
    config._attn_implementation = "sdpa"
    return config, raw


def _init_state(init_dir: str, sub: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(init_dir, sub, "model.safetensors"))


def _save_zlab(directory: str, state: dict, raw_config: dict) -> None:
    """config.json + model.safetensors: the z-lab layout (which ModelOpt's exporter writes too) or DeepSpec's."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in state.items() if "rotary" not in k},
              os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(raw_config, f, indent=1)


class Ours:
    """draftsmith's DFlash / DSpark: block_logits / block_outputs on the given anchors, then the drafter's loss."""

    def __init__(self, dump, init_dir, overrides=()):
        import dataclasses

        import yaml

        from drafters import load_drafter
        from inference.engine.target import TargetModel

        self.kind = dump["meta"]["kind"]
        info = TargetModel.from_pretrained(dump["meta"]["target"]).target_info()
        self.model = load_drafter(os.path.join(init_dir, "native"), info).train()
        values = {key: yaml.safe_load(value) for key, _, value in (item.partition("=") for item in overrides)}
        self.model.config = dataclasses.replace(self.model.config, **values)  # loss-side settings (loss_weighting)
        self.layer_ids = dump["meta"]["layer_ids"]

    def parameters(self):
        return self.model.parameters()

    def _batch(self, batch):
        dim = batch["last_hidden"].shape[-1]
        hidden = {i: chunk for i, chunk in zip(self.layer_ids, batch["features"].float().split(dim, dim=-1))}
        return {**batch, "hidden": hidden, "final_hidden": batch["last_hidden"].float()}

    def step(self, batch, anchors, valid):
        batch = self._batch(batch)
        if self.kind == "dflash":
            out = self.model.block_logits(batch, anchors, valid)
        else:
            out = self.model.block_outputs(batch, anchors, valid)
        logits = out.logits  # computed once here; the loss then reads slices of it (drafters/output.DraftOutput)
        loss, _ = self.model.loss(out, batch)
        ids = out.target_ids(logits.detach().argmax(dim=-1))  # [N, K]
        draft = torch.full((*anchors.shape, ids.shape[1]), -1, dtype=torch.long)
        rows, cols = valid.nonzero(as_tuple=True)
        draft[rows, cols] = ids
        return loss, draft

    def save(self, directory):
        self.model.save(directory, "native")


class Eagle3(Ours):
    """draftsmith's EAGLE-3 (recipes/smollm2/eagle3.yaml's drafter: TTT 3 at 0.8^k, an 8k draft vocabulary picked
    from the dumped batches' loss tokens) on the same batches, steps and optimizer settings, reading 3 of the dumped
    feature layers (the recipe's [2, 15, 27] -> the dump's nearest [2, 15, 28]): the equal-data baseline the block
    drafters are held against. Its cells are mapped onto the block layout (anchor = the last known token, depth d
    predicts anchor + 1 + d), so its accuracy is counted on the same cells at depths < TTT steps (deeper ones: 0)."""

    def __init__(self, dump, init_dir, overrides=()):
        import yaml

        from drafters import DRAFTERS
        from drafters.eagle3.config import Eagle3Config
        from inference.engine.target import TargetModel

        info = TargetModel.from_pretrained(dump["meta"]["target"]).target_info()
        self.layer_ids = dump["meta"]["layer_ids"]
        with open(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                               "recipes", "smollm2", "eagle3.yaml")) as f:
            settings = dict(yaml.safe_load(f)["drafter"])
        settings.pop("kind")
        settings["layer_ids"] = [min(self.layer_ids, key=lambda i: abs(i - wanted)) for wanted in settings["layer_ids"]]
        settings.update({key: yaml.safe_load(value) for key, _, value in (item.partition("=") for item in overrides)})
        self.kind, self.depths = "eagle3", dump["meta"]["num_depths"]
        torch.manual_seed(0)
        self.model = DRAFTERS["eagle3"](Eagle3Config(**settings), info).train()
        counts = torch.zeros(info.vocab_size, dtype=torch.long)
        for batch in dump["batches"]:
            kept = batch["input_ids"][(batch["loss_mask"] * batch["attention_mask"]).bool()]
            counts += torch.bincount(kept, minlength=info.vocab_size)
        self.model.init_from_data(counts)

    def step(self, batch, anchors, valid):
        batch = self._batch(batch)
        out = self.model(batch)
        logits = out.logits
        loss, _ = self.model.loss(out, batch)
        ids = out.target_ids(logits.detach().argmax(dim=-1))  # [N, K]: row n = label position s + 1 at every k
        depths = ids.shape[1]
        # the block cell (b, anchor p, depth d) is the EAGLE-3 cell of row b with label position p + 1 + d at depth d
        lookup = {}
        for n, (b, label) in enumerate(zip(out.batch_index.tolist(), out.label_position[:, 0].tolist())):
            lookup[(b, label)] = n
        draft = torch.full((*anchors.shape, self.depths), -1, dtype=torch.long)
        for b, a in valid.nonzero().tolist():
            for d in range(depths):
                n = lookup.get((b, int(anchors[b, a]) + 1 + d))
                if n is not None and out.depth_valid[n, d]:
                    draft[b, a, d] = ids[n, d]
        return loss, draft


def _given_anchors(anchors, valid):
    return lambda *args, **kwargs: (anchors, valid)


class SpecForge:
    """SpecForge 0.2.0: DFlashDraftModel / DSparkDraftModel inside OnlineDFlashModel / OnlineDSparkModel (sdpa)."""

    def __init__(self, dump, init_dir):
        from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel, OnlineDSparkModel

        meta = dump["meta"]
        self.kind = meta["kind"]
        embed, head = frozen_modules(dump)
        self.head = Capture(head)
        if self.kind == "dflash":
            from specforge.modeling.draft.dflash import DFlashDraftModel

            self.config, self.raw = _zlab_config(init_dir, "dflash")
            self.draft = DFlashDraftModel(self.config)
            self.draft.load_state_dict(_init_state(init_dir, "dflash"), strict=False)
            self.wrapper = OnlineDFlashModel(self.draft, self.head, embed, meta["mask_token_id"],
                                             block_size=meta["block_size"], attention_backend="sdpa",
                                             num_anchors=meta["num_anchors"], loss_decay_gamma=meta["gamma"],
                                             loss_type=meta.get("specforge_loss", "dflash"))
        else:
            from specforge.modeling.draft.dspark import DSparkDraftModel

            self.config, self.raw = _zlab_config(init_dir, "deepspec")
            # SpecForge reads the DSpark fields from dflash_config; DeepSpec's layout has them at the top level
            self.config.dflash_config = {key: self.raw[key] for key in (
                "target_layer_ids", "mask_token_id", "markov_rank", "markov_head_type", "enable_confidence_head",
                "confidence_head_with_markov")}
            self.draft = DSparkDraftModel(self.config)
            self.init_state = _init_state(init_dir, "deepspec")
            result = self.draft.load_state_dict(self.init_state, strict=False)
            unexpected = set(result.unexpected_keys) - {"embed_tokens.weight", "lm_head.weight"}
            if result.missing_keys or unexpected:
                raise SystemExit(f"specforge dspark: initial weights do not fit: {result}")
            self.wrapper = OnlineDSparkModel(self.draft, self.head, embed, meta["mask_token_id"],
                                             block_size=meta["block_size"], attention_backend="sdpa",
                                             num_anchors=meta["num_anchors"], loss_decay_gamma=meta["gamma"])

    def parameters(self):
        return self.draft.parameters()

    def step(self, batch, anchors, valid):
        self.wrapper._sample_anchor_positions = _given_anchors(anchors, valid)
        self.head.reset()
        if self.kind == "dflash":
            loss, _, _ = self.wrapper(batch["input_ids"], _features(batch), _loss_mask(batch))
            logits = self.head.first.view(*anchors.shape, -1, self.head.first.shape[-1])  # [B, A, S, V]
            return loss, logits[:, :, 1:].argmax(dim=-1)
        loss, _, _ = self.wrapper(batch["input_ids"], _features(batch), _loss_mask(batch),
                                  target_last_hidden_states=batch["last_hidden"].float())
        return loss, self._dspark_ids(batch, anchors)

    def _dspark_ids(self, batch, anchors):
        """The draft argmax of the Markov-corrected logits, teacher-forced on the true previous tokens (as trained)."""
        base = self.head.first.view(*anchors.shape, -1, self.head.first.shape[-1])  # [B, A, S, V]
        seq_len = batch["input_ids"].shape[1]
        positions = (anchors.unsqueeze(-1) + torch.arange(base.shape[2])).clamp(max=seq_len - 1)  # a + k
        rows = torch.arange(anchors.shape[0]).view(-1, 1, 1).expand_as(positions)
        prev = batch["input_ids"][rows, positions]  # token before each label a + k + 1
        with torch.no_grad():
            logits = self.draft.apply_logits_head(base, prev_token_ids=prev, hidden_states=None)
        return logits.argmax(dim=-1)

    def save(self, directory):
        if self.kind == "dflash":
            self.draft.save_pretrained(directory, safe_serialization=True)
        else:  # DeepSpec's layout (what our DSpark reader loads), with the frozen target tensors it carries
            frozen = {k: self.init_state[k] for k in ("embed_tokens.weight", "lm_head.weight")}
            _save_zlab(directory, {**self.draft.state_dict(), **frozen}, self.raw)


class ModelOpt:
    """Model Optimizer 0.47: its DFlashModule and HFDFlashModel's training pieces (noise embedding, positions, mask,
    _compute_loss with its defaults: logit distillation and D-PACE), called on a stand-in for the converted HF model,
    since HFDFlashModel itself only exists around a converted base model's forward."""

    def __init__(self, dump, init_dir):
        from modelopt.torch.speculative.plugins.hf_dflash import HFDFlashModel
        from modelopt.torch.speculative.plugins.modeling_dflash import DFlashModule

        meta = dump["meta"]
        if meta["kind"] != "dflash":
            raise SystemExit("modelopt: only the DFlash adapter is wired (see docs/benchmarks.md)")
        self.hf = HFDFlashModel
        self.config, self.raw = _zlab_config(init_dir, "dflash")
        self.config.block_size = meta["block_size"]
        self.config.target_layer_ids = self.raw["dflash_config"]["target_layer_ids"]
        self.module = DFlashModule(self.config)
        self.module.load_state_dict(_init_state(init_dir, "dflash"), strict=False)
        embed, head = frozen_modules(dump)
        self.head = Capture(head)
        self.shim = types.SimpleNamespace(
            dflash_block_size=meta["block_size"], mask_token_id=meta["mask_token_id"],
            dflash_draft_attention="bidirectional", dflash_swa_window_size=None,
            dflash_loss_objective=meta.get("modelopt_objective", "dpace"), dflash_dpace_alpha=0.5,
            dflash_loss_decay_factor=meta["gamma"], _base_model_embeddings=embed, _base_model_lm_head=self.head,
            dflash_self_logit_distillation=meta.get("modelopt_kd", True))
        self.lm_head_weight = head.weight

    def parameters(self):
        return self.module.parameters()

    def step(self, batch, anchors, valid):
        s, hf = self.shim, self.hf
        input_ids = batch["input_ids"]
        seq_len, n = input_ids.shape[1], anchors.shape[1]
        features = _features(batch)
        noise = hf._build_noise_embedding(s, input_ids, anchors, valid, n)
        positions = hf._build_position_ids(s, seq_len, anchors, input_ids.device)
        mask = hf._build_draft_attention_mask(s, seq_len, anchors, valid, n, features.dtype, input_ids.device)
        hidden = self.module(noise_embedding=noise, target_hidden=features, position_ids=positions,
                             attention_mask=mask)
        logits = s._base_model_lm_head.inner(hidden)
        base_logits = F.linear(batch["last_hidden"].float(), self.lm_head_weight) if s.dflash_self_logit_distillation \
            else None
        loss, _ = hf._compute_loss(s, logits, input_ids, anchors, valid, _loss_mask(batch), base_logits)
        ids = logits.detach().view(*anchors.shape, -1, logits.shape[-1])[:, :, 1:].argmax(dim=-1)
        return loss, ids

    def save(self, directory):
        _save_zlab(directory, self.module.state_dict(), self.raw)


TRAINERS = {"ours": Ours, "eagle3": Eagle3, "specforge": SpecForge, "modelopt": ModelOpt}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trainer", help="ours, ours-VARIANT (with --set), eagle3, specforge, modelopt or speculators")
    parser.add_argument("--dump", required=True)
    parser.add_argument("--init", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--set", action="append", default=[], metavar="key=value",
                        help="our drafter's config for an ours-VARIANT trainer, e.g. loss_weighting=dpace")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dump = torch.load(args.dump, weights_only=False)
    if args.trainer == "ours" or args.trainer.startswith("ours-"):
        adapter = Ours(dump, args.init, args.set)
    elif args.trainer == "eagle3":
        adapter = Eagle3(dump, args.init, args.set)
    elif args.trainer in TRAINERS:
        adapter = TRAINERS[args.trainer](dump, args.init)
    else:
        raise SystemExit(f"parity_trainers: unknown trainer {args.trainer!r}")
    train(adapter, dump, args.steps, os.path.join(args.out, "curve.json"), args.trainer,
          weights_dir=os.path.join(args.out, "weights"))


if __name__ == "__main__":
    main()
