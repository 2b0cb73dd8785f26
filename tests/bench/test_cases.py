"""Every benchmarked case computes the same loss and gradients on the same workload.

Tiny fp32 shapes; Liger's Triton kernels run under TRITON_INTERPRET=1 (set by tests/conftest.py),
so the padded and one-row-per-token layouts are checked end to end, not just timed.
"""

import sys

import pytest
import torch

from bench.kernels.cases import CASES, CaseOptions, Unavailable, build_case, supported_kwargs, token_advantages
from bench.kernels.workload import Shape, make_workload, reference_loss

SHAPE = Shape(num_tokens=24, vocab=37, hidden=8, num_seqs=4, dtype="fp32")
LOGITS_CASES = [n for n, (kind, _) in CASES.items() if kind == "logits" and n != "torch_compile"]
LINEAR_CASES = [n for n, (kind, _) in CASES.items() if kind == "linear"]


@pytest.fixture(scope="module")
def workload():
    return make_workload(SHAPE, "cpu", seed=5)


def packed_grad(name: str, grad: torch.Tensor, workload) -> torch.Tensor:
    """Map a case's input gradient back to packed [T, ...] rows."""
    if name == "liger_grpo_loss_same_rows":
        return grad[:, 0]
    if name.startswith("liger"):  # padded [S, L(+1), ...]
        return torch.cat([grad[i, :n] for i, n in enumerate(workload.lengths)])
    return grad


def run_case(name, workload, **options):
    case = build_case(name, workload, CaseOptions(**({"liger_compiled": False} | options)))
    case.reset()
    loss = case.step()
    return (
        case,
        float(loss),
        [packed_grad(name, leaf.grad, workload) if i == 0 else leaf.grad for i, leaf in enumerate(case.leaves)],
    )


@pytest.fixture(scope="module")
def eager_grads(workload):
    return run_case("torch_eager", workload)[2], run_case("torch_eager_linear", workload)[2]


@pytest.mark.parametrize("name", LOGITS_CASES)
def test_logits_cases_match_the_reference(name, workload, eager_grads):
    _, loss, grads = run_case(name, workload)
    assert loss == pytest.approx(reference_loss(workload), rel=1e-5, abs=1e-6)
    torch.testing.assert_close(grads[0], eager_grads[0][0], rtol=1e-4, atol=1e-6)
    assert grads[0].abs().sum() > 0


@pytest.mark.parametrize("name", LINEAR_CASES)
def test_linear_cases_match_the_reference(name, workload, eager_grads):
    _, loss, grads = run_case(name, workload)
    assert loss == pytest.approx(reference_loss(workload), rel=1e-5, abs=1e-6)
    for got, want in zip(grads, eager_grads[1]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_osvl_triton_backend_case_matches(workload, eager_grads):
    _, loss, grads = run_case("osvl_grpo_loss", workload, osvl_backend="triton")
    assert loss == pytest.approx(reference_loss(workload), rel=1e-5, abs=1e-6)
    torch.testing.assert_close(grads[0], eager_grads[0][0], rtol=1e-4, atol=1e-6)


def test_torch_compile_case_matches(workload):
    # aot_eager traces through dynamo + AOTAutograd like inductor does, without its C++ build
    _, loss, _ = run_case("torch_compile", workload, compile_backend="aot_eager")
    assert loss == pytest.approx(reference_loss(workload), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("name", ["osvl_grpo_loss", "liger_grpo_loss_padded", "liger_grpo_loss_same_rows"])
def test_inplace_cases_restore_their_logits_between_steps(name, workload):
    case, first, _ = run_case(name, workload, inplace_grad=True)
    case.reset()
    assert float(case.step()) == pytest.approx(
        first, rel=1e-6
    )  # the gradient overwrote the logits; reset restored them


def test_missing_liger_is_unavailable(workload, monkeypatch):
    monkeypatch.setitem(sys.modules, "liger_kernel", None)
    monkeypatch.setitem(sys.modules, "liger_kernel.chunked_loss", None)
    for name in ("liger_grpo_loss_padded", "liger_grpo_loss_same_rows", "liger_fused_linear_grpo"):
        with pytest.raises(Unavailable, match="liger-kernel not installed"):
            build_case(name, workload, CaseOptions())


def test_liger_triton_on_cpu_needs_the_interpreter(workload, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(Unavailable, match="TRITON_INTERPRET"):
        build_case("liger_grpo_loss_padded", workload, CaseOptions())


def test_unknown_case_is_a_value_error(workload):
    with pytest.raises(ValueError, match="unknown case"):
        build_case("cce", workload, CaseOptions())


def test_helpers(workload):
    assert supported_kwargs(lambda a, b=1: None, b=2, c=3) == {"b": 2}
    adv = token_advantages(workload)
    assert adv.shape == (SHAPE.num_tokens,)
    assert adv[workload.lengths[0]] == workload.advantages[1]
