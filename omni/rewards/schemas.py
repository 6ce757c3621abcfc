"""The reward server's bodies as pydantic models, so its /docs page documents the protocol
(`omni.rewards.protocol` reads and writes the same JSON; imported only by the server, since
pydantic comes with the `reward-http` extra)."""

from typing import Any, Dict, List, Optional

from pydantic import BaseModel, Field


class ScoreRequest(BaseModel):
    """POST /score: a batch of images with their prompts (and the prompts' metadata)."""

    prompts: List[str] = Field(description="the prompt of each image, in order")
    images: List[str] = Field(description="each image as base64 8-bit RGB PNG, one per prompt; all of one size")
    metadata: Optional[List[Dict[str, Any]]] = Field(
        None, description="each prompt's metadata (e.g. GenEval's tag and include), one object per prompt; default: {}"
    )
    sources: Optional[List[List[str]]] = Field(
        None,
        description="an edit's source images (base64 PNG or JPEG), a list per prompt; default: none (text-to-image)",
    )
    targets: Optional[List[Optional[str]]] = Field(
        None, description="an edit's target image (base64) or null, one per prompt; default: none"
    )


class ScoreResponse(BaseModel):
    """The answer of POST /score. A non-finite score travels as NaN / Infinity (JSON as
    Python writes it), so the client's reward.nonfinite policy sees it, not a made-up number."""

    scores: List[float] = Field(description="one score per image, in the request's order")


class Health(BaseModel):
    """GET /health."""

    ok: bool = True
    reward: List[str] = Field(description="the names of the reward components whose weighted sum is served")


class Problem(BaseModel):
    """A 400 (a request the server refuses: not retried) or a 500 (the reward failed: retried)."""

    detail: str
