"""DiffusionNFT's optimality, implicit policies and loss on hand-computed numbers, and its
update on the tiny SD3."""

import math

import torch

from omni.algorithms import diffusion_nft as nft


def test_optimality_hand_computed():
    r = nft.optimality(torch.tensor([-5.0, -2.5, 0.0, 2.5, 10.0]), adv_clip_max=5.0)
    assert torch.allclose(r, torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0]))


def test_implicit_policies_hand_computed():
    positive, negative = nft.implicit_policies(torch.tensor([2.0]), torch.tensor([1.0]), beta=0.5)
    assert torch.allclose(positive, torch.tensor([1.5])) and torch.allclose(negative, torch.tensor([0.5]))


def test_normalised_error_hand_computed():
    """x_t = 1, t = 0.5, v = (1, 4): x0_hat = (0.5, -1); x0 = 0, so the errors are (0.5, -1),
    their mean absolute value 0.75, and the loss (0.25 + 1) / 0.75 / 2."""
    error = nft.normalised_x0_error(
        torch.tensor([[1.0, 4.0]]), torch.ones(1, 2), torch.tensor([0.5]), torch.zeros(1, 2)
    )
    assert math.isclose(error.item(), 1.25 / 0.75 / 2, rel_tol=1e-6)


def test_loss_and_its_gradient_at_the_rollout_policy():
    """One element, x_t = 1, t = 0.5, v = v_old = 1, x0 = 0: both policies predict x0_hat = 0.5,
    normalised error 0.5^2 / 0.5 = 0.5, loss adv_max / beta * 0.5 = 5 whatever r (beta 0.5).
    Its gradient in v is adv_max / beta * 2 e (-t beta) / c * (2r - 1): -5 at r = 1, +5 at r = 0,
    0 at r = 1/2 (a neutral image does not move the policy)."""
    for r, expected_grad in ((1.0, -5.0), (0.0, 5.0), (0.5, 0.0)):
        v = torch.ones(1, 1, requires_grad=True)
        loss, _, _ = nft.nft_loss(
            v, torch.ones(1, 1), torch.ones(1, 1), torch.tensor([0.5]), torch.zeros(1, 1), torch.tensor([r]), 0.5, 5.0
        )
        loss.backward()
        assert math.isclose(loss.item(), 5.0, rel_tol=1e-6)
        assert math.isclose(v.grad.item(), expected_grad, abs_tol=1e-6), r


def test_update_moves_good_images_clean_estimate_closer(fresh, monkeypatch):
    """On the tiny model: after an update whose first image is good (r = 1) and second bad
    (r = 0), the policy's clean-latent estimate of the first improves relative to the second's."""
    from omni.algorithms.diffusion_nft import DiffusionNFTConfig
    from tests.algorithms.test_flow_grpo_update import rollout

    monkeypatch.setattr(fresh.cfg, "algorithm", DiffusionNFTConfig(name="diffusion_nft", timesteps_per_sample=4))
    batch = rollout(fresh, n=2)
    nft_batch = nft.NFTBatch(batch.latents[:, -1], batch.cond, torch.tensor([1.0, 0.0]), batch.options.guidance_scale)

    def errors():
        n, k = 2, 4
        sigmas, noise = nft.forward_noise(fresh.cfg.algorithm, n, nft_batch.clean.shape[1:], 7, 0, n)
        clean = nft_batch.clean.repeat_interleave(k, 0)
        noisy = nft.noisy_latents(clean, noise.reshape(n * k, *clean.shape[1:]), sigmas.reshape(-1))
        with torch.no_grad():
            v = fresh.velocity(
                noisy,
                sigmas.reshape(-1),
                nft_batch.cond.apply(lambda t: t.repeat_interleave(k, 0)),
                nft_batch.guidance_scale,
            )
        return ((noisy - sigmas.reshape(-1, 1, 1, 1) * v - clean) ** 2).mean(dim=(1, 2, 3)).reshape(n, k).mean(1)

    before = errors()
    metrics = fresh.apply_update(nft.update, nft_batch, seed=0)
    after = errors()
    assert metrics["grad_norm"] > 0
    assert (after[0] - before[0]) < (after[1] - before[1]), (before, after)
