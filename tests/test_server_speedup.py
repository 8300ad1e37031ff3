"""benchmarks/peers/server_speedup.py without vLLM: its input checks and the arithmetic of its JSON (synthetic passes)."""

import importlib.util
import os

import pytest

PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "peers", "server_speedup.py")
spec = importlib.util.spec_from_file_location("server_speedup", PATH)
server_speedup = importlib.util.module_from_spec(spec)
spec.loader.exec_module(server_speedup)


def one_pass(tokens_per_prompt: list[int], seconds: float, drafts=0, accepted=0, draft_tokens=0) -> dict:
    return {"tokens": [list(range(n)) for n in tokens_per_prompt], "seconds": seconds, "drafts": drafts,
            "accepted": accepted, "draft_tokens": draft_tokens}


def test_summary_is_medians_of_tokens_per_second_and_counter_ratios():
    passes = {
        ("ours", 0): [one_pass([10, 10], 2.0), one_pass([10, 10], 4.0), one_pass([10, 10], 1.0)],  # 10, 5, 20
        ("vllm", 0): [one_pass([10, 10], 1.0)],  # 20
        ("ours", 3): [one_pass([10, 10], 1.0, drafts=8, accepted=12, draft_tokens=24)],  # 20 tok/s, tau 2.5
        ("vllm", 3): [one_pass([10, 9], 0.5, drafts=8, accepted=12, draft_tokens=24)],  # 38 tok/s
    }
    result = server_speedup.summarise(passes, [3])
    assert result["ar_tokens_per_s_ours"] == pytest.approx(10.0)
    assert result["ar_tokens_per_s_vllm"] == pytest.approx(20.0)
    row = result["rows"][0]
    assert row["k"] == 3
    assert row["speedup_ours"] == pytest.approx(2.0) and row["speedup_vllm"] == pytest.approx(38 / 20)
    assert row["tau_ours"] == pytest.approx(2.5) and row["tau_vllm"] == pytest.approx(2.5)
    assert row["acceptance_rate_ours"] == pytest.approx(0.5)
    assert row["identical_outputs"] == "1/2"


@pytest.mark.parametrize("flags, message", [(["--k", "0,3"], "--k"), (["--k", "x"], "--k"),
                                            (["--num-prompts", "0"], "--num-prompts"), ([], "--drafter")])
def test_bad_input_names_the_flag(tmp_path, flags, message, capsys):
    drafter = tmp_path / "export"
    argv = ["--target", "t", "--drafter", str(drafter), "--prompts", "mt_bench", "--out", str(tmp_path / "o.json")]
    if message != "--drafter":
        drafter.mkdir()
        (drafter / "config.json").write_text("{}")
    assert server_speedup.main(argv + flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
