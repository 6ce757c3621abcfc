"""A request to vLLM-Omni and its answer, as plain data (no vLLM import here).

The engine process submits one vLLM-Omni request per prompt group (`prompt_groups`: a run
of equal prompts, `num_outputs_per_prompt` images, each with its own seed), or with
`rollout.options.requests=per_image` one per image; vLLM-Omni co-batches compatible
requests (up to `max_num_seqs`) into one call of the pipeline's `forward`.

- request: the prompt as an `OmniTextPrompt` dict (an edit's source images, opened as RGB,
  in its `multi_modal_data`, where vLLM-Omni's edit pipelines read them); `OmniDiffusionSamplingParams` fields
  for steps, size, frames (1 for an image), guidance, text length and the outputs' seeds
  (and for several, a CPU generator each); our sampler's options (seeds, noise level, SDE
  window and step, ODE solver) under `extra_args["omni_rollout"]`, the params' free-form slot.
- answer (`DiffusionOutput` fields), the request's outputs along dim 0: the images as the output payload, the latent
  trajectory, per-step log-probs and noise levels in the `trajectory_*` fields vLLM-Omni
  keeps for RL, and the text embeddings in an `omni_rollout` metadata group (vLLM-Omni
  0.30 replaced `custom_output` by metadata groups). A pipeline whose vLLM-Omni post-process
  converts images whatever the output type (Qwen-Image's makes PIL images of them) also
  puts the fp32 image in that group, which the post-process passes through untouched, and
  the reader takes it from there. A post-process that takes an image tensor only (FLUX.1
  Kontext's) gets one; the group then rides with the trajectory's latents, in a dict.

`emulate_request_output` mirrors what vLLM-Omni's output formatter makes of those fields,
for the engine's local backend; the contract tests check it against the real formatter.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Dict, List, Sequence, Tuple, Union

import torch

from omni.data.prompts import Prompt, source_images
from omni.models.base import Conditioning
from omni.rollout.base import RolloutBatch, SamplingOptions

ROLLOUT_KEY = "omni_rollout"
IMAGE_KEY = "image"  # the fp32 image in the metadata group, where a post-process would convert it
LATENTS_KEY = "latents"  # the trajectory's latents, where the metadata group rides beside them
# What vLLM-Omni's post-process of a family does with a pipeline's output (output_type latent):
PASSES = "passes"  # returns the envelope untouched (SD3, FLUX, Wan; our own pipeline)
CONVERTS_PAYLOAD = "converts_payload"  # makes images of the payload's, keeps the metadata (Qwen-Image)
TAKES_TENSOR = "takes_tensor"  # takes an image tensor only (FLUX.1 Kontext)
POST_PROCESSES = (PASSES, CONVERTS_PAYLOAD, TAKES_TENSOR)
# What a request without our options (vLLM-Omni's start-up warm-up) is sampled with.
DEFAULT_RESOLUTION = 512
DEFAULT_MAX_SEQUENCE_LENGTH = 256


def request_inputs(
    prompt: str, seeds: Union[int, Sequence[int]], options: SamplingOptions
) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(prompt, sampling-params keyword arguments) of one request: the prompt's images, one
    per seed (a prompt group's, or one image's). Each output keeps its own seed: ours under
    `extra_args`, and for vLLM-Omni's own pipelines one CPU generator per output, from which
    they draw each output's initial noise as our sampler draws it."""
    seeds = [int(seeds)] if isinstance(seeds, int) else [int(s) for s in seeds]
    sampling = dict(
        num_inference_steps=options.num_steps,
        height=options.resolution,
        width=options.resolution,
        num_frames=options.num_frames,
        guidance_scale=options.guidance_scale,
        max_sequence_length=options.max_sequence_length,
        seed=seeds[0],
        num_outputs_per_prompt=len(seeds),
        # the native backend's own pipeline: its initial latents from a CPU generator (as
        # our sampler's), and no VAE decode of its own (ours decodes the fp32 latent)
        generator_device="cpu",
        output_type="latent",
        extra_args={
            ROLLOUT_KEY: {
                "seeds": seeds,
                "noise_level": options.noise_level,
                "sde_steps": list(options.sde_steps),
                "sde_type": options.sde_type,
                "ode_solver": options.ode_solver,
            }
        },
    )
    if len(seeds) > 1:  # one seed: vLLM-Omni makes the generator itself
        sampling["generator"] = [torch.Generator().manual_seed(seed) for seed in seeds]
    text: Dict[str, Any] = {"prompt": str(prompt)}
    if source_images(prompt):
        from omni.data.edits import open_sources

        text["multi_modal_data"] = {"image": open_sources(prompt)}
    return text, sampling


