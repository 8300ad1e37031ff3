"""Every accelerate config in recipes/accelerate parses with accelerate's own loader and says its world size.

accelerate's `num_processes` is the total over all machines (accelerate launch starts num_processes / num_machines
per machine), so a config's comment line `# World size: N (M machine(s) x P process(es)).` must give N =
num_processes, M = num_machines and M x P = N.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from accelerate.commands.config.config_args import load_config_from_file

CONFIG_DIR = Path(__file__).resolve().parent.parent / "recipes" / "accelerate"
CONFIGS = sorted(CONFIG_DIR.glob("*.yaml"))
WORLD_SIZE = re.compile(r"^# World size: (\d+) \((\d+) machines? x (\d+) process(?:es)?\)\.$", re.MULTILINE)


def test_the_configs_the_docs_name_exist():
    names = {path.name for path in CONFIGS}
    assert {"1gpu.yaml", "8gpu_ddp.yaml", "8gpu_fsdp.yaml", "8gpu_zero2.yaml", "8gpu_zero3.yaml",
            "2x8_mi300x_fsdp.yaml", "cpu_ddp2.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=[path.name for path in CONFIGS])
def test_config_parses_and_its_world_size_matches_its_comment(path):
    config = load_config_from_file(str(path))
    found = WORLD_SIZE.findall(path.read_text())
    assert len(found) == 1, f"{path.name}: needs exactly one '# World size: N (M machines x P processes).' line"
    world_size, num_machines, per_machine = (int(value) for value in found[0])
    assert config.num_processes == world_size, f"{path.name}: num_processes {config.num_processes} != {world_size}"
    assert config.num_machines == num_machines, f"{path.name}: num_machines {config.num_machines} != {num_machines}"
    assert num_machines * per_machine == world_size
    assert f"--config_file recipes/accelerate/{path.name}" in path.read_text()  # its launch line names itself


@pytest.mark.parametrize("path", CONFIGS, ids=[path.name for path in CONFIGS])
def test_sharded_configs_use_fsdp2_and_keep_the_target_out_of_zero_init(path):
    config = load_config_from_file(str(path))
    if config.distributed_type == "FSDP":
        assert config.fsdp_config["fsdp_version"] == 2
    if config.distributed_type == "DEEPSPEED":
        assert config.deepspeed_config["zero_stage"] in (2, 3)
        assert not config.deepspeed_config.get("zero3_init_flag", False)  # would partition the frozen target too
        assert "gradient_accumulation_steps" not in config.deepspeed_config  # accelerate passes the derived value


def test_slurm_script_is_valid_bash_launching_an_existing_config_and_resuming():
    """What a preempted SLURM job relies on: requeueable, SIGTERM before the limit, resume from the latest
    checkpoint, requeue on the preemption exit status; its default accelerate config exists."""
    import subprocess

    script = CONFIG_DIR.parent / "slurm" / "train_multinode.sbatch"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    for needed in ("#SBATCH --requeue", "#SBATCH --signal=TERM@", "train.resume_from=latest", "scontrol requeue",
                   "accelerate launch --config_file"):
        assert needed in text, needed
    default_config = re.search(r"CONFIG=\$\{CONFIG:-(\S+)\}", text).group(1)
    assert (CONFIG_DIR.parent.parent / default_config).is_file()
    from train.loop import PREEMPTED_EXIT_CODE

    assert f'"$status" -eq {PREEMPTED_EXIT_CODE}' in text
