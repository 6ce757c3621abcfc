"""The ODE solvers (omni/rollout/ode.py): one DPM-Solver++(2M) step against the paper's
formula worked out by hand, and its order of convergence on a flow with a closed form."""

import math

import pytest
import torch

from omni.rollout.ode import ODESolver
from omni.rollout.sde import ode_step


def test_dpm2_step_hand_computed():
    """Previous step at sigma 0.8 with D_prev = x_prev - 0.8 v_prev = (0.2, -1); this step from
    sigma 0.6 to 0.3 with x = (1, -2), v = (0.5, 1.5), so D = x - 0.6 v = (0.7, -2.9).
    lambda = log((1 - s) / s): h = log(7/3) - log(2/3) = log 3.5, h_prev = log(2/3) - log(1/4)
    = log(8/3), e^-h = 2/7, alpha' = 0.7, so alpha' (1 - e^-h) = 0.5 and sigma'/sigma = 0.5.
    DPM-Solver++(2M): x' = 0.5 x + 0.5 ((1 + k) D - k D_prev), k = 1 / (2 r) = log 3.5 / (2 log(8/3))."""
    solver = ODESolver("dpm2")
    first = solver.step(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 0.6]), 0.8, 0.6)
    assert torch.equal(
        first, ode_step(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 0.6]), 0.8, 0.6)
    )  # no history: Euler
    x_next = solver.step(torch.tensor([0.5, 1.5]), torch.tensor([1.0, -2.0]), 0.6, 0.3)
    k = math.log(3.5) / (2 * math.log(8 / 3))  # 0.638625...
    expected = [0.5 * 1.0 + 0.5 * ((1 + k) * 0.7 - k * 0.2), 0.5 * -2.0 + 0.5 * ((1 + k) * -2.9 - k * -1.0)]
    assert expected == pytest.approx([1.0096563, -3.0566938], abs=1e-6)
    assert x_next.tolist() == pytest.approx(expected, abs=1e-6)


def test_first_order_where_the_formula_has_no_finite_value():
    """The step to sigma 0 lands on D = x - sigma v (lambda' infinite); after sigma_prev = 1
    (lambda_prev -infinite) and after `reset` (an SDE step) the step is Euler's."""
    x, v, d_prev_v = torch.tensor([1.0, -2.0]), torch.tensor([0.5, 1.5]), torch.tensor([3.0, -1.0])
    solver = ODESolver("dpm2")
    solver.step(d_prev_v, x, 0.4, 0.2)
    assert torch.equal(solver.step(v, x, 0.2, 0.0), x - 0.2 * v)
    solver = ODESolver("dpm2")
    solver.step(d_prev_v, x, 1.0, 0.7)
    assert torch.equal(solver.step(v, x, 0.7, 0.4), ode_step(v, x, 0.7, 0.4))
    solver.reset()
    assert torch.equal(solver.step(v, x, 0.4, 0.2), ode_step(v, x, 0.4, 0.2))
    assert not torch.equal(solver.step(v, x, 0.2, 0.1), ode_step(v, x, 0.2, 0.1))  # with history again


# A Gaussian data distribution N(MU, S^2) on the straight path x = (1 - s) x0 + s x1 has the
# linear velocity below and the exact ODE flow x(s) = (1 - s) MU + sqrt((1 - s)^2 S^2 + s^2) x(1).
MU, S = 1.0, 2.0


def toy_velocity(x: torch.Tensor, sigma: float) -> torch.Tensor:
    variance = (1 - sigma) ** 2 * S**2 + sigma**2
    return -MU + (sigma - (1 - sigma) * S**2) / variance * (x - (1 - sigma) * MU)


def toy_error(solver: str, num_steps: int) -> float:
    noise = torch.tensor([1.0, -0.5, 0.3, 2.0, -1.7], dtype=torch.float64)
    sigmas = torch.linspace(1, 0, num_steps + 1, dtype=torch.float64)
    ode, x = ODESolver(solver), noise.clone()
    for i in range(num_steps):
        x = ode.step(toy_velocity(x, float(sigmas[i])), x, sigmas[i], sigmas[i + 1])
    return float((x - (MU + S * noise)).abs().max())


def test_dpm2_converges_at_second_order_and_beats_euler():
    """From sigma 1 to 0: Euler's error halves when the steps double; DPM-Solver++(2M)'s is
    several times smaller and drops more than 3x (4x asymptotically; its first and last steps,
    infinite in lambda, are first order)."""
    euler = {n: toy_error("euler", n) for n in (16, 32, 64)}
    dpm2 = {n: toy_error("dpm2", n) for n in (16, 32, 64)}
    for n in (16, 32, 64):
        assert dpm2[n] < euler[n] / 4, (n, dpm2[n], euler[n])
    assert 1.8 < euler[16] / euler[32] < 2.2
    assert dpm2[16] / dpm2[32] > 3 and dpm2[32] / dpm2[64] > 3, dpm2


def test_unknown_solver_is_refused():
    with pytest.raises(ValueError, match="rk4"):
        ODESolver("rk4")