def request_seeds(params) -> List[int]:
    """The seed of each output of a request (`request_inputs`'s; a request without ours, such
    as vLLM-Omni's start-up warm-up, its one seed)."""
    ours = (getattr(params, "extra_args", None) or {}).get(ROLLOUT_KEY, {})
    if "seeds" in ours:
        return [int(seed) for seed in ours["seeds"]]
    if params.seed is None:
        raise ValueError("a rollout request needs a seed (its image's noise is drawn from it)")
    return [int(params.seed)]


def prompt_groups(prompts: Sequence[str], seeds: Sequence[int], size: int) -> List[Tuple[str, List[int]]]:
    """(prompt, seeds) of each request: a run of equal prompts (text and sources, as a prompt
    group comes) in one request of at most `size` images; `size` 1: a request per image."""
    groups: List[Tuple[str, List[int]]] = []
    for prompt, seed in zip(prompts, seeds):
        last = groups[-1] if groups else None
        same = last is not None and last[0] == prompt and source_images(last[0]) == source_images(prompt)
        if same and len(last[1]) < size:
            last[1].append(int(seed))
        else:
            groups.append((prompt, [int(seed)]))
    return groups


def request_rows(texts: Sequence[str], params_list: Sequence, requests: Sequence[int]):
    """The rows a forward samples for `requests` (indices into the batch): each request's
    prompt once per output, with its seeds, and the rows (start, stop) of each request."""
    prompts, seeds, spans = [], [], []
    for i in requests:
        request = request_seeds(params_list[i])
        spans.append((len(seeds), len(seeds) + len(request)))
        prompts += [texts[i]] * len(request)
        seeds += request
    return prompts, seeds, spans


def prompt_sources(prompts: Sequence[str]) -> List[List[str]]:
    """Each prompt's source image files (an edit's; [] for text to image), as they travel
    beside the prompts' texts to the engine, which opens them: a path both sides read."""
    return [list(source_images(p)) for p in prompts]


def with_sources(texts: Sequence[str], sources: Sequence[Sequence[str]]) -> List[str]:
    """The engine's side of `prompt_sources`: prompts that carry their source images again
    (no sources: the texts as they are)."""
    if not any(sources):
        return list(texts)
    if len(sources) != len(texts):
        raise ValueError(f"{len(texts)} prompts but {len(sources)} lists of source images")
    return [
        Prompt(text, images=images, origin=f"request prompt {i}")
        for i, (text, images) in enumerate(zip(texts, sources))
    ]


def prompt_text(prompt) -> str:
    return prompt if isinstance(prompt, str) else (prompt.get("prompt") or "")


def options_from_sampling_params(params) -> SamplingOptions:
    """Inverse of `request_inputs` for the options; a request without ours samples
    deterministically (all ODE steps) with vLLM-Omni's values or the defaults above."""
    ours = (getattr(params, "extra_args", None) or {}).get(ROLLOUT_KEY, {})
    return SamplingOptions(
        num_steps=int(params.num_inference_steps or 2),
        resolution=int(params.height or DEFAULT_RESOLUTION),
        guidance_scale=float(params.guidance_scale or 0.0),
        noise_level=float(ours.get("noise_level", 0.0)),
        max_sequence_length=int(params.max_sequence_length or DEFAULT_MAX_SEQUENCE_LENGTH),
        sde_steps=tuple(ours.get("sde_steps", (0, 0))),
        sde_type=str(ours.get("sde_type", "sde")),
        ode_solver=str(ours.get("ode_solver", "euler")),
        num_frames=int(getattr(params, "num_frames", None) or 1),
    )


def group_by_options(prompts: Sequence, params_list: Sequence) -> List[Tuple[SamplingOptions, List[int]]]:
    """Requests of one vLLM-Omni batch grouped by their sampling options (one sampler call each)."""
    groups: Dict[Tuple, Tuple[SamplingOptions, List[int]]] = {}
    for i, params in enumerate(params_list):
        options = options_from_sampling_params(params)
        key = tuple(vars(options).values())
        groups.setdefault(key, (options, []))[1].append(i)
    return list(groups.values())


