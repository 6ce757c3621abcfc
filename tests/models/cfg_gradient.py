"""What `predict_velocity(..., uncond_grad=False)` must do in every family with a CFG pass
(algorithm.cfg_gradient=conditional): the same guided velocity, with no gradient through the
unconditional pass."""

import torch


def assert_unconditional_pass_not_differentiated(family, transformer, latents, sigmas, cond, scale):
    """The velocity equals the exact path's; the negative prompt's embeddings get a gradient
    only on the exact path; the positive one's is the same on both (the guided velocity
    depends on it through the conditional pass alone)."""

    def embeddings_gradients(uncond_grad):
        inputs = cond.apply(lambda t: t.detach().clone().requires_grad_(t.is_floating_point()))
        velocity = family.predict_velocity(transformer, latents, sigmas, inputs, scale, uncond_grad=uncond_grad)
        velocity.square().sum().backward()
        return velocity.detach(), inputs.embeds.grad, inputs.neg_embeds.grad

    exact, positive, negative = embeddings_gradients(True)
    conditional, positive_cond, negative_cond = embeddings_gradients(False)
    assert (conditional - exact).abs().max() < 1e-5
    assert negative.abs().max() > 0 and negative_cond is None
    assert positive.abs().max() > 0 and torch.allclose(positive_cond, positive, rtol=1e-4, atol=1e-6)
