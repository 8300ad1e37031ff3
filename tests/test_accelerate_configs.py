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
        # the recipe fills these before prepare (train/fit/launch.py fill_deepspeed_config); a value here that
        # disagreed with the recipe would stop the run
        for key in ("gradient_accumulation_steps", "gradient_clipping", "train_micro_batch_size_per_gpu"):
            assert key not in config.deepspeed_config, key


def test_slurm_script_is_valid_bash_launching_an_existing_config_and_resuming():
    """What a preempted SLURM job relies on: requeueable, warned before the limit and passing SIGTERM on to the
    training, resume from the latest checkpoint, requeue when a signal arrived (or a one-process run exited with the
    preemption status); its default accelerate config exists."""
    import subprocess

    script = CONFIG_DIR.parent / "slurm" / "train_multinode.sbatch"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    for needed in ("#SBATCH --requeue", "#SBATCH --signal=B:USR1@", 'scancel --signal=TERM "$SLURM_JOB_ID"\' USR1',
                   "trap 'stopping=1' TERM", "train.resume_from=latest", "scontrol requeue",
                   "accelerate launch --config_file"):
        assert needed in text, needed
    default_config = re.search(r"CONFIG=\$\{CONFIG:-(\S+)\}", text).group(1)
    assert (CONFIG_DIR.parent.parent / default_config).is_file()
    from train.fit.loop import PREEMPTED_EXIT_CODE

    assert f'"$status" -eq {PREEMPTED_EXIT_CODE}' in text


def _fake_slurm(bin_dir, calls):
    """srun / scancel / scontrol stand-ins: srun records its pid and runs until signalled (exit 1, as a
    multi-process launcher does after SIGTERM) or for FAKE_SRUN_STATUS's exit status at once; the others record."""
    scripts = {
        "srun": f'echo $$ > {calls}.srun\n[ -n "${{FAKE_SRUN_STATUS:-}}" ] && exit "$FAKE_SRUN_STATUS"\n'
                "sleep 30 &\ntrap 'kill $!; exit 1' TERM\nwait\n",
        "scancel": f'echo "scancel $*" >> {calls}\nkill -TERM "$(cat {calls}.srun)"\n',
        "scontrol": f'if [ "$1" = show ]; then echo node1; else echo "scontrol $*" >> {calls}; fi\n',
    }
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text("#!/bin/bash\n" + body)
        path.chmod(0o755)


def _run_sbatch(work, status=None, signal_script=None, signal_step=False):
    """Run the sbatch script against the stand-ins; optionally signal the script (and the step, as SLURM does on
    preemption) once the step runs. Returns (exit status, recorded calls, output)."""
    import os
    import signal
    import subprocess
    import time

    bin_dir, calls = work / "bin", work / "calls"
    bin_dir.mkdir(parents=True)
    _fake_slurm(bin_dir, calls)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "RECIPE": "r.yaml", "SLURM_JOB_ID": "7",
           "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_NNODES": "2"}
    if status is not None:
        env["FAKE_SRUN_STATUS"] = str(status)
    script = CONFIG_DIR.parent / "slurm" / "train_multinode.sbatch"
    process = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    if signal_script is not None:
        step_pid = work / "calls.srun"
        while not step_pid.exists() or not step_pid.read_text().strip():
            time.sleep(0.05)
        time.sleep(0.2)  # the script is now waiting on the step
        process.send_signal(signal_script)
        if signal_step:
            os.kill(int(step_pid.read_text()), signal.SIGTERM)
    output, _ = process.communicate(timeout=60)
    recorded = calls.read_text().splitlines() if calls.exists() else []
    return process.returncode, recorded, output


def test_slurm_script_passes_the_time_limit_warning_on_and_requeues(tmp_path):
    import signal

    status, calls, output = _run_sbatch(tmp_path, signal_script=signal.SIGUSR1)
    assert calls == ["scancel --signal=TERM 7", "scontrol requeue 7"], output
    assert status == 1  # what a multi-process launcher returns after its processes saved and stopped


def test_slurm_script_requeues_after_preemption_but_not_after_a_failure(tmp_path):
    import signal

    status, calls, output = _run_sbatch(tmp_path / "preempted", signal_script=signal.SIGTERM, signal_step=True)
    assert calls == ["scontrol requeue 7"] and status == 1, output
    status, calls, output = _run_sbatch(tmp_path / "failed", status=2)
    assert calls == [] and status == 2, output
    status, calls, output = _run_sbatch(tmp_path / "one_process", status=143)
    assert calls == ["scontrol requeue 7"] and status == 143, output
