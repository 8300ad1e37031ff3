"""Security and portability of the packages (drafters/, inference/, train/), checked on their source and by running
the CLI: no CUDA-only code outside guarded branches (AMD users run ROCm builds, where only vendor-neutral calls are
certain to work: torch.accelerator, device-type strings read from tensors), torch.load only with weights_only=True,
trust_remote_code only where the user passed it, no network at run time, recipe paths taken without shell expansion.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from train.config import load_recipe

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("drafters", "inference", "train")
DEBUG_RECIPE = str(ROOT / "recipes" / "debug" / "tiny_eagle3.yaml")
CUDA_MODULES = ("flash_attn", "triton", "apex", "xformers")


def package_sources():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield path, path.read_text()


def _dotted(node: ast.AST) -> str:
    """`torch.backends.cuda.matmul` for an Attribute chain, '' for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else ""


def _cuda_only(node: ast.AST) -> str | None:
    """What makes `node` CUDA-only, or None."""
    if isinstance(node, ast.Attribute) and not isinstance(getattr(node, "parent", None), ast.Attribute):
        name = _dotted(node)
        if name.startswith(("torch.cuda", "torch.backends.cuda", "torch.backends.cudnn")):
            return name
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "cuda":
        return ".cuda()"
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.split(":")[0] == "cuda":
        # comparing a device type with "cuda" is how a branch is guarded, not a CUDA-only call
        return None if isinstance(getattr(node, "parent", None), ast.Compare) else repr(node.value)
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [alias.name for alias in node.names]
        found = [name for name in names if name.split(".")[0] in CUDA_MODULES]
        return f"import {found[0]}" if found else None
    return None


def _guarded(node: ast.AST) -> bool:
    """Inside the body or else of an `if` (or a conditional expression), or of a `try` that catches ImportError:
    a branch taken only where the backend exists. The condition itself is not a guarded place: it runs everywhere,
    so it must be vendor-neutral (torch.accelerator.is_available(), `tensor.device.type == ...`)."""
    child, parent = node, getattr(node, "parent", None)
    while parent is not None:
        if isinstance(parent, (ast.If, ast.IfExp)) and child is not parent.test:
            return True
        if isinstance(parent, ast.Try) and child in parent.body and any(
                "ImportError" in ast.unparse(handler.type or ast.Name("BaseException"))
                or "ModuleNotFoundError" in ast.unparse(handler.type or ast.Name("BaseException"))
                for handler in parent.handlers):
            return True
        child, parent = parent, getattr(parent, "parent", None)
    return False