def output_fields(batch: RolloutBatch, rows: Sequence[int], post_process: str = PASSES) -> Dict[str, Any]:
    """`DiffusionOutput` keyword arguments for one request: the `rows` of a sampled batch (its
    outputs), every tensor batched along dim 0 but the shared noise levels. `post_process`:
    what vLLM-Omni's post-process of the family does with the output (`PASSES`,
    `CONVERTS_PAYLOAD`, `TAKES_TENSOR`). Where it converts the images (it takes a batch in
    [-1, 1]), the exact images also ride in the metadata group; where it takes a tensor only,
    the metadata group rides with the trajectory's latents, a dict vLLM-Omni passes through."""
    if post_process not in POST_PROCESSES:
        raise ValueError(f"post_process={post_process!r}: one of {POST_PROCESSES}")
    index = torch.as_tensor(list(rows), dtype=torch.long)
    cond = {name: t[index] for name, t in batch.cond.tensors().items()}
    images, latents = batch.images[index], batch.latents[index]
    if post_process != PASSES:
        cond[IMAGE_KEY] = images
        images = images * 2 - 1
    if post_process == TAKES_TENSOR:
        output, latents = images, {LATENTS_KEY: latents, ROLLOUT_KEY: cond}
    else:
        output = {"payload": {"image": images}, "metadata": {ROLLOUT_KEY: cond}}
    return dict(
        output=output,
        trajectory_latents=latents,
        trajectory_log_probs=batch.log_probs[index],
        trajectory_timesteps=batch.sigmas,
    )


def emulate_request_output(fields: Dict[str, Any]) -> SimpleNamespace:
    """The `OmniRequestOutput` attributes vLLM-Omni's formatter derives from `fields` (an
    output passed through an identity post-process)."""
    output = fields["output"]
    envelope = isinstance(output, dict)
    return SimpleNamespace(
        error=None,
        images=[output["payload"]["image"] if envelope else output],
        trajectory_latents=fields["trajectory_latents"],
        trajectory_log_probs=fields["trajectory_log_probs"],
        trajectory_timesteps=fields["trajectory_timesteps"],
        multimodal_output={"metadata": output["metadata"]} if envelope else {},
    )


def _images(images: Sequence) -> torch.Tensor:
    """A request's images, batched, in [0, 1]: our payload passed through (one tensor, the
    outputs along dim 0), or PIL images if a formatter converted them (read back)."""
    if len(images) == 1 and isinstance(images[0], torch.Tensor):
        return images[0].float()
    import numpy as np

    return torch.stack([torch.from_numpy(np.asarray(i, dtype=np.float32) / 255.0).permute(2, 0, 1) for i in images])


def result_from_output(output) -> Dict[str, torch.Tensor]:
    """One request's tensors (its outputs along dim 0; `sigmas` shared) from a finished
    `OmniRequestOutput`."""
    if getattr(output, "error", None):
        raise RuntimeError(f"vLLM-Omni request failed: {output.error}")
    metadata = (output.multimodal_output or {}).get("metadata", {})
    latents = output.trajectory_latents
    if isinstance(latents, dict) and ROLLOUT_KEY in latents:  # beside a tensor-only post-process
        metadata, latents = latents, latents[LATENTS_KEY]
    if ROLLOUT_KEY not in metadata or not output.images:
        raise RuntimeError(
            "vLLM-Omni's answer lacks the rollout payload: is the engine running "
            "omni.rollout.vllm_pipeline.FlowGRPOPipeline with output_type='latent'?"
        )
    result = {name: t for name, t in metadata[ROLLOUT_KEY].items()}
    result.update(
        image=result.pop(IMAGE_KEY) if IMAGE_KEY in result else _images(output.images),
        latents=latents,
        log_probs=output.trajectory_log_probs,
        sigmas=output.trajectory_timesteps,
    )
    return {name: torch.as_tensor(t).cpu() for name, t in result.items()}


def collate_results(
    prompts: Sequence[str], results: Sequence[Dict[str, torch.Tensor]], options: SamplingOptions, conditioning: type
) -> RolloutBatch:
    """Per-request results (each its outputs along dim 0) -> the batch the actor re-scores
    (`conditioning`: the family's type)."""
    stack = lambda name: torch.cat([r[name] for r in results])  # noqa: E731
    cond = conditioning(*(stack(name) if name in results[0] else None for name in conditioning.field_names()))
    return RolloutBatch(
        list(prompts), stack("image"), stack("latents"), stack("log_probs").float(), results[0]["sigmas"], cond, options
    )


def batch_to_tensors(batch: RolloutBatch) -> Dict[str, torch.Tensor]:
    """A sampled batch as named tensors (the engine's HTTP answer)."""
    tensors = dict(images=batch.images, latents=batch.latents, log_probs=batch.log_probs, sigmas=batch.sigmas)
    tensors.update(batch.cond.tensors())
    return tensors


def batch_from_tensors(
    prompts: Sequence[str], tensors: Dict[str, torch.Tensor], options: SamplingOptions, conditioning: type
) -> RolloutBatch:
    cond: Conditioning = conditioning.from_tensors(tensors)
    return RolloutBatch(
        list(prompts), tensors["images"], tensors["latents"], tensors["log_probs"], tensors["sigmas"], cond, options
    )
