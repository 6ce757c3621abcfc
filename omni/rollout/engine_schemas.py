"""The rollout engine's messages as pydantic models, so its /docs page documents them.

Each POST body (both ways) is a safetensors blob (`omni.rollout.transport.pack`): named
tensors, and a JSON object in its metadata under "json". The models below type that JSON
object per route, and name the tensors beside it; the server validates each request's JSON
with them (a field missing or of the wrong type is refused naming it, 422). Imported by the
server only (pydantic comes with FastAPI).
"""

from typing import Any, Dict, List, Optional, Type

from pydantic import BaseModel, ConfigDict, Field

from omni.rollout.base import SamplingOptions


class GenerateMeta(BaseModel):
    """POST /generate: sample one image (or clip) per prompt and seed with the SDE; the answer
    holds the tensors of the rollout (images, latents, log_probs, sigmas and the conditioning's
    own tensors), and no JSON."""

    prompts: List[str]
    seeds: List[int] = Field(description="one per prompt: the same seed gives the same sample")
    options: SamplingOptions
    sources: List[List[str]] = Field(
        default_factory=list,
        description="per prompt, an edit's source image files (paths the engine reads); none for text to image",
    )


class UpdateWeightsMeta(BaseModel):
    """POST /update_weights: load the base weights or the LoRA written (atomically) to `path`,
    a directory both sides read (`omni.rollout.transport`); no tensors."""

    path: str = Field(description="an absolute path to the sync's directory")


class SyncAnswer(BaseModel):
    """The JSON of the answer to /update_weights."""

    model_config = ConfigDict(extra="allow")

    has_base: bool = Field(description="whether the engine holds base weights now (LoRA syncs need them)")
    lora_modules: Optional[List[str]] = Field(
        None, description="after a LoRA sync, the modules the adapter is bound to (None: the backend cannot tell)"
    )


class EncodePromptsMeta(BaseModel):
    """POST /encode_prompts: the conditioning of prompts (an edit's also of its sources); the answer's tensors are the
    family's conditioning (`Conditioning.tensors`)."""

    prompts: List[str]
    guidance_scale: float
    max_sequence_length: int
    sources: List[List[str]] = Field(
        default_factory=list,
        description="per prompt, an edit's source image files (paths the engine reads); none for text to image",
    )


class EncodeImagesMeta(BaseModel):
    """POST /encode_images: tensor "images" (B, 3, H, W) in [0, 1] -> tensor "latents"; no JSON."""


class EngineHealth(BaseModel):
    """GET /health."""

    model_config = ConfigDict(extra="allow")

    ok: bool = True
    has_base: bool
    model: str = Field(description="the checkpoint directory the engine serves")
    family: str
    backend: str


REQUESTS: Dict[str, Type[BaseModel]] = {
    "generate": GenerateMeta,
    "update_weights": UpdateWeightsMeta,
    "encode_prompts": EncodePromptsMeta,
    "encode_images": EncodeImagesMeta,
}
ANSWERS: Dict[str, Type[BaseModel]] = {"update_weights": SyncAnswer}


def openapi_extra(route: str, media_type: str) -> Dict[str, Any]:
    """The route's request body for /docs: a safetensors blob whose JSON is the route's model."""
    model = REQUESTS[route]
    blob = {"schema": {"type": "string", "format": "binary"}, "x-omni-json-metadata": model.model_json_schema()}
    doc = (
        f"a safetensors blob (omni.rollout.transport.pack); its metadata's JSON object is a {model.__name__}: "
        f"{model.__doc__.strip()}"
    )
    answer = ANSWERS.get(route)
    responses = {
        "200": {
            "description": f"a safetensors blob{f'; its JSON is a {answer.__name__}' if answer else ''}",
            "content": {
                media_type: {
                    "schema": {"type": "string", "format": "binary"},
                    **({"x-omni-json-metadata": answer.model_json_schema()} if answer else {}),
                }
            },
        },
        "422": {"description": "the JSON does not fit the model (the fields are named)"},
        "500": {"description": "the backend failed: its traceback, as text"},
    }
    return {
        "requestBody": {"required": True, "description": doc, "content": {media_type: blob}},
        "responses": responses,
    }