def cuda_only_calls(source: str, filename: str = "<source>") -> list[str]:
    """'file:line: what' for every CUDA-only construct outside a guarded branch."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            child.parent = node
    found = []
    for node in ast.walk(tree):
        what = _cuda_only(node)
        if what and not _guarded(node):
            found.append(f"{filename}:{node.lineno}: {what}")
    return sorted(set(found), key=lambda item: int(item.split(":")[1]))


def test_the_cuda_checker_flags_unguarded_calls_and_accepts_guarded_ones():
    flagged = cuda_only_calls("import torch\n"
                              "x = torch.zeros(1).cuda()\n"
                              "device = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
                              "torch.backends.cuda.matmul.allow_tf32 = True\n"
                              "import triton\n")
    assert flagged == ["<source>:2: .cuda()", "<source>:3: torch.cuda.is_available",
                       "<source>:4: torch.backends.cuda.matmul.allow_tf32", "<source>:5: import triton"]
    assert cuda_only_calls("import torch\n"
                           "if x.device.type == 'cuda':\n"
                           "    torch.cuda.empty_cache()\n"
                           "try:\n"
                           "    import flash_attn\n"
                           "except ImportError:\n"
                           "    flash_attn = None\n"
                           "if torch.accelerator.is_available():\n"
                           "    y = x.to(torch.accelerator.current_accelerator())\n") == []


def test_no_cuda_only_code_path_in_the_packages():
    found = [hit for path, source in package_sources() for hit in cuda_only_calls(source, str(path.relative_to(ROOT)))]
    assert not found, "CUDA-only code outside a guarded branch (use torch.accelerator):\n" + "\n".join(found)


def _calls(name: str):
    for path, source in package_sources():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call) and _dotted(node.func).endswith(name):
                yield f"{path.relative_to(ROOT)}:{node.lineno}", node


def test_torch_load_only_with_weights_only():
    """Weights are read through safetensors; a pickle is only ever unpickled as plain tensors."""
    unsafe = [where for where, call in _calls("torch.load")
              if not any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                         for k in call.keywords)]
    assert not unsafe, f"torch.load without weights_only=True: {unsafe}"
    pickles = [where for path, source in package_sources() for where in
               [f"{path.relative_to(ROOT)}:{n.lineno}" for n in ast.walk(ast.parse(source))
                if isinstance(n, (ast.Import, ast.ImportFrom)) and "pickle" in ast.unparse(n)]]
    assert not pickles, f"pickle imported: {pickles}"


def test_trust_remote_code_is_only_ever_the_users():
    """No code path switches trust_remote_code on by itself: every keyword passes a value that came from the user
    (target.trust_remote_code, --trust-remote-code), never the literal True, and the recipe's field is off unless
    set."""
    switched = []
    for path, source in package_sources():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.keyword) and node.arg == "trust_remote_code" and \
                    isinstance(node.value, ast.Constant) and node.value.value is True:
                switched.append(f"{path.relative_to(ROOT)}:{node.value.lineno}")
            if isinstance(node, ast.Dict) and any(isinstance(k, ast.Constant) and k.value == "trust_remote_code"
                                                  and isinstance(v, ast.Constant) and v.value is True
                                                  for k, v in zip(node.keys, node.values)):
                switched.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert switched == [], f"trust_remote_code=True in {switched}; it must only follow an explicit user request"
    assert load_recipe(DEBUG_RECIPE).target.trust_remote_code is False
    assert load_recipe(DEBUG_RECIPE, ["target.trust_remote_code=true"]).target.trust_remote_code is True


def test_a_target_with_remote_code_is_refused_without_running_it(tmp_path):
    """A model that needs its own code is refused by transformers without running it, with or without the user's
    trust_remote_code (which runs a shipped tokenizer only: the model is always transformers' own classes)."""
    import shutil

    from inference.assets.debug_target import resolve_debug_target
    from inference.engine.target import TargetModel

    marker = tmp_path / "code_ran"
    (tmp_path / "remote.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "not-in-transformers", "architectures": ["RemoteModel"],
        "auto_map": {"AutoConfig": "remote.RemoteConfig", "AutoModelForCausalLM": "remote.RemoteModel"}}))
    for name in os.listdir(resolve_debug_target("debug:tiny-llama")):
        if name.startswith(("tokenizer", "chat_template")):
            shutil.copy(os.path.join(resolve_debug_target("debug:tiny-llama"), name), tmp_path)
    for trusted in (False, True):
        with pytest.raises(ValueError, match="trust_remote_code"):
            TargetModel.from_pretrained(str(tmp_path), trust_remote_code=trusted)
        with pytest.raises(ValueError, match="trust_remote_code"):  # estimate's config-only path reads the config too
            TargetModel.from_config(str(tmp_path), trust_remote_code=trusted)
    assert not marker.exists()


@pytest.mark.parametrize("field,value", [("output.dir", "~/runs/x"), ("data.path", "$HOME/chats.jsonl"),
                                         ("features.cache_dir", "${SCRATCH}/cache"),
                                         ("target.name_or_path", "~/models/llama")])
def test_recipe_paths_are_not_shell_expanded(field, value):
    """A recipe is not a shell script: `~` and `$VAR` are refused, naming the field, instead of being expanded to
    whatever the environment of the process says (or, taken literally, creating a directory called `~`)."""
    with pytest.raises(ValueError, match=rf"{field.replace('.', '[.]')}: .*not shell-expanded"):
        load_recipe(DEBUG_RECIPE, [f"{field}={value}"])


def test_train_and_eval_run_with_the_network_disabled(tmp_path):
    """A real CLI run (train a few steps with a speculative-decoding probe, on the debug target) with every way out
    closed through the environment: offline hub flags and proxies pointing at a closed local port."""
    from inference.assets.debug_target import resolve_debug_target

    chats = tmp_path / "chats.jsonl"
    with open(chats, "w") as f:
        for i in range(12):
            f.write(json.dumps({"id": f"c{i}", "messages": [
                {"role": "user", "content": f"count to {i}"},
                {"role": "assistant", "content": " ".join(str(n) for n in range(i + 3))}]}) + "\n")
    unroutable = "http://127.0.0.1:9"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HTTP_PROXY": unroutable, "HTTPS_PROXY": unroutable, "http_proxy": unroutable, "https_proxy": unroutable,
           "ALL_PROXY": unroutable, "NO_PROXY": "", "no_proxy": "", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    overrides = [f"target.name_or_path={resolve_debug_target('debug:tiny-llama')}", f"data.path={chats}",
                 "data.num_samples=null", "data.num_eval_samples=2", f"data.cache_dir={tmp_path / 'datasets'}",
                 f"output.dir={tmp_path / 'run'}", "train.batch_size=2", "train.epochs=null", "train.max_steps=2",
                 "train.save_every=null", "train.eval_every=null", "train.keep_last=null", "schedule.warmup_steps=0",
                 "eval.num_prompts=1", "eval.max_new_tokens=8", "eval.num_batches=1"]
    result = subprocess.run([sys.executable, "-m", "train.cli", "train", DEBUG_RECIPE, *overrides], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
