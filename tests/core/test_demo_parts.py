"""Unit tests of the demo's parts: reward, advantages, GRPO loss, policy logprobs, report, CLI
checks. No engine is started here (tests/backends/*/test_demo_smoke.py runs the real loop)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from rlinfer_core.errors import BackendNotFound, InvalidRequest  # noqa: E402
from rlinfer_demo.cli import check_backend, check_model  # noqa: E402
from rlinfer_demo.loop import DemoConfig, RunInfo, StepRecord, build_requests, logprob_gap  # noqa: E402
from rlinfer_demo.report import summarize, write_plots, write_report  # noqa: E402
from rlinfer_demo.task import DigitTask, is_digit_text  # noqa: E402
from rlinfer_demo.trainer import Policy, group_advantages, grpo_loss, token_logprobs  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rlinfer_core.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


# --- task ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [("7", True), (" 15", True), ("0", True), ("", False), (" ", False), ("a1", False), ("١", False), ("1.5", False)],
)
def test_is_digit_text(text: str, expected: bool) -> None:
    assert is_digit_text(text) is expected


def test_reward_is_fraction_of_digit_tokens() -> None:
    task = DigitTask(prompts=[[1, 2]], digit_token_ids={10, 11})
    assert task.reward([10, 11, 10, 11]) == 1.0
    assert task.reward([10, 3, 4, 5]) == 0.25
    assert task.reward([3]) == 0.0
    assert task.reward([]) == 0.0


def test_task_from_tiny_tokenizer(tiny: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    task = DigitTask.from_tokenizer(tokenizer, num_prompts=10)
    assert len(task.prompts) == 10
    assert all(p and all(0 <= t < len(tokenizer) for t in p) for p in task.prompts)
    decoded = {tokenizer.decode([i]).strip() for i in task.digit_token_ids}
    assert set("0123456789") <= decoded
    assert all(d.isdigit() for d in decoded)
    assert 0 < len(task.digit_token_ids) < len(tokenizer) // 4  # rare at start: there is room to learn


# --- GRPO math -----------------------------------------------------------------------------------


def test_group_advantages_normalise_per_group() -> None:
    rewards = torch.tensor([0.0, 1.0, 0.5, 0.5, 2.0, 4.0])
    adv = group_advantages(rewards, group_size=2)
    assert torch.allclose(adv, torch.tensor([-1.0, 1.0, 0.0, 0.0, -1.0, 1.0]), atol=1e-5)


def test_group_advantages_zero_mean_unit_std_and_no_nan() -> None:
    rewards = torch.rand(32, generator=torch.Generator().manual_seed(0))
    adv = group_advantages(rewards, group_size=8).view(4, 8)
    assert torch.allclose(adv.mean(dim=1), torch.zeros(4), atol=1e-5)
    assert torch.allclose(adv.std(dim=1, unbiased=False), torch.ones(4), atol=1e-4)
    assert torch.equal(group_advantages(torch.full((4,), 0.3), 4), torch.zeros(4))


def test_group_advantages_rejects_ragged_groups() -> None:
    with pytest.raises(ValueError, match="multiple of 3"):
        group_advantages(torch.zeros(4), group_size=3)


def test_grpo_loss_on_policy_is_reinforce() -> None:
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([2.0, -1.0])
    loss = grpo_loss(logprobs, logprobs.detach(), adv, mask)
    assert loss.item() == pytest.approx(-(3 * 2.0 + 2 * -1.0) / 5)
    loss.backward()
    expected = -(adv.unsqueeze(1) * mask) / 5
    assert torch.allclose(logprobs.grad, expected)


def test_grpo_loss_clips_large_ratios() -> None:
    old = torch.tensor([[-1.0]])
    new = (old + 1.0).requires_grad_(True)  # ratio e > 1.2: no gradient for a positive advantage
    loss = grpo_loss(new, old, torch.tensor([1.0]), torch.ones(1, 1))
    loss.backward()
    assert loss.item() == pytest.approx(-1.2)
    assert new.grad is not None and new.grad.abs().max().item() == 0.0


def test_token_logprobs_match_log_softmax() -> None:
    logits = torch.randn(5, 7, generator=torch.Generator().manual_seed(1))
    targets = torch.tensor([0, 6, 3, 3, 1])
    expected = torch.log_softmax(logits, -1)[torch.arange(5), targets]
    assert torch.allclose(token_logprobs(logits, targets), expected)


# --- policy --------------------------------------------------------------------------------------


def test_policy_logprobs_do_not_depend_on_batch_padding(tiny: Path) -> None:
    policy = Policy(tiny)
    prompts = [[5, 6, 7], [8, 9]]
    completions = [[10, 11], [12, 13, 14, 15, 16]]
    with torch.no_grad():
        batched, mask = policy.completion_logprobs(prompts, completions)
        alone, _ = policy.completion_logprobs(prompts[:1], completions[:1])
    assert mask.tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert torch.allclose(batched[0, :2], alone[0, :2], atol=1e-6)
    assert batched[0, 2:].abs().sum().item() == 0.0
    assert (batched[1] < 0).all()


def test_policy_train_step_raises_logprob_of_advantaged_sample(tiny: Path) -> None:
    policy = Policy(tiny, lr=1e-2)
    prompts = [[5, 6, 7]] * 2
    completions = [[20, 21, 22], [30, 31, 32]]
    with torch.no_grad():
        before, _ = policy.completion_logprobs(prompts, completions)
    policy.train_step(prompts, completions, before, torch.tensor([1.0, -1.0]))
    with torch.no_grad():
        after, _ = policy.completion_logprobs(prompts, completions)
    assert after[0].sum() > before[0].sum()
    assert after[1].sum() < before[1].sum()
    names = [n for n, _ in policy.named_parameters()]
    assert "lm_head.weight" in names and "model.embed_tokens.weight" in names


# --- loop helpers --------------------------------------------------------------------------------


def _cfg(tmp: Path, **kw: Any) -> DemoConfig:
    return DemoConfig(backend="x", model=str(tmp), out=str(tmp), **kw)


def test_build_requests_n_or_repeated(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, group_size=4, max_tokens=5)
    multi = build_requests([[1, 2], [3]], cfg, multi_sample=True, step=0)
    assert [r.sampling.n for r in multi] == [4, 4]
    assert all(r.sampling.temperature == 1.0 and r.sampling.max_tokens == 5 for r in multi)
    single = build_requests([[1, 2], [3]], cfg, multi_sample=False, step=0)
    assert [r.prompt_token_ids for r in single] == [(1, 2)] * 4 + [(3,)] * 4
    assert len({r.request_id for r in single}) == 8


def test_logprob_gap_ignores_padding() -> None:
    trainer = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    assert logprob_gap([[-1.0, -2.000002], [-0.5]], trainer) == pytest.approx(2e-6, rel=1e-3)


# --- report --------------------------------------------------------------------------------------


def _records(rewards: list[float], gap: float = 1e-6) -> list[StepRecord]:
    return [
        StepRecord(i, i, r, 0.0, 1.0, gap, 96, 0.1, 0.2, 0.01 + i * 1e-3, 0.0, "not supported on cpu (skipped)")
        for i, r in enumerate(rewards)
    ]


def test_summary_verdicts() -> None:
    rising = summarize(_records([0.05, 0.05, 0.06, 0.3, 0.6, 0.9, 0.95, 0.97]), 1e-5)
    assert rising["reward_rose"] and rising["parity_ok_every_step"]
    assert rising["reward_first"] == pytest.approx((0.05 + 0.05 + 0.06) / 3)
    assert rising["reward_last"] == pytest.approx((0.9 + 0.95 + 0.97) / 3)
    flat = summarize(_records([0.05] * 8, gap=3e-5), 1e-5)
    assert not flat["reward_rose"] and not flat["parity_ok_every_step"]


def test_report_json_and_plots(tmp_path: Path) -> None:
    info = RunInfo("x", "1.0", "cpu", {}, "not supported on cpu (skipped)", 1.5)
    records = _records([0.1, 0.2, 0.5, 0.8])
    write_plots(tmp_path, info, records, 1e-5)
    report = write_report(tmp_path, _cfg(tmp_path, steps=4), info, records, 9.0)
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk == json.loads(json.dumps(report))
    assert len(on_disk["steps"]) == 4 and on_disk["summary"]["reward_rose"]
    for name in on_disk["plots"]:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- CLI checks ----------------------------------------------------------------------------------


def test_check_model_errors(tmp_path: Path, tiny: Path) -> None:
    with pytest.raises(InvalidRequest, match="does not exist"):
        check_model(str(tmp_path / "nope"))
    with pytest.raises(InvalidRequest, match=r"no config\.json"):
        check_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "vit"}))
    with pytest.raises(InvalidRequest, match="not a causal LM"):
        check_model(str(tmp_path))
    check_model(str(tiny))


def test_check_backend_unknown_lists_installed() -> None:
    with pytest.raises(BackendNotFound, match="installed:"):
        check_backend("no-such-backend")


def test_check_backend_missing_env_says_how_to_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLINFER_BACKENDS", "only-something-else")
    with pytest.raises(BackendNotFound, match=r"make env-sglang`, then run `\.venvs/sglang/bin/rlinfer demo"):
        check_backend("sglang")
