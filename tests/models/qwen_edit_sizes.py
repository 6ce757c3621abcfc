"""QwenImageEditPlusPipeline resizes every source to fixed areas (1024 x 1024 for the VAE,
384 x 384 for the text encoder's vision tower), which costs the tiny model seconds a source on
a CPU. Our family reads the same module constants when it encodes, so a test that compares
with the pipeline can shrink both (`shrink_edit_sources`) and still compare like with like;
tests marked `real_source_sizes` keep the published sizes."""

import pytest

SMALL_VAE_AREA, SMALL_CONDITION_AREA = 128 * 128, 64 * 64


def shrink_edit_sources(request, monkeypatch) -> None:
    if request.node.get_closest_marker("real_source_sizes"):
        return
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as module

    monkeypatch.setattr(module, "VAE_IMAGE_SIZE", SMALL_VAE_AREA)
    monkeypatch.setattr(module, "CONDITION_IMAGE_SIZE", SMALL_CONDITION_AREA)


@pytest.fixture(autouse=True)
def small_edit_sources(request, monkeypatch):
    """Autouse wherever imported: every test of the module runs with the small sizes."""
    shrink_edit_sources(request, monkeypatch)
