"""Shared fixtures for tests/grading: the embedded SmolLM2 judge (loaded once) and IFBench sample outputs."""

import json

import pytest


@pytest.fixture(scope="session")
def smollm2_judge():
    from setgrpo_verl.grading import LocalHFJudge

    return LocalHFJudge(temperature=1.0, batch_size=8, max_question_tokens=96, max_response_tokens=96)


@pytest.fixture(scope="session")
def ifbench_samples() -> dict[str, str]:
    """prompt -> IFBench's sample response (a real model output, shipped in setgrpo_verl/data)."""
    from setgrpo_verl.grading.convert import ifbench_data_file

    text = ifbench_data_file("IFBench_sample_output.jsonl").read_text(encoding="utf-8")
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return {r["prompt"]: r["response"] for r in rows}
