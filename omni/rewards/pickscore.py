"""PickScore (Kirstain et al. 2023): a CLIP model fine-tuned on Pick-a-Pic's human preferences.

    score = exp(logit_scale) * cos(image embedding, prompt embedding)

i.e. the model's own logits (about 20-23 for good images at logit scale 100; Flow-GRPO divides
by 26, which `weight` can do). PickScore's checkpoint ships without its processor: set
`processor_path` to the CLIP-ViT-H-14 processor it was trained with.

    python recipes/train.py reward=pickscore reward.components.pickscore.path=/ckpt/PickScore_v1 \\
        reward.components.pickscore.processor_path=/ckpt/CLIP-ViT-H-14-laion2B-s32B-b79K
"""

from omni.rewards.clip_base import ClipReward


class PickScore(ClipReward):
    def score(self, images, prompts):
        similarity = (self.image_embeddings(images) * self.text_embeddings(prompts)).sum(dim=-1)
        return self.model.logit_scale.exp().float().cpu() * similarity.cpu()


REWARD = PickScore
