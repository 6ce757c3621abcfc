"""CLIPScore (Hessel et al. 2021): how well an image matches its prompt under a CLIP model.

    score = max(100 * cos(image embedding, prompt embedding), 0)

(the convention of torchmetrics' CLIPScore; Hessel et al. scale by 2.5 instead of 100,
which `weight` can do).

    python recipes/train.py reward=clipscore reward.components.clipscore.path=/ckpt/clip-vit-large-patch14
"""

from omni.rewards.clip_base import ClipReward


class ClipScore(ClipReward):
    def score(self, images, prompts):
        similarity = (self.image_embeddings(images) * self.text_embeddings(prompts)).sum(dim=-1)
        return (100 * similarity).clamp(min=0).cpu()


REWARD = ClipScore
