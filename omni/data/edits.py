"""Edit data: an instruction and the source image(s) it applies to.

An edit item is an `omni.data.prompts.Prompt` whose text is the instruction and whose `images`
are the source image files (one for FLUX.1 Kontext, one or more for Qwen-Image-Edit-Plus); an
optional target image (what the edit should give) rides in its metadata as "target". Edit
families (`ModelFamily.edit`) open the sources when they encode the prompt; edit rewards open
them to compare the result with the source.
"""

from __future__ import annotations

from typing import List

from PIL import Image

from omni.data.prompts import source_images


def open_sources(prompt: str) -> List[Image.Image]:
    """The prompt's source images as RGB PIL images, in order; an edit prompt without
    sources, or a source that cannot be read, is an error naming the prompt's origin."""
    paths = source_images(prompt)
    where = getattr(prompt, "origin", "") or repr(str(prompt)[:60])
    if not paths:
        raise ValueError(f"{where}: an edit prompt needs at least one source image ('image' or 'images')")
    images = []
    for path in paths:
        try:
            with Image.open(path) as image:
                images.append(image.convert("RGB"))
        except (OSError, ValueError) as error:
            raise ValueError(f"{where}: source image {path} cannot be read ({error})") from None
    return images
