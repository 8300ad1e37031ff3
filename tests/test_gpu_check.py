"""benchmarks/gpu_check.sh: its CPU dry run passes every section, so the GPU check cannot rot between GPU runs, and a
run always leaves its three files (summary.md, summary.json, logs.tgz), whatever the deadline."""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = list("ABCDEFGH")
RESULTS = ["logs.tgz", "summary.json", "summary.md"]


H_FAMILIES = ("tiny-qwen3.5", "tiny-gemma4", "tiny-nemotron-h", "tiny-llama4-chunked")  # one per mechanism


def gpu_check(tmp_path: Path, *args: str, timeout: float) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "out"
    env = {**os.environ, "GPU_CHECK_TIMEOUT": str(int(timeout)),  # the script's outer limit, past the harness's own
           "GPU_CHECK_H_FAMILIES": ",".join(H_FAMILIES)}  # H's other families: tests/test_families*.py, float64
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--cpu", "--work", str(tmp_path / "work"),
                           *args, str(out)], capture_output=True, text=True, timeout=timeout + 60, env=env)
    assert sorted(os.listdir(out)) == RESULTS, proc.stderr[-2000:]
    return proc, json.loads((out / "summary.json").read_text())


def test_a_run_without_time_skips_every_section_and_still_leaves_its_three_files(tmp_path):
    proc, summary = gpu_check(tmp_path, "--deadline", "0", timeout=300)
    assert summary["finished"] and summary["mode"] == "cpu"
    assert [summary["sections"][s]["status"] for s in SECTIONS] == ["skipped"] * len(SECTIONS)
    assert proc.returncode == len(SECTIONS)  # the exit status counts the sections that did not pass
    assert "| A. environment" in (tmp_path / "out" / "summary.md").read_text()


@pytest.mark.slow
def test_the_cpu_dry_run_passes_every_section(tmp_path):
    proc, summary = gpu_check(tmp_path, "--slack", "6", timeout=6 * 280 + 60)  # a loaded machine: time fails nothing
    failed = {s: summary["sections"][s]["cause"] for s in SECTIONS if summary["sections"][s]["status"] != "ok"}
    assert failed == {} and proc.returncode == 0, (failed, proc.stdout[-3000:])
    assert summary["finished"] and summary["machine"]["device"] == "cpu"
    sections = summary["sections"]
    assert set(sections["B"]["numbers"]) == {"eagle3", "peagle", "dflash", "dspark", "mtp", "medusa", "assistant"}
    assert all(kind["resume_max_abs_weight_change"] == 0.0 for kind in sections["B"]["numbers"].values())
    assert sections["D"]["numbers"]["eval_float32"]["eagle3:final"]["greedy_exact_match"] == 1.0
    assert all("error" not in sections["H"]["numbers"][name] for name in H_FAMILIES)
    with tarfile.open(tmp_path / "out" / "logs.tgz") as archive:
        names = archive.getnames()
    assert "logs/worker-1.log" in names and "logs/d_eval_float32.log" in names


def test_a_new_run_keeps_the_runs_of_the_sections_it_does_not_run(tmp_path):
    """`--sections D` on the machine where an earlier call ran B decodes B's drafters: a run clears its logs and the
    runs of its own sections only, and every run when the earlier ones were made in the other mode (CPU / GPU)."""
    from benchmarks.gpu_check.__main__ import clear_work

    work = tmp_path / "work"
    for part in ("logs/worker-1.log", "runs/b/eagle3/final/config.json", "runs/d/float32/report.json",
                 "cache/kernels.json"):
        (work / part).parent.mkdir(parents=True, exist_ok=True)
        (work / part).write_text("{}")
    clear_work(str(work), "gpu", list("ABCDEFG"))  # the first run: everything it made is gone, caches stay
    assert sorted(os.listdir(work / "runs")) == ["mode"] and (work / "cache/kernels.json").exists()
    assert not (work / "logs").exists()
    (work / "runs/b/eagle3/final").mkdir(parents=True)
    (work / "runs/d").mkdir()
    clear_work(str(work), "gpu", ["D"])  # D again, alone: B's drafters stay, D's own runs go
    assert (work / "runs/b/eagle3/final").is_dir() and not (work / "runs/d").exists()
    clear_work(str(work), "cpu", ["D"])  # a dry run after a GPU run: nothing of the GPU's is decoded as its own
    assert sorted(os.listdir(work / "runs")) == ["mode"] and (work / "runs/mode").read_text() == "cpu"


def test_the_hf_reference_emits_eos_where_the_target_picks_it():
    """D's and H's reference (HF generate, no EOS) keeps the target's argmax where it is the EOS token: tiny-gpt-oss
    puts <|im_end|> (258) 0.6 logits ahead at the third new token of H's first prompt. With `min_new_tokens` it
    masked that logit and generate chose another token, a divergence of 18 ulps from the engine in bf16."""
    import torch

    from benchmarks.gpu_check.d_lossless import hf_greedy
    from benchmarks.gpu_check.h_families import prompts
    from inference.engine.target import TargetModel

    target = TargetModel.from_pretrained("debug:tiny-gpt-oss", dtype=torch.float32)
    row = hf_greedy(target, prompts()[:1], 24)[0]
    assert len(row) == 24 and row[2] == target.tokenizer.convert_tokens_to_ids("<|im_end|>") == 258
